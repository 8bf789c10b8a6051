"""torch.compile of a patched model: the fused loss (the cross_entropy of the logits promise, compiler-
disabled: the head call and flce's loss run eagerly) is the only graph break, the backbone stays one
graph, and the compiled training step equals the unpatched eager one (loss, every gradient)."""

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


def test_the_fused_loss_is_the_only_graph_break():
    model = tiny_model("llama", num_hidden_layers=1)
    inputs = tiny_batch()
    assert _explain(model, inputs).graph_break_count == 0  # unpatched: one graph
    with patched(model):
        explained = _explain(model, inputs)
    reasons = [r.reason for r in explained.break_reasons]
    assert explained.graph_break_count == 1 and FUSED_LOSS in reasons[0], reasons
    backbone = _ops(explained.graphs[0])  # embedding to final norm, up to the loss
    assert any("embedding" in op for op in backbone) and len(backbone) > 50, backbone


def test_no_graph_break_before_the_fused_loss():
    """Not even one that leaves no graph behind (``explain`` does not count those): the patched forward's own
    checks trace (no ContextVar read unless an old TRL trainer was guarded)."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", num_hidden_layers=1)
    with patched(model):
        torch._dynamo.reset()
        counters.clear()
        try:
            torch.compile(model, backend="eager")(**tiny_batch())
            reasons = list(counters["graph_break"])
        finally:
            torch._dynamo.reset()
    assert reasons and all(FUSED_LOSS in reason for reason in reasons), reasons


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
                got, got_grads = loss_and_grads(model, through=compiled, **inputs)
                assert_same_step(got, want, got_grads, want_grads, 2e-6, 2e-5)
                assert type(model.lm_head) is torch.nn.Linear and "forward" not in model.lm_head.__dict__
    finally:
        torch._dynamo.reset()
