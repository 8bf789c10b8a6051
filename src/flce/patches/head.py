"""The fused loss, computed inside the model's own call of its head module.

The model's forward still calls ``self.lm_head(hidden_states)``; for that one call the head's forward is
swapped for the fused loss. So every hook on the head fires as usual (FSDP/FSDP2 unshard, DeepSpeed
ZeRO-3 gather, accelerate offload), the weight read is the gathered one, and it is never copied or
replaced: the parameter itself goes into :func:`flce.linear_cross_entropy`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..api import linear_cross_entropy

# Wrappers whose forward ends in a call of the wrapped module (FSDP1, activation checkpointing): the
# swap goes on the wrapped module so the wrapper's own unshard/recompute logic still runs.
_WRAPPED_ATTRS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def innermost(head: nn.Module) -> nn.Module:
    """The module whose forward computes the head's logits, below FSDP1/checkpoint wrappers."""
    while True:
        inner = next((getattr(head, a) for a in _WRAPPED_ATTRS if isinstance(getattr(head, a, None), nn.Module)),
                     None)
        if inner is None:
            return head
        head = inner


def unfusable_reason(head: nn.Module) -> str | None:
    """Why the head's logits are not ``x @ W.T + b`` for a weight we can read, or None if they are."""
    if _is_plain_linear(head):
        return None
    lora = sys.modules.get("peft.tuners.lora")  # a LoRA head exists only if peft was imported
    if lora is None or not isinstance(head, lora.Linear):
        return f"its lm_head is a {type(head).__name__}, neither nn.Linear nor a PEFT LoRA Linear"
    if not _is_plain_linear(head.base_layer):
        return f"its LoRA lm_head wraps a {type(head.base_layer).__name__}, not an nn.Linear"
    if head.disable_adapters and head.merged:
        return "its LoRA lm_head has merged adapters that are disabled"
    for name in _active_adapters(head):
        if name in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(name):
            return f"its LoRA lm_head adapter {name!r} is a variant (DoRA, ...), not a plain low-rank update"
        dropout = head.lora_dropout[name]
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            return f"its LoRA lm_head adapter {name!r} applies dropout (p={dropout.p}) in training"
    return None


def head_weights(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, H), bias (V,) or None) of a fusable head, read when its hooks have run.

    A LoRA head's weight is ``W + sum of its active adapters' B @ A * scaling``: one (V, H) temporary
    whose autograd graph carries the gradients to the adapters.
    """
    if _is_plain_linear(head):
        return head.weight, head.bias
    base = head.base_layer
    weight = base.weight
    if not (head.disable_adapters or head.merged):
        for name in _active_adapters(head):
            weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


@contextmanager
def head_computes_loss(head: nn.Module, labels: torch.Tensor, loss_kwargs: dict,
                       options: dict) -> Iterator[list[torch.Tensor]]:
    """While active, the next call of ``head`` returns the fused loss instead of logits.

    Yields a list that receives that loss. Labels are shifted as ``ForCausalLMLoss`` does (or
    ``loss_kwargs["shift_labels"]`` is used); ``num_items_in_batch`` and ``ignore_index`` in
    ``loss_kwargs`` apply as there. ``options`` go to :func:`flce.linear_cross_entropy`.
    """
    target_module = innermost(head)
    result: list[torch.Tensor] = []

    def fused_forward(hidden_states: torch.Tensor, *_args, **_kwargs) -> torch.Tensor:
        if result:
            raise RuntimeError("flce: the model called its lm_head twice in one forward; the fused loss "
                               "supports exactly one call")
        weight, bias = head_weights(target_module)
        result.append(shifted_loss(hidden_states, weight, bias, labels, loss_kwargs, options))
        return result[0]  # the head's output is the loss, so hooks on outputs see a tensor that needs grad

    with _forward_replaced(target_module, fused_forward):
        yield result
    if not result:
        raise RuntimeError("flce: the model's forward did not call its lm_head; it does not follow the "
                           "standard transformers causal-LM layout")


def shifted_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 loss_kwargs: dict, options: dict) -> torch.Tensor:
    """``ForCausalLMLoss(hidden @ weight.T + bias, labels, ...)`` without the logits.

    hidden: (..., H) as the head received it; labels: the model's labels (or shift_labels), whose
    shifted form has as many entries as hidden has rows.
    """
    ignore_index = loss_kwargs.get("ignore_index", -100)
    target = loss_kwargs.get("shift_labels")
    if target is None:
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    rows = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1).to(rows.device)
    if target.numel() != rows.shape[0]:
        raise ValueError(f"flce: {target.numel()} shifted labels for {rows.shape[0]} hidden states (with "
                         "logits_to_keep, pass labels for the kept positions only)")
    return linear_cross_entropy(rows, weight, target, linear_bias=bias, ignore_index=ignore_index,
                                num_items_in_batch=loss_kwargs.get("num_items_in_batch"), **options)


@contextmanager
def _forward_replaced(module: nn.Module, fn) -> Iterator[None]:
    # accelerate's hooks (offload, device maps) call module._old_forward between pre/post hooks.
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    missing = object()
    saved = module.__dict__.get(attr, missing)
    setattr(module, attr, fn)
    try:
        yield
    finally:
        if saved is missing:
            delattr(module, attr)
        else:
            setattr(module, attr, saved)


def _is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _active_adapters(head: nn.Module) -> list[str]:
    return [name for name in head.active_adapters if name in head.lora_A]
