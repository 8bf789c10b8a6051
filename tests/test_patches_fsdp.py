"""FSDP2 (one CPU process, gloo): the fused loss runs inside lm_head's call, so FSDP's hooks unshard
the [final norm, lm_head] group (as accelerate groups it) and the gradients match the unsharded model."""

import copy
import socket
import warnings

import pytest
import torch.distributed as dist
from hf_tiny import loss_and_grads, patched, tiny_batch, tiny_model
from reference import assert_close


@pytest.fixture
def process_group():
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("needs a one-process group")
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_head_matches_unsharded(process_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = tiny_model("llama", head_scale=20.0)
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    assert isinstance(model.lm_head.weight, DTensor)
    inputs = tiny_batch()
    want, want_grads = loss_and_grads(reference, **inputs)
    with patched(model), warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. FSDP's "a grouped module did not run forward"
        for _ in range(2):  # the second step starts from resharded parameters
            got, got_grads = loss_and_grads(model, **inputs)
    assert got.logits is None
    assert_close(got.loss, want.loss, 2e-6, "loss")
    for name, grad in want_grads.items():
        assert_close(got_grads[name].full_tensor(), grad, 2e-5, name)
