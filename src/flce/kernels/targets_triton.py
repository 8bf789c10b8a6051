"""Triton kernel behind kernels.targets.count_targets: the target check and the mean's scale in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _count_kernel(t_ptr, counts_ptr, scale_ptr, n, ignore_index, V, BLOCK: tl.constexpr):
    # One program: the targets of a step are few (a Python loop of torch ops costs more in launches).
    n_valid = tl.zeros((), dtype=tl.int64)
    n_bad = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = tl.load(t_ptr + offs, mask=offs < n, other=ignore_index)
        valid = y != ignore_index
        n_valid += tl.sum(valid.to(tl.int64), 0)
        n_bad += tl.sum((valid & ((y < 0) | (y >= V))).to(tl.int64), 0)
    tl.store(counts_ptr, n_valid)
    tl.store(counts_ptr + 1, n_bad)
    tl.store(scale_ptr, 1.0 / tl.maximum(n_valid.to(tl.float32), 1.0))


def count_targets_triton(t: torch.Tensor, ignore_index: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.empty(2, dtype=torch.int64, device=t.device)
    scale = torch.empty((), dtype=torch.float32, device=t.device)
    _count_kernel[(1,)](t, counts, scale, t.numel(), ignore_index, vocab, BLOCK=BLOCK, num_warps=8)
    return counts, scale
