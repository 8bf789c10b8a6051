"""What one ``apply_flce_patch`` call asked for, validated before anything is patched."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels import BACKENDS
from ..options import LossOptions

# Passed through to flce.linear_cross_entropy.
LOSS_OPTIONS = frozenset({"label_smoothing", "z_loss", "softcap", "temperature", "weight", "accum_dtype",
                          "chunk_size", "backend", "validate_target", "low_memory"})
# Decided by the model's own loss code (its cross_entropy call, Trainer's num_items_in_batch).
FIXED_BY_CALL = frozenset({"reduction", "ignore_index", "num_items_in_batch", "linear_bias", "return_stats"})


@dataclass(frozen=True)
class PatchSettings:
    """loss_options: keyword options for flce.linear_cross_entropy (on top of what the model passes to its
    cross_entropy and the transform it applies to its logits).

    materialize_logits: None (default) fuses in training and computes logits in eval mode (what
    ``Trainer.evaluate`` and metrics need); False fuses whenever labels are given (eval too, logits then
    None); True never fuses (the unpatched forward, logits always there).
    use_flce_experts: models whose experts the "flce" experts backend computes select it (flce.experts), and
    the MoE modules without the experts decorator that flce knows run on its experts (``moe_blocks``)."""

    loss_options: dict = field(default_factory=dict)
    materialize_logits: bool | None = None
    use_flce_experts: bool = True

    def fuses(self, training: bool) -> bool:
        """Whether a call with labels computes the fused loss (and no logits)."""
        return training if self.materialize_logits is None else not self.materialize_logits


def make_settings(options: dict) -> PatchSettings:
    """Split and check ``apply_flce_patch``'s keyword options; raise before anything is patched."""
    options = dict(options)
    materialize_logits = options.pop("materialize_logits", None)
    use_flce_experts = options.pop("use_flce_experts", True)
    if materialize_logits not in (None, True, False):
        raise TypeError(f"materialize_logits must be None, True or False, got {materialize_logits!r}")
    if not isinstance(use_flce_experts, bool):
        raise TypeError(f"use_flce_experts must be a bool, got {use_flce_experts!r}")
    fixed = sorted(FIXED_BY_CALL & options.keys())
    if fixed:
        raise ValueError(f"apply_flce_patch: {', '.join(fixed)} cannot be set: the model's own loss code "
                         "decides them (e.g. transformers' ForCausalLMLoss: ignore_index=-100, mean, or sum / "
                         "num_items_in_batch)")
    unknown = sorted(options.keys() - LOSS_OPTIONS)
    if unknown:
        raise TypeError(f"apply_flce_patch got unexpected option(s) {', '.join(unknown)}; loss options are "
                        f"{', '.join(sorted(LOSS_OPTIONS))}, patch options materialize_logits, use_flce_experts")
    LossOptions(label_smoothing=options.get("label_smoothing", 0.0), z_loss=options.get("z_loss", 0.0),
                softcap=options.get("softcap"), temperature=options.get("temperature", 1.0))
    if options.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {options['backend']!r}")
    return PatchSettings(options, materialize_logits, use_flce_experts)
