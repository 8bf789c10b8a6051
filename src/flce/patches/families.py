"""The model families the patch knows, and what each one's causal-LM forward does beyond Llama's.

Every listed family follows the standard transformers 5 layout: ``self.model`` backbone, one call of
``self.lm_head`` on the (``logits_to_keep``-sliced) last hidden state, ``self.loss_function`` =
``ForCausalLMLoss`` when labels are given. They differ only in what happens around that call, which is
all a :class:`Family` records. A family is listed only once its forward has been read and its loss
checked against the unpatched model (tests/test_patches_generic.py), because a family with an unknown
transform of the logits (a scale, a bias) would silently get a different loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How one family's forward departs from Llama's.

    softcap_attr: config attribute with the final-logit softcap the forward applies (None: no softcap).
    router_aux_loss: with ``output_router_logits`` the forward adds ``router_aux_loss_coef * aux_loss``.
    experts_backend: its experts accept ``set_experts_implementation("flce")`` (flce.experts).
    """

    name: str
    softcap_attr: str | None = None
    router_aux_loss: bool = False
    experts_backend: bool = False


_PLAIN = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Phi3", "Olmo2")
_SOFTCAP = ("Gemma2", "Gemma3")
_AUX_LOSS = ("Qwen2Moe", "Qwen3Moe")

FAMILIES: dict[str, Family] = {
    **{f"{p}ForCausalLM": Family(p.lower()) for p in _PLAIN},
    **{f"{p}ForCausalLM": Family(p.lower(), softcap_attr="final_logit_softcapping") for p in _SOFTCAP},
    **{f"{p}ForCausalLM": Family(p.lower(), router_aux_loss=True) for p in _AUX_LOSS},
    "MixtralForCausalLM": Family("mixtral", router_aux_loss=True, experts_backend=True),
}


def family_of(cls: type) -> Family:
    """The family of a transformers causal-LM class (or a subclass that keeps its forward).

    Raises ValueError naming the class when it is not supported.
    """
    for base in cls.__mro__:
        family = FAMILIES.get(base.__name__)
        if family is not None and base.__module__.startswith("transformers.models."):
            if _overrides_forward(cls, base):
                raise ValueError(f"flce.apply_flce_patch: {cls.__name__} overrides the forward of "
                                 f"{base.__name__}; only the transformers forward is supported")
            return family
    supported = ", ".join(sorted(FAMILIES))
    raise ValueError(f"flce.apply_flce_patch does not support {cls.__module__}.{cls.__qualname__}; "
                     f"supported classes (and subclasses that keep their forward): {supported}")


def _overrides_forward(cls: type, base: type) -> bool:
    """True if a class between ``cls`` and ``base`` defines its own forward (a patch wrapper does not count)."""
    for klass in cls.__mro__:
        if klass is base:
            return False
        forward = klass.__dict__.get("forward")
        if forward is not None and not getattr(forward, "__flce_patch__", None):
            return True
    return False
