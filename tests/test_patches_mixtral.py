"""Mixtral, first-class: router aux loss exactly as unpatched, aux_loss and router_logits still returned,
the "flce" experts backend selected and restored, and a short AdamW run matching the unpatched one."""

import pytest
import torch
import transformers
from hf_tiny import assert_patched_matches, converges_alike, patched, tiny_batch, tiny_model
from reference import assert_close

import flce
from flce.patches import moe


@pytest.fixture
def flce_experts():
    """An "flce" experts backend: flce.experts' own when it is registered, else a counting stand-in
    that computes what the default backend computes."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if moe.BACKEND_NAME in ALL_EXPERTS_FUNCTIONS.keys():
        yield None
        return
    calls = []
    default = ALL_EXPERTS_FUNCTIONS["grouped_mm"]

    def stand_in(self, hidden_states, top_k_index, top_k_weights):
        calls.append(hidden_states.shape)
        return default(self, hidden_states, top_k_index, top_k_weights)

    ExpertsInterface.register(moe.BACKEND_NAME, stand_in)
    try:
        yield calls
    finally:
        del ExpertsInterface._global_mapping[moe.BACKEND_NAME]


@pytest.mark.parametrize("router_logits", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, (2e-6, 2e-5)), (torch.bfloat16, (1e-2, 6e-2))])
def test_loss_and_grads_with_and_without_router_logits(router_logits, dtype, tol):
    model = tiny_model("mixtral", dtype=dtype, head_scale=40.0)
    inputs = {**tiny_batch(), "output_router_logits": router_logits}
    want, got = assert_patched_matches(model, inputs, loss_tol=tol[0], grad_tol=tol[1], use_flce_experts=False)
    if router_logits:
        assert torch.equal(got.aux_loss, want.aux_loss)
        assert len(got.router_logits) == model.config.num_hidden_layers
        assert all(torch.equal(g, w) for g, w in zip(got.router_logits, want.router_logits))
    else:
        assert got.aux_loss is None and want.aux_loss is None


def test_aux_loss_is_added_with_its_coefficient():
    model = tiny_model("mixtral", router_aux_loss_coef=0.7)
    inputs = tiny_batch()
    with patched(model, use_flce_experts=False):
        plain = model(**inputs, output_router_logits=False)
        routed = model(**inputs, output_router_logits=True)
    assert plain.aux_loss is None and routed.aux_loss is not None
    assert_close(routed.loss - plain.loss, 0.7 * routed.aux_loss, 1e-5, "aux term")


def test_router_logits_from_config_and_tuple_output():
    model = tiny_model("mixtral")
    assert model.config.output_router_logits
    inputs = tiny_batch()
    want = model(**inputs, use_cache=False, return_dict=False)  # (loss, aux_loss, logits, router_logits)
    with patched(model, use_flce_experts=False):
        got = model(**inputs, use_cache=False, return_dict=False)
    assert len(got) == len(want) - 1  # logits dropped, order kept
    assert_close(got[0], want[0], 2e-6, "loss")
    assert torch.equal(got[1], want[1]) and len(got[2]) == len(want[3])


def test_experts_backend_selected_and_restored(flce_experts):
    model = tiny_model("mixtral")
    previous = model.config._experts_implementation
    inputs = tiny_batch()
    want = model(**inputs)
    with patched(model):
        assert model.config._experts_implementation == moe.BACKEND_NAME
        got = model(**inputs)
        flce.apply_flce_patch(model, use_flce_experts=False)  # opting out restores at once
        assert model.config._experts_implementation == previous
        flce.apply_flce_patch(model)
    assert model.config._experts_implementation == previous
    assert_close(got.loss, want.loss, 1e-4, "loss with the flce experts backend")
    assert flce_experts is None or flce_experts, "the stand-in backend should have run"


def test_class_patch_selects_experts_on_first_call_and_restores(flce_experts):
    model = tiny_model("mixtral")
    previous = model.config._experts_implementation
    with patched(transformers.MixtralForCausalLM):
        assert model.config._experts_implementation == previous  # a class patch cannot see instances
        model(**tiny_batch())
        assert model.config._experts_implementation == moe.BACKEND_NAME
    assert model.config._experts_implementation == previous


def test_unregistered_experts_backend_warns_and_keeps_the_implementation(monkeypatch):
    monkeypatch.setattr(moe, "BACKEND_NAME", "flce-not-registered")
    model = tiny_model("mixtral")
    previous = model.config._experts_implementation
    with pytest.warns(UserWarning, match="flce-not-registered"), patched(model):
        assert model.config._experts_implementation == previous
        assert model(**tiny_batch()).logits is None


def test_adamw_run_matches_unpatched():
    converges_alike("mixtral", {"use_flce_experts": False})
