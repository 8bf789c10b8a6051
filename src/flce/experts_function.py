"""The experts layer's autograd: routing, forward and backward on the device, and the two ways autograd reaches them.

Eagerly :class:`ExpertsFunction` runs them (the least host time per layer call). Under torch.compile the same
forward and backward run as the custom ops ``flce::experts`` / ``flce::experts_backward``: dynamo traces around
them instead of breaking the graph at every layer, and inductor fuses the router and the residual around the layer.
Inside an op the body runs as it does eagerly (its autotuned Triton launches and, for large GEMMs outside CUDA-graph
capture, the per-expert loop's host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .kernels.experts_dispatch import elementwise_ops, gemm_path, resolve_elementwise, rows_mm, wgrad_mm
from .kernels.experts_torch import Activation


@dataclass(frozen=True)
class Routes:
    """Token-expert pairs sorted by expert. S = T * k pairs, pair ``t * k + j`` is (token t, choice j).

    perm: (S,) int64, the pair in each sorted row. pos: (T, k) int64, the sorted row of each pair.
    offsets: (E + 1,) int32, expert e owns sorted rows [offsets[e], offsets[e + 1]); offsets[E] is the
    number of rows in use (dropped pairs sit after it). experts: (S,) int64, the expert of each sorted row (E for
    a dropped pair).
    """

    perm: torch.Tensor
    pos: torch.Tensor
    offsets: torch.Tensor
    experts: torch.Tensor


def route_pairs(top_k_index: torch.Tensor, num_experts: int) -> Routes:
    """Sort the (T, k) routing choices by expert, on the device (stable: ties keep token order). The keys are sorted
    as int16 where the experts fit: an int64 radix sort makes four times the passes (on an H200, 1024 tokens, top-8 of
    128: 102-109 us of GPU time per call with int64 keys, 58-62 with int16; the host's time the same)."""
    ids = top_k_index.reshape(-1)
    key_dtype = torch.int16 if num_experts < torch.iinfo(torch.int16).max else torch.int32
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(key_dtype)
    sorted_keys, perm = torch.sort(keys, stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=key_dtype)
    offsets = torch.searchsorted(sorted_keys, bounds, out_int32=True)
    rows = torch.arange(perm.numel(), device=ids.device)
    pos = torch.empty_like(perm).scatter_(0, perm, rows)
    return Routes(perm=perm, pos=pos.view(top_k_index.shape), offsets=offsets, experts=sorted_keys.long())


@dataclass(frozen=True)
class Plan:
    """How a layer call runs: the GEMMs' dtype, the GEMM path, the elementwise ops (resolved backend) and the
    activation."""

    dtype: torch.dtype
    gemm: str
    elementwise: str
    act: Activation

    @property
    def ops(self) -> dict:
        return elementwise_ops(self.elementwise)


def plan_for(device: torch.device, dtype: torch.dtype, gemm: str, elementwise: str, act: Activation) -> Plan:
    return Plan(dtype, gemm, resolve_elementwise(elementwise, device, dtype), act)


def forward_rows(hidden, gate_up, down, weights, gate_up_bias, down_bias, routes: Routes, plan: Plan):
    """out (T, H) in hidden's dtype, and what backward may need: xs (S, H), h (S, 2I or I) and y (S, H).
    gate_up and down are already in plan.dtype."""
    ops, n_valid = plan.ops, routes.offsets[-1:]
    with torch.autocast(hidden.device.type, enabled=False):
        xs = hidden.to(plan.dtype).index_select(0, routes.perm // routes.pos.shape[1])
        h = rows_mm(xs, gate_up.transpose(1, 2), routes.offsets, plan.gemm)
        a = ops["activation"](h, n_valid, plan.act, gate_up_bias, routes.experts)
        y = rows_mm(a, down.transpose(1, 2), routes.offsets, plan.gemm)
        out = ops["combine"](y, routes.pos, weights, n_valid, hidden.dtype, down_bias, routes.experts)
    return out, xs, h, y


def backward_rows(grad_out, xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, routes: Routes, plan: Plan,
                  needs: tuple[bool, ...], transposed: tuple[bool, bool], hidden_dtype: torch.dtype,
                  release: bool = False):
    """The gradients of (hidden, gate_up, down, weights, gate_up_bias, down_bias) where ``needs`` says so, else None;
    the weights' gradients in the layout of a parameter stored ``transposed``, in plan.dtype, the biases' as float32
    sums (float64 for float64). h is given exactly where x, a weight or the first bias needs a gradient, y where the
    routing weights need one, xs where gate_up needs one. ``release``: free y, h and xs after their last read
    (``release_saved``)."""
    need_x, need_gate_up, need_down, need_weights, need_gate_up_bias, need_down_bias = needs
    ops, gemm, offsets, n_valid = plan.ops, plan.gemm, routes.offsets, routes.offsets[-1:]
    dx = d_gate_up = d_down = d_gate_up_bias = d_down_bias = None
    free = release_saved if release else lambda t: None
    with torch.autocast(grad_out.device.type, enabled=False):
        dy, dw = ops["combine_backward"](grad_out.contiguous(), y if need_weights else None, routes.perm, weights,
                                         n_valid, plan.dtype, down_bias, routes.experts)
        free(y)
        if need_down_bias:
            d_down_bias = ops["expert_sums"](dy, offsets, routes.experts)
        if h is not None:
            dh, a = ops["activation_backward"](h, rows_mm(dy, down, offsets, gemm), n_valid, plan.act, gate_up_bias,
                                               routes.experts)
            free(h)
            d_down = _wgrad(dy, a, offsets, gemm, transposed[1]) if need_down else None
            del dy, a
            if need_gate_up_bias:
                d_gate_up_bias = ops["expert_sums"](dh, offsets, routes.experts)
            d_gate_up = _wgrad(dh, xs, offsets, gemm, transposed[0]) if need_gate_up else None
            free(xs)
            if need_x:
                dx = ops["combine"](rows_mm(dh, gate_up, offsets, gemm), routes.pos, None, n_valid, hidden_dtype)
    return dx, d_gate_up, d_down, dw, d_gate_up_bias, d_down_bias


def graph_kept() -> bool:
    """Whether the backward running now keeps the graph for another one (``retain_graph`` / ``create_graph``);
    where torch cannot tell, and while a compiler traces the backward (compiled autograd), kept."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)  # what AOTAutograd asks too
    return kept is None or torch.compiler.is_compiling() or kept()


def release_saved(t: torch.Tensor | None) -> None:
    """Free a saved activation's memory after backward's last read of it. Autograd holds a Function's saved tensors
    until its backward returns, so the layer's backward would hold h and y (about 1 GB at Mixtral's size and 8192
    tokens) through its largest GEMMs, where eager autograd frees each at its op's backward. Only for tensors the
    layer made (no caller sees them) and a graph not kept for another backward; the allocator orders the reuse after
    the kernels already queued that read them, as for any freed tensor."""
    if t is not None and t.numel():
        t.untyped_storage().resize_(0)


def _wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, gemm: str, transposed: bool) -> torch.Tensor:
    """Per expert, a[rows]^T @ b[rows] (E, M, N), in the layout of the weight it is the gradient of: for a weight
    stored transposed, (b^T a)^T, so that the parameter gets its gradient without a copy."""
    return wgrad_mm(b, a, offsets, gemm).transpose(1, 2) if transposed else wgrad_mm(a, b, offsets, gemm)


def stored_transposed(weight: torch.Tensor) -> bool:
    """A (E, N, K) weight that is the transposed view of an (E, K, N) tensor (transformers' ``is_transposed``)."""
    return weight.stride(1) < weight.stride(2)


def _saved(needs: tuple[bool, ...]) -> tuple[bool, bool, bool]:
    """Whether backward needs xs, h and y, from which of the six inputs need gradients."""
    need_x, need_gate_up, need_down, need_weights, need_gate_up_bias, _ = needs
    return need_gate_up, need_x or need_gate_up or need_down or need_gate_up_bias, need_weights


class ExpertsFunction(torch.autograd.Function):
    """Inputs: hidden (T, H), gate_up (E, 2I, H), down (E, H, I), weights (T, k) contiguous, gate_up_bias (E, 2I)
    and down_bias (E, H) or None, the :class:`Routes` and the :class:`Plan`. Output: (T, H) in hidden's dtype;
    gradients in their inputs' dtypes."""

    @staticmethod
    def forward(ctx, hidden, gate_up_param, down_param, weights, gate_up_bias, down_bias, routes, plan):
        gate_up, down = gate_up_param.to(plan.dtype), down_param.to(plan.dtype)  # copies only under autocast
        out, xs, h, y = forward_rows(hidden, gate_up, down, weights, gate_up_bias, down_bias, routes, plan)
        save_xs, save_h, save_y = _saved(ctx.needs_input_grad[:6])
        ctx.save_for_backward(xs if save_xs else None, h if save_h else None, y if save_y else None, gate_up, down,
                              weights, gate_up_bias, down_bias, *_route_tensors(routes))
        ctx.plan = plan
        ctx.transposed = stored_transposed(gate_up_param), stored_transposed(down_param)
        ctx.hidden_dtype, ctx.param_dtype = hidden.dtype, gate_up_param.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, *route_tensors = ctx.saved_tensors
        grads = backward_rows(grad_out, xs, h, y, gate_up, down, weights, gate_up_bias, down_bias,
                              Routes(*route_tensors), ctx.plan, ctx.needs_input_grad[:6], ctx.transposed,
                              ctx.hidden_dtype, release=not graph_kept())
        return *_in_dtypes(grads, ctx.param_dtype, gate_up_bias, down_bias), None, None


def _route_tensors(routes: Routes) -> tuple[torch.Tensor, ...]:
    return routes.perm, routes.pos, routes.offsets, routes.experts


def _in_dtypes(grads, param_dtype, gate_up_bias, down_bias):
    """The gradients of backward_rows in their inputs' dtypes."""
    dtypes = (None, param_dtype, param_dtype, None, getattr(gate_up_bias, "dtype", None),
              getattr(down_bias, "dtype", None))
    return tuple(g if g is None or dtype is None else g.to(dtype) for g, dtype in zip(grads, dtypes))


# ------------------------------------------------------------------------------ the custom ops (torch.compile)

_ACT_SCHEMA = "str kind, float? limit, float alpha, float up_offset, bool interleaved, float? gate_softcap, " \
              "float? up_softcap"


def _act_args(act: Activation) -> tuple:
    return act.kind, act.limit, act.alpha, act.up_offset, act.interleaved, act.gate_softcap, act.up_softcap


def _act(kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap) -> Activation:
    return Activation(limit, alpha, up_offset, interleaved, kind, gate_softcap, up_softcap)


@torch.library.custom_op("flce::experts", mutates_args=(), schema=(
    "(Tensor hidden, Tensor top_k_index, Tensor weights, Tensor gate_up, Tensor down, Tensor? gate_up_bias, "
    f"Tensor? down_bias, ScalarType dtype, str? gemm, str elementwise, {_ACT_SCHEMA}, bool[3] saves) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _experts_op(hidden, top_k_index, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, elementwise,
                kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap, saves):
    """out (T, H), then what backward needs (xs, h, y: (0,) where ``saves`` says not) and the routes."""
    act = _act(kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap)
    routes = route_pairs(top_k_index, gate_up.shape[0])
    plan = plan_for(hidden.device, dtype, gemm_path(gemm), elementwise, act)
    out, *kept = forward_rows(hidden, gate_up.to(dtype), down.to(dtype), weights, gate_up_bias, down_bias, routes,
                              plan)
    kept = [t if save else t.new_empty(0) for t, save in zip(kept, saves)]
    return out, *kept, *_route_tensors(routes)


@_experts_op.register_fake
def _(hidden, top_k_index, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, elementwise,
      kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap, saves):
    (tokens, width), rows = hidden.shape, top_k_index.numel()
    new = hidden.new_empty
    kept = [new((rows, n) if save else (0,), dtype=dtype) for n, save in zip((width, gate_up.shape[1], width), saves)]
    return (new(tokens, width), *kept, new(rows, dtype=torch.int64), new(top_k_index.shape, dtype=torch.int64),
            new(gate_up.shape[0] + 1, dtype=torch.int32), new(rows, dtype=torch.int64))


@torch.library.custom_op("flce::experts_backward", mutates_args=(), schema=(
    "(Tensor grad_out, Tensor xs, Tensor h, Tensor y, Tensor gate_up, Tensor down, Tensor weights, "
    "Tensor? gate_up_bias, Tensor? down_bias, Tensor perm, Tensor pos, Tensor offsets, Tensor experts, "
    f"ScalarType dtype, str? gemm, str elementwise, {_ACT_SCHEMA}, bool[6] needs, bool[2] transposed) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _experts_backward_op(grad_out, xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, perm, pos, offsets,
                         experts, dtype, gemm, elementwise, kind, limit, alpha, up_offset, interleaved, gate_softcap,
                         up_softcap, needs, transposed):
    """backward_rows' gradients ((0,) where not needed); the weights' in plan dtype and contiguous as stored: (E, 2I,
    H) / (E, H, I), or where ``transposed`` (E, H, 2I) / (E, I, H)."""
    act = _act(kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap)
    plan = plan_for(grad_out.device, dtype, gemm_path(gemm), elementwise, act)
    saved_h = _saved(tuple(needs))[1]
    grads = backward_rows(grad_out, xs, h if saved_h else None, y, gate_up.to(dtype), down.to(dtype), weights,
                          gate_up_bias, down_bias, Routes(perm, pos, offsets, experts), plan, tuple(needs),
                          tuple(transposed), grad_out.dtype)
    flips = (False, *transposed, False, False, False)  # the weights' gradients as their contiguous storage
    grads = [g.transpose(1, 2) if flip and g is not None else g for g, flip in zip(grads, flips)]
    return tuple(g if g is not None else grad_out.new_empty(0) for g in grads)


@_experts_backward_op.register_fake
def _(grad_out, xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, perm, pos, offsets, experts, dtype, gemm,
      elementwise, kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap, needs, transposed):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    stored = [w.transpose(1, 2).shape if flip else w.shape for w, flip in zip((gate_up, down), transposed)]
    shapes = ((grad_out.shape, grad_out.dtype), (stored[0], dtype), (stored[1], dtype),
              (weights.shape, weights.dtype), ((gate_up.shape[0], gate_up.shape[1]), acc),
              ((down.shape[0], down.shape[1]), acc))
    return tuple(grad_out.new_empty(shape if need else (0,), dtype=dt) for (shape, dt), need in zip(shapes, needs))


# The op's inputs in order: hidden, top_k_index, weights, gate_up, down, gate_up_bias, down_bias, then non-tensors.
_GRAD_INPUTS = (0, 3, 4, 2, 5, 6)  # backward_rows' order: hidden, gate_up, down, weights, the two biases


def _setup_context(ctx, inputs, output):
    hidden, _, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, elementwise, *rest = inputs
    _, xs, h, y, *route_tensors = output
    ctx.save_for_backward(xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, *route_tensors)
    ctx.config = dtype, gemm, elementwise, *rest[:-1]


def _backward(ctx, grad_out, *_):
    xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, *route_tensors = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[i] for i in _GRAD_INPUTS)
    transposed = stored_transposed(gate_up), stored_transposed(down)
    grads = _experts_backward_op(grad_out, xs, h, y, gate_up, down, weights, gate_up_bias, down_bias, *route_tensors,
                                 *ctx.config, needs, transposed)
    grads = [g if need else None for g, need in zip(grads, needs)]
    grads[1:3] = [g.transpose(1, 2) if g is not None and flip else g for g, flip in zip(grads[1:3], transposed)]
    dx, d_gate_up, d_down, dw, d_gate_up_bias, d_down_bias = _in_dtypes(grads, gate_up.dtype, gate_up_bias, down_bias)
    return dx, None, dw, d_gate_up, d_down, d_gate_up_bias, d_down_bias, *([None] * 11)


_experts_op.register_autograd(_backward, setup_context=_setup_context)


def experts_op(hidden, top_k_index, weights, gate_up, down, gate_up_bias, down_bias, dtype: torch.dtype,
               gemm: str | None, elementwise: str, act: Activation) -> torch.Tensor:
    """The layer through ``flce::experts`` (what torch.compile traces): the same result and gradients as
    :class:`ExpertsFunction`; xs, h and y are kept only where the inputs needing gradients call for them. The GEMM
    path (None: ``FLCE_EXPERTS_GEMM`` or "auto") and the elementwise backend are resolved when the op runs."""
    needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                  for t in (hidden, gate_up, down, weights, gate_up_bias, down_bias))
    out, *_ = _experts_op(hidden, top_k_index, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm,
                          elementwise, *_act_args(act), list(_saved(needs)))
    return out
