"""flce: fused linear + cross-entropy that never materializes the [tokens, vocab] logits.

``import flce`` needs torch only; the Hugging Face patches (``flce[hf]``) load on first use.
"""

import importlib

from .api import LinearCrossEntropyLoss, LossStats, linear_cross_entropy
from .experts import experts_forward
from .grouped import GroupedLinear, grouped_linear
from .grouped_loss import grouped_linear_cross_entropy
from .log_probs import TokenStats, linear_log_probs
from .options import LossOptions
from .planner import ChunkPlan, plan_chunks

_FROM_PATCHES = ("apply_flce_patch", "remove_flce_patch")
_SUBMODULES = ("distributed", "patches")  # loaded on first use: flce.patches needs flce[hf] to patch

__all__ = [
    "ChunkPlan",
    "GroupedLinear",
    "LinearCrossEntropyLoss",
    "LossOptions",
    "LossStats",
    "TokenStats",
    "apply_flce_patch",
    "experts_forward",
    "grouped_linear",
    "grouped_linear_cross_entropy",
    "linear_cross_entropy",
    "linear_log_probs",
    "plan_chunks",
    "remove_flce_patch",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _FROM_PATCHES:
        return getattr(importlib.import_module(".patches", __name__), name)
    raise AttributeError(f"module 'flce' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
