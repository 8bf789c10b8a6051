"""Grouped-head fused linear + cross-entropy: G vocabulary heads, one per group, never the (B, G, V) logits.

Multi-token prediction or per-group heads: group g of every batch position is projected by its own
head ``W[g]`` (V x H). The chunk loop is the core's (function.py) with each GEMM batched over the
groups: a chunk of ``c`` batch positions holds (G, c, V) logits in one contiguous buffer, which the
cross-entropy kernel sees as G*c ordinary rows. On Hopper the logits come from flce's GEMM, one launch
per group, stored less their tile max as the core's (``_group_logits``). The grad_weight GEMM of a chunk
is G GEMMs with K = c, so chunks are sized per group exactly like the core's (``plan_chunks`` with a
G*V-wide "vocabulary").
Batch-major inputs are read and their gradients written through (G, B, ·) views (see grouped.py).

The loss over groups (``group_reduction``), with L_g = ``linear_cross_entropy(x_g, W_g, t_g, ...)`` the
loss of group g alone under the same ``reduction`` and ``num_items_in_batch``:

- "sum" (default): sum_g L_g. The grouped loss is a fused loop over the heads, nothing more: each head
  keeps its own mean (a head whose tokens are mostly ignored weighs as much as a full one).
- "mean": sum_g L_g / G. Multi-token prediction weighs its depths equally this way (DeepSeek-V3's
  lambda / D * sum_k L_k is "mean" times lambda), with a scale that does not grow with the head count.
- "pooled": all groups' tokens as one batch: the sum over every valid token of every head divided by
  their number (by the sum of their class weights with ``weight``), so every token counts once.
  Equal to "mean" only when every group has as many valid tokens.

With reduction="sum" (or ``num_items_in_batch``) "sum" and "pooled" agree. Each group's L_g (its share
of the pooled loss for "pooled") comes back in ``LossStats.group_losses`` with ``return_stats``.
Implemented as one (G,) scale per group, applied per token, so all three cost the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_tensors, compute_dtype, flat_targets, raise_bad_targets
from .function import (ChunkGrads, LinearCrossEntropyFunction, LoopSpec, LossParts, PendingGrads,
                       input_grad_dtype, scaled_operand, scaled_product_into, settle_residual, split_scale,
                       unit_dlogits)
from .gemm import bmm_into, linear_into, padded_width
from .grouped import check_group_bias, group_major_view
from .import_hooks import compile_disabled
from .kernels import ce_chunk, math_dtype, resolve_backend
from .kernels.scale import scale_into
from .kernels.targets import count_targets
from .options import LossOptions, check_run_options
from .planner import ChunkPlan, plan_chunks, weight_grad_hidden
from .reduction import LossStats, class_weights, items_scale, reduction_scale

GROUP_REDUCTIONS = ("sum", "mean", "pooled")


@dataclass(frozen=True)
class GroupedChunkPlan(ChunkPlan):
    """A ChunkPlan over batch positions (a chunk of ``rows`` positions holds G*rows logit rows), plus
    the layout of the inputs."""

    group_major: bool = False


@compile_disabled  # as the core: host-side checks and Triton launches, one graph break
def grouped_linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group_major: bool = False,
    group_reduction: str = "sum",
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    accum_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    return_stats: bool = False,
    validate_target: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, LossStats]:
    """Cross-entropy of ``input[:, g] @ linear_weight[g].T (+ linear_bias[g])`` for G heads at once.

    Args:
        input: (B, G, H), or (G, B, H) with ``group_major=True``.
        linear_weight: (G, V, H), one head per group, V >= 1. linear_bias: (G, V) or None.
        target: (B, G), or (G, B) with ``group_major=True``.
        group_reduction: "sum" (default), "mean" or "pooled": how the groups' losses combine, see the
            module docstring. No effect with reduction="none".
        weight: (V,) class weights shared by all heads, or None (must not require grad).
        reduction: "mean", "sum", or "none" (target's shape), per group.
        chunk_size: batch positions per chunk (each chunk holds G * chunk_size rows of logits).
        validate_target: as in ``linear_cross_entropy``: check targets (one host sync) and skip the
            batch positions whose targets are ignored in every group. False is sync-free.
        Other options: as in :func:`flce.linear_cross_entropy` (float64 math for float64 inputs,
            differentiable once).
    """
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    _check_grouped(input, linear_weight, target, linear_bias, weight, group_major)
    if not isinstance(group_reduction, str) or group_reduction not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduction must be one of {GROUP_REDUCTIONS}, got {group_reduction!r}")
    num_items = check_run_options(reduction, num_items_in_batch, chunk_size, accum_dtype, backend, return_stats,
                                  validate_target)
    dtype = compute_dtype(input, linear_weight, linear_bias)
    backend = resolve_backend(backend, input.device, dtype)
    acc = math_dtype(dtype)
    groups, vocab, _ = linear_weight.shape
    batch_dim = 1 if group_major else 0
    ignore = opts.ignore_index

    x, t = input, flat_targets(target, ignore).view(target.shape)
    valid = t != ignore
    counts, count_scale = count_targets(t.reshape(-1), ignore, vocab, backend)  # compaction keeps the count
    kept = None  # batch positions kept, when some are ignored in every group
    if validate_target and t.numel():
        kept = _check_and_compact(t, valid, counts, vocab, ignore, batch_dim, target)
        if kept is not None:
            x, t = x.index_select(batch_dim, kept), t.index_select(batch_dim, kept)

    class_w, weight_sum = class_weights(weight, acc)
    scales = token_scale = None  # (G,) per-group loss scales, and as a per-token view in t's shape
    if reduction != "none":
        scales = _group_scales(t, class_w, opts, num_items, counts, count_scale, group_reduction, batch_dim, acc)
        token_scale = scales[:, None].expand(t.shape) if group_major else scales.expand(t.shape)
    base = plan_chunks(t.shape[batch_dim], groups * vocab, dtype, linear_weight.dtype,
                       chunk_size=chunk_size, accum_dtype=accum_dtype,
                       weight_grad_hidden=weight_grad_hidden(linear_weight))
    plan = GroupedChunkPlan(base.n_rows, base.rows, base.accum_dtype, group_major=group_major)
    args = (x, linear_weight, linear_bias, t, class_w, weight_sum)
    spec = LoopSpec(opts, plan, dtype, backend, return_stats, entry="flce.grouped_linear_cross_entropy")
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args[:3]):
        loss, lse, correct, token_loss = LinearCrossEntropyFunction.apply(grouped_chunk_loop, spec, *args,
                                                                          scales, None)
    else:
        parts, _ = grouped_chunk_loop(*args, None, (False, False, False), spec)
        token_loss, lse, correct = parts.loss, parts.lse, parts.correct
        loss = token_loss if token_scale is None else (token_loss * token_scale).sum()

    if reduction == "none":
        loss = _scatter_positions(loss, kept, batch_dim, target.shape)
    if not return_stats:
        return loss
    return loss, _grouped_stats(lse, correct, token_loss, valid, kept, token_scale, scales, group_reduction,
                                opts, batch_dim, target.shape)


def _group_scales(t: torch.Tensor, class_w, opts: LossOptions, num_items, counts, count_scale,
                  group_reduction: str, batch_dim: int, acc: torch.dtype) -> torch.Tensor:
    """(G,) factors that turn each group's sum of token losses into its part of the loss.
    t: (B, G) or (G, B) int64 targets (batch dimension ``batch_dim``)."""
    groups = t.shape[1 - batch_dim]
    if num_items is not None:
        scales = items_scale(num_items, t.device, acc).expand(groups)
    elif opts.reduction == "sum" or group_reduction == "pooled":
        scales = reduction_scale(t, class_w, opts, None, counts, count_scale, acc).expand(groups)
    else:  # each group's own mean (0 for a group with nothing valid)
        valid = t != opts.ignore_index
        if class_w is None:
            denom = valid.sum(batch_dim, dtype=acc)
        else:
            denom = (class_w[t.clamp(0, class_w.numel() - 1)] * valid).sum(batch_dim, dtype=acc)
        scales = torch.where(denom != 0, 1.0 / denom, torch.zeros_like(denom))
    return scales / groups if group_reduction == "mean" else scales


def _grouped_stats(lse, correct, token_loss, valid, kept, token_scale, scales, group_reduction, opts: LossOptions,
                   batch_dim: int, shape) -> LossStats:
    """LossStats of the grouped loss; per-token inputs are those of the kept batch positions."""
    num_valid = valid.sum()
    accuracy = correct.sum() / num_valid.clamp(min=1)
    z_tokens = opts.z_loss * lse.detach().square()
    if token_scale is None:
        return LossStats(_scatter_positions(z_tokens, kept, batch_dim, shape), accuracy, num_valid)
    per_group = token_loss.detach().sum(batch_dim) * scales
    if group_reduction == "mean":  # report each group's L_g; the loss is their mean
        per_group = per_group * scales.shape[0]
    return LossStats((z_tokens * token_scale).sum(), accuracy, num_valid, per_group)


def grouped_chunk_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    spec: LoopSpec,
    defer: bool = False,
) -> tuple[LossParts, ChunkGrads]:
    """The core's ``chunk_loop`` (same contract) over groups: chunks of batch positions, batched GEMMs.
    ``defer`` (a single chunk with a per-group scale) returns the chunk's unscaled dlogits for backward's
    GEMMs (``PendingGroupedGrads``), as the core's single chunk does.

    x: (B, G, H) or (G, B, H) per ``plan.group_major``; weight: (G, V, H); bias: (G, V) or None;
    target: (B, G) or (G, B) int64; grad_scale: None, 0-d, (G,) one per group, or per token in target's
    shape (reduction="none"). Per-token outputs have the target's shape; gradients the shapes of x, weight
    and bias. With a per-group or per-token grad_scale, ``parts.total`` is the sum of the tokens' losses
    times their scales. As in the core, 16-bit dlogits are left unscaled where float32 alone takes the scale
    (``grads.scale``, (G,): grad_input's product, the weight and bias sums), else take each group's power of two.
    """
    opts, plan, compute_dtype, backend, want_correct = spec[:5]  # the grouped loss never passes counts

    def gm(t: torch.Tensor) -> torch.Tensor:
        return group_major_view(t, plan.group_major)

    groups, vocab, hidden = weight.shape
    dev = x.device
    acc = math_dtype(compute_dtype)
    w = weight.to(compute_dtype)  # no copy unless autocast asks for a narrower dtype
    grad = grad_scale is not None
    need_x, need_w, need_b = (grad and k for k in needs)
    per_group = grad and grad_scale.dim() == 1
    per_token = grad and grad_scale.dim() == 2

    def per_token_buffer() -> torch.Tensor:
        return torch.empty(target.shape, dtype=acc, device=dev)

    parts = LossParts(per_token_buffer(), per_token_buffer(), per_token_buffer() if want_correct else None)
    grads = ChunkGrads(
        input=torch.empty(x.shape, dtype=input_grad_dtype(x.dtype, compute_dtype), device=dev) if need_x else None,
        weight=torch.empty(groups, vocab, hidden, dtype=plan.accum_dtype, device=dev) if need_w else None,
        bias=torch.zeros(groups, vocab, dtype=acc, device=dev) if need_b else None,
    )
    if plan.n_rows == 0:
        if grads.weight is not None:
            grads.weight.zero_()
        if per_token or per_group:
            parts.total = torch.zeros((), dtype=acc, device=dev)
        return parts, grads

    # Flat buffers so that a shorter last chunk still reads as (G * c, V) rows of one stride, padded to whole lines
    # (``gemm.padded_width``: the GEMMs' and the TMA store's alignment at any V).
    width = padded_width(vocab, compute_dtype.itemsize)
    logits_buffer = torch.empty(groups * plan.rows * width, dtype=compute_dtype, device=dev)
    token_buffer = torch.empty(3, groups * plan.rows, dtype=acc, device=dev)
    x_gm, t_gm = gm(x), gm(target)
    defer = defer and per_group and plan.num_chunks == 1
    ce_scale, residual, pending_scale = grad_scale, None, None
    # The residual joins grad_input's float32 product here (the sums: ``settle_residual``); a 16-bit weight
    # gradient (a single chunk's) takes it on x_c, its operand, rounded once.
    wide_weight = grads.weight is None or grads.weight.dtype.itemsize > 2
    if defer:  # backward applies the scales with grad_output, where each gradient is rounded once
        ce_scale, pending_scale = unit_dlogits(grad_scale, opts.temperature)
    elif per_group and compute_dtype.itemsize == 2 and (need_x or need_w or need_b):
        # unscaled where only float32 takes the scale, as the one-head loop; else each group's power of two
        ce_scale, residual = (unit_dlogits if wide_weight else split_scale)(grad_scale, opts.temperature)
    for i, (start, end) in enumerate(plan.bounds()):
        n = groups * (end - start)
        x_c = x_gm[:, start:end].to(compute_dtype)  # (G, c, H) view
        logits = logits_buffer[: n * width].view(groups, end - start, width)[..., :vocab]
        tile_stats = _group_logits(x_c, w, bias, logits, opts, backend)
        loss_c, lse_c, correct_c = token_buffer[:, :n]
        if per_token:
            scale = gm(grad_scale)[:, start:end].reshape(-1).contiguous()
        elif per_group and ce_scale.dim() == 1:  # a group's rows are contiguous in the chunk's G * c rows
            scale = ce_scale[:, None].expand(groups, end - start).reshape(-1).contiguous()  # (not an expanded view)
        else:
            scale = ce_scale
        ce_chunk(
            backend,
            logits.view(n, vocab),
            t_gm[:, start:end].reshape(-1).contiguous(),
            loss_c,
            lse_c,
            correct_c if want_correct else None,
            class_weight,
            weight_sum,
            scale if grad else None,
            opts,
            tile_stats=tile_stats,
            # where the heads' GEMMs stored the logits less their tile max: each target's logit from a float32 dot
            operands=None if tile_stats is None else (x_c, w, bias),
        )
        for full, chunk in zip((parts.loss, parts.lse, parts.correct), (loss_c, lse_c, correct_c)):
            if full is not None:
                gm(full)[:, start:end].copy_(chunk.view(groups, -1))
        if defer:
            parts.total = (gm(parts.loss) * grad_scale[:, None]).sum()
            # x itself, not a view made here: an in-place change of it then raises autograd's usual error
            return parts, PendingGroupedGrads(logits, x.to(compute_dtype), w, pending_scale, plan.group_major)
        if need_x and residual is not None:
            scaled_product_into(gm(grads.input)[:, start:end], logits, w, residual, backend,
                                pieces=plan.num_chunks == 1)
        elif need_x:
            bmm_into(gm(grads.input)[:, start:end], logits, w, accumulate=False)
        if need_w:
            if residual is not None and not wide_weight:
                x_c = scaled_operand(x_c, residual[:, None, None], backend)
            bmm_into(grads.weight, logits.transpose(1, 2), x_c, accumulate=i > 0)
        if need_b:
            grads.bias += logits.sum(1, dtype=acc)
    settle_residual(grads, residual)
    if per_token:
        parts.total = (parts.loss * grad_scale).sum()
    elif per_group:
        parts.total = (gm(parts.loss) * grad_scale[:, None]).sum()
    return parts, grads


def _group_logits(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, logits: torch.Tensor,
                  opts: LossOptions, backend: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A chunk's (G, c, V) logits into ``logits``: on Hopper one of flce's GEMMs per group, which stores them less
    their tile max (``kernels.logits_triton``; then returns the (G * c, T) tile maxima and sums the CE kernel
    reads), else one batched cuBLAS GEMM. x_c (G, c, H), w (G, V, H), bias (G, V) or None."""
    heads = range(w.shape[0])
    if backend == "triton":
        from .kernels import logits_triton

        if all(logits_triton.supported(x_c[g], w[g], None if bias is None else bias[g], logits[g]) for g in heads):
            groups, rows, vocab = logits.shape
            stats = torch.empty(2, groups, rows, logits_triton.num_tiles(vocab), dtype=torch.float32,
                                device=logits.device)
            for g in heads:
                logits_triton.logits_with_tile_stats(x_c[g], w[g], None if bias is None else bias[g], logits[g],
                                                     stats[0, g], stats[1, g], opts)
            tile_max, tile_sum = stats.view(2, groups * rows, -1)
            return tile_max, tile_sum
    linear_into(logits, x_c, w.transpose(1, 2), bias)
    return None


@dataclass
class PendingGroupedGrads(PendingGrads):
    """A single grouped chunk's dlogits (G, c, V), left unscaled, and its operands x (in its layout, the
    compute dtype) and w (G, V, H); ``scale`` (G,): the loss's per-group scales over the temperature."""

    group_major: bool = False

    def finish(self, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, needs, dtypes, backend: str) -> ChunkGrads:
        """Backward's batched GEMMs, each head's scale times grad_output g (0-d) applied where its gradients
        are rounded once (as ``function.finish_pending``): grad_input's float32 product, x_c for grad_weight,
        grad_bias's float32 sums. grad_input comes back in x's layout."""
        x_dtype, w_dtype, b_dtype = dtypes
        dl, g, x_c = self.dlogits, g * self.scale, group_major_view(x, self.group_major)
        grads = ChunkGrads(None, None, None)
        if needs[0]:
            out = torch.empty_like(x_c, dtype=x_dtype)  # x's layout, seen as (G, c, H)
            scaled_product_into(out, dl, w, g, backend, pieces=True)
            grads.input = group_major_view(out, self.group_major)
        if needs[1]:
            x_g = scaled_operand(x_c, g[:, None, None], backend)
            grads.weight = torch.empty(w.shape, dtype=w_dtype, device=w.device)
            bmm_into(grads.weight, dl.transpose(1, 2), x_g, accumulate=False)
        if needs[2]:
            grads.bias = scale_into(dl.sum(1, dtype=math_dtype(dl.dtype)), g[:, None], b_dtype, backend)
        return grads


def _check_grouped(input, linear_weight, target, bias, class_weight, group_major: bool) -> None:
    """Grouped shapes here; dtypes, devices and the class weights through the core's check on group 0."""
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if type(group_major) is not bool:
        raise TypeError(f"group_major must be True or False, got {group_major!r}")
    if linear_weight.dim() != 3 or linear_weight.shape[0] < 1:
        raise ValueError(f"linear_weight must be (G, V, H) with G >= 1, got {tuple(linear_weight.shape)}")
    groups, vocab, hidden = linear_weight.shape
    layout = "(G, B, H)" if group_major else "(B, G, H)"
    group_dim = 0 if group_major else 1
    if input.dim() != 3 or input.shape[group_dim] != groups or input.shape[2] != hidden:
        raise ValueError(f"input must be {layout} = {layout.replace('G', str(groups)).replace('H', str(hidden))} "
                         f"(group_major={group_major}) to match linear_weight {tuple(linear_weight.shape)}, "
                         f"got {tuple(input.shape)}")
    if tuple(target.shape) != tuple(input.shape[:2]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal input's leading shape "
                         f"{tuple(input.shape[:2])}")
    check_group_bias("linear_bias", bias, groups, vocab)
    check_tensors(group_major_view(input, group_major)[0], linear_weight[0],
                  group_major_view(target, group_major)[0], bias[0] if bias is not None else None,
                  class_weight)


def _check_and_compact(t: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, vocab: int, ignore_index: int,
                       batch_dim: int, original: torch.Tensor) -> torch.Tensor | None:
    """Raise on targets outside [0, V); return the batch positions to keep if some are ignored in
    every group (one host sync). ``counts``: ``count_targets``' counts of t; original: the caller's target."""
    keep = valid.any(dim=1 - batch_dim)
    n_keep, n_bad = torch.stack([keep.sum(), counts[1]]).tolist()
    if n_bad:
        raise_bad_targets(t, vocab, ignore_index, n_bad, original)
    if n_keep == keep.numel():
        return None
    return keep.nonzero_static(size=n_keep).squeeze(1)  # sized: no second sync


def _scatter_positions(values: torch.Tensor, kept: torch.Tensor | None, batch_dim: int, shape) -> torch.Tensor:
    """Put per-token values of the kept batch positions back in the full shape (zeros elsewhere)."""
    if kept is None:
        return values
    return values.new_zeros(shape).index_copy(batch_dim, kept, values)
