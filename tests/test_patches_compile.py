"""torch.compile of a patched model: a plain output embedding (an nn.Linear without hooks) is read without its call,
so the fused loss traces into flce's custom ops and the model is one graph (``fullgraph=True``); a head with hooks
is called eagerly behind one graph break, at the loss, hooks and all. Either way the compiled training step equals the
unpatched eager one (loss, every gradient)."""

import copy

import pytest
import torch
from hf_tiny import assert_same_step, loss_and_grads, patched, tiny_batch, tiny_model

FUSED_LOSS = "fused_cross_entropy"


def _explain(model, inputs):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(**inputs)
    finally:
        torch._dynamo.reset()


def _ops(graph) -> list[str]:
    return [str(n.target) for n in graph.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def test_a_plain_head_compiles_to_one_graph_with_the_loss_op():
    model = tiny_model("llama", num_hidden_layers=1)
    inputs = tiny_batch()
    with patched(model):
        explained = _explain(model, inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    ops = _ops(explained.graphs[0])  # embedding to the loss
    assert any("embedding" in op for op in ops) and "flce.linear_cross_entropy.default" in ops, ops


def test_a_head_with_a_hook_is_called_behind_one_graph_break():
    """A forward pre-hook on the head (as FSDP2's or a user's): the head is called eagerly, the hook runs once a
    step, and the step still equals the unpatched one."""
    model = tiny_model("llama", num_hidden_layers=1)
    reference = copy.deepcopy(model)
    seen = []
    for m in (model, reference):
        m.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    inputs = tiny_batch()
    with patched(model):
        explained = _explain(model, inputs)
        reasons = [r.reason for r in explained.break_reasons]
        assert explained.graph_break_count == 1 and FUSED_LOSS in reasons[0], reasons
        torch._dynamo.reset()
        seen.clear()
        got, got_grads = loss_and_grads(model, through=torch.compile(model, backend="aot_eager"), **inputs)
        assert len(seen) == 1  # the head's one call, fused
        want, want_grads = loss_and_grads(reference, **inputs)
        assert_same_step(got, want, got_grads, want_grads, 2e-6, 2e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the softcap is traced into the fused loss
def test_compiled_patched_step_equals_eager(family):
    model = tiny_model(family, head_scale=20.0, num_hidden_layers=1)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a break would raise
    try:
        with patched(model):
            for seq in (11, 11, 14):  # the cached graphs, then a recompile with dynamic shapes
                inputs = tiny_batch(seq=seq)
                want, want_grads = loss_and_grads(reference, **inputs)
                got, got_grads = loss_and_grads(model, through=compiled, **inputs)
                assert_same_step(got, want, got_grads, want_grads, 2e-6, 2e-5)
                assert type(model.lm_head) is torch.nn.Linear and "forward" not in model.lm_head.__dict__
    finally:
        torch._dynamo.reset()
