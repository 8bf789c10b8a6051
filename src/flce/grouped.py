"""Grouped linear: ``y[b, g] = x[b, g] @ W[g].T (+ bias[g])`` as strided batched GEMMs, no copies.

The group index may be the inner (batch-major, ``(B, G, in)``) or the outer (group-major,
``(G, B, in)``) dimension. Either way every GEMM sees its operands as a (G, B, ·) *view*: cuBLAS's
strided batched GEMM takes a row stride (lda/ldc) and a batch stride separately, so a permuted view of
a contiguous buffer is read, and written, in place. Forward and backward are three such GEMMs:

    y       = x @ W^T           (G batches of B x in  @ in x out)
    grad_x  = grad_y @ W        (G batches of B x out @ out x in), written into the input's layout
    grad_W  = grad_y^T @ x      (G batches of out x B @ B x in), K = B: one pass, no accumulation

No host syncs and no data-dependent control flow: the function can be captured in a CUDA graph.
Twice differentiable where the GEMMs run in the operands' own dtype (the saved operands are then the
inputs themselves); under autocast, whose casts happen inside, a second derivative raises.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .checks import check_devices, compute_dtype
from .function import first_order_only
from .gemm import bmm_into, linear_into


def grouped_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_major: bool = False,
) -> torch.Tensor:
    """G independent linear maps, one per group, in a single batched GEMM.

    Args:
        input: (..., G, in) batch-major, or with ``group_major=True`` (G, ..., in). A 2-D input is the
            flattened form of that layout: rows ``b * G + g`` (batch-major) or ``g * B + b``.
        weight: (G, out, in), stacked ``nn.Linear`` weights.
        bias: (G, out) or None.
        group_major: where the group dimension sits, see ``input``.

    Returns:
        The input's layout with ``in`` replaced by ``out``: (..., G, out), (G, ..., out) or (B*G, out).
        Under autocast it has the autocast dtype, like ``F.linear``.
    """
    _check(input, weight, bias)
    if type(group_major) is not bool:
        raise TypeError(f"group_major must be True or False, got {group_major!r}")
    groups = weight.shape[0]
    x3 = _as_3d(input, groups, group_major)
    dtype = compute_dtype(input, weight, bias, names=("input", "weight", "bias"))
    y3 = GroupedLinearFunction.apply(x3, weight, bias, group_major, dtype)
    return y3.reshape(*input.shape[:-1], weight.shape[1])


class GroupedLinear(nn.Module):
    """G ``nn.Linear(in_features, out_features)`` layers applied to G groups of the input at once.

    Parameters: ``weight`` (G, out, in) and ``bias`` (G, out), initialised as ``nn.Linear`` initialises
    each layer: uniform in ``[-1/sqrt(in), 1/sqrt(in)]``. See :func:`grouped_linear` for the layouts.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 group_major: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features),
                            ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if type(group_major) is not bool:
            raise TypeError(f"group_major must be True or False, got {group_major!r}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.group_major = group_major
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's kaiming_uniform_(a=sqrt(5)) and its bias rule both come down to this bound.
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return grouped_linear(input, self.weight, self.bias, group_major=self.group_major)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, group_major={self.group_major}")


def group_major_view(t: torch.Tensor, group_major: bool) -> torch.Tensor:
    """(G, B, ...) view of a tensor stored group-major (as is) or batch-major (first two dims swapped)."""
    return t if group_major else t.transpose(0, 1)


class GroupedLinearFunction(torch.autograd.Function):
    """x3: (B, G, in) or (G, B, in) per ``group_major``; weight (G, out, in); bias (G, out) or None."""

    @staticmethod
    def forward(ctx, x3, weight, bias, group_major, compute_dtype):
        with torch.autocast(x3.device.type, enabled=False):
            x = x3.to(compute_dtype)  # no copy unless autocast narrows
            w = weight.to(compute_dtype)
            out = torch.empty(*x3.shape[:-1], weight.shape[1], dtype=compute_dtype, device=x3.device)
            out_gm = group_major_view(out, group_major)
            linear_into(out_gm, group_major_view(x, group_major), w.transpose(1, 2), bias)  # rounded to out's dtype
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if need_w else None, w if need_x else None)
        ctx.meta = (group_major, x3.shape, x3.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.cast = x is not x3 or w is not weight  # the saved operands are copies, outside the graph
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True
            if not ctx.cast:  # the saved operands are the inputs: plain GEMMs differentiate again
                return (*_differentiable_grads(grad_out, x, w, ctx.meta[0], *ctx.needs_input_grad[:3]), None, None)
            with torch.no_grad():
                grads = GroupedLinearFunction._grads(ctx, grad_out, x, w)
            return first_order_only(grads, "flce.grouped_linear under autocast")
        return GroupedLinearFunction._grads(ctx, grad_out, x, w)

    @staticmethod
    def _grads(ctx, grad_out, x, w):
        group_major, x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_out.stride(-1) != 1:  # e.g. an expanded grad: cuBLAS needs unit stride in one dim
            grad_out = grad_out.contiguous()
        dy = group_major_view(grad_out, group_major)  # (G, B, out)
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = torch.empty(x_shape, dtype=x_dtype, device=dy.device)
            bmm_into(group_major_view(grad_x, group_major), dy, w.to(dy.dtype), accumulate=False)
        if need_w:
            grad_w = torch.empty(dy.shape[0], dy.shape[2], x_shape[-1], dtype=w_dtype, device=dy.device)
            bmm_into(grad_w, dy.transpose(1, 2), group_major_view(x, group_major).to(dy.dtype),
                     accumulate=False)
        if need_b:
            grad_b = dy.sum(1, dtype=torch.float64 if dy.dtype == torch.float64 else torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


def _differentiable_grads(grad_out, x, w, group_major: bool, need_x: bool, need_w: bool, need_b: bool):
    """The three gradients as autograd-tracked ops (create_graph=True). x: (B, G, in) or (G, B, in);
    w: (G, out, in); grad_out: x's layout with ``out`` columns."""
    dy = group_major_view(grad_out, group_major)  # (G, B, out)
    grad_x = group_major_view(torch.bmm(dy, w), group_major) if need_x else None
    grad_w = torch.bmm(dy.transpose(1, 2), group_major_view(x, group_major)) if need_w else None
    grad_b = dy.sum(1) if need_b else None
    return grad_x, grad_w, grad_b


def _as_3d(input: torch.Tensor, groups: int, group_major: bool) -> torch.Tensor:
    """(B, G, in) or (G, B, in) view (a copy only if the leading dims cannot be merged as a view)."""
    hidden = input.shape[-1]
    if input.dim() == 2:
        if input.shape[0] % groups:
            raise ValueError(f"2-D input has {input.shape[0]} rows, not a multiple of the {groups} groups")
        rows = input.shape[0] // groups
        return input.reshape((groups, rows, hidden) if group_major else (rows, groups, hidden))
    group_dim = 0 if group_major else input.dim() - 2
    if input.shape[group_dim] != groups:
        layout = "(G, ..., in)" if group_major else "(..., G, in)"
        raise ValueError(f"input {tuple(input.shape)} must be {layout} with G = {groups} (weight's groups) "
                         f"at dim {group_dim} (group_major={group_major})")
    rows = math.prod(input.shape[1:-1] if group_major else input.shape[:-2])
    return input.reshape((groups, rows, hidden) if group_major else (rows, groups, hidden))


def _check(input, weight, bias) -> None:
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if weight.dim() != 3:
        raise ValueError(f"weight must be (G, out, in), got shape {tuple(weight.shape)}")
    groups, out_features, in_features = weight.shape
    if groups < 1:
        raise ValueError("weight must hold at least one group")
    if input.dim() < 2 or input.shape[-1] != in_features:
        raise ValueError(f"input must be (..., {in_features}) with at least 2 dims to match weight "
                         f"{tuple(weight.shape)}, got {tuple(input.shape)}")
    check_group_bias("bias", bias, groups, out_features)
    check_devices(("input", input), ("weight", weight), ("bias", bias))


def check_group_bias(name: str, bias, groups: int, size: int) -> None:
    """A per-group bias must be None or a floating (G, size) tensor."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        what = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise TypeError(f"{name} must be a floating tensor of shape ({groups}, {size}) or None, got {what}")
    if tuple(bias.shape) != (groups, size):
        raise ValueError(f"{name} must be ({groups}, {size}), got {tuple(bias.shape)}")
