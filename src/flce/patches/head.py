"""The fused loss, computed inside a call of the model's own output-embedding module.

The loss is the forward of one call of the head module: for that call its forward is swapped for
:func:`flce.linear_cross_entropy`, so every hook on the head fires as usual (FSDP/FSDP2 unshard, DeepSpeed
ZeRO-3 gather, accelerate offload), the weight read is the gathered one, and the parameters themselves go
into the loss. What the head computes must be a linear map of its input that can be read off the module:
``x @ W.T + b`` for ``nn.Linear``; for a PEFT LoRA head (dropout and DoRA included) the same map written on
an augmented input, ``[x | s * dropout(x) @ A.T | ...] @ [W | B | ...].T + b``, whose autograd graph reaches
W, A, B and DoRA's magnitude; for a Linear whose float32 output a learned (V,) vector scales column by column
(``SCALED_COLUMN_HEADS``) ``x @ (s[:, None] * W).T``, whose graph reaches W and s.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..api import linear_cross_entropy
from ..distributed import is_dtensor
from ..kernels import resolve_backend
from ..kernels.scale import scale_into
from .transform import LogitTransform, Unfusable

# Wrappers whose forward ends in a call of the wrapped module (FSDP1, activation checkpointing): the swap
# goes on the wrapped module so the wrapper's own unshard/recompute logic still runs.
_WRAPPED_ATTRS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclass(frozen=True)
class ScaledColumns:
    """A head that is an ``nn.Linear`` subclass returning ``float(x @ W.T + b) * (scale * factor)``: ``scale`` names
    its learned (V,) parameter, ``factor`` its constant (a float attribute)."""

    scale: str
    factor: str


# Heads whose forward is not nn.Linear's but still a linear map flce can read, by class name: what differs.
SCALED_COLUMN_HEADS = {"DoryLMHead": ScaledColumns("logit_scale", "logit_scale_factor")}


@dataclass
class LinearParts:
    """``input @ weight.T + bias`` equals the head's output. input: (N, K); weight: (V, K); bias: (V,) or None."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


def innermost(head: nn.Module) -> nn.Module:
    """The module whose forward computes the head's logits, below wrappers that call it."""
    while True:
        inner = next((getattr(head, a) for a in _WRAPPED_ATTRS if isinstance(getattr(head, a, None), nn.Module)),
                     None) or _modules_to_save_target(head)
        if inner is None:
            return head
        head = inner


def unreadable_reason(head: nn.Module) -> str | None:
    """Why the linear map of ``head`` cannot be read off the module (None: it can)."""
    module = innermost(head)
    if _is_plain_linear(module) or scaled_columns(module) is not None:
        return None
    lora = _peft_lora()
    if lora is None or not isinstance(module, lora.Linear):
        return (f"its output embedding is a {type(module).__qualname__}, not an nn.Linear or a PEFT LoRA Linear "
                "whose weight flce can read")
    if not _is_plain_linear(module.base_layer):
        return f"its LoRA output embedding wraps a {type(module.base_layer).__qualname__}, not an nn.Linear"
    for name in _active_adapters(module):
        variant = getattr(module, "lora_variant", {}).get(name)
        if variant is not None and type(variant).__name__ != "DoraLinearVariant":
            return f"its LoRA output embedding's adapter {name!r} is a {type(variant).__name__}"
    return None


def linear_parts(module: nn.Module, x: torch.Tensor) -> LinearParts:
    """The head's linear map on rows x (N, H), read when its hooks have run."""
    reason = unreadable_reason(module)
    if reason is not None:
        raise Unfusable(reason)
    if _is_plain_linear(module):
        return LinearParts(x, module.weight, module.bias)
    scaled = scaled_columns(module)
    if scaled is not None:
        return _scaled_column_parts(module, scaled, x)
    return _lora_parts(module, x)


def scaled_columns(module: nn.Module) -> ScaledColumns | None:
    """The column scale of a ``SCALED_COLUMN_HEADS`` head (None for any other module)."""
    scaled = SCALED_COLUMN_HEADS.get(type(module).__name__)
    if scaled is None or not isinstance(module, nn.Linear):
        return None
    scale = getattr(module, scaled.scale, None)
    if not isinstance(scale, torch.Tensor) or scale.shape != (module.out_features,):
        return None
    return scaled


def _scaled_column_parts(module: nn.Linear, scaled: ScaledColumns, x: torch.Tensor) -> LinearParts:
    """s[:, None] * W (and s * b), s = scale * factor, multiplied in float32 and rounded once to the weight's dtype:
    each logit then carries its weights' roundings where the head's own forward rounds the logit before scaling."""
    if is_dtensor(module.weight):
        raise Unfusable(f"its output embedding ({type(module).__name__}) scales its columns by a learned vector, "
                        "which flce folds into a plain weight only, not a DTensor")
    s = getattr(module, scaled.scale).float() * float(getattr(module, scaled.factor))
    bias = None if module.bias is None else (module.bias * s).to(module.bias.dtype)
    return LinearParts(x, ScaleRows.apply(module.weight, s), bias)


class ScaleRows(torch.autograd.Function):
    """(V, H) weight times a (V,) scale per row (float32, or float64), in the weight's dtype: each product in the
    scale's dtype, rounded once (``kernels.scale.scale_into``: on CUDA a streaming kernel, no float32 copy of a
    131072 x 2560 head). The scale's gradient, the rows' dot products of grad with the weight, goes in pieces of
    rows of ``PIECE_ELEMENTS``."""

    PIECE_ELEMENTS = 1 << 24

    @staticmethod
    def forward(ctx, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.backend = resolve_backend("auto", weight.device, weight.dtype)
        return scale_into(weight, scale[:, None], weight.dtype, ctx.backend, out=torch.empty_like(weight))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        weight, scale = ctx.saved_tensors
        grad_weight = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_weight = scale_into(grad, scale[:, None], weight.dtype, ctx.backend, out=torch.empty_like(weight))
        if ctx.needs_input_grad[1]:
            grad_scale = torch.empty_like(scale)
            for rows in ScaleRows.pieces(weight):  # in the scale's dtype
                torch.sum(grad[rows].to(scale.dtype) * weight[rows], dim=1, out=grad_scale[rows])
        return grad_weight, grad_scale

    @staticmethod
    def pieces(weight: torch.Tensor) -> list[slice]:
        step = max(ScaleRows.PIECE_ELEMENTS // max(weight.shape[1], 1), 1)
        return [slice(i, i + step) for i in range(0, weight.shape[0], step)]


def head_loss(head: nn.Module, rows: torch.Tensor, target: torch.Tensor, transform: LogitTransform,
              options: dict, through_head: bool = True) -> torch.Tensor:
    """Cross-entropy of ``transform(head(rows))`` against target (N,), computed by one call of ``head``, or
    without calling it (``through_head=False``, for a head that ``reads_directly``).

    options: keyword options for flce.linear_cross_entropy (reduction, ignore_index, ...).
    """
    module = innermost(head)

    def fused_forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        parts = linear_parts(module, x)
        weight, bias = parts.weight, parts.bias
        if transform.vocab is not None:
            start, stop = transform.vocab
            weight = weight[start:stop]
            bias = None if bias is None else bias[start:stop]
        if transform.bias is not None:
            extra = transform.bias.to(weight.dtype)
            bias = extra if bias is None else bias + extra
        return linear_cross_entropy(parts.input, weight, target, linear_bias=bias, **transform.loss_options(),
                                    **options)

    if not through_head:
        return fused_forward(rows)
    # accelerate's hooks (offload, device maps) call module._old_forward between pre/post hooks.
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    saved = module.__dict__.get(attr)
    setattr(module, attr, fused_forward)
    try:
        return head(rows)
    finally:
        if saved is None:
            delattr(module, attr)
        else:
            setattr(module, attr, saved)


def reads_directly(head: nn.Module) -> bool:
    """Whether the head's call would do nothing but its linear map: a plain nn.Linear, no wrapper, no hook of its
    own or global, no accelerate hook. Its weight may then be read without the call, which torch.compile traces
    (the loss's custom ops, no graph break); any other head is called, hooks and all, behind a graph break."""
    from torch.nn.modules import module as hooks

    own = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks)
    shared = (hooks._global_forward_hooks, hooks._global_forward_pre_hooks, hooks._global_backward_hooks,
              hooks._global_backward_pre_hooks)
    return (_is_plain_linear(head) and innermost(head) is head and not hasattr(head, "_hf_hook")
            and not any(own) and not any(shared))


def _is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _peft_lora():
    return sys.modules.get("peft.tuners.lora")  # a LoRA head exists only if peft was imported


def _modules_to_save_target(head: nn.Module) -> nn.Module | None:
    """The module a PEFT ModulesToSaveWrapper's forward calls (as peft decides it), or None."""
    other = sys.modules.get("peft.utils.other")
    if other is None or not isinstance(head, other.ModulesToSaveWrapper):
        return None
    active = head.active_adapters
    if head.disable_adapters or not active or any(a not in head._adapters for a in active):
        return head.original_module
    return head.modules_to_save[active[0]]


def _active_adapters(head: nn.Module) -> list[str]:
    return [name for name in head.active_adapters if name in head.lora_A]


def _lora_parts(head: nn.Module, x: torch.Tensor) -> LinearParts:
    """peft's lora.Linear forward (peft 0.21), as one linear map on an augmented input.

    Vanilla adapter: result += s * B(A(dropout(x))). DoRA, with m = magnitude / ||W + s B A||_rows
    (detached norm): without dropout result = m * (result - b) + b + m * s * B(A(x)); with dropout
    result += (m - 1) * dropout(x) @ W.T + m * s * B(A(dropout(x))).
    """
    base = head.base_layer
    if head.disable_adapters and head.merged:
        head.unmerge()  # as peft's forward does
    blocks = [(x, base.weight)]  # (features (N, k), weight (V, k)) pairs
    extra = None  # bias terms beyond the base layer's, (V,)
    if not (head.disable_adapters or head.merged):
        for name in _active_adapters(head):
            blocks, extra = _adapter_blocks(head, name, x, blocks, extra)
    dtype, wdtype = x.dtype, base.weight.dtype
    bias = base.bias if extra is None else (extra if base.bias is None else base.bias + extra).to(wdtype)
    if len(blocks) == 1:
        return LinearParts(x, base.weight, bias)
    features = torch.cat([f.to(dtype) for f, _ in blocks], dim=-1)
    weight = torch.cat([w.to(wdtype) for _, w in blocks], dim=1)
    return LinearParts(features, weight, bias)


def _adapter_blocks(head, name, x, blocks, extra):
    lora_a, lora_b = head.lora_A[name], head.lora_B[name]
    dropout, scaling = head.lora_dropout[name], head.scaling[name]
    x = head._cast_input_dtype(x, lora_a.weight.dtype)
    b_bias = None if lora_b.bias is None else scaling * lora_b.bias
    if name not in getattr(head, "lora_variant", {}):
        blocks = blocks + [(lora_a(dropout(x)) * scaling, lora_b.weight)]
        return blocks, _plus(extra, b_bias)
    magnitude = _dora_scale(head, name, x)[:, None]
    if isinstance(dropout, nn.Identity) or not head.training:
        blocks = [(f, w * magnitude) for f, w in blocks] + [(lora_a(x) * scaling, lora_b.weight * magnitude)]
        extra = None if extra is None else extra * magnitude[:, 0]
    else:
        dropped = dropout(x)
        weight = head.get_base_layer().weight.to(x.dtype)
        blocks = blocks + [(dropped, weight * (magnitude - 1)), (lora_a(dropped) * scaling, lora_b.weight * magnitude)]
    return blocks, _plus(extra, None if b_bias is None else b_bias * magnitude[:, 0])


def _dora_scale(head, name, x) -> torch.Tensor:
    """DoRA's per-output factor m (V,), computed by peft's own DoraLinearLayer methods."""
    layer = head.lora_magnitude_vector[name]
    lora_weight = layer.get_lora_weight(lora_A=head.lora_A[name], lora_B=head.lora_B[name],
                                        adapter_name=name).to(x.dtype)
    weight = head.get_base_layer().weight.to(x.dtype)
    norm = layer.get_weight_norm(weight=weight, lora_weight=lora_weight.detach(), scaling=head.scaling[name],
                                 adapter_name=name).detach()
    return layer.weight / norm


def _plus(a, b):
    return b if a is None else a if b is None else a + b
