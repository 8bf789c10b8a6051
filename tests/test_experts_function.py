"""The experts layer's autograd under torch.compile: the custom ops ``flce::experts`` / ``flce::experts_backward``
traced without a graph break, against float64 for every activation form, torch.library's opcheck, partial
gradients, no_grad, bad input and a refused double backward; eagerly, backward's release of the saved activations."""

import shutil

import pytest
import torch
from reference import TOL, assert_close
from test_experts import (FORMS, KERNEL_DEVICE, TRITON, check, form_case, loop_reference, make_case, routing,
                          tiny_mixtral_config)

import flce
from flce import experts_function as ef
from flce.kernels import experts_torch

transformers = pytest.importorskip("transformers")

HAS_GROUPED_MM = experts_torch.has_grouped_mm()


@pytest.fixture
def compiled():
    """experts_forward compiled whole (fullgraph: a graph break fails the call), fresh compile caches."""
    torch._dynamo.reset()
    yield torch.compile(flce.experts_forward, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()


def _op_args(form="biases", dtype=torch.float64, device="cpu", saves=(True, True, True)):
    """flce::experts' arguments for a form. Every pair routed: the rows of dropped pairs in xs, h and y are left
    unwritten, which opcheck's comparisons of two runs would read."""
    (x, ids, weights, gate_up, down), kwargs = form_case(form, 11, 16, 12, 4, 2, dtype, device, "random")
    act = flce.experts._activation(kwargs.get("activation", "swiglu"), kwargs.get("swiglu_limit"),
                                   kwargs.get("swiglu_alpha", 1.0), kwargs.get("swiglu_up_offset", 0.0),
                                   kwargs.get("interleaved", False), kwargs.get("swiglu_gate_softcap"),
                                   kwargs.get("swiglu_up_softcap"))
    return (x, ids, weights, gate_up, down, kwargs.get("gate_up_proj_bias"), kwargs.get("down_proj_bias"), dtype,
            None, "auto", *ef._act_args(act), list(saves))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_compiled_forms_match_float64_reference(form, compiled):
    """Every activation form and the biases through the compiled graph (the custom ops, no break): output and every
    gradient against the float64 loop, GPT-OSS's weights stored transposed."""
    tensors, kwargs = form_case(form, 23, 16, 12, 4, 2, torch.float64, "cpu", "dropped")
    check(*tensors, TOL[torch.float64], stored_transposed=form == "gpt_oss", layer=compiled, **kwargs)


@pytest.mark.skipif(not TRITON, reason="triton cannot run here")
@pytest.mark.parametrize("form", ["gpt_oss", "relu2_biases", "softcaps"])
def test_compiled_triton_paths_match_float64_reference(form, compiled):
    tensors, kwargs = form_case(form, 19, 32, 16, 4, 2, torch.float32, KERNEL_DEVICE)
    check(*tensors, TOL[torch.float32], stored_transposed=form == "gpt_oss", layer=compiled, gemm="triton",
          elementwise="triton", **kwargs)


@pytest.mark.parametrize("form", ["gpt_oss", "biases", "relu2_biases", "softcaps"])
def test_opcheck(form):
    """torch.library's checks of both ops: schema, fake tensors against the real ones, the autograd registration and
    AOT dispatch (static and dynamic shapes)."""
    args = _op_args(form)
    torch.library.opcheck(torch.ops.flce.experts.default, args)
    out, xs, h, y, *routes = torch.ops.flce.experts.default(*args)
    x, _, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, ew, *act_and_saves = args
    tensors = [t.detach() for t in (torch.randn_like(out), xs, h, y, gate_up, down, weights)]
    biases = [b if b is None else b.detach() for b in (gate_up_bias, down_bias)]  # no formula for a second derivative
    backward_args = (*tensors, *biases, *routes, dtype, gemm, ew, *act_and_saves[:-1], [True] * 6, [False, True])
    torch.library.opcheck(torch.ops.flce.experts_backward.default, backward_args)


@pytest.mark.parametrize("needs", ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias", "none"])
def test_compiled_partial_gradients_match_eager(needs, compiled):
    """Only one input needing a gradient (what backward computes, and what forward keeps for it, follows it), or
    none: the compiled layer's output and that gradient equal experts_forward's eager ones."""
    (x, ids, weights, gate_up, down), kwargs = form_case("biases", 13, 16, 12, 4, 2, torch.float64, "cpu")
    inputs = {"x": x, "weights": weights, "gate_up": gate_up, "down": down, "gate_up_bias":
              kwargs["gate_up_proj_bias"], "down_bias": kwargs["down_proj_bias"]}
    for name, t in inputs.items():
        t.requires_grad_(name == needs)
    results = []
    for layer in (flce.experts_forward, compiled):
        out = layer(x, ids, weights, gate_up, down, **kwargs)
        grads = torch.autograd.grad(out.square().sum(), inputs[needs]) if needs != "none" else ()
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    assert got.requires_grad == (needs != "none")
    assert_close(got, want, 1e-12, "output")
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, 1e-12, f"grad {needs}")


def test_compiled_autocast_matches_eager_autocast(compiled):
    """float32 experts under bfloat16 autocast, compiled: bfloat16 GEMMs inside the op (the dtype decided while
    tracing), float32 output and gradients, equal to the eager layer under the same autocast."""
    x, ids, weights, gate_up, down = make_case(17, 16, 8, 3, 2, torch.float32, "cpu")
    results = []
    for layer in (flce.experts_forward, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, ids, weights, gate_up, down)
        results.append((out, torch.autograd.grad(out.square().sum(), (x, weights, gate_up, down))))
    (want, want_grads), (got, got_grads) = results
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_grads)
    assert_close(got, want, 1e-6, "output")
    for name, g, w in zip(("x", "weights", "gate_up", "down"), got_grads, want_grads):
        assert_close(g, w, 1e-5, f"grad {name}")


def test_no_grad_keeps_nothing_for_backward():
    """Under no_grad the op returns empty placeholders for xs, h and y, and the layer's output needs no gradient."""
    args = _op_args("biases", saves=[False, False, False])
    out, xs, h, y, *_ = torch.ops.flce.experts.default(*args)
    assert xs.numel() == h.numel() == y.numel() == 0
    x, ids, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, ew, *_ = args
    with torch.no_grad():
        layered = ef.experts_op(x, ids, weights, gate_up, down, gate_up_bias, down_bias, dtype, gemm, ew,
                                experts_torch.SWIGLU)
    assert not layered.requires_grad and torch.equal(layered, out)


def test_double_backward_is_refused():
    """Eager (once_differentiable) and through the op (no formula for its backward op): a second derivative raises
    instead of being silently wrong."""
    x, ids, weights, gate_up, down = make_case(7, 16, 12, 4, 2, torch.float64, "cpu")
    for out in (flce.experts_forward(x, ids, weights, gate_up, down),
                ef.experts_op(x, ids, weights, gate_up, down, None, None, torch.float64, None, "auto",
                              experts_torch.SWIGLU)):
        grad, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError):
            grad.sum().backward()


def _saving(fn):
    """fn()'s result and every tensor autograd saved while it ran (saved-tensor hooks that keep a reference)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


def test_backward_frees_its_saved_activations():
    """Eagerly, a backward that does not keep the graph frees the layer's saved activations (xs, h and y: the rows of
    the T * k pairs) before it returns, so they do not add to its peak memory, and a second backward raises autograd's
    own error; the weights and routing weights saved beside them are untouched."""
    x, ids, weights, gate_up, down = make_case(9, 16, 12, 4, 2, torch.float64, "cpu")
    out, saved = _saving(lambda: flce.experts_forward(x, ids, weights, gate_up, down, gemm="loop",
                                                      elementwise="torch"))
    pairs = [t for t in saved if t.dim() == 2 and t.shape[0] == ids.numel() and t.is_floating_point()]
    assert len(pairs) == 3 and all(t.untyped_storage().nbytes() > 0 for t in pairs)
    grad = torch.randn_like(out)
    torch.autograd.grad(out, (x, weights, gate_up, down), grad, retain_graph=False)
    assert all(t.untyped_storage().nbytes() == 0 for t in pairs)
    kept = [t for t in saved if not any(t is p for p in pairs)]
    assert any(t is weights for t in kept) and all(t.untyped_storage().nbytes() > 0 for t in kept)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, (x, weights, gate_up, down), grad)


def test_retained_graph_gives_the_same_gradients_twice():
    """With retain_graph nothing is freed: both backwards give the float64 reference's gradients."""
    x, ids, weights, gate_up, down = make_case(9, 16, 12, 4, 2, torch.float64, "cpu")
    out = flce.experts_forward(x, ids, weights, gate_up, down, gemm="loop", elementwise="torch")
    ref, ref_leaves = loop_reference(x, ids, weights, gate_up, down)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, ref_leaves, grad)
    for retain in (True, False):
        got = torch.autograd.grad(out, (x, weights, gate_up, down), grad, retain_graph=retain)
        for name, g, w in zip(("x", "weights", "gate_up", "down"), got, want):
            assert_close(g, w, TOL[torch.float64], f"grad {name}, retain_graph={retain}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layer_matches_the_reference(reentrant):
    """Under activation checkpointing (saved-tensor hooks that recompute the layer, or a second forward inside
    backward) the activations backward frees are the recomputed ones: every gradient as the float64 reference's."""
    x, ids, weights, gate_up, down = make_case(9, 16, 12, 4, 2, torch.float64, "cpu")
    ref, ref_leaves = loop_reference(x, ids, weights, gate_up, down)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, ref_leaves, grad)
    out = torch.utils.checkpoint.checkpoint(
        lambda x_, w_: flce.experts_forward(x_, ids, w_, gate_up, down, gemm="loop", elementwise="torch"), x, weights,
        use_reentrant=reentrant)
    out.backward(grad)
    for name, leaf, w in zip(("x", "weights", "gate_up", "down"), (x, weights, gate_up, down), want):
        assert_close(leaf.grad, w, TOL[torch.float64], f"grad {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_backward_peak_leaves_out_the_freed_activations():
    """On the GPU the freed activations come off backward's peak: against a backward that keeps the graph, at least
    the bytes of h and y less (their memory is reused by the weight gradients that follow)."""
    tokens, hidden, inter, experts, top_k = 2048, 1024, 2048, 8, 2
    x, ids, weights, gate_up, down = make_case(tokens, hidden, inter, experts, top_k, torch.bfloat16, "cuda")
    freed = tokens * top_k * (2 * inter + hidden) * 2  # h (S, 2I) and y (S, H) in bf16
    peaks = {}
    for retain in (True, False):
        out = flce.experts_forward(x, ids, weights, gate_up, down)
        grad = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        torch.autograd.grad(out, (x, weights, gate_up, down), grad, retain_graph=retain)
        torch.cuda.synchronize()
        peaks[retain] = torch.cuda.max_memory_allocated() - start
        del out, grad
    assert peaks[True] - peaks[False] >= 0.9 * freed, peaks


@pytest.mark.parametrize("bad", [{"gemm": "cublas"}, {"elementwise": "cuda"}, {"swiglu_limit": -1.0}])
def test_bad_input_raises_under_compile(bad):
    """The argument checks run while dynamo traces: the same ValueError as eagerly."""
    x, ids, weights, gate_up, down = make_case(5, 8, 4, 3, 2, torch.float64, "cpu")
    torch._dynamo.reset()
    try:
        with pytest.raises(ValueError, match=next(iter(bad))):
            torch.compile(flce.experts_forward, backend="aot_eager")(x, ids, weights, gate_up, down, **bad)
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_fuses_around_the_layer():
    """Inductor (the default backend) compiles a router, the layer and an activation after it as one graph; the
    step equals the same function run eagerly."""
    torch.manual_seed(0)
    x, _, weights, gate_up, down = make_case(9, 16, 12, 4, 2, torch.float32, "cpu")
    ids = routing("random", 9, 2, 4)
    router = torch.randn(16, 4)

    def block(x, weights, gate_up, down):
        scale = torch.softmax(x @ router, -1).amax(-1, keepdim=True)
        return flce.experts_forward(x * 2, ids, weights * scale, gate_up, down).relu()

    torch._dynamo.reset()
    try:
        steps = []
        for fn in (block, torch.compile(block, fullgraph=True)):
            out = fn(x, weights, gate_up, down)
            steps.append((out, torch.autograd.grad(out.square().sum(), (x, weights, gate_up, down))))
    finally:
        torch._dynamo.reset()
    (want, want_grads), (got, got_grads) = steps
    assert_close(got, want, 1e-5, "output")
    for name, g, w in zip(("x", "weights", "gate_up", "down"), got_grads, want_grads):
        assert_close(g, w, 1e-5, f"grad {name}")


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch has no grouped_mm")
def test_compiled_mixtral_breaks_its_graph_no_more_than_grouped_mm():
    """A tiny Mixtral compiled on flce's experts has no more graphs than on transformers' grouped_mm (whatever
    transformers itself breaks on): flce's layer adds none (behind a graph break it made one per layer call)."""
    counts = {}
    ids = torch.randint(0, 64, (2, 11))
    for backend in ("grouped_mm", "flce"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_mixtral_config(), attn_implementation="eager")
        model.set_experts_implementation(backend)
        torch._dynamo.reset()
        counts[backend] = torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_count
    torch._dynamo.reset()
    assert counts["flce"] <= counts["grouped_mm"], counts
