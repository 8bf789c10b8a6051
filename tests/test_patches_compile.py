"""torch.compile of a patched model: the fused loss (flce.linear_cross_entropy, compiler-disabled) is the
only graph break, and the compiled training step equals the unpatched eager one (loss, every gradient)."""

import copy

import pytest
import torch
from hf_tiny import loss_and_grads, patched, tiny_batch, tiny_model
from reference import assert_close

FUSED_LOSS = "linear_cross_entropy"


def _explain(model, inputs):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(**inputs)
    finally:
        torch._dynamo.reset()


def test_the_fused_loss_is_the_only_graph_break():
    model = tiny_model("llama", num_hidden_layers=1)
    inputs = tiny_batch()
    assert _explain(model, inputs).graph_break_count == 0  # unpatched: one graph
    with patched(model):
        explained = _explain(model, inputs)
        reasons = [r.reason for r in explained.break_reasons]
        assert explained.graph_break_count >= 1 and all(FUSED_LOSS in r for r in reasons), reasons
        # By default Dynamo splits each frame between the model's forward and the loss (the model's loss
        # function's frames) at that one call; resuming inside nested frames leaves a single break.
        if not hasattr(torch._dynamo.config, "nested_graph_breaks"):
            pytest.skip("this torch has no nested_graph_breaks")
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            nested = _explain(model, inputs)
    assert nested.graph_break_count == 1 and FUSED_LOSS in nested.break_reasons[0].reason
    assert nested.graph_count == 2


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the softcap is traced into the fused loss
def test_compiled_patched_step_equals_eager(family):
    model = tiny_model(family, head_scale=20.0, num_hidden_layers=1)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    try:
        with patched(model):
            for seq in (11, 11, 14):  # the cached graphs, then a recompile with dynamic shapes
                inputs = tiny_batch(seq=seq)
                want, want_grads = loss_and_grads(reference, **inputs)
                model.zero_grad(set_to_none=True)
                got = compiled(**inputs)
                got.loss.backward()
                assert got.logits is None
                assert_close(got.loss, want.loss, 2e-6, "loss")
                for name, param in model.named_parameters():
                    assert_close(param.grad, want_grads[name], 2e-5, name)
                assert type(model.lm_head) is torch.nn.Linear and "forward" not in model.lm_head.__dict__
    finally:
        torch._dynamo.reset()
