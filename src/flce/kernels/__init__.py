"""Per-chunk cross-entropy kernels: the Triton kernel and its torch twin, behind one entry point."""

from __future__ import annotations

import functools
import os

import torch

from ..options import BACKENDS, LossOptions
from .ce_torch import ce_chunk_torch


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cross-entropy arithmetic and of the loss for logits of ``dtype``: float64 for
    float64 (as eager PyTorch), else float32 whatever the storage dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, and on the CPU only under its interpreter (TRITON_INTERPRET=1, read per call)."""
    if device.type != "cuda" and not (os.environ.get("TRITON_INTERPRET") == "1" and _interpreter_ready()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreter_ready() -> bool:
    """Whether triton's own jit functions (tl.max, tl.sum, ...) are interpreted. triton decides that when
    it is first imported: if TRITON_INTERPRET=1 came later, its kernels cannot run on the CPU."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl.standard.sum, InterpretedFunction)


def nvidia_major(device: torch.device) -> int:
    """The CUDA capability major of the NVIDIA GPU ``device`` (9: Hopper), 0 for any other device. A ROCm
    build of torch answers ``get_device_capability`` with its gfx version (MI300: 9.4), which promises none
    of the NVIDIA features gated on it here (TMA, wgmma, CUTLASS's sm90 kernels, PTX)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    return _capability_major(device.index)


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int | None) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.lru_cache(maxsize=None)
def _triton_on_cuda() -> bool:
    return triton_available(torch.device("cuda"))


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """'auto' means triton on CUDA and torch elsewhere; an explicit 'triton' must be runnable. The Triton
    kernels compute in float32, so float64 (``dtype``, the logits') always takes the torch twin, whose
    arithmetic then is float64."""
    if device.type == "cuda" and (backend == "auto" or backend == "triton") and _triton_on_cuda():
        return "torch" if dtype == torch.float64 else "triton"  # every step asks: answered once per process
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 and triton_available(device) else "torch"
    if backend == "triton" and not triton_available(device):
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
            raise ValueError("backend='triton' cannot run on the CPU in this process: TRITON_INTERPRET=1 was set "
                             "after triton was first imported, and triton reads it only then. Set it in the "
                             "environment before starting Python (or use backend='torch')")
        raise ValueError(
            f"backend='triton' cannot run on {device.type} tensors here: it needs CUDA, or "
            "TRITON_INTERPRET=1 in the environment before triton is first imported (the CPU interpreter), "
            "and triton installed"
        )
    return "torch" if dtype == torch.float64 else backend


def ce_chunk(
    backend: str,
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    correct: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    opts: LossOptions,
    counts: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    tile_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    grad_out: torch.Tensor | None = None,
    operands: tuple | None = None,
) -> None:
    """Cross-entropy of one chunk of logits, in place.

    Args:
        logits: (n, V), rows contiguous; overwritten with grad_scale * d loss / d logits when
            ``grad_scale`` is given (exact zeros on ignored rows).
        target: (n,) int64. loss, lse: (n,) outputs in the math dtype (``math_dtype``: float32, float64
            for float64 logits, which only the torch twin takes), 0 on ignored rows.
        correct: (n,) output in the math dtype, 1 where argmax == target, or None to skip.
        class_weight: (V,) or None; weight_sum: 0-d sum of class_weight or None.
        grad_scale: None (loss only), a 0-d scale, or (n,) per-row scales; all in the math dtype.
        counts: None, or (3,) int64 zeros when the chunk holds all rows of a mean (the small-batch
            path): then the kernel also counts [targets that are not ignore_index, those outside
            [0, V), -] into it, writes grad_scale = 1 / max(valid, 1) and ``total`` (0-d float32) =
            the mean loss, and the gradient it writes is not scaled (backward applies grad_scale).
        tile_stats: None, or the (n, T) float32 per-tile max and sum exp(z - max) that
            ``logits_triton.logits_with_tile_stats`` wrote with ``logits`` (triton only), which then hold
            what that GEMM stores: the logits / T less their tile max. The kernel takes each row's lse from
            them and reads the values once.
        grad_out: None (or ``logits``), or an (n, V) buffer, rows contiguous (in any float dtype, e.g. 16-bit
            beside float32 logits), that takes the gradient instead of the logits; the logits are scratch then.
            Not with ``tile_stats``.
        operands: None, or with ``tile_stats`` the GEMM's (x (n, H), W (V, H), bias (V,) or None), unit-stride
            rows: each row's logit at its target then comes from a float32 dot of them, not from its stored value
            (which a tile max can leave off by |z_y - tile max| / 256 in 16 bits). Or G groups' (x (G, c, H),
            W (G, V, H), bias (G, V) or None) where the n = G * c rows are the groups' in turn (grouped heads).
    """
    grad_out = None if grad_out is logits else grad_out
    if backend == "triton":
        from .ce_triton import ce_chunk_triton

        assert logits.dtype != torch.float64, "float64 takes the torch twin (resolve_backend)"
        ce_chunk_triton(logits, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts, counts,
                        total, tile_stats, grad_out=grad_out, operands=operands)
    else:
        assert tile_stats is None and operands is None, "tile statistics come with the triton backend only"
        ce_chunk_torch(logits, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts, counts, total,
                       grad_out)
