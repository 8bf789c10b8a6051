"""MoE modules without transformers' experts decorator, computed through flce's experts (patches/moe_blocks.py).
Llama 4's dense block: against its own forward in float64 (output, router logits, every gradient; top-1 and top-2),
in a patched model (the dense experts never run, the router's hooks fire once), under torch.compile. LongCat-Flash's
experts with identity experts: against their own forward in float64, and all tokens on identity experts. A class that
computes otherwise keeps its forward."""

import copy

import pytest
import torch
from conftest import DEVICE
from reference import TOL, assert_close

transformers = pytest.importorskip("transformers")
llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")

import flce  # noqa: E402
from flce.patches import moe_blocks  # noqa: E402


def tiny_config(top_k: int, experts: int = 4, hidden: int = 32, inter: int = 24):
    return transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                         num_experts_per_tok=top_k)


def make_block(config, dtype=torch.float64, device="cpu", cls=None) -> torch.nn.Module:
    """A block with random weights (fresh draws: the class's experts start at zeros) in ``dtype``."""
    block = (cls or llama4.Llama4TextMoe)(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return block.to(device=device, dtype=dtype)


def separated_tokens(block: torch.nn.Module, tokens: int, margin: float = 0.05) -> torch.Tensor:
    """(tokens, H) float64 inputs whose k-th and (k+1)-th router logits lie ``margin`` apart, so that rounding in
    any dtype picks the experts float64 picks."""
    k, router = block.router.top_k, block.router.weight.detach().double().cpu()
    x = torch.randn(tokens * 8, router.shape[1], dtype=torch.float64)
    top = (x @ router.T).topk(k + 1, dim=1).values if k < router.shape[0] else None
    keep = x if top is None else x[top[:, k - 1] - top[:, k] > margin]
    assert keep.shape[0] >= tokens, "too few tokens with separated logits"
    return keep[:tokens]


def step(block, x, grad):
    """(output, router logits, gradients of x and every parameter) of one forward + backward."""
    x = x.detach().clone().requires_grad_()
    out, logits = block(x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], grad)
    return out, logits, grads


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sparse_block_matches_the_dense_block_in_float64(top_k, dtype):
    device = "cpu" if dtype == torch.float64 else DEVICE
    reference = make_block(tiny_config(top_k, experts=5))
    block = copy.deepcopy(reference).to(device=device, dtype=dtype)
    moe_blocks.enable(block)
    x = separated_tokens(reference, 37)
    grad = torch.randn(37, 32, dtype=torch.float64)
    want = step(reference, x, grad)  # unflagged: transformers' dense forward
    got = step(block, x.to(device, dtype), grad.to(device, dtype))
    assert got[0].dtype == dtype and got[1].dtype == dtype
    names = ["output", "router logits", "grad x"] + [f"grad {n}" for n, _ in block.named_parameters()]
    for name, g, w in zip(names, [*got[:2], *got[2]], [*want[:2], *want[2]]):
        assert g.shape == w.shape, name
        assert_close(g, w, TOL[dtype], name)
    moe_blocks.disable(block)
    assert_close(step(block, x.to(device, dtype), grad.to(device, dtype))[0], want[0], TOL[dtype], "disabled")


def test_a_block_class_that_computes_otherwise_keeps_its_forward():
    """A class of the same name whose routing weights scale the experts' outputs, not their inputs."""

    def output_scaled(self, hidden_states):
        scores, logits = self.router(hidden_states)
        routed = self.experts(hidden_states.repeat(scores.shape[1], 1))
        routed = routed.view(scores.shape[1], -1, hidden_states.shape[1]) * scores.T[:, :, None]
        return self.shared_expert(hidden_states) + routed.sum(0), logits

    other = type("Llama4TextMoe", (llama4.Llama4TextMoe,), {"forward": output_scaled})
    for cls, computed in ((other, False), (llama4.Llama4TextMoe, True)):
        holder = torch.nn.Module()
        holder.config, holder.block = tiny_config(1), make_block(tiny_config(1), cls=cls)
        assert moe_blocks.computed_modules(holder) == ([holder.block] if computed else []), cls


def test_patched_model_never_runs_the_dense_experts():
    """The experts and routers are still called as modules (their hooks fire once per block: FSDP2 / ZeRO-3 /
    offload gather weights there, transformers records router logits there), the experts on the routed tokens only."""
    hf_zoo = pytest.importorskip("hf_zoo")
    if "llama4_text" not in hf_zoo.ZOO:
        pytest.skip(f"transformers {transformers.__version__} has no llama4_text")
    torch.manual_seed(0)
    model = hf_zoo.build("llama4_text")
    reference = copy.deepcopy(model)
    inputs = hf_zoo.zoo_batch(model, "llama4_text")
    want = reference(**inputs)
    flce.apply_flce_patch(model)
    blocks = [m for m in model.modules() if isinstance(m, llama4.Llama4TextMoe)]
    calls = []
    for block in blocks:
        for module in (block.router, block.experts):
            module.register_forward_hook(lambda module, args, out: calls.append((module, type(args[0]))))
    got = model(**inputs)  # training mode: the fused loss, flce's experts
    assert got.logits is None and torch.allclose(got.loss, want.loss, rtol=2e-6)
    routed = [(b.router, torch.Tensor) for b in blocks], [(b.experts, moe_blocks.RoutedTokens) for b in blocks]
    assert blocks and calls == [c for pair in zip(*routed) for c in pair]  # each once, in order
    flce.remove_flce_patch(model)
    calls.clear()
    model(**inputs)
    assert [kind for _, kind in calls] == [torch.Tensor] * 2 * len(blocks)  # the dense experts again


def test_compiled_block_matches_eager():
    block = make_block(tiny_config(2), dtype=torch.float32)
    moe_blocks.enable(block)
    x = separated_tokens(block, 19).float()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # no graph break: the experts' custom op
    grad = torch.randn(19, 32)
    for got, want in zip(step(compiled, x, grad), step(block, x, grad)):
        for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want if isinstance(want, (list, tuple))
                        else [want]):
            assert_close(g, w, TOL[torch.float32])


# ------------------------------------------------------------------ LongCat-Flash: identity experts

longcat = pytest.importorskip("transformers.models.longcat_flash.modeling_longcat_flash") if hasattr(
    transformers, "LongcatFlashConfig") else None


def make_longcat_experts(dtype=torch.float64, routed=4, identity=2):
    if longcat is None:
        pytest.skip(f"transformers {transformers.__version__} has no LongCat-Flash")
    config = transformers.LongcatFlashConfig(hidden_size=32, expert_ffn_hidden_size=24, n_routed_experts=routed,
                                             zero_expert_num=identity, moe_topk=2)
    module = longcat.LongcatFlashExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return module.to(dtype)


def experts_step(module, x, ids, weights, grad):
    x, weights = (t.detach().clone().requires_grad_() for t in (x, weights))
    out = module(x, ids, weights)
    return out, torch.autograd.grad(out, [x, weights, module.gate_up_proj, module.down_proj], grad,
                                    allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_identity_experts_match_their_own_forward_in_float64(dtype):
    device = "cpu" if dtype == torch.float64 else DEVICE
    reference = make_longcat_experts()
    module = copy.deepcopy(reference).to(device=device, dtype=dtype)
    moe_blocks.enable(module)
    ids = torch.rand(29, 6).argsort(1)[:, :2]  # over the 4 routed and 2 identity experts
    x, weights, grad = torch.randn(29, 32, dtype=torch.float64), torch.rand(29, 2, dtype=torch.float64), \
        torch.randn(29, 32, dtype=torch.float64)
    want_out, want = experts_step(reference, x, ids, weights, grad)  # unflagged: the class's loop
    got_out, got = experts_step(module, x.to(device, dtype), ids.to(device), weights.to(device, dtype),
                                grad.to(device, dtype))
    assert got_out.dtype == dtype
    assert_close(got_out, want_out, TOL[dtype], "output")
    for name, g, w in zip(("x", "weights", "gate_up", "down"), got, want):
        assert_close(g, w, TOL[dtype], f"grad {name}")


def test_tokens_all_on_identity_experts_leave_the_routed_weights_without_gradient():
    """As the class's loop: the routed experts' weights are not used, so their gradients are None, not zeros."""
    module = make_longcat_experts()
    reference = copy.deepcopy(module)
    moe_blocks.enable(module)
    ids = torch.tensor([[4, 5], [5, 4], [4, 5]])
    x, weights, grad = torch.randn(3, 32, dtype=torch.float64), torch.rand(3, 2, dtype=torch.float64), \
        torch.randn(3, 32, dtype=torch.float64)
    (got_out, got), (want_out, want) = (experts_step(m, x, ids, weights, grad) for m in (module, reference))
    assert_close(got_out, want_out, TOL[torch.float64], "output")
    assert got[2] is None and got[3] is None and want[2] is None and want[3] is None
    assert_close(got[1], want[1], TOL[torch.float64], "grad weights")


def test_wrapped_classes_are_not_taken_for_decorated_experts():
    """A class this module wraps (functools.wraps gives it ``__wrapped__``, as transformers' decorator does) is not
    an experts module the "flce" backend dispatches."""
    from flce.patches.moe import experts_modules

    holder = torch.nn.Module()
    holder.experts = make_longcat_experts()
    moe_blocks.enable(holder.experts)
    assert hasattr(type(holder.experts).forward, "__wrapped__") and experts_modules(holder) == []


@pytest.mark.parametrize("patch_again", [False, True])
def test_a_model_saved_whole_computes_through_flce_where_it_is_loaded(patch_again):
    """torch.save keeps each module's flag, and loading it in a process whose classes are as transformers defines them
    wraps them again (``WrappedClasses``); patching the loaded model again changes nothing."""
    import io

    from hf_tiny import tiny_batch, tiny_model

    model = tiny_model("llama4")
    flce.apply_flce_patch(model)
    blob = io.BytesIO()
    torch.save(model, blob)
    classes = (llama4.Llama4TextMoe, llama4.Llama4TextExperts)
    wrapped = [cls.forward for cls in classes]
    try:
        for cls in classes:  # another process: the classes as transformers defines them
            cls.forward = cls.forward.__wrapped__
        del llama4.Llama4TextMoe._flce_sparse_experts
        blob.seek(0)
        loaded = torch.load(blob, weights_only=False)
        if patch_again:
            flce.apply_flce_patch(loaded)
        kinds = []
        for block in (m for m in loaded.modules() if isinstance(m, llama4.Llama4TextMoe)):
            block.experts.register_forward_hook(lambda module, args, out: kinds.append(type(args[0])))
        loaded(**tiny_batch())
        assert kinds and all(kind is moe_blocks.RoutedTokens for kind in kinds)
    finally:
        for cls, forward in zip(classes, wrapped):
            cls.forward = forward
        llama4.Llama4TextMoe._flce_sparse_experts = False


def test_the_class_check_runs_on_the_cpu_whatever_the_default_device():
    with torch.device("meta"):  # e.g. a model built under a device context, patched inside it
        assert moe_blocks._tiny_agrees(llama4.Llama4TextMoe, moe_blocks.FORMS["Llama4TextMoe"], tiny_config(1))
