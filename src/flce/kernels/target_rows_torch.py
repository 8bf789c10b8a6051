"""Torch twin of ``exp_rows_triton.subtract_target_rows``: a weight gradient's one-hot term, row by row.

Used on the CPU and with the torch backend (the low-memory mode's blocks, ``low_memory.weight_grad_blocks``).
"""

from __future__ import annotations

import torch


def subtract_target_rows_torch(grad: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, target_coef: torch.Tensor,
                               scale: torch.Tensor, order: torch.Tensor | None = None) -> None:
    """grad[v] -= scale * sum over rows r with keys[r] = v of target_coef[r] * x[r], summed in float32 (float64
    for float64 tensors) and rounded once per row of grad. grad (V, H); x (n, H); keys (n,) integers, V (or
    more) for rows without the term; target_coef (n,); scale 0-d; ``order`` (n,): keys[i] is row order[i]'s."""
    if order is not None:
        x, target_coef = x[order], target_coef[order]
    rows = keys < grad.shape[0]
    if not bool(rows.any()):
        return
    wide = torch.float64 if torch.float64 in (grad.dtype, x.dtype) else torch.float32
    keys = keys[rows].long()
    hit, slot = torch.unique(keys, return_inverse=True)
    sums = torch.zeros(hit.numel(), x.shape[1], dtype=wide, device=x.device)
    sums.index_add_(0, slot, target_coef[rows].to(wide)[:, None] * x[rows].to(wide))
    grad[hit] = (grad[hit].to(wide) - scale.to(wide) * sums).to(grad.dtype)
