"""Public entry points: ``linear_cross_entropy`` and ``LinearCrossEntropyLoss``, with argument checks."""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import loss_op
from .checks import (HostCopy, check_and_compact, check_class_weight, check_tensors, compute_dtype, flat_targets,
                     raise_bad_targets)
from .distributed import dtensor_locals, is_dtensor, vocab_parallel_linear_cross_entropy
from .function import LinearCrossEntropyFunction, LoopSpec, chunk_loop
from .import_hooks import compile_disabled
from .kernels import math_dtype, resolve_backend
from .low_memory import LowMemoryFunction, check_low_memory, low_memory_plan
from .options import LossOptions, check_run_options
from .planner import ChunkPlan, plan_chunks, weight_grad_hidden
from .reduction import LossStats, loss_scale, loss_stats, scatter_rows

__all__ = ["LinearCrossEntropyLoss", "LossStats", "linear_cross_entropy"]

# Host time matters at small batches, where a step is launch-bound: the checks below stay cheap.
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


@functools.lru_cache(maxsize=256, typed=True)
def _cached_loss_options(*args) -> LossOptions:
    return LossOptions(*args)


def _loss_options(*args) -> LossOptions:
    """LossOptions, validated once per distinct set of (hashable) values."""
    try:
        return _cached_loss_options(*args)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return LossOptions(*args)  # raises the clear error for a value of the wrong type


def _traced(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean", ignore_index=-100,
            label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0, num_items_in_batch=None,
            accum_dtype=None, chunk_size=None, backend="auto", return_stats=False, validate_target=True,
            low_memory=False):
    """``linear_cross_entropy`` as torch.compile traces it: the same checks, then the custom ops of ``loss_op``;
    NotImplemented (one graph break, the eager call) for what they do not serve."""
    if not loss_op.TRACED or return_stats or low_memory or type(linear_weight) not in _PLAIN_TENSORS:
        return NotImplemented
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    check_tensors(input, linear_weight, target, linear_bias, weight)
    num_items = check_run_options(reduction, num_items_in_batch, chunk_size, accum_dtype, backend, return_stats,
                                  validate_target, read_cpu=False)
    dtype = compute_dtype(input, linear_weight, linear_bias)
    x = input.reshape(-1, input.shape[-1])
    t = flat_targets(target, opts.ignore_index)
    loss = loss_op.traced_loss(x, linear_weight, linear_bias, t, weight, num_items, opts, chunk_size, accum_dtype,
                               dtype, backend, validate_target)
    return loss.reshape(target.shape) if reduction == "none" else loss


# Eagerly: data-dependent control flow and Triton launches. Under torch.compile: custom ops (no graph break)
# where ``_traced`` serves the call, else one graph break and the eager call.
@compile_disabled(traced=_traced)
def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
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
    low_memory: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, LossStats]:
    """Cross-entropy of ``input @ linear_weight.T + linear_bias`` without materializing the logits.

    Equals ``F.cross_entropy(logits / temperature -> softcap, target, weight, ...)`` plus
    ``z_loss * logsumexp(logits)**2`` per valid token, computed chunk by chunk. The arithmetic and the
    loss are float32 whatever the inputs' dtype, float64 for float64 inputs (which always take the torch
    backend). Under autocast the GEMMs run in autocast's dtype, except for float64 inputs (as F.linear).
    Differentiable once with respect to input, linear_weight and linear_bias; a second derivative
    (create_graph=True, then differentiating the gradients) raises.

    Args:
        input: (..., H) hidden states. linear_weight: (V, H), V >= 1. target: (...) integer class indices.
        linear_bias: (V,) or None. weight: (V,) class weights or None; they must not require grad (the
            loss is not differentiable with respect to them, as F.cross_entropy's).
        reduction: "mean" | "sum" | "none" ("none" returns target's shape, 0 at ignored tokens).
        num_items_in_batch: with "mean"/"sum", the loss is the sum over valid tokens divided by it
            (Hugging Face gradient accumulation): an int or float >= 0, or a one-element real tensor
            (0-d, or (1,) / (1, 1) as Trainer passes it to DataParallel replicas); 0 gives a loss of 0.
            A GPU tensor's value is not read (no host sync): negative or non-finite gives a NaN loss.
        accum_dtype: grad_weight accumulator dtype (None: float32 across chunks, see planner).
        chunk_size: rows per chunk (None: from a memory budget, see planner).
        backend: "auto" (triton on CUDA, torch elsewhere), "triton" or "torch" (float64 always takes
            "torch", whose arithmetic is then float64).
        return_stats: also return a ``LossStats``.
        validate_target: raise a ValueError for targets outside [0, V). From 1024 tokens this is one
            host sync that also drops ignored rows before the GEMMs, wherever that can pay: on a GPU
            with gradients, only while the last count on the device says the dropped rows are worth
            more than the sync (see ``SYNC_WORTH_FLOP``). Otherwise the check runs in the background
            and raises in forward or, at the latest, in backward (the loss is NaN until then); ignored
            rows are then computed and zeroed, as in eager PyTorch. False makes the call sync-free
            (CUDA-graph capture): targets are trusted, and a target outside [0, V) gives a NaN loss.
        low_memory: the precise low-memory mode (``low_memory.py``): a small buffer above the gradients,
            grad_weight rounded once, one more GEMM (the logits recomputed in backward); chunk_size then
            sets forward's rows per chunk; no accum_dtype, no DTensor weight.
    """
    check_low_memory(low_memory, accum_dtype)
    if type(linear_weight) not in _PLAIN_TENSORS and is_dtensor(linear_weight):  # Shard(0) or replicated
        if low_memory:
            raise NotImplementedError("low_memory=True takes a plain linear_weight, not a DTensor")
        return _dtensor_loss(
            input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            temperature=temperature, num_items_in_batch=num_items_in_batch, accum_dtype=accum_dtype,
            chunk_size=chunk_size, backend=backend, return_stats=return_stats, validate_target=validate_target)
    opts = _loss_options(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    check_tensors(input, linear_weight, target, linear_bias, weight)
    num_items = check_run_options(reduction, num_items_in_batch, chunk_size, accum_dtype, backend, return_stats,
                                  validate_target)
    dtype = compute_dtype(input, linear_weight, linear_bias)
    backend = resolve_backend(backend, input.device, dtype)
    acc = math_dtype(dtype)

    hidden, vocab = input.shape[-1], linear_weight.shape[0]
    x = input if input.dim() == 2 else input.reshape(-1, hidden)
    t = t_all = flat_targets(target, opts.ignore_index)
    n = t.numel()
    grad = torch.is_grad_enabled() and any(a is not None and a.requires_grad
                                           for a in (x, linear_weight, linear_bias))
    sync = validate_target and n >= COMPACT_MIN_ROWS and (
        not (grad and t.is_cuda) or _sync_pays(_ignored_share.get(t.device), n, vocab, hidden))

    def plan_for(rows: int) -> ChunkPlan:
        if low_memory:
            return low_memory_plan(rows, x, linear_weight, dtype, chunk_size, reduction)
        return plan_chunks(rows, vocab, dtype, linear_weight.dtype, chunk_size=chunk_size,
                           accum_dtype=accum_dtype, weight_grad_hidden=weight_grad_hidden(linear_weight),
                           product_hidden=hidden)

    plan = None if sync else plan_for(n)  # with the sync, the rows it keeps decide the plan
    # Everything that does not depend on dropping ignored rows is queued before the check's host sync, so
    # that less host work separates the sync from the first GEMM.
    class_w, weight_sum, counts, scale, kernel_counts = loss_scale(t, weight, opts, num_items, vocab, acc, backend,
                                                                   None if low_memory else plan, grad)
    rows = None  # indices of the valid rows, when ignored rows are dropped
    pending = None
    if sync:
        rows = _check_and_compact(t, vocab, opts.ignore_index, counts, target)
        if rows is not None:
            x, t = x.index_select(0, rows), t.index_select(0, rows)
        plan = plan_for(x.shape[0])
    elif validate_target and n:
        pending = _TargetCheck(t, counts, vocab, opts.ignore_index, target)
        if kernel_counts is None:
            pending.start()
    spec = LoopSpec(opts, plan, dtype, backend, return_stats, kernel_counts, wide_logits=not low_memory)
    if grad:
        function = LowMemoryFunction if low_memory else LinearCrossEntropyFunction
        loss, lse, correct = function.apply(
            chunk_loop, spec, x, linear_weight, linear_bias, t, class_w, weight_sum, scale, pending)[:3]
        if pending is not None:
            if kernel_counts is not None:
                pending.start()  # the forward's CE kernel has queued the counts
            if not pending.done():
                pending = None  # backward raises; meanwhile a bad row's loss is NaN (see _TargetCheck)
    else:  # nothing to differentiate: the loop computes the loss alone
        parts, _ = chunk_loop(x, linear_weight, linear_bias, t, class_w, weight_sum, None, (False, False, False),
                              spec)
        loss = parts.loss if scale is None else parts.loss.sum() * scale
        lse, correct = parts.lse, parts.correct

    if pending is not None:
        pending.raise_if_bad()
    if reduction == "none":
        loss = scatter_rows(loss, rows, t_all.numel()).reshape(target.shape)
    if not return_stats:
        return loss
    return loss, loss_stats(lse, correct, t_all != opts.ignore_index, rows, scale, opts, target.shape)


def _dtensor_loss(input, linear_weight, target, *, linear_bias, weight, **options):
    """A DTensor weight: Shard(0) on one mesh dimension runs the vocab-parallel loss over that dimension's
    group, an all-Replicate weight the one-device loss on the local tensors (see ``dtensor_locals``)."""
    local = dtensor_locals(input, linear_weight, target, linear_bias, weight)
    kwargs = dict(linear_bias=local.linear_bias, weight=local.weight, **options)
    if local.group is None:
        return linear_cross_entropy(local.input, local.linear_weight, local.target, **kwargs)
    return vocab_parallel_linear_cross_entropy(local.input, local.linear_weight, local.target, group=local.group,
                                               shard_sizes=local.shard_sizes, **kwargs)


# The keyword options of linear_cross_entropy that the module form fixes (linear_bias is forward's argument).
MODULE_OPTIONS = ("weight", "reduction", "ignore_index", "label_smoothing", "z_loss", "softcap", "temperature",
                  "num_items_in_batch", "accum_dtype", "chunk_size", "backend", "return_stats", "validate_target",
                  "low_memory")


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`linear_cross_entropy`; the keyword options are fixed (and checked) at
    construction. Class weights (``weight``) are a buffer, moved by ``.to()`` with the module."""

    def __init__(self, **options) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(MODULE_OPTIONS))
        if unknown:
            raise TypeError(f"LinearCrossEntropyLoss got unknown option(s) {unknown}; it takes {MODULE_OPTIONS} "
                            "(linear_bias is an argument of forward)")
        weight = options.pop("weight", None)
        if weight is not None:
            check_class_weight(weight, None)
        LossOptions(  # fail at construction, not at the first step
            options.get("ignore_index", -100), options.get("label_smoothing", 0.0),
            options.get("z_loss", 0.0), options.get("softcap"), options.get("temperature", 1.0),
            options.get("reduction", "mean"),
        )
        check_run_options(options.get("reduction", "mean"), options.get("num_items_in_batch"),
                          options.get("chunk_size"), options.get("accum_dtype"), options.get("backend", "auto"),
                          options.get("return_stats", False), options.get("validate_target", True))
        check_low_memory(options.get("low_memory", False), options.get("accum_dtype"))
        self.register_buffer("weight", weight)
        self.options = options

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                linear_bias: torch.Tensor | None = None):
        """input (..., H), linear_weight (V, H), target (...), linear_bias (V,) or None."""
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
                                    **self.options)

    def extra_repr(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self.options.items()]
        if self.weight is not None:
            shown.insert(0, f"weight=<class weights {tuple(self.weight.shape)}>")
        return ", ".join(shown)


# Below this many tokens the GEMMs are passes over the weight whatever the row count, so dropping
# ignored rows saves nothing; the target check then runs asynchronously instead of as an early sync.
COMPACT_MIN_ROWS = 1024
# Dropping ignored rows needs their count on the host: a sync, after which the GPU idles while the host
# launches the first GEMM (H200 machine: 1024 x 4096 x 128256 took 4.59 ms with it, 4.26 without). It
# is worth that where the rows it drops would cost more GEMM time, about this many FLOPs (~0.3 ms at
# ~700 TFLOP/s). A training step on a GPU therefore skips it while the last count seen on its device
# says so (the check then runs in the background, as for small batches); a device's first call counts.
SYNC_WORTH_FLOP = 2e11
_ignored_share: dict[torch.device, float] = {}  # device -> share of ignored tokens in its last count


def _sync_pays(share: float | None, n: int, vocab: int, hidden: int) -> bool:
    """Whether dropping ``share`` of n rows saves more than a sync costs (unknown share: count once)."""
    return share is None or share * 6.0 * n * vocab * hidden >= SYNC_WORTH_FLOP


def _record_share(t: torch.Tensor, n_valid: int) -> None:
    _ignored_share[t.device] = 1.0 - n_valid / max(t.numel(), 1)


class _TargetCheck:
    """Range check copied to the host in the background.

    Forward raises if the copy has already landed; otherwise, when a backward follows, backward raises
    once its own kernels are queued, so waiting never leaves the GPU without work (a forward-time
    wait drains the queue each step and made small batches slower than eager). Until then the loss is
    not a plausible number: the CE kernel gives a row with a bad target a NaN loss and gradient.
    """

    def __init__(self, t: torch.Tensor, counts: torch.Tensor, vocab: int, ignore_index: int,
                 original: torch.Tensor) -> None:
        """t: (n,) int64 targets; counts: [valid, out of range, ...] int64 on t's device, once the kernels
        queued so far ran; original: the caller's target (named in the error)."""
        self.t, self.counts, self.vocab, self.ignore_index, self.original = t, counts, vocab, ignore_index, original

    def start(self) -> None:
        """Queue the copy of the counts (call once the kernel that writes them is queued)."""
        self.copy = HostCopy(self.counts)

    def done(self) -> bool:
        return self.copy.done()

    def raise_if_bad(self) -> None:
        n_valid, n_bad = self.copy.wait().tolist()[:2]
        _record_share(self.t, n_valid)
        if n_bad:
            raise_bad_targets(self.t, self.vocab, self.ignore_index, n_bad, self.original)


def _check_and_compact(t: torch.Tensor, vocab: int, ignore_index: int, counts: torch.Tensor,
                       original: torch.Tensor) -> torch.Tensor | None:
    """``checks.check_and_compact`` (the one host sync), recording the device's share of ignored rows."""
    rows, n_valid = check_and_compact(t, vocab, ignore_index, counts, original)
    _record_share(t, n_valid)
    return rows
