"""Selecting flce's experts backend ("flce", registered by flce.experts) on a patched MoE model.

Only models whose experts it computes are switched: the classes in ``EXPERTS_BACKEND_CLASSES`` (and
subclasses). The previous implementation is remembered on the instance and put back by
``restore_experts``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Iterator

from torch import nn

from ..experts import BACKEND_NAME
from .settings import PatchSettings

# transformers classes whose experts flce.experts computes (gate_up_proj (E, 2I, H), SiLU-gated).
EXPERTS_BACKEND_CLASSES = frozenset({"MixtralForCausalLM"})

_PREVIOUS = "_flce_patch_previous_experts"
_MISSING = object()
_SWITCHED: weakref.WeakSet = weakref.WeakSet()  # models switched here, for removing a class patch


def select_experts(model: nn.Module, settings: PatchSettings) -> None:
    """Switch ``model`` to the "flce" experts backend if it computes its experts and the settings want it."""
    if not (settings.use_flce_experts and has_experts_backend(type(model))):
        restore_experts(model)
        return
    if _PREVIOUS in model.__dict__:
        return
    if not _backend_registered():
        warnings.warn(f"flce: no experts backend named {BACKEND_NAME!r} is registered with transformers' "
                      f"ExpertsInterface; {type(model).__name__} keeps its experts implementation "
                      f"{_current(model)!r} (pass use_flce_experts=False to silence this)", stacklevel=4)
        return
    model.__dict__[_PREVIOUS] = _current(model)
    model.set_experts_implementation(BACKEND_NAME)
    _SWITCHED.add(model)


def has_experts_backend(cls: type) -> bool:
    return any(base.__name__ in EXPERTS_BACKEND_CLASSES and base.__module__.startswith("transformers.models.")
               for base in cls.__mro__)


def restore_experts(model: nn.Module) -> None:
    """Put back the experts implementation ``select_experts`` replaced (if it is still "flce")."""
    previous = model.__dict__.pop(_PREVIOUS, _MISSING)
    _SWITCHED.discard(model)
    if previous is not _MISSING and _current(model) == BACKEND_NAME:
        model.set_experts_implementation(previous)


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
