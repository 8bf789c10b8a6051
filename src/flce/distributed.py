"""Vocab-parallel fused linear + cross-entropy: the (V, H) weight is split by rows over a process group.

Every rank holds the same input and target and a contiguous slice of the vocabulary. Per chunk of
rows each rank computes its slice of the logits; the ranks agree on the softmax with two small
all-reduces (MAX of the row maxima, then one SUM of [sum of exp rescaled to the global max, target
logit, smoothing sum]); each rank then writes its slice's gradient over its logits and runs the
grad_weight GEMM for its rows of W. grad_input is the sum over ranks of dlogits @ W_shard: one
all-reduce over the whole grad_input at the end, in float32 for 16-bit inputs (rounded once). Neither
logits nor weights travel. On Hopper each rank's logits come from flce's GEMM as on one device
(``function.chunk_logits``): stored less their tile max, with statistics that stage 1 reads instead of the
logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .checks import check_and_compact, check_class_weight, check_tensors, compute_dtype, flat_targets
from .function import (ChunkGrads, LossParts, chunk_logits, finish_forward, not_twice_differentiable, release,
                       scale_grads, scaled_operand, settle_residual, split_scale, take_grads, unit_dlogits)
from .gemm import column_sums_into, mm_into, padded_rows
from .import_hooks import compile_disabled
from .kernels import math_dtype, resolve_backend
from .kernels.ce_vocab_parallel import (ROW_MAX, STATS, SUM_EXP, SUM_LOGITS, TARGET_LOGIT, TARGET_STORED, shard_grad,
                                        shard_stats)
from .kernels.targets import count_targets
from .options import LossOptions, check_run_options
from .planner import ChunkPlan, plan_chunks, weight_grad_hidden
from .reduction import LossStats, loss_stats, reduction_scale, scatter_rows

__all__ = [
    "DTensorLocals",
    "ShardLayout",
    "dtensor_locals",
    "is_dtensor",
    "learn_layout",
    "vocab_parallel_linear_cross_entropy",
]


@dataclass(frozen=True)
class ShardLayout:
    """How the vocabulary is split: ``sizes[r]`` rows of W on rank r of the group, in rank order."""

    sizes: tuple[int, ...]
    rank: int

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def end(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def vocab(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class _Setup:
    """What the chunk loop needs besides tensors."""

    opts: LossOptions
    plan: ChunkPlan
    compute_dtype: torch.dtype
    backend: str
    layout: ShardLayout
    group: dist.ProcessGroup | None
    want_correct: bool


@dataclass
class _Rows:
    """Per-row facts for all n rows. local: (n,) int64 target column in this shard, -1 if elsewhere or
    ignored; valid: (n,) bool; target_weight: (n,) class weight of the target (1 without), in the math
    dtype; poison: None, or (n,) NaN where an unchecked target is outside [0, V), else 0."""

    local: torch.Tensor
    valid: torch.Tensor
    target_weight: torch.Tensor
    poison: torch.Tensor | None = None


@dataclass
class _Classes:
    """Class weights: ``local`` (V_local,) slice in the math dtype, or None; ``total`` their sum over all V
    (a 0-d tensor, or V as a float without class weights: no host-to-device copy)."""

    local: torch.Tensor | None
    total: torch.Tensor | float


@compile_disabled  # collectives and data-dependent control flow: one graph break, exact result
def vocab_parallel_linear_cross_entropy(
    input: torch.Tensor,
    linear_weight_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    shard_sizes: tuple[int, ...] | list[int] | None = None,
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
    """``flce.linear_cross_entropy`` with the vocabulary split over the ranks of ``group``.

    Every rank passes the same ``input`` and ``target`` and its own contiguous slice of the weight;
    every rank gets the loss of the full weight, the full grad_input, and the gradient of its own
    slice (and of its bias slice). For reduction="none" the backward's grad_output must also be the
    same on every rank (true when what follows the loss is replicated).

    Args:
        input: (..., H), same on every rank. linear_weight_shard: (V_r, H), rows
            [start_r, start_r + V_r) of the full (V, H) weight, ranks in order (V_r may differ, even be
            0). target: (...) global class indices, same on every rank.
        group: the process group over which the vocabulary is split (None: the default group).
        shard_sizes: every rank's V_r, if known (skips learning it with an all-gather).
        linear_bias: (V_r,) this rank's slice of the bias, or None.
        weight: (V,) class weights over the full vocabulary, the same on every rank, or None.
        Other options: as in ``flce.linear_cross_entropy`` (float64 inputs: float64 arithmetic;
        differentiable once). ``return_stats``' accuracy counts a tie for the top logit as a hit.
        ``validate_target`` also checks that the shard sizes agree and that the target is the same on
        every rank (a weight sharded by FSDP must be unsharded first); with False, a target outside
        [0, V) gives its row a NaN loss and gradient, as in the one-device loss.

    Host syncs: one to learn the layout (skipped with ``shard_sizes`` and validate_target=False, the
    sync-free setting), one for validation, as in the single-GPU function.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs an initialized torch.distributed "
                           "process group; on one device use flce.linear_cross_entropy")
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    check_tensors(input, linear_weight_shard, target, linear_bias, None, min_vocab=0)  # weight: after the layout
    num_items = check_run_options(reduction, num_items_in_batch, chunk_size, accum_dtype, backend, return_stats,
                                  validate_target)
    dtype = compute_dtype(input, linear_weight_shard, linear_bias)
    backend = resolve_backend(backend, input.device, dtype)
    acc = math_dtype(dtype)

    hidden, local_vocab = input.shape[-1], linear_weight_shard.shape[0]
    x = input.reshape(-1, hidden)
    t = flat_targets(target, opts.ignore_index)
    valid = t != opts.ignore_index
    layout = learn_layout(local_vocab, t, group, shard_sizes, check=validate_target)
    if layout.vocab == 0:
        raise ValueError(f"the vocabulary is empty: every rank's linear_weight_shard has 0 rows ({layout.sizes})")
    if weight is not None:
        check_class_weight(weight, layout.vocab, input.device)
    counts, count_scale = count_targets(t, opts.ignore_index, layout.vocab, backend)
    rows = None
    if validate_target and t.numel():
        rows, _ = check_and_compact(t, layout.vocab, opts.ignore_index, counts, target)
        if rows is not None:
            x, t = x.index_select(0, rows), t.index_select(0, rows)

    class_w = weight.to(acc).contiguous() if weight is not None else None
    scale = None if reduction == "none" else reduction_scale(t, class_w, opts, num_items, counts, count_scale, acc)
    if accum_dtype is None and dtype == torch.float16:
        # beside one chunk's fp16 weight gradient the fp16 dlogits would take the mean's power of two, sinking a
        # softmax's tail below fp16's smallest normal (``function._sums_take_scale``): a float32 sum instead
        accum_dtype = torch.float32
    plan = plan_chunks(x.shape[0], local_vocab, dtype, linear_weight_shard.dtype,
                       chunk_size=chunk_size, accum_dtype=accum_dtype,
                       weight_grad_hidden=weight_grad_hidden(linear_weight_shard))
    setup = _Setup(opts, plan, dtype, backend, layout, group, return_stats)
    row_facts, classes = _row_facts(t, class_w, layout, opts, acc, poison=not validate_target)
    args = (x, linear_weight_shard, linear_bias)
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
        loss, lse, correct, _ = VocabParallelFunction.apply(*args, row_facts, classes, scale, setup)
    else:
        parts, _ = _chunk_loop(*args, row_facts, classes, setup, None, (False, False, False))
        loss = parts.loss if scale is None else parts.loss.sum() * scale
        lse, correct = parts.lse, parts.correct

    if reduction == "none":
        loss = scatter_rows(loss, rows, valid.numel()).reshape(target.shape)
    if not return_stats:
        return loss
    return loss, loss_stats(lse, correct, valid, rows, scale, opts, target.shape)


def learn_layout(local_vocab: int, target: torch.Tensor, group: dist.ProcessGroup | None,
                 shard_sizes=None, *, check: bool = True) -> ShardLayout:
    """Every rank's vocabulary slice, from ``shard_sizes`` or an all-gather over ``group``.

    The all-gather (one host sync) also carries a fingerprint of ``target`` (n,), so that a rank
    whose target differs from the others' raises instead of silently mixing batches.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if shard_sizes is not None:
        sizes = tuple(int(s) for s in shard_sizes)
        if len(sizes) != world or min(sizes) < 0:
            raise ValueError(f"shard_sizes {sizes} must list {world} sizes >= 0, one per rank of the group")
        if not check:  # trusted, as the caller asked for no communication: only this rank's size is checked
            if sizes[rank] != local_vocab:
                raise ValueError(f"shard_sizes {sizes} give rank {rank} {sizes[rank]} rows, its "
                                 f"linear_weight_shard has {local_vocab}")
            return ShardLayout(sizes, rank)
    mine = torch.stack([torch.tensor(local_vocab, device=target.device),
                        torch.tensor(target.numel(), device=target.device), _fingerprint(target)])
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    gathered = torch.stack(table).tolist()  # the one host sync
    if len({tuple(r[1:]) for r in gathered}) > 1:
        raise ValueError("target differs across the ranks of the group: vocab-parallel cross-entropy needs "
                         "the same input and target on every rank (a weight sharded by FSDP must be "
                         "unsharded first, e.g. by computing the loss inside the module's forward)")
    learned = tuple(r[0] for r in gathered)
    if shard_sizes is not None and learned != sizes:  # raised on every rank alike
        raise ValueError(f"shard_sizes {sizes} disagree with the ranks' weight shards {learned}")
    return ShardLayout(learned, rank)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 checksum of class indices; exact (no overflow: terms < 2**32, fewer than 2**31 rows)."""
    pos = torch.arange(t.numel(), device=t.device)
    return ((t % 65521 + 1) * (pos % 65519 + 1)).sum()


def _row_facts(t: torch.Tensor, class_w: torch.Tensor | None, layout: ShardLayout, opts: LossOptions,
               acc: torch.dtype, poison: bool) -> tuple[_Rows, _Classes]:
    """Per-row facts (t: (n,) int64) and the class weights; ``poison``: mark unchecked targets outside
    [0, V), which no shard holds, so that their rows come out NaN (as in the one-device loss)."""
    valid = t != opts.ignore_index
    local = t - layout.start
    here = valid & (local >= 0) & (local < layout.sizes[layout.rank])
    if class_w is None:
        target_weight = torch.ones(t.shape, dtype=acc, device=t.device)
        classes = _Classes(None, float(layout.vocab))
    else:
        target_weight = class_w[t.clamp(0, layout.vocab - 1)]
        classes = _Classes(class_w[layout.start:layout.end], class_w.sum())
    bad = torch.where(valid & ((t < 0) | (t >= layout.vocab)), float("nan"), 0.0).to(acc) if poison else None
    return _Rows(torch.where(here, local, -1), valid, target_weight, bad), classes


def _chunk_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: _Rows,
    classes: _Classes,
    setup: _Setup,
    grad_scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    saved_lse: torch.Tensor | None = None,
) -> tuple[LossParts, ChunkGrads]:
    """Every chunk on this rank's shard; gradients for ``needs`` = (input, weight, bias) when
    ``grad_scale`` (0-d or (n,)) is given. With ``saved_lse`` (n,) the softmax is already known: no
    statistics, no forward collectives (the recompute in backward for reduction="none").

    x: (n, H) replicated; weight: (V_r, H); bias: (V_r,) or None.
    """
    n, hidden = x.shape
    dev, plan = x.device, setup.plan
    acc = math_dtype(setup.compute_dtype)
    w = weight.to(setup.compute_dtype)
    grad = grad_scale is not None
    need_x, need_w, need_b = (grad and k for k in needs)
    parts = LossParts(
        loss=torch.zeros(n, dtype=acc, device=dev),
        lse=saved_lse if saved_lse is not None else torch.empty(n, dtype=acc, device=dev),
        correct=torch.empty(n, dtype=acc, device=dev) if setup.want_correct else None,
    )
    grads = ChunkGrads(
        # Each rank's dlogits @ W_shard stays in the math dtype through the all-reduce: grad_input is
        # rounded once, when backward scales it, not once per partial sum and per reduction step.
        input=torch.empty(x.shape, dtype=acc, device=dev) if need_x else None,
        weight=torch.empty(weight.shape, dtype=plan.accum_dtype, device=dev) if need_w else None,
        bias=torch.zeros(weight.shape[0], dtype=acc, device=dev) if need_b else None,
    )
    if n == 0:  # the same on every rank (the target is replicated): no collectives either
        if grads.weight is not None:
            grads.weight.zero_()
        return parts, grads

    buffer = padded_rows(plan.rows, weight.shape[0], setup.compute_dtype, dev)
    ce_scale, residual = grad_scale, None
    wide_sums = grads.weight is None or grads.weight.dtype.itemsize > 2
    if grad and setup.compute_dtype.itemsize == 2 and (grad_scale.dim() == 0 or not need_b):
        # as the one-device loop: unscaled where float32 alone takes the scale (``function.unit_dlogits``), else its
        # power of two (``function.split_scale``; a per-row grad_output, reduction="none", per row)
        split = unit_dlogits if grad_scale.dim() == 0 and wide_sums else split_scale
        ce_scale, residual = split(grad_scale, setup.opts.temperature)
    per_row = residual is not None and residual.dim() == 1
    x_takes_residual = per_row or not wide_sums
    summing = None  # the grad_input all-reduce, in flight behind the last grad_weight GEMM
    for i, (start, end) in enumerate(plan.bounds()):
        chunk = slice(start, end)
        x_c = x[chunk].to(setup.compute_dtype)
        # On Hopper the logits less their tile max, as on one device (far less rounding where p is not small)
        logits, tile_stats = chunk_logits(x_c, w, bias, buffer[: end - start], setup.opts, setup.backend,
                                          sums=saved_lse is None)
        if saved_lse is None:
            _agree_on_softmax(logits, rows, classes, setup, parts, chunk, tile_stats, (x_c, w, bias))
        if not grad:
            continue
        scale = ce_scale[chunk] if ce_scale.dim() == 1 else ce_scale.expand(end - start)
        _write_grad(logits, rows, classes, setup, parts.lse[chunk], scale, chunk,
                    None if tile_stats is None else tile_stats[0])
        rows_residual = residual[chunk, None] if per_row else residual
        if need_x:
            mm_into(grads.input[chunk], logits, w, accumulate=False)
            if residual is not None:  # float32: scaled before the sum, rounded once in backward
                grads.input[chunk] *= rows_residual
            if end == n:  # each rank holds dlogits @ W_shard for every row: the gradient is their sum
                summing = dist.all_reduce(grads.input, group=setup.group, async_op=True)
        if need_w:
            if residual is not None and x_takes_residual:  # per row, or a 16-bit weight gradient
                x_c = scaled_operand(x_c, rows_residual, setup.backend)
            mm_into(grads.weight, logits.t(), x_c, accumulate=i > 0)
        if need_b:
            column_sums_into(grads.bias, logits, accumulate=True)
    settle_residual(grads, None if per_row else residual)
    if summing is not None:
        summing.wait()
    return parts, grads


def _agree_on_softmax(logits, rows: _Rows, classes: _Classes, setup: _Setup, parts: LossParts,
                      chunk: slice, tile_stats=None, operands=None) -> None:
    """Partial statistics, two all-reduces, then loss, lse (and hits) of the chunk's rows. ``operands``: the
    chunk's (x_c, W_local, bias), from which the target's logit is taken where the logits are stored shifted."""
    opts, vocab = setup.opts, setup.layout.vocab
    stats = torch.zeros(STATS, logits.shape[0], dtype=parts.lse.dtype, device=logits.device)
    shard_stats(setup.backend, logits, rows.local[chunk], classes.local, opts, stats, tile_stats,
                None if tile_stats is None else operands)
    row_max = stats[ROW_MAX].clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=setup.group)
    stats[SUM_EXP] *= torch.exp(stats[ROW_MAX] - row_max)  # 0 for an empty shard (its max is -inf)
    dist.all_reduce(stats[SUM_EXP:], group=setup.group)  # sum of exp, target logits, smoothing sum
    lse = row_max + torch.log(stats[SUM_EXP])
    z_y, w_y, valid = stats[TARGET_LOGIT], rows.target_weight[chunk], rows.valid[chunk]
    loss = (1.0 - opts.label_smoothing) * w_y * (lse - z_y)
    if opts.label_smoothing > 0.0:
        loss += opts.label_smoothing / vocab * (classes.total * lse - stats[SUM_LOGITS])
    if opts.z_loss > 0.0:
        loss += opts.z_loss * lse.square()
    if rows.poison is not None:
        loss += rows.poison[chunk]
    parts.loss[chunk] = torch.where(valid, loss, 0.0)
    parts.lse[chunk] = torch.where(valid, lse, 0.0)
    if parts.correct is not None:  # the target's logit is the top one (ties count as hits)
        parts.correct[chunk] = (valid & (stats[TARGET_STORED] >= row_max)).float()


def _write_grad(logits, rows: _Rows, classes: _Classes, setup: _Setup, lse, scale, chunk: slice,
                tile_max=None) -> None:
    """dz over this shard's columns, with the per-row coefficients of the full softmax."""
    opts, vocab = setup.opts, setup.layout.vocab
    eps = opts.label_smoothing
    target_coef = (1.0 - eps) * rows.target_weight[chunk]
    extra_coef = eps / vocab * classes.total + 2.0 * opts.z_loss * lse
    scale = torch.where(rows.valid[chunk], scale.to(lse.dtype) / opts.temperature, 0.0)
    if rows.poison is not None:  # NaN, not 0, so the kernels write NaN over the row
        scale = scale + rows.poison[chunk]
    shard_grad(setup.backend, logits, rows.local[chunk], classes.local, lse.contiguous(), extra_coef.contiguous(),
               target_coef.contiguous(), scale.contiguous(), eps / vocab, opts, tile_max)


class VocabParallelFunction(torch.autograd.Function):
    """Inputs: x (n, H), weight shard (V_r, H), bias shard, row facts, class weights, grad_scale (0-d
    reduction scale, or None for reduction='none'), setup. Outputs: loss (0-d, or (n,) for 'none'),
    lse (n,), correct (n,) or None, per-row losses or None (see ``finish_forward``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, classes, grad_scale, setup):
        ctx.set_materialize_grads(False)  # lse and correct get no gradient: skip their zero tensors
        needs = tuple(ctx.needs_input_grad[:3])
        parts, grads = _chunk_loop(x, weight, bias, rows, classes, setup, grad_scale, needs)
        ctx.meta = (rows, classes, setup, (x.dtype, weight.dtype, bias.dtype if bias is not None else None))
        ctx.entry = "flce.distributed.vocab_parallel_linear_cross_entropy"
        # reduction="none" keeps the inputs and the softmax, and recomputes logits in backward
        return finish_forward(ctx, parts, grads, grad_scale, (x, weight, bias, parts.lse),
                              weight if weight.dtype == setup.compute_dtype else None)

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_loss, _grad_lse, _grad_correct, _grad_rows):
        rows, classes, setup, dtypes = ctx.meta
        if grad_loss is None:  # an undefined gradient is a zero one (the same on every rank: no collective)
            release(ctx)
            return None, None, None, None, None, None, None
        g = grad_loss.to(math_dtype(setup.compute_dtype))
        grads = take_grads(ctx)
        saved = ctx.saved_tensors  # raises if the caller changed one in place since forward
        if grads is None:
            x, weight, bias, lse = saved
            _, grads = _chunk_loop(x, weight, bias, rows, classes, setup, g.contiguous(),
                                   tuple(ctx.needs_input_grad[:3]), saved_lse=lse)
            g = None
        return *scale_grads(grads, g, dtypes), None, None, None, None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a torch.distributed DTensor (False where torch.distributed is unavailable)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class DTensorLocals(NamedTuple):
    """The plain tensors a DTensor call runs on, and the group the vocabulary is split over (None: the
    weight is replicated, the one-device loss applies) with every rank's rows of it."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    target: torch.Tensor
    linear_bias: torch.Tensor | None
    weight: torch.Tensor | None
    group: dist.ProcessGroup | None
    shard_sizes: tuple[int, ...] | None


def dtensor_locals(input, linear_weight, target, linear_bias=None, weight=None) -> DTensorLocals:
    """Unwrap a DTensor ``linear_weight`` (V, H): Shard(0) on at most one mesh dimension and Replicate on
    the others. input, target: plain tensors or all-Replicate DTensors (the same on every rank);
    linear_bias: None or a DTensor placed like the weight; weight (class weights): a plain (V,) tensor or
    a Replicate DTensor. ``flce.linear_cross_entropy`` calls this for a DTensor weight."""
    from torch.distributed.tensor import Replicate, Shard

    placements = linear_weight.placements
    vocab_dims = [d for d, p in enumerate(placements) if p == Shard(0)]
    if len(vocab_dims) > 1 or any(p != Replicate() for d, p in enumerate(placements) if d not in vocab_dims):
        raise ValueError(f"linear_weight must be sharded on dim 0 over at most one mesh dimension and "
                         f"replicated over the others, got placements {placements}")
    if linear_bias is not None and (not is_dtensor(linear_bias) or tuple(linear_bias.placements) != tuple(placements)):
        raise ValueError(f"linear_bias must be a DTensor with the weight's placements {placements}")
    bias_local = linear_bias.to_local() if linear_bias is not None else None
    class_w = _replicated_local(weight, "weight") if weight is not None else None
    group = sizes = None
    if vocab_dims:
        mesh = linear_weight.device_mesh
        group = mesh.get_group(vocab_dims[0])
        sizes = _chunk_sizes(linear_weight.shape[0], mesh.size(vocab_dims[0]))
    return DTensorLocals(_replicated_local(input, "input"), linear_weight.to_local(),
                         _replicated_local(target, "target"), bias_local, class_w, group, sizes)


def _replicated_local(t, name: str):
    if not is_dtensor(t):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise ValueError(f"{name} must be a plain tensor or a replicated DTensor, got placements {t.placements}")
    return t.to_local()


def _chunk_sizes(vocab: int, world: int) -> tuple[int, ...]:
    """Rows per rank under DTensor's Shard(0) (torch.chunk's split: ceil(V / world) each, the rest last)."""
    step = -(-vocab // world)
    return tuple(max(0, min(step, vocab - r * step)) for r in range(world))
