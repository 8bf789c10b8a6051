"""Llama, first-class: gradient checkpointing, tied embeddings, and a short AdamW run whose per-step
losses match the unpatched model's (PEFT heads: test_patches_peft.py)."""

import pytest
import transformers
from hf_tiny import assert_patched_matches, converges_alike, loss_and_grads, patched, tiny_batch, tiny_model
from reference import assert_close

import flce


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = tiny_model("llama", tie_word_embeddings=True)
    # transformers 5.23 renamed it (5.17 has only the old name)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    assert model.model.gradient_checkpointing
    if reentrant:
        model.enable_input_require_grads()
    assert_patched_matches(model, tiny_batch(), loss_tol=2e-6, grad_tol=2e-5)


def test_class_patch_with_tied_embeddings_keeps_one_parameter():
    model = tiny_model("llama", tie_word_embeddings=True)
    tied = model.lm_head.weight
    inputs = tiny_batch()
    want, want_grads = loss_and_grads(model, **inputs)
    with patched(transformers.LlamaForCausalLM):
        got, got_grads = loss_and_grads(model, **inputs)
    assert got.logits is None
    assert model.lm_head.weight is tied and model.model.embed_tokens.weight is tied
    assert_close(got.loss, want.loss, 2e-6, "loss")
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, 2e-5, name)


def test_adamw_run_matches_unpatched():
    converges_alike("llama")


def test_loss_options_change_the_loss_on_a_patched_class():
    inputs = tiny_batch()
    model = tiny_model("llama", head_scale=20.0)
    with patched(transformers.LlamaForCausalLM, z_loss=1e-2):
        with_z = model(**inputs).loss
    with patched(transformers.LlamaForCausalLM):
        plain = model(**inputs).loss
    assert with_z.item() > plain.item()
    assert "forward" not in transformers.LlamaForCausalLM.__dict__ or not hasattr(
        transformers.LlamaForCausalLM.forward, "__flce_patch__")
    assert flce.remove_flce_patch(transformers.LlamaForCausalLM) is transformers.LlamaForCausalLM
