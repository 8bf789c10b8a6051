"""``apply_flce_patch`` / ``remove_flce_patch`` on a model class or on one model.

A class patch replaces ``cls.forward``; an instance patch sets ``model.forward`` to an
:class:`InstanceForward`. Either keeps the original's signature (Trainer inspects it) and reads its
settings at call time, so re-applying only updates the settings, and a wrapper that someone else has
wrapped in turn (accelerate's mixed-precision forward) becomes a pass-through when removed. An instance
patch takes precedence over a class patch of its class. A patched instance saved whole (torch.save)
comes back patched: its forward is a plain picklable object holding the model (weakly) and the settings.
"""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
import weakref
from typing import TypeVar

from torch import nn

from .forward import NO_LABELS, causal_lm_forward, static_refusal, takes_labels
from .moe import restore_experts, select_experts, switched_models
from .settings import PatchSettings, make_settings
from .trl import route_trl_to_flce

T = TypeVar("T")

_FORWARD = "_flce_patch_forward"  # on a patched instance: its InstanceForward (also when wrapped by others)
_CLASS_SETTINGS: dict[type, PatchSettings] = {}
_CLASS_SAVED: dict[type, object] = {}  # the class's own forward before patching (or _MISSING)
_MISSING = object()


def apply_flce_patch(model_or_class: T, **options) -> T:
    """Make a transformers language model compute its training loss with flce, without logits.

    Args:
        model_or_class: a model (patches that instance; a PEFT or DDP/FSDP/DeepSpeed wrapper is
            looked through) or a class such as ``transformers.LlamaForCausalLM`` (patches every
            instance, also ones built later). Any causal LM or vision-language model whose logits are
            its output embedding's linear map of the hidden states, transformed by scalings, a bias, a
            softcap or a vocabulary slice on the way to ``cross_entropy``; what cannot be fused raises a
            ValueError that says why (here, or at the first training call when only the forward shows it).
        **options: loss options for :func:`flce.linear_cross_entropy` (``z_loss``, ``label_smoothing``,
            ``softcap`` and ``temperature`` (applied on top of the model's own logit transform),
            ``weight``, ``chunk_size``, ``accum_dtype``, ``backend``, ``validate_target``,
            ``low_memory``) and patch options: ``materialize_logits`` (None: fuse in training and return
            logits in eval mode; False: fuse whenever labels are given; True: never fuse) and
            ``use_flce_experts`` (a MoE model whose experts the "flce" experts backend computes, every one of
            them: select that backend; Llama 4's dense MoE blocks and LongCat-Flash's experts, which have no
            experts decorator: compute their routed experts through flce's; default True).

    A call with labels in training returns the unpatched model's ``loss`` (its own label shift,
    ``shift_labels``, ignore_index, ``num_items_in_batch``, ``logits_to_keep``, router aux loss) and
    ``logits=None``; every other call is the unpatched forward. Patch before ``Trainer.train`` /
    ``accelerator.prepare``; an instance patched after ``prepare`` works too, a class patched after
    it misses the instances prepare captured (a warning names them). Applying again updates the
    options. Returns what it was given.
    """
    target = _unwrap(model_or_class)
    settings = make_settings(options)
    reason = _class_refusal(target) if isinstance(target, type) else static_refusal(target)
    if reason is not None:  # what can be known before a call: raise now, patch nothing
        name = target.__qualname__ if isinstance(target, type) else type(target).__name__
        raise ValueError(f"flce cannot fuse {name}: {reason}")
    if isinstance(target, type):
        _patch_class(target, settings)
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
        if not _instance_patched(model):
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
        if settings is None or _instance_patched(self):  # removed, or an instance patch governs
            return func(self, *args, **kwargs)
        select_experts(self, settings)
        return causal_lm_forward(self, functools.partial(func, self), settings, args, kwargs)

    forward.__flce_patch__ = "class"
    return forward


class InstanceForward:
    """``model.forward`` of a patched instance: the fused forward around ``inner`` (None: the class's).

    settings None makes it a pass-through (removed while someone else's wrapper still calls it). It holds its
    model weakly: the model's ``__dict__`` holds it, and a strong reference back would make every patched model
    a reference cycle, whose parameters and gradients outlive ``del model`` until Python's cyclic collector
    runs (GPU memory does not trigger it).
    """

    __flce_patch__ = "instance"

    def __init__(self, model: nn.Module, inner, settings: PatchSettings | None) -> None:
        self._model, self.inner, self.settings = weakref.ref(model), inner, settings

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("flce: this forward's model no longer exists")
        return model

    def __reduce__(self):
        """Pickled (torch.save) and deep-copied around the copy of its model, which both already hold."""
        return InstanceForward, (self.model, self.inner, self.settings)

    def __call__(self, *args, **kwargs):
        inner = self.inner if self.inner is not None else functools.partial(type(self.model).forward, self.model)
        if self.settings is None:
            return inner(*args, **kwargs)
        return causal_lm_forward(self.model, inner, self.settings, args, kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        inner = self.inner if self.inner is not None else functools.partial(type(self.model).forward, self.model)
        return inspect.signature(inner)


def _instance_patched(model: nn.Module) -> bool:
    forward = model.__dict__.get(_FORWARD)
    return forward is not None and forward.settings is not None


def _patch_instance(model: nn.Module, settings: PatchSettings) -> None:
    forward = model.__dict__.get(_FORWARD)
    if forward is None or forward.model is not model:  # not in this model's forward chain yet
        forward = InstanceForward(model, model.__dict__.get("forward"), settings)
        model.__dict__[_FORWARD] = forward
        model.forward = forward
    forward.settings = settings
    select_experts(model, settings)


def _unpatch_instance(model: nn.Module) -> None:
    restore_experts(model)  # also on a model saved whole while its class was patched
    forward = model.__dict__.pop(_FORWARD, None)
    if forward is None:
        return
    forward.settings = None
    if model.__dict__.get("forward") is forward:  # still outermost
        if forward.inner is None:
            del model.forward
        else:
            model.forward = forward.inner


def _class_refusal(cls: type) -> str | None:
    from transformers import GenerationMixin, PreTrainedModel

    if not issubclass(cls, PreTrainedModel):
        return "it is not a transformers model class"
    if not issubclass(cls, GenerationMixin):
        return ("it is not a language model that generates text (no GenerationMixin), so no output embedding "
                "feeds a language-modeling loss")
    return None if takes_labels(cls) else NO_LABELS


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
            and _FORWARD not in o.__dict__ and not _routes_through_class_patch(o.__dict__.get("forward"))]


def _routes_through_class_patch(forward) -> bool:
    func = getattr(forward, "__func__", forward)
    marked = inspect.unwrap(func, stop=lambda f: getattr(f, "__flce_patch__", None) == "class")
    return getattr(marked, "__flce_patch__", None) == "class"
