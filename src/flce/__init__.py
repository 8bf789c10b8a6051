"""flce: fused linear + cross-entropy that never materializes the [tokens, vocab] logits."""

from .api import LinearCrossEntropyLoss, LossStats, linear_cross_entropy
from .options import LossOptions
from .planner import ChunkPlan, plan_chunks

__all__ = [
    "ChunkPlan",
    "LinearCrossEntropyLoss",
    "LossOptions",
    "LossStats",
    "linear_cross_entropy",
    "plan_chunks",
]
__version__ = "0.1.0"
