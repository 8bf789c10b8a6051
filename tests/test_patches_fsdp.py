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


def test_fsdp2_sharded_llama4_experts_compute_sparsely(process_group):
    """Llama 4's blocks through flce's experts (patches/moe_blocks.py) with each experts module its own FSDP2 unit:
    the experts are called as a module, so FSDP unshards their weights before flce reads them."""
    from torch.distributed.fsdp import fully_shard

    hf_zoo = pytest.importorskip("hf_zoo")
    if "llama4_text" not in hf_zoo.ZOO:
        pytest.skip("this transformers has no llama4_text")
    from flce.patches import moe_blocks

    reference = hf_zoo.build("llama4_text")
    model = copy.deepcopy(reference)
    inputs = hf_zoo.zoo_batch(model, "llama4_text")
    blocks = [m for m in model.modules() if type(m).__name__ in moe_blocks.FORMS]
    for block in blocks:
        fully_shard(block.experts)
    fully_shard(model)
    want, want_grads = hf_zoo.train_step(reference, inputs)
    with patched(model):
        assert blocks and all(moe_blocks.enabled(b) for b in blocks)
        for _ in range(2):
            got, got_grads = hf_zoo.train_step(model, inputs)
    assert_close(got.loss, want.loss, 2e-6, "loss")
    for name, grad in want_grads.items():
        assert_close(got_grads[name].full_tensor(), grad, 2e-5, name)
