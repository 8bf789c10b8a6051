"""GEMMs that write (or accumulate) into a preallocated output, possibly wider than their operands.

``out_dtype`` lets cuBLAS keep a float32 result from bf16/fp16 operands with no temporary. Where it is
missing (CPU builds, older torch), the operands are upcast instead: same result, more memory traffic.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Flipped by tests to exercise the fallback on builds that do have out_dtype.
FORCE_FALLBACK = False

_OPS = {False: (torch.mm, torch.addmm), True: (torch.bmm, torch.baddbmm)}  # (write, accumulate)


@functools.lru_cache(maxsize=None)
def _probe_out_dtype(device_type: str, batched: bool = False) -> bool:
    mm, addmm = _OPS[batched]
    try:
        shape = (1, 2, 2) if batched else (2, 2)
        a = torch.ones(shape, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(shape, dtype=torch.float32, device=device_type)
        mm(a, a, out_dtype=torch.float32, out=acc)
        addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc.flatten()[0].item() == 4.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def supports_out_dtype(device: torch.device, batched: bool = False) -> bool:
    """Whether (b)mm/add(b)mm(out_dtype=float32) works for half-precision operands on this device type."""
    return not FORCE_FALLBACK and _probe_out_dtype(device.type, batched)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b; ``out`` may be wider (float32) than the operands."""
    if a.shape[1] == 1:
        # An outer product (one row, e.g. grad_weight at batch 1): cuBLAS's K=1 kernel writes the
        # (V, H) result at a third of copy speed (0.83 ms at 128256 x 4096 on an H200). A zero second
        # term leaves every value unchanged; it is added to a.t()'s rows, so that a stays column-major
        # with its long leading dimension (a [V, 2] row-major copy drew an align2 kernel: 0.54 ms).
        a, b = F.pad(a.t(), (0, 0, 0, 1)).t(), F.pad(b, (0, 0, 0, 1))
    _gemm_into(out, a, b, accumulate, batched=False)


def mm_new(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b as a new (m, n) tensor of ``dtype``. Where ``mm_into`` would add nothing to the plain GEMM
    (same dtype, K > 1) torch allocates the output itself: one host call fewer on launch-bound steps."""
    if dtype == a.dtype and a.shape[1] != 1:
        return torch.mm(a, b)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    mm_into(out, a, b, accumulate=False)
    return out


def first_cols(t: torch.Tensor, k: int) -> torch.Tensor:
    """t[:, :k] (a GEMM operand's first k columns), without a dispatcher call when that is all of t."""
    return t if k == t.shape[1] else t[:, :k]


# Rows from which a GPU sums columns as a GEMV (``column_sums_into``).
GEMV_MIN_ROWS = 1024


def column_sums_into(out: torch.Tensor, a: torch.Tensor, *, accumulate: bool) -> torch.Tensor:
    """out (C,) = a (n, C) summed over its rows (or out += that), in out's dtype. On a GPU from
    ``GEMV_MIN_ROWS`` rows as a GEMV against ones (float32 inside): there torch's sum over dim 0 into a wider
    dtype keeps a staging buffer of 132-141 MiB (8192 x 3712 to 8192 x 20480 bf16) and 501 MiB at 8192 x
    128256 where the GEMV takes none, at the same speed from 20480 columns (H200,
    benchmark/results/2026-11-26-h200-eafbb74/column_sums.txt); at 256 rows the sum needs no buffer and is
    twice as fast."""
    if not a.is_cuda or a.shape[0] < GEMV_MIN_ROWS:
        part = a.sum(0, dtype=out.dtype)
        return out.add_(part) if accumulate else out.copy_(part)
    ones = torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)
    mm_into(out[:, None], a.t(), ones, accumulate=accumulate)
    return out


def bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """Batched ``mm_into``: out[i] = a[i] @ b[i] (or +=). ``out`` may be a strided view (any row stride,
    e.g. a permuted (B, G, N) buffer seen as (G, B, N)): cuBLAS writes it in place through ldc/strideC."""
    _gemm_into(out, a, b, accumulate, batched=True)


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, batched: bool) -> None:
    mm, addmm = _OPS[batched]
    kwargs = {}
    if out.dtype != a.dtype:
        if out.dtype == torch.float32 and supports_out_dtype(out.device, batched):
            kwargs["out_dtype"] = torch.float32
        else:
            a, b = a.to(out.dtype), b.to(out.dtype)
    if accumulate:
        addmm(out, a, b, out=out, **kwargs)
    else:
        mm(a, b, out=out, **kwargs)
