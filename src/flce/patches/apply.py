"""``apply_flce_patch`` / ``remove_flce_patch`` on a model class or on one model.

A class patch replaces ``cls.forward``; an instance patch sets ``model.forward``. Either wrapper keeps
the original's signature (``functools.wraps``: Trainer inspects it) and reads its settings at call time,
so re-applying only updates the settings, and a wrapper that someone else has wrapped in turn
(accelerate's mixed-precision forward) becomes a pass-through when removed. An instance patch takes
precedence over a class patch of its class.
"""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
from types import MethodType
from typing import TypeVar

from torch import nn

from .families import family_of
from .forward import causal_lm_forward
from .moe import restore_experts, select_experts, switched_models
from .settings import PatchSettings, make_settings
from .trl import route_trl_to_flce

T = TypeVar("T")

_SETTINGS = "_flce_patch_settings"  # on a patched instance: its PatchSettings
_INNER = "_flce_patch_inner_forward"  # on a patched instance: the forward it wraps (None: the class's)
_CLASS_SETTINGS: dict[type, PatchSettings] = {}
_CLASS_SAVED: dict[type, object] = {}  # the class's own forward before patching (or _MISSING)
_MISSING = object()


def apply_flce_patch(model_or_class: T, **options) -> T:
    """Make a transformers causal LM compute its training loss with flce, without logits.

    Args:
        model_or_class: a model (patches that instance; a PEFT or DDP/FSDP/DeepSpeed wrapper is
            looked through) or a class such as ``transformers.LlamaForCausalLM`` (patches every
            instance, also ones built later). Supported: see ``flce.patches.FAMILIES``; anything
            else raises ValueError naming the class, and nothing is patched.
        **options: loss options for :func:`flce.linear_cross_entropy` (``z_loss``, ``label_smoothing``,
            ``softcap`` (default: the config's ``final_logit_softcapping`` where the model has one),
            ``temperature``, ``weight``, ``chunk_size``, ``accum_dtype``, ``backend``,
            ``validate_target``, ``low_memory``) and patch options: ``materialize_logits`` (None: fuse in training and
            return logits in eval mode; False: fuse whenever labels are given; True: never fuse) and
            ``use_flce_experts`` (Mixtral: select the "flce" experts backend; default True).

    A call with labels in training returns ``loss`` (equal to the unpatched loss: same label shift,
    ``shift_labels``, ignore_index, ``num_items_in_batch``, ``logits_to_keep``, router aux loss) and
    ``logits=None``; every other call is the unpatched forward. Patch before ``Trainer.train`` /
    ``accelerator.prepare``; an instance patched after ``prepare`` works too, a class patched after
    it misses the instances prepare captured (a warning names them). Applying again updates the
    options. Returns what it was given.
    """
    target = _unwrap(model_or_class)
    cls = target if isinstance(target, type) else type(target)
    settings = make_settings(family_of(cls), options)
    if isinstance(target, type):
        _patch_class(cls, settings)
    else:
        _patch_instance(target, settings)
    route_trl_to_flce()  # TRL's fused LM head (trainers built before or after) on flce's kernels
    return model_or_class


def remove_flce_patch(model_or_class: T) -> T:
    """Undo :func:`apply_flce_patch` on that model or class (a no-op if it is not patched)."""
    target = _unwrap(model_or_class)
    if isinstance(target, type):
        _unpatch_class(target)
    else:
        _unpatch_instance(target)
    return model_or_class


def _patch_class(cls: type, settings: PatchSettings) -> None:
    if cls not in _CLASS_SAVED:
        _CLASS_SAVED[cls] = cls.__dict__.get("forward", _MISSING)
        cls.forward = _class_forward(cls, cls.forward)
    _CLASS_SETTINGS[cls] = settings
    _warn_if_prepared_before(cls)


def _unpatch_class(cls: type) -> None:
    if _CLASS_SETTINGS.pop(cls, None) is None:
        return
    for model in switched_models(cls):
        if _SETTINGS not in model.__dict__:
            restore_experts(model)
    if getattr(cls.__dict__.get("forward"), "__flce_patch__", None) == "class":
        saved = _CLASS_SAVED.pop(cls)
        if saved is _MISSING:
            delattr(cls, "forward")
        else:
            setattr(cls, "forward", saved)


def _class_forward(cls: type, func):
    @functools.wraps(func)
    def forward(self, *args, **kwargs):
        settings = _CLASS_SETTINGS.get(cls)
        if settings is None or _SETTINGS in self.__dict__:  # removed, or an instance patch governs
            return func(self, *args, **kwargs)
        select_experts(self, settings)
        return causal_lm_forward(self, functools.partial(func, self), settings, args, kwargs)

    forward.__flce_patch__ = "class"
    return forward


def _patch_instance(model: nn.Module, settings: PatchSettings) -> None:
    if _INNER not in model.__dict__:  # our wrapper is not in this model's forward chain yet
        model.__dict__[_INNER] = model.__dict__.get("forward")
        model.forward = MethodType(_instance_forward(type(model)), model)
    model.__dict__[_SETTINGS] = settings
    select_experts(model, settings)


def _unpatch_instance(model: nn.Module) -> None:
    if model.__dict__.pop(_SETTINGS, None) is None:
        return
    restore_experts(model)
    current = model.__dict__.get("forward")
    if getattr(getattr(current, "__func__", None), "__flce_patch__", None) == "instance":  # still outermost
        inner = model.__dict__.pop(_INNER)
        if inner is None:
            del model.forward
        else:
            model.forward = inner


def _instance_forward(cls: type):
    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        inner = self.__dict__[_INNER] or functools.partial(type(self).forward, self)
        settings = self.__dict__.get(_SETTINGS)
        if settings is None:
            return inner(*args, **kwargs)
        return causal_lm_forward(self, inner, settings, args, kwargs)

    forward.__flce_patch__ = "instance"
    return forward


def _unwrap(obj):
    """The transformers model (or class) inside PEFT / DDP / FSDP1 / DeepSpeed / torch.compile wrappers."""
    if isinstance(obj, type):
        if not issubclass(obj, nn.Module):
            raise TypeError(f"flce.apply_flce_patch expects a transformers causal-LM model or class, got "
                            f"the class {obj.__qualname__}")
        return obj
    if not isinstance(obj, nn.Module):
        raise TypeError(f"flce.apply_flce_patch expects a transformers causal-LM model or class, got "
                        f"{type(obj).__name__}")
    from transformers import PreTrainedModel

    while not isinstance(obj, PreTrainedModel):
        if callable(getattr(obj, "get_base_model", None)):  # peft.PeftModel
            obj = obj.get_base_model()
        elif isinstance(getattr(obj, "module", None), nn.Module):  # DDP, FSDP1, DeepSpeedEngine
            obj = obj.module
        elif isinstance(getattr(obj, "_orig_mod", None), nn.Module):  # torch.compile
            obj = obj._orig_mod
        else:
            break
    return obj


def _warn_if_prepared_before(cls: type) -> None:
    """accelerate's prepare (mixed precision) keeps the class forward of that moment on the instance."""
    if not _prepared_unpatched(cls):
        return
    gc.collect()  # count live instances only, not ones in cycles waiting to be collected
    count = len(_prepared_unpatched(cls))
    if count:
        warnings.warn(f"flce: {count} {cls.__name__} instance(s) were prepared by accelerate before the class "
                      f"was patched and keep the unpatched forward; patch before Trainer.train / "
                      f"accelerator.prepare, or patch those instances: flce.apply_flce_patch(model)",
                      stacklevel=4)


def _prepared_unpatched(cls: type) -> list:
    return [o for o in gc.get_objects() if issubclass(type(o), cls) and "_original_forward" in o.__dict__
            and _INNER not in o.__dict__ and not _routes_through_class_patch(o.__dict__.get("forward"))]


def _routes_through_class_patch(forward) -> bool:
    func = getattr(forward, "__func__", forward)
    marked = inspect.unwrap(func, stop=lambda f: getattr(f, "__flce_patch__", None) == "class")
    return getattr(marked, "__flce_patch__", None) == "class"
