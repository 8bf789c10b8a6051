"""The patched forward: the model's own forward, with labels, whose output embedding returns a promise.

The model runs exactly as unpatched (label shift, ``shift_labels``, ``num_items_in_batch``, ignore_index,
the MoE aux loss, its output class), except that for this one call its output-embedding module is
replaced, in every parent that holds it, by a recorder whose hooks are none and which returns a
:class:`~.promise.LogitsPromise` instead of logits. The model's loss code hands the promise to
``F.cross_entropy``, which computes the fused loss inside a call of the real head (:mod:`.head`); the
output's logits are None. A model that uses its logits any other way is refused with a ValueError.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .head import innermost, scaled_columns, unreadable_reason
from .promise import HeadCall, LogitsPromise
from .settings import PatchSettings
from .transform import ADVICE
from .trl import passes_through

_SIGNATURES: dict[type, inspect.Signature] = {}
_HOLDER_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [(parent path, name)]


def causal_lm_forward(model: nn.Module, inner: Callable, settings: PatchSettings, args: tuple,
                      kwargs: dict) -> Any:
    """``inner(*args, **kwargs)`` (the model's forward), with the loss fused when ``settings`` say so.

    Fused: labels given and ``settings.fuses(model.training)``; the output then has ``logits=None``.
    Otherwise (and for TRL's ``fused_lm_head=True`` calls) the call goes to ``inner`` unchanged.
    """
    if passes_through(kwargs) or not settings.fuses(model.training) or _labels(model, args, kwargs) is None:
        return inner(*args, **kwargs)
    reason = static_refusal(model)
    if reason is not None:
        raise ValueError(f"flce cannot fuse {type(model).__name__}: {reason}; {ADVICE}")
    head = model.get_output_embeddings()
    calls: list[HeadCall] = []
    holders = _holders(model, head)
    recorder = _Recorder(head, type(model).__name__, settings.loss_options, calls)
    for parent, name in holders:  # no hooks of the head fire for this call: it computes nothing
        parent._modules[name] = recorder
    if torch.compiler.is_compiling():  # no try block around the loss's graph break: torch.compile resumes after it
        output = inner(*args, **kwargs)
        _put_back(holders, head)
    else:
        try:
            output = inner(*args, **kwargs)
        finally:
            _put_back(holders, head)
    _check_consumed(model, head, calls)
    return without_promises(output)


NO_LABELS = "its forward takes no labels, so it computes no language-modeling loss to fuse"


def static_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be fused, as far as can be told without running it (None: no reason yet)."""
    if not takes_labels(type(model)):
        return NO_LABELS
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return "it has no output embedding (get_output_embeddings() returns None)"
    if not _holders(model, head):
        return f"its output embedding ({type(head).__name__}) is not a submodule of it"
    return unreadable_reason(head)


class _Recorder:
    """Stands in for the output embedding during one forward: returns a promise, fires no hooks.

    A plain callable (not an nn.Module, so torch.compile can create it while tracing); attribute reads
    (``weight``, ``out_features``, ...) go to the real head.
    """

    def __init__(self, head: nn.Module, owner: str, options: dict, calls: list[HeadCall]) -> None:
        self._flce_head, self._flce_owner, self._flce_options, self._flce_calls = head, owner, options, calls

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> LogitsPromise:
        if args or kwargs or not isinstance(hidden, torch.Tensor):
            raise ValueError(f"flce cannot fuse {self._flce_owner}: it calls its output embedding with more than "
                             f"the hidden states; {ADVICE}")
        call = HeadCall(self._flce_head, hidden, self._flce_owner, self._flce_options)
        self._flce_calls.append(call)
        return LogitsPromise.of_head_call(call, _out_features(self._flce_head), _output_dtype(hidden, self._flce_head))

    def __getattr__(self, name: str):
        if name.startswith("_flce_"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._flce_head, name)


def _put_back(holders: list[tuple[nn.Module, str]], head: nn.Module) -> None:
    for parent, name in holders:
        parent._modules[name] = head


def _holders(model: nn.Module, head: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, name) with ``parent._modules[name] is head`` below ``model``.

    Found once per model (paths, checked on every call) in eager mode; while torch.compile traces, found
    without the cache (the search runs at trace time only, and uses no generators, which Dynamo cannot step).
    """
    compiling = torch.compiler.is_compiling()
    paths = None if compiling else _HOLDER_PATHS.get(model)
    if paths is not None:
        holders = [(model.get_submodule(parent), name) for parent, name in paths]
        if all(parent._modules.get(name) is head for parent, name in holders):
            return holders
    paths, stack, seen = [], [("", model)], set()
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, child in module._modules.items():
            if child is head:
                paths.append((prefix, name))
            elif child is not None:
                stack.append((f"{prefix}.{name}" if prefix else name, child))
    if not compiling:
        _HOLDER_PATHS[model] = paths
    return [(model.get_submodule(parent), name) for parent, name in paths]


def _check_consumed(model: nn.Module, head: nn.Module, calls: list[HeadCall]) -> None:
    owner = type(model).__name__
    if not calls:
        raise ValueError(f"flce cannot fuse {owner}: its forward does not call its output embedding "
                         f"({type(head).__name__}) on the hidden states (it reads the weight itself); "
                         f"{ADVICE}")
    if any(call.losses == 0 for call in calls):
        raise ValueError(f"flce cannot fuse {owner}: its forward does not compute its loss with cross_entropy on "
                         f"the logits of its output embedding; {ADVICE}")


def without_promises(output: Any) -> Any:
    """The model's output with every logits promise replaced by None (dropped from a tuple)."""
    if isinstance(output, tuple):
        return type(output)(x for x in output if not isinstance(x, LogitsPromise)) if type(output) is tuple \
            else output
    if dataclasses.is_dataclass(output) and any(isinstance(v, LogitsPromise) for v in output.values()):
        values = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return type(output)(**{k: None if isinstance(v, LogitsPromise) else v for k, v in values.items()})
    return output


def _labels(model: nn.Module, args: tuple, kwargs: dict):
    if "labels" in kwargs:
        return kwargs["labels"]
    try:
        return _signature(type(model)).bind(model, *args, **kwargs).arguments.get("labels")
    except TypeError:
        return None  # the forward itself raises the clear error


def takes_labels(cls: type) -> bool:
    return "labels" in _signature(cls).parameters


def _signature(cls: type) -> inspect.Signature:
    """The class forward's signature (with self), through every ``__wrapped__`` layer."""
    signature = _SIGNATURES.get(cls)
    if signature is None:
        signature = _SIGNATURES[cls] = inspect.signature(inspect.unwrap(cls.forward))
    return signature


def _out_features(head: nn.Module) -> int:
    out = getattr(head, "out_features", None)
    return out if isinstance(out, int) else head.weight.shape[0]


def _output_dtype(hidden: torch.Tensor, head: nn.Module) -> torch.dtype:
    if scaled_columns(innermost(head)) is not None:  # below FSDP1 / modules_to_save wrappers, as the loss reads it
        return torch.float32  # its forward scales float32 logits
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    weight = getattr(head, "weight", None)
    return hidden.dtype if not isinstance(weight, torch.Tensor) else torch.promote_types(hidden.dtype, weight.dtype)
