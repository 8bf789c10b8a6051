"""``linear_cross_entropy`` as torch.compile traces it: two custom ops, ``flce::linear_cross_entropy`` and its
backward ``flce::linear_cross_entropy_backward``, so that a compiled function keeps the loss in its graph (no
graph break; ``fullgraph=True`` holds) and ``mode="reduce-overhead"`` captures it in its CUDA graphs.

Each op runs flce's chunk loop as an eager call does; what the autograd Function keeps on its ``ctx`` travels as
the forward op's outputs, whose shapes follow from the inputs' (the chunk plan is a pure function of them):
a single chunk's unscaled dlogits and pending scale, or several chunks' gradients and residual scale, and the
target counts. Differences from an eager call, all of which keep the result:

- the exp-logits path (``exp_logits.py``) keeps its stored exponentials in the outputs that the standard path's
  dlogits take, and a flag says which path ran: backward reads it first (a host sync); while a CUDA graph is
  being captured it takes the standard path, which a captured forward took too (a device-side assert refuses a
  backward captured without its forward);
- ignored rows are computed and zeroed, never dropped (dropping them needs their count on the host);
- the target check waits in backward (forward without gradients: at its end); while a CUDA graph is being
  captured it is a device-side assert (``torch._assert_async``), which stops the process on a bad target as
  eager ``F.cross_entropy`` does on CUDA.

The public function takes this route under torch.compile for plain tensors without ``return_stats`` or
``low_memory``; other calls keep a graph break and run eagerly (``import_hooks.compile_disabled``), as every
call does with ``TRACED = False``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import exp_logits, function
from .checks import HostCopy, raise_bad_targets
from .exp_logits import PendingExp
from .function import (ChunkGrads, LoopSpec, PendingGrads, chunk_loop, finish_pending, hopper_gemms,
                       input_grad_dtype, scale_grads)
from .gemm import padded_rows, padded_width
from .kernels import math_dtype, resolve_backend
from .options import LossOptions
from .planner import ChunkPlan, plan_chunks
from .reduction import ScaleParts, class_weights, loss_scale

TRACED = True  # False: torch.compile breaks its graph at the loss and runs it eagerly

_OPTIONS = ("int ignore_index, float label_smoothing, float z_loss, float? softcap, float temperature, str reduction, "
            "int? chunk_size, ScalarType? accum_dtype, ScalarType dtype, str backend, bool validate")
# What forward keeps for backward, after the loss (``_kept``): a single chunk's dlogits (or exp(z)), several
# chunks' gradients, the scale still to apply, the target counts, the GEMMs' casts of x and weight (autocast),
# the exp-logits path's row coefficients and int32 keys + window count (its last entry; -1: the standard path
# ran), and the loss's scale for a rerun of several chunks.
_SAVED_NAMES = ("dlogits", "grad_input", "grad_weight", "grad_bias", "scale", "counts", "x_cast", "weight_cast",
                "coefs", "ints", "loss_scale")
_SAVED = ", ".join(f"Tensor {name}" for name in _SAVED_NAMES)
_STANDARD = -1  # the window count's value where the standard path ran


def traced_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                class_weight: torch.Tensor | None, num_items, opts: LossOptions, chunk_size: int | None,
                accum_dtype: torch.dtype | None, dtype: torch.dtype, backend: str, validate: bool) -> torch.Tensor:
    """The loss through ``flce::linear_cross_entropy``: x (n, H), weight (V, H), bias (V,) or None, target (n,)
    int64 contiguous, class_weight (V,) or None, num_items as ``check_num_items`` returns it, dtype: the GEMMs'
    (autocast's, resolved by the caller), backend as the caller gave it (resolved inside the ops, outside the
    trace: its answer is cached per process). Returns the 0-d loss, or (n,) for reduction="none"."""
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (x, weight, bias)]
    items = num_items if isinstance(num_items, torch.Tensor) else None
    value = None if items is not None or num_items is None else float(num_items)
    loss, *_ = _forward_op(x, weight, bias, target, class_weight, items, value, *_option_args(opts), chunk_size,
                           accum_dtype, dtype, backend, validate, needs)
    return loss


def _option_args(opts: LossOptions) -> tuple:
    return (opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap, opts.temperature, opts.reduction)


class _Layout(NamedTuple):
    """What a call's outputs hold, from shapes, dtypes and options alone (the fake implementation's answer too).
    deferred: a single chunk's GEMMs wait for backward; handed: several chunks hand gradients over; exp_single /
    exp_multi: the exp-logits path may run (the single chunk / the chunks)."""

    plan: ChunkPlan
    backend: str
    grad: bool
    deferred: bool
    handed: bool
    exp_single: bool
    exp_multi: bool


def _layout(x, weight, bias, needs, opts: LossOptions, chunk_size, accum_dtype, dtype, backend: str) -> _Layout:
    """The ``_Layout`` of a call (x (n, H), weight (V, H); backend as the caller gave it)."""
    n, hidden = x.shape
    backend = resolve_backend(backend, x.device, dtype)
    plan = plan_chunks(n, weight.shape[0], dtype, weight.dtype, chunk_size=chunk_size, accum_dtype=accum_dtype,
                       weight_grad_hidden=hidden if needs[1] else 0, product_hidden=hidden)
    grad = any(needs) and opts.reduction != "none" and n > 0
    deferred = grad and plan.num_chunks == 1
    exp_grads = (needs[0] or needs[1]) and not needs[2]  # the path gives no bias gradient
    exp_single = deferred and exp_grads and exp_logits.suited(_cast_layout(x, dtype), _cast_layout(weight, dtype), bias,
                                                              True, opts, False, backend, x.device)
    exp_multi = grad and not deferred and exp_grads and plan.input_product_cols > 0 and hopper_gemms(backend, x.device)
    return _Layout(plan, backend, grad, deferred, grad and not deferred, exp_single, exp_multi)


def _cast_layout(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t, or a meta tensor of its layout in ``dtype`` (what a cast would give, for shape and stride checks)."""
    return t if t.dtype == dtype else torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")


class _Kept(NamedTuple):
    """A kept tensor's shape and dtype; ``padded``: rows 128-byte aligned, as a single chunk's logits on the
    Triton backend (``gemm.padded_rows``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    padded: bool = False

    def new(self, device: torch.device) -> torch.Tensor:
        if self.padded:
            return padded_rows(*self.shape, self.dtype, device)
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def stride(self) -> tuple[int, ...]:
        if self.padded:
            return padded_width(self.shape[1], self.dtype.itemsize), 1
        return tuple(math.prod(self.shape[d + 1:]) for d in range(len(self.shape)))


def _kept(x, weight, dtype, lay: _Layout, needs, validate: bool) -> list:
    """What the forward op keeps for backward after the loss, in ``_SAVED_NAMES``' order: a ``_Kept`` each, or
    None for an output left empty, (0,)."""
    (n, hidden), vocab, acc = x.shape, weight.shape[0], math_dtype(dtype)
    handed, deferred, single, multi = lay.handed, lay.deferred, lay.exp_single, lay.exp_multi
    return [
        _Kept((n, vocab), dtype, lay.backend == "triton") if deferred else None,
        _Kept((n, hidden), input_grad_dtype(x.dtype, dtype)) if handed and needs[0] else None,
        _Kept((vocab, hidden), lay.plan.accum_dtype) if handed and needs[1] else None,
        _Kept((vocab,), acc) if handed and needs[2] else None,
        _Kept((), acc) if lay.grad else None,
        _Kept((2,), torch.int64) if validate and n > 0 and any(needs) else None,
        _Kept((n, hidden), dtype) if deferred and x.dtype != dtype else None,
        _Kept((vocab, hidden), dtype) if deferred and weight.dtype != dtype else None,
        _Kept((2, n), torch.float32) if single else None,
        _Kept((n + 1,), torch.int32) if single else _Kept((1,), torch.int32) if multi else None,
        _Kept((), acc) if multi else None,
    ]


@torch.library.custom_op("flce::linear_cross_entropy", mutates_args=(), schema=(
    "(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, Tensor? num_items, "
    f"float? num_items_value, {_OPTIONS}, bool[3] needs) -> (Tensor loss, {_SAVED})"))
def _forward_op(x, weight, bias, target, class_weight, num_items, num_items_value, ignore_index, label_smoothing,
                z_loss, softcap, temperature, reduction, chunk_size, accum_dtype, dtype, backend, validate, needs):
    """The loss (0-d, or (n,) for reduction="none"), then what backward needs (``_kept``)."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    lay = _layout(x, weight, bias, needs, opts, chunk_size, accum_dtype, dtype, backend)
    items = num_items if num_items is not None else num_items_value
    scaled = loss_scale(target, class_weight, opts, items, weight.shape[0], math_dtype(dtype), lay.backend, lay.plan,
                        lay.grad)
    spec = LoopSpec(opts, lay.plan, dtype, lay.backend, counts=scaled.kernel_counts,
                    exp_path=lay.exp_single or lay.exp_multi)
    parts, grads = chunk_loop(x, weight, bias, target, scaled.class_w, scaled.weight_sum,
                              scaled.scale if lay.grad else None, tuple(needs) if lay.grad else (False,) * 3, spec,
                              defer=True)
    if reduction == "none":
        loss = parts.loss
    else:
        loss = parts.total if parts.total is not None else parts.loss.sum() * scaled.scale
    if validate and target.numel() and not any(needs):
        _check_targets(scaled.counts, target, weight.shape[0], ignore_index)  # no backward to wait in
    kept = _kept_tensors(grads, scaled, lay, x)
    specs = _kept(x, weight, dtype, lay, needs, validate)
    return (loss, *(_as_kept(t, spec, x, num_items) for t, spec in zip(kept, specs)))


def _kept_tensors(grads, scaled: ScaleParts, lay: _Layout, x: torch.Tensor) -> tuple:
    """The chunk loop's results in ``_SAVED_NAMES``' order (None: nothing, or what ``_kept`` leaves out)."""
    n, counts = x.shape[0], scaled.counts[:2]
    if isinstance(grads, PendingExp):
        return grads.e, None, None, None, grads.scale, counts, grads.x, grads.w, grads.coefs, grads.ints, None
    if isinstance(grads, PendingGrads):
        coefs = ints = None
        if lay.exp_single:  # the standard path ran where the exp-logits path could have
            coefs = torch.empty(2, n, dtype=torch.float32, device=x.device)
            ints = torch.full((n + 1,), _STANDARD, dtype=torch.int32, device=x.device)
        return grads.dlogits, None, None, None, grads.scale, counts, grads.x, grads.w, coefs, ints, None
    if grads is None:  # reduction="none", or no gradient asked for
        return (None,) * 5 + (counts,) + (None,) * 5
    residual = grads.scale
    if residual is None and lay.grad:  # the outputs are fixed: a scale of 1
        residual = torch.ones((), dtype=scaled.scale.dtype, device=x.device)
    elif residual is not None and residual is scaled.scale:  # ``function.unit_dlogits``: another output's tensor
        residual = residual.clone()
    misses = grads.window.misses if grads.window is not None else None
    if misses is None and lay.exp_multi:
        misses = torch.full((1,), _STANDARD, dtype=torch.int32, device=x.device)
    return None, grads.input, grads.weight, grads.bias, residual, counts, None, None, None, misses, scaled.scale


def _as_kept(t: torch.Tensor | None, spec: _Kept | None, x: torch.Tensor, num_items) -> torch.Tensor:
    """t as its ``_Kept`` announces it: (0,) where not kept; a copy only where t's layout differs or t is an input
    (a 0-d num_items as the scale), which an op's output must not alias."""
    if spec is None:
        return x.new_empty(0)
    assert tuple(t.shape) == spec.shape and t.dtype == spec.dtype, (tuple(t.shape), t.dtype, spec)
    if t.stride() != spec.stride() or t is num_items:
        return spec.new(x.device).copy_(t)
    return t


@_forward_op.register_fake
def _(x, weight, bias, target, class_weight, num_items, num_items_value, ignore_index, label_smoothing, z_loss,
      softcap, temperature, reduction, chunk_size, accum_dtype, dtype, backend, validate, needs):
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction)
    lay = _layout(x, weight, bias, needs, opts, chunk_size, accum_dtype, dtype, backend)
    loss = x.new_empty(x.shape[0] if reduction == "none" else (), dtype=math_dtype(dtype))
    specs = _kept(x, weight, dtype, lay, needs, validate)
    return (loss, *(x.new_empty(0) if spec is None else spec.new(x.device) for spec in specs))


@torch.library.custom_op("flce::linear_cross_entropy_backward", mutates_args=(), schema=(
    "(Tensor grad_loss, Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
    f"{_SAVED}, {_OPTIONS}, bool[3] needs) -> (Tensor, Tensor, Tensor)"))
def _backward_op(grad_loss, x, weight, bias, target, class_weight, dlogits, grad_input, grad_weight, grad_bias, scale,
                 counts, x_cast, weight_cast, coefs, ints, loss_scale, ignore_index, label_smoothing, z_loss, softcap,
                 temperature, reduction, chunk_size, accum_dtype, dtype, backend, validate, needs):
    """Gradients of x, weight and bias ((0,) where ``needs`` says not), new tensors in the inputs' dtypes; raises
    on a bad target once its GEMMs are queued."""
    call = _Call(x, weight, bias, target, class_weight,
                 LossOptions(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction), chunk_size,
                 accum_dtype, dtype, resolve_backend(backend, x.device, dtype), tuple(needs))
    g = grad_loss.to(math_dtype(dtype))
    if reduction == "none":  # the per-row grad_output is known only now: the loop runs again
        out = _rerun(call, g.contiguous(), None)
    elif dlogits.dim() == 2:  # a single chunk: its two GEMMs
        out = _single_chunk_grads(call, dlogits, scale, x_cast, weight_cast, coefs, ints, g)
    elif _path_taken(ints) == "missed":  # several chunks: rows left the window, the loop runs again
        out = _rerun(call, loss_scale, g)
    else:  # several chunks (or none): their gradients times grad_output
        handed = [t if t.shape != (0,) and need else None
                  for t, need in zip((grad_input, grad_weight, grad_bias), call.needs)]
        out = scale_grads(ChunkGrads(*handed, scale=scale if scale.dim() == 0 else None), g, call.dtypes, call.backend,
                          fresh=True)
    if counts.numel():
        _check_targets(counts, target, weight.shape[0], ignore_index)
    # (0,) where not needed; zeros where needed and none was computed (no rows)
    return tuple(x.new_empty(0) if not need else t if t is not None else torch.zeros_like(like)
                 for t, like, need in zip(out, (x, weight, bias), call.needs))


class _Call(NamedTuple):
    """What backward knows of the call: its differentiable inputs, targets and class weights, options, the chunk
    size and accumulator asked for, the GEMMs' dtype, the resolved backend, the gradients needed."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    class_weight: torch.Tensor | None
    opts: LossOptions
    chunk_size: int | None
    accum_dtype: torch.dtype | None
    dtype: torch.dtype
    backend: str
    needs: tuple[bool, bool, bool]

    @property
    def dtypes(self) -> tuple:
        return self.x.dtype, self.weight.dtype, None if self.bias is None else self.bias.dtype

    def spec(self) -> LoopSpec:
        """The loop on the standard path, with the eager call's chunk plan."""
        plan = _layout(self.x, self.weight, self.bias, self.needs, self.opts, self.chunk_size, self.accum_dtype,
                       self.dtype, self.backend).plan
        return LoopSpec(self.opts, plan, self.dtype, self.backend, exp_path=False)

    def class_weights(self) -> tuple:
        """(class weights in the math dtype, their sum), or (None, None)."""
        return class_weights(self.class_weight, math_dtype(self.dtype))


def _single_chunk_grads(call: _Call, dlogits, scale, x_cast, weight_cast, coefs, ints, g) -> list:
    """A single chunk's two GEMMs on what forward kept: exp(z) where the exp-logits path ran, else the dlogits; the
    standard path's dlogits recomputed (into a new buffer, not an input) where rows left the path's window."""
    xs = x_cast if x_cast.dim() == 2 else call.x
    ws = weight_cast if weight_cast.dim() == 2 else call.weight
    path = _path_taken(ints)
    if path == "exp":
        pending = PendingExp(dlogits, coefs, ints, call.target, None, None, scale, None, ())
        return [*exp_logits.finish(pending, xs, ws, g, call.needs, call.dtypes), None]
    pending = PendingGrads(dlogits, None, None, scale)
    if path == "missed":
        fresh = padded_rows(*dlogits.shape, dlogits.dtype, dlogits.device)
        redo = (call.bias, *call.class_weights())
        pending = function.redo_standard(PendingExp(fresh, coefs, ints, call.target, None, None, scale, None, redo),
                                         xs, ws, call.spec())
    return scale_grads(finish_pending(pending, xs, ws, g, call.needs, call.dtypes, call.backend), None, call.dtypes,
                       call.backend)


def _rerun(call: _Call, loop_scale: torch.Tensor, g: torch.Tensor | None) -> list:
    """The chunk loop again on the standard path with ``loop_scale`` (the per-row grad_output, or the loss's
    scale), its gradients times g (None: already in)."""
    class_w, weight_sum = call.class_weights()
    _, grads = chunk_loop(call.x, call.weight, call.bias, call.target, class_w, weight_sum, loop_scale, call.needs,
                          call.spec())
    return scale_grads(grads, g, call.dtypes, call.backend)


def _path_taken(ints: torch.Tensor) -> str:
    """Which path forward took where the exp-logits path could run: "standard", "exp", or "missed" (it ran, and
    rows left its window). Reads the count on the host (a sync); while a CUDA graph is being captured, asserts on
    the device that forward took the standard path (as it does when captured) instead."""
    if ints.shape == (0,):
        return "standard"
    flag = ints[-1:]
    if flag.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(flag[0] == _STANDARD, "flce: backward is being captured in a CUDA graph, but its forward "
                                                  "was not: capture both, or neither")
        return "standard"
    count = int(HostCopy(flag).wait()[0])
    if count == _STANDARD:
        return "standard"
    return "missed" if exp_logits.note_misses(flag.device, count) else "exp"


@_backward_op.register_fake
def _(grad_loss, x, weight, bias, target, class_weight, dlogits, grad_input, grad_weight, grad_bias, scale, counts,
      x_cast, weight_cast, coefs, ints, loss_scale, ignore_index, label_smoothing, z_loss, softcap, temperature,
      reduction, chunk_size, accum_dtype, dtype, backend, validate, needs):
    return tuple(t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip((x, weight, bias), needs))


def _check_targets(counts: torch.Tensor, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise on targets outside [0, V) (counts[1] of ``count_targets``); while a CUDA graph is captured, a
    device-side assert instead (nothing can be read on the host there)."""
    if counts.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(counts[1] == 0, f"flce: target holds values outside [0, {vocab}) that are not "
                                            f"ignore_index={ignore_index}")
        return
    n_bad = int(HostCopy(counts).wait()[1])
    if n_bad:
        raise_bad_targets(target, vocab, ignore_index, n_bad, target)


_FORWARD_ARGS = 19  # the forward op's arguments: seven tensors and the value, eleven options, needs


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, class_weight, _, _, *config = inputs
    ctx.save_for_backward(x, weight, bias, target, class_weight, *output[1:])
    ctx.options = config[:-1]


def _backward(ctx, grad_loss, *_):
    x, weight, bias, *rest = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in range(3)]
    if grad_loss is None or not any(needs):
        return (None,) * _FORWARD_ARGS
    grads = _backward_op(grad_loss, x, weight, bias, *rest, *ctx.options, needs)
    return *(g if need else None for g, need in zip(grads, needs)), *([None] * (_FORWARD_ARGS - 3))


_forward_op.register_autograd(_backward, setup_context=_setup_context)
