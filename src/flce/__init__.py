"""flce: fused linear + cross-entropy that never materializes the [tokens, vocab] logits."""

from .api import LinearCrossEntropyLoss, LossStats, linear_cross_entropy
from .experts import experts_forward
from .grouped import GroupedLinear, grouped_linear
from .grouped_loss import grouped_linear_cross_entropy
from .log_probs import TokenStats, linear_log_probs
from .options import LossOptions
from .patches import apply_flce_patch, remove_flce_patch
from .planner import ChunkPlan, plan_chunks

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
