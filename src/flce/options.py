"""Loss hyper-parameters shared by every front end (plain, grouped, vocab-parallel)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossOptions:
    """What the cross-entropy kernel needs to know about the loss, validated once.

    Per valid row, with ``z`` the logits after temperature and softcap::

        loss = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_j w_j * (lse - z_j) + z_loss * lse**2
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__}")
        _check_real("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        _check_real("z_loss", self.z_loss)
        if self.z_loss < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        if self.softcap is not None:
            _check_real("softcap", self.softcap)
            if self.softcap <= 0.0:
                raise ValueError(f"softcap must be > 0 (or None), got {self.softcap}")
        _check_real("temperature", self.temperature)
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


def check_run_options(reduction: str, num_items_in_batch, chunk_size, accum_dtype) -> None:
    """Checks of the per-call knobs shared by every front end (the loss itself: LossOptions)."""
    if reduction == "none" and num_items_in_batch is not None:
        raise ValueError("num_items_in_batch cannot be combined with reduction='none'")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be a floating torch.dtype or None, got {accum_dtype!r}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
