"""Public entry points: ``linear_cross_entropy`` and ``LinearCrossEntropyLoss``, with argument checks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .function import LinearCrossEntropyFunction, LoopSpec, chunk_loop
from .import_hooks import compile_disabled
from .kernels import resolve_backend
from .kernels.targets import count_targets
from .low_memory import LowMemoryFunction, check_low_memory, low_memory_plan
from .options import LossOptions, check_run_options
from .planner import ChunkPlan, plan_chunks, weight_grad_hidden


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


def _is_dtensor(t: torch.Tensor) -> bool:
    from .distributed import is_dtensor

    return is_dtensor(t)


@dataclass
class LossStats:
    """Side results (detached device tensors, no host sync).

    z_loss: the z-loss part of the loss, reduced like the loss; accuracy: share of valid tokens whose
    argmax is the target; num_valid: number of tokens that are not ``ignore_index``.
    """

    z_loss: torch.Tensor
    accuracy: torch.Tensor
    num_valid: torch.Tensor


@compile_disabled  # data-dependent control flow and Triton launches: one graph break, exact result
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
    ``z_loss * logsumexp(logits)**2`` per valid token, computed chunk by chunk.

    Args:
        input: (..., H) hidden states. linear_weight: (V, H). target: (...) class indices.
        linear_bias: (V,) or None. weight: (V,) class weights or None.
        reduction: "mean" | "sum" | "none" ("none" returns target's shape, 0 at ignored tokens).
        num_items_in_batch: with "mean"/"sum", the loss is the sum over valid tokens divided by it
            (Hugging Face gradient accumulation).
        accum_dtype: grad_weight accumulator dtype (None: float32 across chunks, see planner).
        chunk_size: rows per chunk (None: from a memory budget, see planner).
        backend: "auto" (triton on CUDA, torch elsewhere), "triton" or "torch".
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
    if type(linear_weight) not in _PLAIN_TENSORS and _is_dtensor(linear_weight):  # Shard(0) or replicated
        if low_memory:
            raise NotImplementedError("low_memory=True takes a plain linear_weight, not a DTensor")
        from .distributed import linear_cross_entropy_dtensor  # lazy: distributed imports this module

        return linear_cross_entropy_dtensor(
            input, linear_weight, target, linear_bias=linear_bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            temperature=temperature, num_items_in_batch=num_items_in_batch, accum_dtype=accum_dtype,
            chunk_size=chunk_size, backend=backend, return_stats=return_stats, validate_target=validate_target)
    opts = _loss_options(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    _check_tensors(input, linear_weight, target, linear_bias, weight)
    check_run_options(reduction, num_items_in_batch, chunk_size, accum_dtype)
    backend = resolve_backend(backend, input.device)
    compute_dtype = _compute_dtype(input, linear_weight, linear_bias)

    hidden, vocab = input.shape[-1], linear_weight.shape[0]
    x = input if input.dim() == 2 else input.reshape(-1, hidden)
    t = t_all = _flat_targets(target)
    n = t.numel()
    grad = torch.is_grad_enabled() and any(a is not None and a.requires_grad
                                           for a in (x, linear_weight, linear_bias))
    sync = validate_target and n >= COMPACT_MIN_ROWS and (
        not (grad and t.is_cuda) or _sync_pays(_ignored_share.get(t.device), n, vocab, hidden))

    def plan_for(rows: int) -> ChunkPlan:
        if low_memory:
            return low_memory_plan(rows, x, linear_weight, compute_dtype, chunk_size)
        return plan_chunks(rows, vocab, compute_dtype, linear_weight.dtype, chunk_size=chunk_size,
                           accum_dtype=accum_dtype, weight_grad_hidden=weight_grad_hidden(linear_weight))

    plan = None if sync else plan_for(n)  # with the sync, the rows it keeps decide the plan
    class_w = weight.float().contiguous() if weight is not None else None
    weight_sum = class_w.sum() if class_w is not None else None
    kernel_counts = None
    if not low_memory and _kernel_finishes_mean(plan, grad, reduction, class_w, num_items_in_batch):
        kernel_counts = counts = torch.zeros(3, dtype=torch.int64, device=t.device)
        scale = torch.empty((), dtype=torch.float32, device=t.device)  # written by the CE kernel
    else:
        # Everything that does not depend on dropping ignored rows is queued before the check's host
        # sync, so that less host work separates the sync from the first GEMM.
        counts, count_scale = count_targets(t, ignore_index, vocab, backend)
        scale = None if reduction == "none" else _reduction_scale(t, class_w, opts, num_items_in_batch,
                                                                  count_scale)
    rows = None  # indices of the valid rows, when ignored rows are dropped
    pending = None
    if sync:
        rows = _check_and_compact(t, vocab, ignore_index, counts)
        if rows is not None:
            x, t = x.index_select(0, rows), t.index_select(0, rows)
        plan = plan_for(x.shape[0])
    elif validate_target and n:
        pending = _TargetCheck(t, counts, vocab, ignore_index)
        if kernel_counts is None:
            pending.start()
    spec = LoopSpec(opts, plan, compute_dtype, backend, return_stats, kernel_counts)
    if grad:
        function = LowMemoryFunction if low_memory else LinearCrossEntropyFunction
        loss, lse, correct = function.apply(
            chunk_loop, spec, x, linear_weight, linear_bias, t, class_w, weight_sum, scale, pending)
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
        loss = _scatter_rows(loss, rows, t_all.numel()).reshape(target.shape)
    if not return_stats:
        return loss
    return loss, _stats(lse, correct, t_all != ignore_index, rows, scale, opts, target.shape)


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`linear_cross_entropy`; the keyword options are fixed at construction."""

    def __init__(self, **options) -> None:
        super().__init__()
        LossOptions(  # fail at construction, not at the first step
            options.get("ignore_index", -100), options.get("label_smoothing", 0.0),
            options.get("z_loss", 0.0), options.get("softcap"), options.get("temperature", 1.0),
            options.get("reduction", "mean"),
        )
        self.options = options

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                linear_bias: torch.Tensor | None = None):
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def _check_tensors(input, linear_weight, target, bias, class_weight) -> None:
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    if linear_weight.dim() != 2 or not linear_weight.is_floating_point():
        raise ValueError(f"linear_weight must be a 2-D floating tensor (V, H), got {tuple(linear_weight.shape)} "
                         f"{linear_weight.dtype}")
    if input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"hidden size mismatch: input has {tuple(input.shape)}, linear_weight (V, H) has "
                         f"{tuple(linear_weight.shape)}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal input's leading shape "
                         f"{tuple(input.shape[:-1])}")
    vocab = linear_weight.shape[0]
    for name, t in (("linear_bias", bias), ("weight", class_weight)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != (vocab,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating tensor of shape ({vocab},), got {shape}")
    device = input.device
    if any(t is not None and t.device != device for t in (linear_weight, target, bias, class_weight)):
        devices = {n: t.device for n, t in (("input", input), ("linear_weight", linear_weight),
                                            ("target", target), ("linear_bias", bias), ("weight", class_weight))
                   if t is not None}
        raise ValueError("all tensors must be on one device, got " +
                         ", ".join(f"{n} on {d}" for n, d in devices.items()))


def _flat_targets(target: torch.Tensor) -> torch.Tensor:
    """target as a contiguous (n,) int64 tensor (itself when it already is one: no dispatcher calls)."""
    if target.dim() == 1 and target.dtype == torch.int64 and target.is_contiguous():
        return target
    return target.reshape(-1).long().contiguous()


def _compute_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """The GEMMs' dtype: autocast's when it is on, else the (shared) dtype of input and weight."""
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if input.dtype != weight.dtype:
        raise TypeError(f"input ({input.dtype}) and linear_weight ({weight.dtype}) must share a dtype "
                        "outside autocast")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"linear_bias ({bias.dtype}) and linear_weight ({weight.dtype}) must share a dtype "
                        "outside autocast")
    return weight.dtype


def _kernel_finishes_mean(plan: ChunkPlan | None, grad: bool, reduction: str, class_w, num_items) -> bool:
    """Whether the CE kernel counts the targets and finishes the mean itself (``LoopSpec.counts``): for a
    plain mean over one chunk in training, which spares a small, launch-bound batch three launches."""
    return (grad and plan is not None and plan.n_rows > 0 and plan.num_chunks == 1 and reduction == "mean"
            and class_w is None and num_items is None)


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

    def __init__(self, t: torch.Tensor, counts: torch.Tensor, vocab: int, ignore_index: int) -> None:
        """counts: [valid, out of range, ...] int64 on t's device, once the kernels queued so far ran."""
        self.t, self.counts, self.vocab, self.ignore_index = t, counts, vocab, ignore_index

    def start(self) -> None:
        """Queue the copy of the counts (call once the kernel that writes them is queued)."""
        self.host = torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=self.t.is_cuda)
        self.host.copy_(self.counts, non_blocking=True)
        self.event = torch.cuda.Event() if self.t.is_cuda else None
        if self.event is not None:
            self.event.record()

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def raise_if_bad(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        n_valid, n_bad = self.host.tolist()[:2]
        _record_share(self.t, n_valid)
        if n_bad:
            _raise_bad_targets(self.t, self.vocab, self.ignore_index, n_bad)


def _raise_bad_targets(t, vocab, ignore_index, n_bad):
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    first = t[bad][0].item()
    raise ValueError(f"target holds {n_bad} value(s) outside [0, {vocab}) that are not ignore_index "
                     f"(first: {first})")


def _check_and_compact(t: torch.Tensor, vocab: int, ignore_index: int,
                       counts: torch.Tensor) -> torch.Tensor | None:
    """Raise on targets outside [0, V); return the valid rows' indices if any row is ignored.
    ``counts``: ``count_targets``' counts of t."""
    n_valid, n_bad = counts.tolist()  # the one host sync
    _record_share(t, n_valid)
    if n_bad:
        _raise_bad_targets(t, vocab, ignore_index, n_bad)
    if n_valid == t.numel():
        return None
    return (t != ignore_index).nonzero_static(size=n_valid).squeeze(1)  # sized: no second sync


def _reduction_scale(t, class_w, opts: LossOptions, num_items, count_scale: torch.Tensor) -> torch.Tensor:
    """0-d float32 factor that turns the sum of row losses into the reduced loss (0 if nothing counts).

    Built with as few launches as possible (and no host-to-device copy, which would wait for the GPU);
    ``count_scale``: ``count_targets``' 1 / max(valid, 1).
    """
    device = t.device
    if num_items is not None:
        if not isinstance(num_items, torch.Tensor):
            return torch.full((), 1.0 / num_items if num_items else 0.0, dtype=torch.float32, device=device)
        denom = num_items.to(device=device, dtype=torch.float32)
    elif opts.reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    elif class_w is not None:
        vocab = class_w.numel()
        denom = (class_w[t.clamp(0, vocab - 1)] * (t != opts.ignore_index)).sum()
    else:  # a count: with no valid row the loss sum is 0 anyway, so 1 / max(count, 1) is exact
        return count_scale
    return torch.where(denom != 0, 1.0 / denom, torch.zeros_like(denom))


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Place per-valid-row values back at their rows (zeros at ignored rows)."""
    if rows is None:
        return values
    return values.new_zeros(n).index_copy(0, rows, values)


def _stats(lse, correct, valid, rows, scale, opts: LossOptions, shape) -> LossStats:
    num_valid = valid.sum()
    z_rows = opts.z_loss * lse.detach().square()
    if scale is None:
        z = _scatter_rows(z_rows, rows, valid.numel()).reshape(shape)
    else:
        z = z_rows.sum() * scale
    accuracy = correct.sum() / num_valid.clamp(min=1)
    return LossStats(z_loss=z, accuracy=accuracy, num_valid=num_valid)
