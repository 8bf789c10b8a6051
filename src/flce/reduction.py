"""From per-row losses to the reduced loss: the reduction's scale, scattering rows back, side statistics.

Shared by every front end (plain, grouped, vocab-parallel); device work only, no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kernels.targets import count_targets
from .options import LossOptions
from .planner import ChunkPlan


@dataclass
class LossStats:
    """Side results (detached device tensors, no host sync).

    z_loss: the z-loss part of the loss, reduced like the loss; accuracy: share of valid tokens whose
    argmax is the target; num_valid: number of tokens that are not ``ignore_index``;
    group_losses: (G,) each group's loss, whose sum (or mean, per ``group_reduction``) is the loss, from
    ``grouped_linear_cross_entropy`` with reduction "mean" or "sum" (None otherwise).
    """

    z_loss: torch.Tensor
    accuracy: torch.Tensor
    num_valid: torch.Tensor
    group_losses: torch.Tensor | None = None


class ScaleParts(NamedTuple):
    """What a call computes from its targets before the GEMMs (``loss_scale``): class weights in the math dtype
    (V,) and their sum, or None; counts [valid, out of range, ...] int64 on the targets' device; the reduction's
    0-d scale (None for reduction="none"); and ``kernel_counts``: counts again where the CE kernel fills them
    and writes the scale and the mean itself (``function.LoopSpec.counts``), else None."""

    class_w: torch.Tensor | None
    weight_sum: torch.Tensor | None
    counts: torch.Tensor
    scale: torch.Tensor | None
    kernel_counts: torch.Tensor | None


def loss_scale(t: torch.Tensor, class_weight: torch.Tensor | None, opts: LossOptions, num_items, vocab: int,
               acc: torch.dtype, backend: str, plan: ChunkPlan | None, grad: bool) -> ScaleParts:
    """``ScaleParts`` for targets t (n,) int64; num_items as ``check_num_items`` returns it; plan: the chunk plan
    where the CE kernel may finish the mean (None: never)."""
    class_w, weight_sum = class_weights(class_weight, acc)
    if kernel_finishes_mean(plan, grad, opts, class_w, num_items, acc):
        counts = torch.zeros(3, dtype=torch.int64, device=t.device)
        scale = torch.empty((), dtype=torch.float32, device=t.device)  # written by the CE kernel
        return ScaleParts(class_w, weight_sum, counts, scale, counts)
    counts, count_scale = count_targets(t, opts.ignore_index, vocab, backend)
    scale = None if opts.reduction == "none" else reduction_scale(t, class_w, opts, num_items, counts, count_scale,
                                                                  acc)
    return ScaleParts(class_w, weight_sum, counts, scale, None)


def class_weights(class_weight: torch.Tensor | None, acc: torch.dtype) -> tuple:
    """(class weights (V,) contiguous in the math dtype ``acc``, their 0-d sum), or (None, None)."""
    if class_weight is None:
        return None, None
    class_w = class_weight.to(acc).contiguous()
    return class_w, class_w.sum()


def kernel_finishes_mean(plan: ChunkPlan | None, grad: bool, opts: LossOptions, class_w, num_items, acc) -> bool:
    """Whether the CE kernel counts the targets and finishes the mean itself (``LoopSpec.counts``): for a
    plain float32 mean over one chunk in training, which spares a small, launch-bound batch three launches.
    (Its dlogits carry 1 / temperature: other temperatures count first, so that backward applies it.)"""
    return (grad and plan is not None and plan.n_rows > 0 and plan.num_chunks == 1 and opts.reduction == "mean"
            and class_w is None and num_items is None and acc == torch.float32 and opts.temperature == 1.0)


def reduction_scale(t: torch.Tensor, class_w: torch.Tensor | None, opts: LossOptions, num_items,
                    counts: torch.Tensor, count_scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0-d ``dtype`` factor that turns the sum of row losses into the reduced loss (0 if nothing counts).

    Built with as few launches as possible (and no host-to-device copy, which would wait for the GPU).
    t: (...) int64 targets; class_w: (V,) or None; num_items: None, a float or a 0-d tensor (as
    ``check_num_items`` returns it); counts, count_scale: ``count_targets``' [valid, ...] counts and
    1 / max(valid, 1) in float32.
    """
    device = t.device
    if num_items is not None:
        return items_scale(num_items, device, dtype)
    if opts.reduction == "sum":
        return torch.ones((), dtype=dtype, device=device)
    if class_w is not None:
        vocab = class_w.numel()
        denom = (class_w[t.clamp(0, vocab - 1)] * (t != opts.ignore_index)).sum(dtype=dtype)
        return torch.where(denom != 0, 1.0 / denom, torch.zeros_like(denom))
    # A count: with no valid row the loss sum is 0 anyway, so 1 / max(count, 1) is exact.
    if dtype == torch.float32:
        return count_scale
    return counts[0].to(dtype).clamp(min=1.0).reciprocal()


def items_scale(num_items, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """1 / num_items (0 for 0). A tensor's value is not read on the host: a negative or non-finite one
    gives NaN, never a plausible loss."""
    if not isinstance(num_items, torch.Tensor):
        return torch.full((), 1.0 / num_items if num_items else 0.0, dtype=dtype, device=device)
    denom = num_items.to(device=device, dtype=dtype)
    ok = (denom > 0) & (denom < float("inf"))
    return torch.where(ok, 1.0 / denom, torch.where(denom == 0, 0.0, float("nan")))


def scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Place per-valid-row values (k,) back at their rows of an (n,) tensor (zeros at ignored rows)."""
    if rows is None:
        return values
    return values.new_zeros(n).index_copy(0, rows, values)


def loss_stats(lse, correct, valid, rows, scale, opts: LossOptions, shape) -> LossStats:
    """``LossStats`` from per-row lse and hits (k,) of the kept ``rows`` (None: all n rows), valid (n,),
    the reduction's ``scale`` (None for reduction='none': per-row z-loss in ``shape``)."""
    num_valid = valid.sum()
    z_rows = opts.z_loss * lse.detach().square()
    if scale is None:
        z = scatter_rows(z_rows, rows, valid.numel()).reshape(shape)
    else:
        z = z_rows.sum() * scale
    accuracy = correct.sum() / num_valid.clamp(min=1)
    return LossStats(z_loss=z, accuracy=accuracy, num_valid=num_valid)
