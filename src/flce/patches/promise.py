"""The logits a patched model's output embedding returns in training: a promise, never computed.

A :class:`LogitsPromise` stands in for a tensor of the logits' shape, dtype and device, without data. It
records what the model does to it on the way to its loss: which hidden rows each logit row comes from (views, slices,
indexing over the leading dimensions) and the elementwise transform (:mod:`.transform`). When
``F.cross_entropy`` receives it (directly, through ``nn.CrossEntropyLoss`` or transformers'
``ForCausalLMLoss``), the promise is kept: the real output embedding is called on those rows with its
forward made the fused loss (:func:`.head.head_loss`), and cross_entropy returns that loss. Any other use of
the logits raises a ValueError that names it, so a loss is never silently different.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..import_hooks import compile_disabled
from .transform import ADVICE, LogitTransform, Unfusable


class HeadCall:
    """One call of the output embedding in a fused forward: its input and what became of its logits.

    head: the output-embedding module (the model's own, called again to compute the loss).
    hidden: (..., H) what the head received. owner: the model's class name, for messages.
    options: the user's loss options. losses: how many losses were computed from these logits.
    """

    def __init__(self, head: nn.Module, hidden: torch.Tensor, owner: str, options: dict) -> None:
        self.head, self.hidden, self.owner, self.options = head, hidden, owner, options
        self.losses = 0

    def refusal(self, what: str) -> ValueError:
        return ValueError(f"flce cannot fuse {self.owner}: it applies {what} to its logits before the loss; "
                          f"{ADVICE}")


class LogitsPromise:
    """Logits of shape (*lead, width) that are ``transform`` of the head's output at hidden rows ``rows``.

    rows: int64 (*lead) indices into the head input's flattened rows, or None for all of them in order.
    A plain object with the tensor methods models use on logits (and ``__torch_function__`` for torch's
    functions), so that torch.compile traces it, and the fused loss too where the head is read without its call
    (``head.reads_directly``); else the loss is the only graph break.
    """

    def __init__(self, call: HeadCall, lead: tuple[int, ...], width: int, dtype: torch.dtype,
                 device: torch.device, rows: torch.Tensor | None, transform: LogitTransform) -> None:
        self._call, self._lead, self._width, self._rows, self._transform = call, lead, width, rows, transform
        self.dtype, self.device = dtype, device

    @classmethod
    def of_head_call(cls, call: HeadCall, width: int, dtype: torch.dtype) -> LogitsPromise:
        hidden = call.hidden
        return cls(call, tuple(hidden.shape[:-1]), width, dtype, hidden.device, None, LogitTransform())

    def __repr__(self) -> str:
        return f"LogitsPromise(shape={tuple(self.shape)}, dtype={self.dtype}, transform={self._transform})"

    # -- metadata ---------------------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self._lead, self._width))

    @property
    def ndim(self) -> int:
        return len(self._lead) + 1

    @property
    def requires_grad(self) -> bool:
        return self._call.hidden.requires_grad

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def is_floating_point(self) -> bool:
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        promise = next(a for a in _flat(args, kwargs) if isinstance(a, LogitsPromise))
        handler = _HANDLERS.get(func)
        if handler is None:
            raise promise._call.refusal(_op_name(func))
        if handler is fused_cross_entropy:  # no try block around the graph break: torch.compile resumes after it
            return handler(*args, **kwargs)
        return _refusing(handler, promise)(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)
        raise self._call.refusal(f".{name}")

    # -- building derived promises --------------------------------------------------------------------

    def _derive(self, lead=None, rows: Any = "same", transform: LogitTransform | None = None,
                dtype: torch.dtype | None = None, device: torch.device | None = None,
                width: int | None = None) -> LogitsPromise:
        return LogitsPromise(self._call, self._lead if lead is None else tuple(lead),
                             self._width if width is None else width, dtype or self.dtype, device or self.device,
                             self._rows if isinstance(rows, str) else rows, transform or self._transform)

    def _row_index(self) -> torch.Tensor:
        if self._rows is not None:
            return self._rows
        return torch.arange(math.prod(self._lead), device=self._call.hidden.device).view(self._lead)

    def _with_rows(self, rows: torch.Tensor) -> LogitsPromise:
        return self._derive(lead=rows.shape, rows=rows)


def _refusing(handler, promise: LogitsPromise):
    def call(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except Unfusable as e:
            raise promise._call.refusal(str(e)) from None
    return call


# -- handlers: one per supported operation; each returns a derived promise or a loss ----------------------

def _as_scale(value, op: str) -> float:
    if isinstance(value, LogitsPromise):
        raise Unfusable(f"{op} of the logits by themselves")
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise Unfusable(f"{op} by a tensor that requires grad (a learned scale)")
        if value.numel() != 1:
            raise Unfusable(f"{op} by a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unfusable(f"{op} by {type(value).__name__}")
    return float(value)


def _mul(a, b, *, out=None):
    promise, other = (a, b) if isinstance(a, LogitsPromise) else (b, a)
    if out is not None:
        raise Unfusable("a multiplication with out=")
    return promise._derive(transform=promise._transform.scaled(_as_scale(other, "a multiplication"),
                                                                "a multiplication"))


def _div(a, b, *, rounding_mode=None, out=None):
    if not isinstance(a, LogitsPromise) or rounding_mode is not None or out is not None:
        raise Unfusable("a division of a number by the logits" if isinstance(b, LogitsPromise)
                        else f"a division with rounding_mode={rounding_mode!r}")
    scale = _as_scale(b, "a division")
    if scale == 0:
        raise Unfusable("a division by 0")
    return a._derive(transform=a._transform.scaled(1.0 / scale, "a division"))


def _add(a, b, *, alpha=1, out=None, sign=1):
    promise, other = (a, b) if isinstance(a, LogitsPromise) else (b, a)
    if out is not None or isinstance(other, LogitsPromise):
        raise Unfusable("an addition of the logits to themselves" if out is None else "an addition with out=")
    width = promise.shape[-1]
    if not isinstance(other, torch.Tensor):
        other = torch.full((width,), float(other), device=promise.device)
    if other.dim() and other.shape[-1] != width or any(n != 1 for n in other.shape[:-1]):
        raise Unfusable(f"an addition of a tensor of shape {tuple(other.shape)} (only a per-vocabulary bias of "
                        f"shape ({width},) folds into the linear bias)")
    bias = other.reshape(-1).expand(width) * (sign * alpha)
    return promise._derive(transform=promise._transform.plus(bias, "an addition"))


def _sub(a, b, *, alpha=1, out=None):
    if not isinstance(a, LogitsPromise):
        raise Unfusable("a subtraction of the logits from a number (a negative scale)")
    return _add(a, b, alpha=alpha, out=out, sign=-1)


def _tanh(a, *, out=None):
    if out is not None:
        raise Unfusable("a tanh with out=")
    return a._derive(transform=a._transform.tanh())


def _same(a, *args, **kwargs):  # contiguous(), clone(): nothing to record
    return a


def _to(a, *args, **kwargs):
    """.to(dtype) / .to(device[, dtype]) / .to(tensor) / keywords; non_blocking, copy and memory_format
    change nothing here."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (torch.device, str, int)):
            device = arg
        elif isinstance(arg, (torch.Tensor, LogitsPromise)):
            dtype, device = arg.dtype, arg.device
    if dtype is not None and not dtype.is_floating_point:
        raise Unfusable(f"a cast to {dtype}")
    return a._derive(dtype=dtype, device=None if device is None else torch.device(device))


def _cast(dtype: torch.dtype):
    return lambda a, *args, **kwargs: a._derive(dtype=dtype)


def _type_as(a, other):
    return _to(a, other.dtype)


def _view(a, *shape):
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    if any(isinstance(s, torch.dtype) for s in shape):
        raise Unfusable("a view as another dtype")
    if any(not isinstance(s, (int, torch.SymInt)) for s in shape):
        raise Unfusable(f"a reshape to {shape!r}")
    shape = _resolve(shape, a.numel())
    if not shape or shape[-1] != a.shape[-1]:
        raise Unfusable(f"a reshape to {tuple(shape)} that mixes the vocabulary dimension")
    if a._rows is None:
        return a._derive(lead=shape[:-1])
    return a._with_rows(a._rows.reshape(shape[:-1]))


def _resolve(shape: tuple, numel: int) -> tuple[int, ...]:
    if -1 in shape:
        known = math.prod([s for s in shape if s != -1])
        shape = tuple(numel // known if s == -1 and known else s for s in shape)
    return shape


def _flatten(a, start_dim=0, end_dim=-1):
    last = a.dim() - 1
    start, end = start_dim % a.dim(), end_dim % a.dim()
    if end == last and start != last:
        raise Unfusable("a flatten over the vocabulary dimension")
    lead = list(a.shape[:start]) + [math.prod(a.shape[start:end + 1])] + list(a.shape[end + 1:])
    return _view(a, lead)


def _getitem(a, index):
    index = index if isinstance(index, tuple) else (index,)
    index = _expand_ellipsis(index, a.dim())
    consumed = sum(_dims_consumed(i) for i in index)
    if consumed == a.dim():  # the last index is the vocabulary's
        *index, last = index
        if not isinstance(last, slice) or last.step not in (None, 1):
            raise Unfusable(f"an index {last!r} on the vocabulary dimension")
        start, stop, _ = last.indices(a.shape[-1])
        if stop <= start:
            raise Unfusable("an empty slice of the vocabulary")
        if (start, stop) != (0, a.shape[-1]):
            a = a._derive(transform=a._transform.sliced(start, stop, a.shape[-1]), width=stop - start)
        index = tuple(index)
    elif consumed > a.dim():
        raise IndexError(f"too many indices for logits of shape {tuple(a.shape)}")
    if all(isinstance(i, slice) and i == slice(None) for i in index):
        return a
    return a._with_rows(a._row_index()[index])


def _expand_ellipsis(index: tuple, ndim: int) -> tuple:
    if not any(i is Ellipsis for i in index):
        return index
    at = next(k for k, i in enumerate(index) if i is Ellipsis)
    rest = index[:at] + index[at + 1:]
    fill = ndim - sum(_dims_consumed(i) for i in rest)
    return index[:at] + (slice(None),) * fill + index[at + 1:]


def _dims_consumed(i) -> int:
    if i is None:
        return 0
    if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
        return i.dim()
    return 1


def _lead_only(op: str):
    """squeeze / unsqueeze / transpose / permute over the leading dimensions only."""
    def handler(a, *args, **kwargs):
        if _moves_vocab(op, a.dim(), args, kwargs):
            raise Unfusable(f"{op} over the vocabulary dimension")
        return a._with_rows(getattr(a._row_index(), op)(*args, **kwargs))
    return handler


def _moves_vocab(op: str, ndim: int, args: tuple, kwargs: dict) -> bool:
    dims = [d for d in args if isinstance(d, int)] + [d for d in kwargs.values() if isinstance(d, int)]
    if op == "permute":
        dims = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else list(args)
        return dims[-1] % ndim != ndim - 1
    if op == "unsqueeze":
        return any(d % (ndim + 1) == ndim or d == -1 for d in dims)
    if op == "squeeze" and not dims:
        return False
    return any(d % ndim == ndim - 1 for d in dims)


def _traced_cross_entropy(input, target, *args, **kwargs):
    """``fused_cross_entropy`` as torch.compile traces it, for a head read without its call (``reads_directly``):
    the loss's custom ops, no graph break; NotImplemented (the graph break and the head's call) otherwise."""
    from .head import reads_directly

    if not isinstance(input, LogitsPromise) or not reads_directly(input._call.head):
        return NotImplemented
    return _fused_loss(input, target, *args, through_head=False, **kwargs)


# Under torch.compile a head that hooks or wrappers must see is called eagerly: the graph's one break.
@compile_disabled(traced=_traced_cross_entropy)
def fused_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    """F.cross_entropy of a promise: the fused loss, computed by one call of the head (hooks and all)."""
    return _fused_loss(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)


def _fused_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                label_smoothing=0.0, through_head: bool = True):
    """``fused_cross_entropy``'s work; ``through_head``: by a call of the head (else read off it, ``head_loss``)."""
    from .head import head_loss

    if not isinstance(input, LogitsPromise):
        raise target._call.refusal("a cross_entropy whose target is the logits")
    call = input._call
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if target.is_floating_point():
        raise call.refusal("a cross_entropy with class probabilities as targets")
    if input.dim() not in (1, 2) or tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"cross_entropy: logits of shape {tuple(input.shape)} do not match targets of shape "
                         f"{tuple(target.shape)}")
    options = _call_options(call, weight, label_smoothing)
    try:
        transform = input._transform.with_options(options.pop("temperature", None), options.pop("softcap", None))
    except Unfusable as e:
        raise ValueError(f"flce: apply_flce_patch's {e} ({call.owner}); leave the option out") from None
    hidden = call.hidden  # all rows in order: the head sees what it would have seen unpatched
    if input._rows is not None:
        rows = input._rows.reshape(-1).to(hidden.device)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    try:
        loss = head_loss(call.head, hidden, target.reshape(hidden.shape[:-1]).to(hidden.device), transform,
                         dict(options, ignore_index=ignore_index, reduction=reduction), through_head=through_head)
    except Unfusable as e:  # what the head's call found (its weight as gathered by its hooks)
        raise ValueError(f"flce cannot fuse {call.owner}: {e}; {ADVICE}") from None
    call.losses += 1
    return loss.reshape(target.shape).to(input.device) if reduction == "none" else loss.to(input.device)


def _call_options(call: HeadCall, weight, label_smoothing) -> dict:
    """The user's loss options with the model's class weights and label smoothing (not both given)."""
    options = dict(call.options)
    for name, value, given in (("weight", weight, weight is not None),
                               ("label_smoothing", label_smoothing, label_smoothing != 0.0)):
        if given:
            if options.get(name) is not None:
                raise ValueError(f"flce: {call.owner} passes {name} to its cross_entropy; do not also give it to "
                                 "apply_flce_patch")
            options[name] = value
    return options


def _refuse_as(what: str):
    def handler(*args, **kwargs):
        raise Unfusable(what)
    return handler


_T = torch.Tensor
# Methods of LogitsPromise: name -> handler (the promise is the first argument).
_METHODS = {
    "__mul__": _mul, "__rmul__": _mul, "mul": _mul, "multiply": _mul,
    "__truediv__": _div, "div": _div, "divide": _div, "true_divide": _div,
    "__add__": _add, "__radd__": _add, "add": _add, "__sub__": _sub, "sub": _sub, "subtract": _sub,
    "tanh": _tanh, "contiguous": _same, "clone": _same,
    "to": _to, "float": _cast(torch.float32), "double": _cast(torch.float64), "half": _cast(torch.float16),
    "bfloat16": _cast(torch.bfloat16), "type_as": _type_as,
    "view": _view, "reshape": _view, "flatten": _flatten, "__getitem__": _getitem,
    **{op: _lead_only(op) for op in ("squeeze", "unsqueeze", "transpose", "permute")},
    "__neg__": _refuse_as("a negation"), "neg": _refuse_as("a negation"),
    "__rsub__": _refuse_as("a subtraction of the logits from a number (a negative scale)"),
    "__rtruediv__": _refuse_as("a division of a number by the logits"),
    "detach": _refuse_as("detach (no gradient would reach the model)"),
}


def _method(name: str, handler):
    def method(self, *args, **kwargs):
        return _refusing(handler, self)(self, *args, **kwargs)
    method.__name__ = name
    return method


for _name, _handler in _METHODS.items():
    setattr(LogitsPromise, _name, _method(_name, _handler))

# torch functions (and Tensor methods called with a promise argument, e.g. ``tensor * promise``).
_HANDLERS = {
    **{getattr(_T, name): handler for name, handler in _METHODS.items() if hasattr(_T, name)},
    torch.mul: _mul, torch.multiply: _mul, torch.div: _div, torch.divide: _div, torch.true_divide: _div,
    torch.add: _add, torch.sub: _sub, torch.subtract: _sub, torch.tanh: _tanh, F.tanh: _tanh,
    torch.clone: _same, torch.reshape: _view, torch.flatten: _flatten, torch.neg: _METHODS["neg"],
    F.cross_entropy: fused_cross_entropy,
}


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module.startswith("torch.nn") else name


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a
