"""Selecting flce's experts on a patched MoE model.

Only models whose experts flce computes, every one of them, are switched:

- experts modules that transformers dispatches by implementation (``has_experts_backend``: Mixtral, Qwen2/3-MoE,
  DeepSeek-V2/V3/V4, GPT-OSS, Nemotron-H, Inkling-2, OLMoE, GLM-4 MoE and most MoE families of transformers 5)
  take the "flce" backend (registered by flce.experts);
- MoE modules without that decorator (``moe_blocks``: Llama 4's dense blocks, LongCat-Flash's identity experts)
  compute their routed experts through flce's.

A model with any other experts layout keeps its implementation. What was replaced is remembered on the instance and
put back by ``restore_experts``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Iterator

from torch import nn

from ..experts import BACKEND_NAME, computes_experts
from . import moe_blocks
from .settings import PatchSettings

_PREVIOUS = "_flce_patch_previous_experts"
_MISSING = object()
_SWITCHED: weakref.WeakSet = weakref.WeakSet()  # models switched here, for removing a class patch
_COMPUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> has_experts_backend, found once
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its ``moe_blocks`` modules flce computes


def select_experts(model: nn.Module, settings: PatchSettings) -> None:
    """Switch ``model`` to flce's experts if flce computes them and the settings want it."""
    if not (settings.use_flce_experts and has_flce_experts(model)):
        restore_experts(model)
        return
    if _PREVIOUS in model.__dict__:
        if model not in _SWITCHED:  # a copy or a reload: in a new process its modules' classes are not wrapped yet
            for module in _computed_modules(model):
                moe_blocks.enable(module)
            _SWITCHED.add(model)
        return
    previous = _current(model)
    if has_experts_backend(model):
        if not _backend_registered():
            warnings.warn(f"flce: no experts backend named {BACKEND_NAME!r} is registered with transformers' "
                          f"ExpertsInterface; {type(model).__name__} keeps its experts implementation "
                          f"{_current(model)!r} (pass use_flce_experts=False to silence this)", stacklevel=4)
            return
        model.set_experts_implementation(BACKEND_NAME)
    for module in _computed_modules(model):
        moe_blocks.enable(module)
    model.__dict__[_PREVIOUS] = previous
    _SWITCHED.add(model)


def has_flce_experts(model: nn.Module) -> bool:
    """Whether flce computes ``model``'s experts: by the "flce" backend or through ``moe_blocks``."""
    return has_experts_backend(model) or bool(_computed_modules(model))


def has_experts_backend(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model with ``set_experts_implementation``) has ``experts_modules`` and
    flce.experts computes every one of them itself. Found at the first call."""
    found = _COMPUTED.get(model)
    if found is None:
        experts = experts_modules(model)
        found = (callable(getattr(model, "set_experts_implementation", None)) and bool(experts)
                 and all(computes_experts(m) for m in experts))
        _COMPUTED[model] = found
    return found


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules that transformers dispatches by implementation: a 3-D ``down_proj``, a forward wrapped by
    its experts decorator (not by ``moe_blocks``); a shared expert of the same shape is called directly."""
    return [m for m in model.modules() if getattr(getattr(m, "down_proj", None), "ndim", 0) == 3
            and hasattr(type(m).forward, "__wrapped__") and not moe_blocks.wrapped_here(type(m))]


def restore_experts(model: nn.Module) -> None:
    """Put back the experts implementation ``select_experts`` replaced (if it is still "flce")."""
    previous = model.__dict__.pop(_PREVIOUS, _MISSING)
    _SWITCHED.discard(model)
    if previous is _MISSING:
        return
    for module in _computed_modules(model):
        moe_blocks.disable(module)
    if _current(model) == BACKEND_NAME:
        model.set_experts_implementation(previous)


def _computed_modules(model: nn.Module) -> list[nn.Module]:
    """``moe_blocks.computed_modules``, found at the first call."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = moe_blocks.computed_modules(model)
    return modules


def switched_models(cls: type) -> Iterator[nn.Module]:
    """The live instances of ``cls`` that ``select_experts`` switched."""
    return (m for m in list(_SWITCHED) if isinstance(m, cls))


def _current(model: nn.Module) -> str | None:
    return getattr(model.config, "_experts_implementation", None)


def _backend_registered() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return BACKEND_NAME in ALL_EXPERTS_FUNCTIONS.keys()
