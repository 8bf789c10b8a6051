"""Loss hyper-parameters shared by every front end (plain, grouped, vocab-parallel)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class LossOptions:
    """What the cross-entropy kernel needs to know about the loss, validated once.

    Per valid row, with ``z`` the logits after temperature and softcap::

        loss = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_j w_j * (lse - z_j) + z_loss * lse**2

    Numbers may be any real (or, for ignore_index, integral) Python or NumPy scalars; they are stored as
    float and int.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    reduction: str = "mean"

    def __post_init__(self) -> None:
        if not isinstance(self.reduction, str) or self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, numbers.Integral):
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__}")
        if not -(2**63) <= self.ignore_index < 2**63:  # compared with int64 targets
            raise ValueError(f"ignore_index must fit in int64 ([-2**63, 2**63)), got {self.ignore_index}")
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        self._set_real("label_smoothing")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        self._set_real("z_loss")
        if self.z_loss < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        if self.softcap is not None:
            self._set_real("softcap")
            if self.softcap <= 0.0:
                raise ValueError(f"softcap must be > 0 (or None), got {self.softcap}")
        self._set_real("temperature")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    def _set_real(self, name: str) -> None:
        object.__setattr__(self, name, real_number(name, getattr(self, name)))


def check_run_options(reduction: str, num_items_in_batch, chunk_size, accum_dtype, backend: str = "auto",
                      return_stats: bool = False, validate_target: bool = True, read_cpu: bool = True):
    """Checks of the per-call knobs shared by every front end (the loss itself: LossOptions).

    Returns num_items_in_batch as None, a float, or a 0-d tensor (on a CPU: read here, as a float, unless
    ``read_cpu`` is False: torch.compile traces the call)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be a floating torch.dtype or None, got {accum_dtype!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, flag in (("return_stats", return_stats), ("validate_target", validate_target)):
        if type(flag) is not bool:
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if num_items_in_batch is None:
        return None
    if reduction == "none":
        raise ValueError("num_items_in_batch cannot be combined with reduction='none'")
    return check_num_items(num_items_in_batch, read_cpu)


_NUM_ITEMS = ("num_items_in_batch must be None or the number of items the summed loss is divided by: an int or "
              "float >= 0 (0: nothing counts, the loss is 0), or a one-element real tensor holding one")


def check_num_items(value, read_cpu: bool = True):
    """num_items_in_batch as a float, or as a 0-d tensor where reading it would wait for a GPU (or, without
    ``read_cpu``, be a graph break).

    Accepted: int, float (NumPy scalars too), or a real tensor with one element (0-d as Trainer passes it,
    or (1,) / (1, 1) as it passes it to nn.DataParallel replicas). Finite and >= 0; on a GPU the value is
    not read (that would be a host sync): a negative or non-finite count there makes the loss NaN."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex() or value.numel() != 1:
            raise TypeError(f"{_NUM_ITEMS}; got a {value.dtype} tensor of shape {tuple(value.shape)}")
        if value.requires_grad:
            raise ValueError("num_items_in_batch requires grad, but the loss is not differentiable with respect "
                             "to it: pass num_items_in_batch.detach()")
        if value.device.type != "cpu" or not read_cpu:
            return value.reshape(())
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_NUM_ITEMS}; got {type(value).__name__} {value!r}")
    value = _as_float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{_NUM_ITEMS}; got {value}")
    return value


def real_number(name: str, value: object) -> float:
    """A finite real Python or NumPy scalar as a float (bool and tensors are refused: say what you mean)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = _as_float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf if value > 0 else -math.inf
