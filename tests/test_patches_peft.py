"""PEFT heads, fused and exact against the unfused PEFT model (adapter gradients included): a LoRA head
(fp32, bf16, with dropout, with a bias, two adapters at once), a DoRA head (with and without dropout),
``modules_to_save=["lm_head"]``; an adapter flce cannot read is refused by name; LoRA on the experts' 3-D weights
through flce's experts."""

import pytest
import torch
from hf_tiny import assert_same_step, loss_and_grads, patched, tiny_batch, tiny_model
from reference import assert_close

import flce

peft = pytest.importorskip("peft")


def _peft(model, **config):
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"], "init_lora_weights": False, **config}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**config))  # random A and B: adapters change the loss
    for name, param in peft_model.named_parameters():
        if "lora_magnitude_vector" in name:  # DoRA starts at m = 1; make the per-output factor matter
            with torch.no_grad():
                param.mul_(torch.rand_like(param) + 0.5)
    return peft_model


def _head(peft_model):
    return peft_model.base_model.model.lm_head


def _seeded_step(model, inputs):
    torch.manual_seed(7)  # dropout draws the same masks in both runs: same RNG calls, in the same order
    return loss_and_grads(model, **inputs)


def _assert_fused_matches(peft_model, tol=(2e-6, 2e-5), inputs=None):
    inputs = inputs or tiny_batch()
    want, want_grads = _seeded_step(peft_model, inputs)
    with patched(peft_model):
        got, got_grads = _seeded_step(peft_model, inputs)
    assert want.logits is not None
    assert_same_step(got, want, got_grads, want_grads, *tol)
    return got_grads


@pytest.mark.parametrize("dtype, tol", [(torch.float32, (2e-6, 2e-5)), (torch.bfloat16, (1e-2, 6e-2))])
def test_lora_head(dtype, tol):
    peft_model = _peft(tiny_model("llama", dtype=dtype, head_scale=20.0))
    grads = _assert_fused_matches(peft_model, tol)
    assert any("lm_head.lora_B" in n for n in grads) and any("lm_head.lora_A" in n for n in grads)
    with peft_model.disable_adapter(), patched(peft_model):  # the base head alone
        assert peft_model(**tiny_batch()).logits is None


@pytest.mark.parametrize("dropout, dora", [(0.3, False), (0.0, True), (0.3, True)])
def test_lora_head_with_dropout_or_dora(dropout, dora):
    peft_model = _peft(tiny_model("llama", head_scale=20.0), lora_dropout=dropout, use_dora=dora)
    head = _head(peft_model)
    assert isinstance(head.lora_dropout["default"], torch.nn.Dropout) == (dropout > 0)
    assert ("default" in head.lora_variant) == dora
    grads = _assert_fused_matches(peft_model)
    if dora:
        assert any("lm_head.lora_magnitude_vector" in n for n in grads)


def test_lora_head_with_a_bias_and_two_active_adapters():
    peft_model = _peft(tiny_model("llama", head_scale=20.0), lora_bias=True)
    peft_model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False,
                                                     lora_dropout=0.2))
    peft_model.base_model.set_adapter(["default", "second"])
    assert _head(peft_model).active_adapters == ["default", "second"]
    grads = _assert_fused_matches(peft_model)
    assert any("lm_head.lora_B.second" in n for n in grads) and any("lm_head.lora_B.default.bias" in n for n in grads)


def test_modules_to_save_head_is_fused_through_its_wrapper():
    peft_model = _peft(tiny_model("llama", head_scale=20.0), target_modules=["q_proj"], modules_to_save=["lm_head"])
    wrapper = _head(peft_model)
    assert type(wrapper).__name__ == "ModulesToSaveWrapper"
    with torch.no_grad():  # the trained copy differs from the original head
        wrapper.modules_to_save["default"].weight.mul_(1.5)
    grads = _assert_fused_matches(peft_model)
    assert any("lm_head.modules_to_save.default.weight" in n for n in grads)
    assert not any("lm_head.original_module" in n for n in grads)
    inputs = tiny_batch()
    with peft_model.disable_adapter():  # the wrapper then calls the original (frozen) head
        want = peft_model(**inputs)
        with patched(peft_model):
            got = peft_model(**inputs)
    assert got.logits is None
    assert_close(got.loss, want.loss, 2e-6, "loss with the original head")


def test_an_adapter_variant_flce_cannot_read_is_refused_by_name():
    peft_model = _peft(tiny_model("llama"))

    class SomeVariant:
        pass

    _head(peft_model).lora_variant["default"] = SomeVariant()
    with pytest.raises(ValueError, match="adapter 'default' is a SomeVariant"):
        flce.apply_flce_patch(peft_model)


@pytest.mark.parametrize("family, experts", [("qwen3moe", "mlp.experts"), ("mixtral", "mlp.experts"),
                                             ("llama4", "feed_forward.experts")])  # Llama 4: dense blocks
def test_lora_on_the_experts_parameters_trains_through_flce_s_experts(family, experts, monkeypatch):
    """LoRA on the 3-D expert weights (``target_parameters``, as PEFT's MoE recipes do) wraps the experts module in a
    parametrization; the patch still switches it to flce's experts, which read the adapted weights, and the step
    (adapter gradients included) matches the unpatched model's own experts."""
    if "target_parameters" not in peft.LoraConfig.__dataclass_fields__:
        pytest.skip(f"peft {peft.__version__} cannot target parameters")
    calls = []
    fused = flce.experts.experts_forward
    monkeypatch.setattr(flce.experts, "experts_forward", lambda *a, **k: calls.append(1) or fused(*a, **k))
    peft_model = _peft(tiny_model(family), target_modules=[],
                       target_parameters=[f"{experts}.gate_up_proj", f"{experts}.down_proj"])
    grads = _assert_fused_matches(peft_model)
    assert calls, "the patched step did not run flce's experts"
    assert sum("lora_A" in n for n in grads) == sum("lora_B" in n for n in grads) >= 4  # both weights, every layer
