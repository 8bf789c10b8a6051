"""Torch twin of the column-block gradient kernel (``ce_block_triton.py``): same contract, plain tensor ops.

Used on the CPU and as the reference the kernel is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..options import LossOptions
from .softcap_torch import capped_logits


class RowTerms(NamedTuple):
    """What the block kernels need about the rows besides their logits.

    target: (n,) int64. lse: (n,) float32, each row's log-sum-exp over all V (after temperature and
    softcap), as the CE kernel wrote it. class_weight: (V,) or None; weight_sum: 0-d float32 sum of
    class_weight or None. grad_scale: 0-d or (n,) float32, the reduction's scale times grad_output.
    exact_lse: the lse is that of the unrounded logits (the exp-logits forward, or logits stored less their
    tile max: ``function.LossParts.exact_lse``), so a kernel that recomputes the logits in float32 uses them
    unrounded; else it rounds them to the dtype the logits were stored in, as the lse saw them. target_col:
    None, or (n,) int32: the column whose one-hot term the kernel subtracts, the target or -1 where the
    caller subtracts it (``low_memory.target_rows_apart``).
    """

    target: torch.Tensor
    lse: torch.Tensor
    class_weight: torch.Tensor | None
    weight_sum: torch.Tensor | None
    grad_scale: torch.Tensor
    exact_lse: bool = False
    target_col: torch.Tensor | None = None


def ce_block_torch(logits: torch.Tensor, col_start: int, vocab: int, terms: RowTerms, opts: LossOptions) -> None:
    """Overwrite a block of logits with grad_scale * d loss / d logits, from each row's saved lse.

    logits: (n, C) raw logits of vocabulary columns [col_start, col_start + C) for all n rows, rows
    contiguous; vocab: V, the full vocabulary (targets index it). Math in float32 (float64 for float64
    logits). Ignored rows get exact zeros; a row whose target is outside [0, V) and not ignore_index gets
    NaN, as in the CE kernel.
    """
    n, cols = logits.shape
    if n == 0 or cols == 0:
        return
    target, lse, class_weight, weight_sum, grad_scale = terms[:5]
    math_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    eps, cap = opts.label_smoothing, opts.softcap
    z, slope = capped_logits(logits, 1.0 / opts.temperature, cap, slope=True)
    valid = target != opts.ignore_index
    poison = torch.where(valid & ((target < 0) | (target >= vocab)), float("nan"), 0.0).to(math_dtype)
    y = target.clamp(0, vocab - 1)
    row_lse = lse.to(math_dtype)
    w = class_weight.to(math_dtype) if class_weight is not None else None
    w_y = w[y] if w is not None else torch.ones_like(row_lse)
    w_sum = weight_sum.to(math_dtype) if w is not None else float(vocab)

    target_coef = (1.0 - eps) * w_y
    extra = eps / vocab * w_sum + 2.0 * opts.z_loss * row_lse
    p = torch.exp(z - row_lse[:, None])
    g = (target_coef + extra)[:, None] * p
    col = y if terms.target_col is None else terms.target_col.long()
    local = col - col_start  # the one-hot term's column in this block, if it is here (-1: none)
    here = (col >= 0) & (local >= 0) & (local < cols)
    at = local.clamp(0, cols - 1)[:, None]
    p_y = p.gather(1, at)[:, 0]
    # As the CE kernel: target_coef * (p_y - 1) + extra * p_y, with p_y - 1 formed before any product.
    g_y = torch.where(here, target_coef * (p_y - 1.0) + extra * p_y, g.gather(1, at)[:, 0])
    g.scatter_(1, at, g_y[:, None])
    if eps > 0.0:
        g -= eps / vocab * (w[col_start:col_start + cols] if w is not None else 1.0)
    if slope is not None:
        g *= slope
    scale = grad_scale.to(math_dtype) / opts.temperature
    g *= (scale + poison)[:, None]
    logits.copy_(torch.where(valid[:, None], g, 0.0))
