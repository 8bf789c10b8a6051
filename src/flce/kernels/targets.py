"""Target bookkeeping before the GEMMs: how many targets count, how many are out of range, and the mean's
scale. At small batches a step is launch-bound, so on CUDA this is one Triton launch instead of nine ops."""

from __future__ import annotations

import torch


def count_targets(t: torch.Tensor, ignore_index: int, vocab: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """t: (n,) int64, contiguous. Returns counts (2,) int64 = [targets that are not ignore_index, those
    among them outside [0, vocab)] and 1 / max(valid, 1) as a float32 0-d tensor, both on t's device."""
    if backend == "triton" and t.numel():
        from .targets_triton import count_targets_triton

        return count_targets_triton(t, ignore_index, vocab)
    valid = t != ignore_index
    counts = torch.stack([valid.sum(), (valid & ((t < 0) | (t >= vocab))).sum()])
    return counts, counts[0].float().clamp(min=1.0).reciprocal()
