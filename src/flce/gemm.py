"""GEMMs that write (or accumulate) into a preallocated output, possibly wider than their operands.

``out_dtype`` lets cuBLAS keep a float32 result from bf16/fp16 operands with no temporary. Where it is
missing (CPU builds, older torch), the operands are upcast instead: same result, more memory traffic.
"""

from __future__ import annotations

import functools

import torch

# Flipped by tests to exercise the fallback on builds that do have out_dtype.
FORCE_FALLBACK = False


@functools.lru_cache(maxsize=None)
def _probe_out_dtype(device_type: str) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0].item() == 4.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def supports_out_dtype(device: torch.device) -> bool:
    """Whether mm/addmm(out_dtype=float32) works for half-precision operands on this device type."""
    return not FORCE_FALLBACK and _probe_out_dtype(device.type)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b; ``out`` may be wider (float32) than the operands."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.dtype == torch.float32 and supports_out_dtype(out.device):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)
