"""Per-chunk cross-entropy kernels: the Triton kernel and its torch twin, behind one entry point."""

from __future__ import annotations

import functools
import os

import torch

from ..options import LossOptions
from .ce_torch import ce_chunk_torch

BACKENDS = ("auto", "triton", "torch")


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, and on the CPU only under its interpreter (TRITON_INTERPRET=1)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _triton_on_cuda() -> bool:
    return triton_available(torch.device("cuda"))


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' means triton on CUDA and torch elsewhere; an explicit 'triton' must be runnable."""
    if device.type == "cuda" and (backend == "auto" or backend == "triton") and _triton_on_cuda():
        return "triton"  # every training step asks: answered once per process
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if backend == "triton" and not triton_available(device):
        raise ValueError(
            f"backend='triton' cannot run on {device.type} tensors here: it needs CUDA, or "
            "TRITON_INTERPRET=1 set before flce is imported for the CPU interpreter, and triton installed"
        )
    return backend


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
) -> None:
    """Cross-entropy of one chunk of logits, in place.

    Args:
        logits: (n, V), rows contiguous; overwritten with grad_scale * d loss / d logits when
            ``grad_scale`` is given (exact zeros on ignored rows).
        target: (n,) int64. loss, lse: (n,) float32 outputs (0 on ignored rows).
        correct: (n,) float32 output, 1 where argmax == target, or None to skip.
        class_weight: (V,) or None; weight_sum: 0-d sum of class_weight (float32) or None.
        grad_scale: None (loss only), a 0-d scale, or (n,) per-row scales; all float32.
        counts: None, or (3,) int64 zeros when the chunk holds all rows of a mean (the small-batch
            path): then the kernel also counts [targets that are not ignore_index, those outside
            [0, V), -] into it, writes grad_scale = 1 / max(valid, 1) and ``total`` (0-d float32) =
            the mean loss, and the gradient it writes is not scaled (backward applies grad_scale).
        tile_stats: None, or the (n, T) float32 per-tile max and sum exp(z - max) that
            ``logits_triton.logits_with_tile_stats`` wrote with these logits (triton only): the kernel
            then takes each row's lse from them and reads the logits once.
    """
    if backend == "triton":
        from .ce_triton import ce_chunk_triton

        ce_chunk_triton(logits, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts, counts,
                        total, tile_stats)
    else:
        assert tile_stats is None, "tile statistics come with the triton backend only"
        ce_chunk_torch(logits, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts, counts, total)
