"""The generic patched causal-LM forward: the model's own forward, with its head call made the fused loss.

Running the model's own forward (not a copy of it) keeps everything it does: argument handling,
``logits_to_keep``, router logits, the output class, and any wrapper around it (accelerate's autocast).
Only labels are withheld from it, so it computes no loss of its own, and its one call of ``lm_head``
returns the fused loss instead of logits. The family's extra loss terms are added back afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .head import head_computes_loss, innermost, unfusable_reason
from .settings import PatchSettings
from .trl import passes_through


def causal_lm_forward(model: nn.Module, inner: Callable, settings: PatchSettings, args: tuple,
                      kwargs: dict) -> Any:
    """``inner(*args, **kwargs)`` (the model's forward), with the loss fused when ``settings`` say so.

    Fused: labels given and ``settings.fuses(model.training)``; the output then has ``logits=None``.
    Otherwise the call goes to ``inner`` unchanged, so the output is exactly the unpatched one.
    """
    bound = _forward_signature(type(model)).bind(model, *args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not settings.fuses(model.training) or passes_through(kwargs):  # passes_through: TRL
        return inner(*args, **kwargs)
    reason = _unfusable(model)
    if reason is not None:
        warnings.warn(f"flce: {type(model).__name__} runs unfused because {reason}; logits are materialized",
                      stacklevel=3)
        return inner(*args, **kwargs)

    var_kw = next((p.name for p in bound.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    loss_kwargs = dict(bound.arguments.get(var_kw, {})) if var_kw else {}
    return_dict = model.config.return_dict if hasattr(model, "config") else True  # as can_return_tuple
    passed = loss_kwargs.pop("return_dict", return_dict)
    return_dict = return_dict if passed is None else passed
    bound.arguments["labels"] = None
    if var_kw:
        bound.arguments[var_kw] = loss_kwargs  # the backbone gets the same kwargs as unpatched

    with head_computes_loss(model.lm_head, labels, loss_kwargs, settings.loss_options_for(model)) as result:
        output = inner(*bound.args[1:], return_dict=True, **bound.kwargs)
    loss = _with_router_aux_loss(model, settings, output, result[0])
    output = type(output)(**{**{f.name: getattr(output, f.name) for f in dataclasses.fields(output)},
                             "loss": loss, "logits": None})
    return output if return_dict else output.to_tuple()


def _unfusable(model: nn.Module) -> str | None:
    from transformers.loss.loss_utils import LOSS_MAPPING

    loss_function = model.loss_function
    if loss_function is not LOSS_MAPPING["ForCausalLM"]:
        name = getattr(loss_function, "__name__", type(loss_function).__name__)
        return f"its loss_function is {name!r}, not transformers' ForCausalLMLoss"
    return unfusable_reason(innermost(model.lm_head))


def _with_router_aux_loss(model: nn.Module, settings: PatchSettings, output,
                          loss: torch.Tensor) -> torch.Tensor:
    """MoE families add ``router_aux_loss_coef * aux_loss`` when labels are given (not in place here)."""
    aux_loss = output.get("aux_loss") if settings.family.router_aux_loss else None
    if aux_loss is None:
        return loss
    return loss + model.router_aux_loss_coef * aux_loss.to(loss.device)


@functools.lru_cache(maxsize=None)
def _forward_signature(cls: type) -> inspect.Signature:
    """The class forward's signature (with self), through every ``__wrapped__`` layer."""
    return inspect.signature(inspect.unwrap(cls.forward))
