"""Tiny random transformers causal LMs built offline, and the patched-vs-unpatched comparison the
tests/test_patches_*.py files share."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from reference import assert_close

import flce


VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, attention_dropout=0.0)
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.05, output_router_logits=True)
# family -> (config class, overrides): hand-sized models for the focused tests (the whole zoo: hf_zoo.py)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", {"final_logit_softcapping": 2.0}),
    "gemma3": ("Gemma3TextConfig", {"final_logit_softcapping": 2.0}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, **_MOE}),
    "qwen2moe": ("Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 16,
                                    "shared_expert_intermediate_size": 16, **_MOE}),
    "qwen3moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 16, **_MOE}),
    # dense MoE blocks (every expert on every token), top-2 here where the released models route top-1
    "llama4": ("Llama4TextConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16,
                                    "intermediate_size_mlp": 48}),
    # a head that scales its float32 logits per column by a learned vector; one attention and one mlp per part
    "dory": ("DoryConfig", {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2,
                            "n_output_layers": 2, "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp",
                                                                  "sliding_attention", "mlp"]}),
}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    name, extra = CONFIGS[family]
    if not hasattr(transformers, name):  # a family newer than the installed release (dory: 5.24)
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(transformers, name)(**{**_COMMON, **extra, **overrides})


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, head_scale: float = 1.0,
               **overrides) -> torch.nn.Module:
    """A random model in train mode; ``head_scale`` multiplies the head weight (larger logits)."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides),
                                                          attn_implementation="eager")
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.to(dtype).train()


def tiny_batch(batch: int = 3, seq: int = 11, ignore: float = 0.25, pad: bool = True) -> dict:
    """input_ids, attention_mask (right padding on row 0) and labels (-100 at a share of positions)."""
    input_ids = torch.randint(3, VOCAB, (batch, seq))
    labels = input_ids.clone()
    labels[torch.rand(batch, seq) < ignore] = -100
    attention_mask = torch.ones_like(input_ids)
    if pad:
        attention_mask[0, -3:] = 0
        labels[0, -3:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model: torch.nn.Module, through=None, **inputs):
    """(output, {name: grad}) of one forward/backward from zeroed gradients; ``through``: a wrapper of
    ``model`` to call instead (torch.compile's)."""
    model.zero_grad(set_to_none=True)
    output = (model if through is None else through)(**inputs)
    output.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return output, grads


def assert_same_step(got, want, got_grads: dict, want_grads: dict, loss_tol: float, grad_tol: float,
                     expect_fused: bool = True) -> None:
    """A patched step (logits None when fused) against the unpatched one: loss and every gradient."""
    assert (got.logits is None) == expect_fused
    assert_close(got.loss, want.loss, loss_tol, "loss")
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == grad.dtype, name
        assert_close(got_grads[name], grad, grad_tol, name)


@contextlib.contextmanager
def patched(model_or_class, **options):
    flce.apply_flce_patch(model_or_class, **options)
    try:
        yield model_or_class
    finally:
        flce.remove_flce_patch(model_or_class)


def assert_patched_matches(model: torch.nn.Module, inputs: dict, loss_tol: float, grad_tol: float,
                           expect_fused: bool = True, **options):
    """The model's loss and every parameter's gradient, unpatched then patched (instance), agree."""
    want, want_grads = loss_and_grads(model, **inputs)
    with patched(model, **options):
        got, got_grads = loss_and_grads(model, **inputs)
    assert_same_step(got, want, got_grads, want_grads, loss_tol, grad_tol, expect_fused)
    return want, got


def _train(model, batches, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def converges_alike(family: str, options: dict | None = None, steps: int = 32, **overrides) -> None:
    """Per-step AdamW losses of a patched and an unpatched copy trained on the same batches agree."""
    reference = tiny_model(family, **overrides)
    model = copy.deepcopy(reference)
    batches = [tiny_batch(batch=4, seq=12) for _ in range(4)]
    want = _train(reference, batches, steps)
    with patched(model, **(options or {})):
        got = _train(model, batches, steps)
    assert want[-1] < 0.8 * want[0], "the run should learn something"
    assert_close(torch.tensor(got), torch.tensor(want), 1e-4, "per-step losses")
