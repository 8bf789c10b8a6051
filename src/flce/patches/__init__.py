"""Hugging Face patches: one line makes a transformers causal LM train with the fused loss.

    import flce, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    flce.apply_flce_patch(model)                      # or flce.apply_flce_patch(transformers.LlamaForCausalLM)
    trainer = transformers.Trainer(model=model, ...)  # patch before Trainer.train / accelerator.prepare

In training, a call with labels returns the unpatched model's loss and ``logits=None``; the
[tokens, vocab] logits are never materialized. Every other call (no labels, eval mode) is the unpatched
forward. ``materialize_logits=True`` turns the fusion off, ``False`` fuses in eval mode too.
``flce.remove_flce_patch`` undoes it.

Layout: ``apply`` (class/instance patching) -> ``forward`` (the generic patched forward: the model's own
forward with its ``lm_head`` call made the fused loss) -> ``head`` (the loss inside that call);
``families`` lists the supported classes and their differences (softcap, router aux loss), ``moe``
selects flce's experts backend for Mixtral, ``settings`` validates the options.
"""

from .apply import apply_flce_patch, remove_flce_patch
from .families import FAMILIES, Family, family_of
from .settings import PatchSettings

__all__ = ["FAMILIES", "Family", "PatchSettings", "apply_flce_patch", "family_of", "remove_flce_patch"]
