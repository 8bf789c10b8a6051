"""Integrations that wait for their host module: flce's own import stays at torch's cost.

``when_imported(name, callback)`` runs ``callback(module)`` now if ``name`` is already imported, else
right after its first import finishes (a ``sys.meta_path`` finder wraps that module's loader once).
flce uses it to register its transformers experts backend and to mark its entry points
``torch.compiler.disable`` without importing transformers or ``torch._dynamo`` itself.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Any, Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable[..., Any])

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now, or right after its import."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


def compile_disabled(fn: Fn | None = None, *, traced: Callable[..., Any] | None = None):
    """``torch.compiler.disable(fn)`` from the moment ``torch._dynamo`` is imported (torch.compile
    imports it); plain ``fn`` before, when nothing compiles. Under torch.compile a call is one graph
    break and runs ``fn`` eagerly, unless ``traced`` (same arguments, traced by torch.compile) returns
    something other than NotImplemented. Used bare (``@compile_disabled``) or with ``traced``."""
    if fn is None:
        return functools.partial(compile_disabled, traced=traced)
    target = fn

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if traced is not None and torch.compiler.is_compiling():
            result = traced(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return target(*args, **kwargs)

    def disable(_dynamo: ModuleType) -> None:
        nonlocal target
        target = torch.compiler.disable(fn)

    when_imported("torch._dynamo", disable)
    return entry  # type: ignore[return-value]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it and wraps the loader of a watched module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks; the module keeps its own loader afterwards."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(module.__name__, [])
            if not _pending and _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)
        for callback in callbacks:
            callback(sys.modules.get(module.__name__, module))

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


_FINDER = _Finder()
