"""On a CUDA GPU (the Triton path): a small-but-real bf16 Llama and Mixtral, a sample of the zoo, PEFT
heads in bf16, and torch.compile (inductor) of a patched model, each against the unpatched model."""

import pytest
import torch
import transformers
from hf_tiny import assert_patched_matches, assert_same_step, loss_and_grads, patched
from hf_zoo import installed, zoo_verdict

import flce

pytestmark = pytest.mark.gpu

SIZES = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=512,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)
ZOO_SAMPLE = ["llama", "gemma2", "cohere", "granite", "falcon_h1", "bert", "gpt2", "qwen3_moe", "deepseek_v3",
              "gemma3", "inkling2_text", "git"]


def _cuda_model(config_class, **overrides):
    config = getattr(transformers, config_class)(**SIZES, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to("cuda", torch.bfloat16).train()


def _cuda_batch(batch=4, seq=256):
    input_ids = torch.randint(3, SIZES["vocab_size"], (batch, seq), device="cuda")
    labels = input_ids.clone()
    labels[torch.rand(batch, seq, device="cuda") < 0.2] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def _peak_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_bf16_llama_on_cuda_matches_unpatched_with_less_memory():
    model = _cuda_model("LlamaConfig")
    inputs = _cuda_batch()
    assert_patched_matches(model, inputs, loss_tol=1e-2, grad_tol=6e-2)  # backend "auto": Triton on CUDA

    def step():  # from no gradients to all of them, for both variants
        model(**inputs).loss.backward()

    model.zero_grad(set_to_none=True)
    unpatched = _peak_bytes(step)
    model.zero_grad(set_to_none=True)
    flce.apply_flce_patch(model)
    try:
        fused = _peak_bytes(step)
    finally:
        flce.remove_flce_patch(model)
    # the unpatched step holds bf16 and fp32 [tokens, vocab] logits and their gradients
    assert fused < unpatched, (fused, unpatched)


def test_bf16_mixtral_on_cuda_matches_unpatched():
    model = _cuda_model("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    assert_patched_matches(model, _cuda_batch(), loss_tol=1e-2, grad_tol=6e-2, use_flce_experts=False)


@pytest.mark.parametrize("model_type", installed(ZOO_SAMPLE))
def test_zoo_sample_on_cuda(model_type):
    # fp32 on both sides; flce's GEMMs and cuBLAS round differently (no TF32 on either)
    assert zoo_verdict(model_type, backend="auto", device="cuda", tol=(1e-4, 1e-3)).kind == "fused"


@pytest.mark.parametrize("dropout, dora", [(0.1, False), (0.1, True)])
def test_bf16_peft_head_on_cuda(dropout, dora):
    peft = pytest.importorskip("peft")
    model = _cuda_model("LlamaConfig")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "lm_head"], lora_dropout=dropout,
                             use_dora=dora, init_lora_weights=False)
    peft_model = peft.get_peft_model(model, config)
    inputs = _cuda_batch()
    torch.manual_seed(3)
    want, want_grads = loss_and_grads(peft_model, **inputs)
    with patched(peft_model):
        torch.manual_seed(3)
        got, got_grads = loss_and_grads(peft_model, **inputs)
    assert_same_step(got, want, got_grads, want_grads, 1e-2, 6e-2)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["inductor", "cuda-graphs"])
def test_inductor_compiled_patched_llama_on_cuda(mode):
    """One graph with the loss's custom ops (fullgraph); with CUDA graphs the replays (new gradients each step, as
    ``loss_and_grads`` zeroes them) give the unpatched eager step."""
    model = _cuda_model("LlamaConfig")
    inputs = _cuda_batch()
    want, want_grads = loss_and_grads(model, **inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    try:
        with patched(model):
            for _ in range(3):  # then the cached graphs (with CUDA graphs: warm-up, capture, replay)
                torch.compiler.cudagraph_mark_step_begin()
                got, got_grads = loss_and_grads(model, through=compiled, **inputs)
                assert_same_step(got, want, got_grads, want_grads, 1e-2, 6e-2)
    finally:
        torch._dynamo.reset()
