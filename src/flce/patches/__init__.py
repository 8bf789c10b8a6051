"""Hugging Face patches: one line makes a transformers language model train with the fused loss.

    import flce, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    flce.apply_flce_patch(model)                      # or flce.apply_flce_patch(transformers.LlamaForCausalLM)
    trainer = transformers.Trainer(model=model, ...)  # patch before Trainer.train / accelerator.prepare

In training, a call with labels returns the unpatched model's loss and ``logits=None``; the
[tokens, vocab] logits are never materialized. Every other call (no labels, eval mode) is the unpatched
forward. ``materialize_logits=True`` turns the fusion off, ``False`` fuses in eval mode too.
``flce.remove_flce_patch`` undoes it.

One path for every model: ``apply`` (class/instance patching) -> ``forward`` (the model's own forward,
with labels, its output embedding made a recorder that returns a logits ``promise``) -> ``promise``
(records what the model does to the logits; its cross_entropy is the fused loss) -> ``head`` (that loss,
inside a call of the real output embedding; nn.Linear, column-scaled Linear and PEFT LoRA/DoRA heads).
``transform`` folds the logit transforms (scale, softcap, bias, vocabulary slice) into flce's options; ``moe``
selects flce's experts backend on MoE models whose experts it computes; ``settings`` validates the options.
"""

from .apply import apply_flce_patch, remove_flce_patch
from .settings import PatchSettings

__all__ = ["PatchSettings", "apply_flce_patch", "remove_flce_patch"]
