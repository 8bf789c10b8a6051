"""torch.compile of flce.linear_cross_entropy: the custom ops of ``flce.loss_op`` keep the loss in the graph
(``fullgraph=True``), and the compiled loss and gradients match float64 for every option, one chunk and
several, both backends; bad targets still raise; calls the ops do not serve keep one graph break."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import BACKENDS, DEVICE, HOPPER_DTYPE
from reference import TOL, assert_close, assert_loss_close, reference_loss, rel_err, row_case
from test_fuzz import options as fuzz_options

import flce
from flce import exp_logits, loss_op
from flce.kernels import triton_available

OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0, "temperature": 0.7},
    {"num_items_in_batch": 13},
    {"num_items_in_batch": "tensor"},
    {"weight": "classes", "ignore_index": 3},
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss(x, w, t, **kw):
    return flce.linear_cross_entropy(x, w, t, **kw)


def _options(opts: dict, vocab: int, dtype: torch.dtype) -> dict:
    opts = dict(opts)
    if opts.get("num_items_in_batch") == "tensor":
        opts["num_items_in_batch"] = torch.tensor(13.0, device=DEVICE)
    if opts.get("weight") == "classes":
        opts["weight"] = torch.rand(vocab, dtype=dtype, device=DEVICE) + 0.5
    return opts


def _case(n, hidden, vocab, dtype, bias, seed=0, ignore_index=-100):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, hidden, device=DEVICE, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE, generator=g) * hidden**-0.5 * 3).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=DEVICE, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), device=DEVICE, generator=g)
    t[::7] = ignore_index
    return x, w, b, t


def _grads(loss, leaves):
    total = loss.sum() if loss.dim() else loss
    return torch.autograd.grad(total, [a for a in leaves if a is not None])


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "mean")
@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_compiled_loss_matches_float64(opts, chunk_size, bias, backend):
    dtype = torch.float32 if backend == "torch" else torch.float16  # the interpreter's tl.dot and bf16 (#11584)
    x, w, b, t = _case(29, 32, 70, dtype, bias, ignore_index=opts.get("ignore_index", -100))
    opts = _options(opts, 70, dtype)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    loss = compiled(x, w, t, linear_bias=b, chunk_size=chunk_size, backend=backend, **opts)
    got = _grads(loss, (x, w, b))
    ref_opts = {("weight_cls" if k == "weight" else k): v for k, v in opts.items()}
    want, leaves = reference_loss(x, w, t, linear_bias=b, **ref_opts)
    exact = _grads(want, leaves)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert_loss_close(loss, want, tol, unit=1.0 if loss.dim() == 0 else 1.0)
    for name, a, e in zip(("input", "weight", "bias"), got, exact):
        assert a.dtype == dtype, name
        assert_close(a, e, tol, f"grad_{name}")


def test_no_graph_break_and_one_op_each_way():
    x, w, _, t = _case(12, 16, 50, torch.float32, False)
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    compiled(x, w, t).backward()
    ops = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.count("flce.linear_cross_entropy.default") == 1, ops


def test_recompiles_for_new_row_counts_and_stays_exact():
    w = torch.randn(50, 16, device=DEVICE, requires_grad=True)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    for n in (10, 11, 30):  # the cached graph, then one with a dynamic row count
        x = torch.randn(n, 16, device=DEVICE, requires_grad=True)
        t = torch.randint(0, 50, (n,), device=DEVICE)
        loss = compiled(x, w, t, chunk_size=8)
        want, _ = reference_loss(x, w, t)
        assert_loss_close(loss, want, 1e-5)


def test_only_the_gradients_asked_for():
    x, w, b, t = _case(20, 16, 40, torch.float32, True)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    (gx,) = torch.autograd.grad(compiled(x, w, t, linear_bias=b), (x,))
    want, leaves = reference_loss(x, w, t, linear_bias=b)
    exact = torch.autograd.grad(want, leaves[0])[0]
    assert_close(gx, exact, 1e-5, "grad_input")
    w.requires_grad_(False)
    b.requires_grad_(False)
    loss = compiled(x, w, t, linear_bias=b)  # only x requires grad: forward keeps less
    assert_close(torch.autograd.grad(loss, x)[0], exact, 1e-5, "input only")


def test_no_rows():
    x, w, _, _ = _case(0, 16, 40, torch.float32, False)
    t = torch.empty(0, dtype=torch.int64, device=DEVICE)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    loss = compiled(x, w, t, reduction="sum")
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert loss.item() == 0.0 and gx.shape == x.shape and not gw.any()


def test_in_place_change_after_forward_raises_and_strided_input():
    """Autograd's contract holds compiled: the weight changed in place between forward and backward raises; a
    transposed (strided) input gives float64's loss and gradient."""
    x, w, _, t = _case(10, 16, 50, torch.float32, False)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    loss = compiled(x, w, t)
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    base = torch.randn(16, 10, device=DEVICE, requires_grad=True)
    loss = compiled(base.t(), w, t)
    want, (x64, _, _) = reference_loss(base.t(), w, t)
    assert_loss_close(loss, want, 1e-5)
    assert_close(torch.autograd.grad(loss, base)[0].t(), torch.autograd.grad(want, x64)[0], 1e-5, "grad_input")


def test_autocast_keeps_the_weights_dtype():
    """Float32 weights under bf16 autocast: the GEMMs in bf16 (the weight's copy kept for backward), the
    gradients in float32, as eagerly."""
    x, w, _, t = _case(24, 32, 64, torch.float32, False)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = _grads(compiled(x, w, t), (x, w))
        want = _grads(flce.linear_cross_entropy(x, w, t), (x, w))
    for a, e in zip(got, want):
        assert a.dtype == torch.float32
        assert_close(a, e, 1e-2)  # both bf16 GEMMs
    want64, leaves = reference_loss(x, w, t)
    assert_close(got[1], torch.autograd.grad(want64, leaves[1])[0], 2e-2, "grad_weight vs float64")


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_bad_target_raises(grad):
    x, w, _, t = _case(12, 16, 50, torch.float32, False)
    t[4] = 50
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"outside \[0, 50\).*first: 50"):
        with torch.set_grad_enabled(grad):
            loss = compiled(x, w, t)
        if grad:
            loss.backward()
    loss = compiled(x, w, t, validate_target=False)  # trusted targets: no check, the bad row's loss is NaN
    assert loss.isnan()


@pytest.mark.parametrize("bad,match", [
    ({"linear_weight": (50, 8)}, "hidden size mismatch"),
    ({"reduction": "avg"}, "reduction must be one of"),
    ({"chunk_size": 0}, "chunk_size must be a positive int"),
    ({"num_items_in_batch": -1}, "num_items_in_batch"),
])
def test_bad_arguments_raise_the_eager_errors(bad, match):
    """Compiled, the argument checks raise the same clear errors, naming the argument."""
    x, w, _, t = _case(4, 16, 50, torch.float32, False)
    bad = dict(bad)
    if "linear_weight" in bad:
        w = torch.randn(*bad.pop("linear_weight"), device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        torch.compile(_loss, backend="aot_eager")(x, w, t, **bad)


def test_what_the_ops_do_not_serve_keeps_one_graph_break():
    """return_stats and low_memory run eagerly behind a graph break, with the same result."""
    x, w, _, t = _case(12, 16, 50, torch.float32, False)
    compiled = torch.compile(_loss, backend="aot_eager")
    loss, stats = compiled(x, w, t, return_stats=True)
    want, leaves = reference_loss(x, w, t)
    assert_loss_close(loss, want, 1e-5)
    assert stats.num_valid.item() == (t != -100).sum().item()
    with pytest.raises(Exception, match="(?i)graph break|disable"):
        torch._dynamo.reset()
        torch.compile(_loss, backend="aot_eager", fullgraph=True)(x, w, t, low_memory=True)


@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("gemm_dtype", [None, torch.float16], ids=["", "cast"])
def test_the_ops_pass_opcheck(chunk_size, gemm_dtype, backend):
    """Schema, fake tensors (shapes, strides, dtypes against the real outputs), autograd registration; the
    GEMMs in another dtype than the inputs' (autocast) keep the cast operands."""
    dtype = torch.float32 if backend == "torch" else torch.float16
    x, w, b, t = _case(20, 16, 40, dtype, True)
    for reduction in ("mean", "none"):
        options = (-100, 0.0, 0.0, None, 1.0, reduction, chunk_size, None, gemm_dtype or dtype, backend, True)
        args = (x, w, b, t, None, None, None, *options, [True, True, True])
        torch.library.opcheck(loss_op._forward_op, args)
        loss, *kept = loss_op._forward_op(*args)
        grad_loss = torch.rand_like(loss) + 0.5  # the backward op is not differentiable: plain tensors
        inputs = [a.detach() for a in (grad_loss, x, w, b, t, *kept)]
        torch.library.opcheck(loss_op._backward_op, (*inputs[:5], None, *inputs[5:], *options, [True, False, True]))


# ------------------------------------------------------------------- the exp-logits path inside the ops
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")


def _exp_case(**kwargs):
    return row_case(dtype=HOPPER_DTYPE, device=DEVICE, **kwargs)[:4]


def _compiled_step(x, w, b, t, **kw):
    """The compiled loss (fullgraph) and its gradients of x and w, and the float64 reference's."""
    loss = torch.compile(_loss, backend="aot_eager", fullgraph=True)(x, w, t, linear_bias=b, backend="triton", **kw)
    got = torch.autograd.grad(loss, (x, w))
    want, (x64, w64, _) = reference_loss(x, w, t, linear_bias=b)
    return loss, got, want, torch.autograd.grad(want, (x64, w64))


@needs_triton
@pytest.mark.parametrize("chunk_size", [None, 16], ids=["one-chunk", "chunks"])
def test_compiled_exp_path_matches_float64(path, chunk_size):
    """Where the exp-logits path applies, the ops take it (one chunk: exp(z) kept for backward; several: each
    chunk's gradients in forward) and match float64 as the eager call does."""
    x, w, b, t = _exp_case()
    loss, got, want, exact = _compiled_step(x, w, None, t, chunk_size=chunk_size)
    assert_close(loss, want, TOL[x.dtype], "loss")
    for name, a, e in zip(("input", "weight"), got, exact):
        assert_close(a, e, TOL[x.dtype], f"grad_{name}")
    assert (path.taken, path.chunks) == (([1], []) if chunk_size is None else ([], [16, 16, 8]))
    assert path.fell_back == []


@needs_triton
@pytest.mark.parametrize("chunk_size", [None, 16], ids=["one-chunk", "chunks"])
def test_compiled_exp_path_out_of_the_window_falls_back(path, chunk_size):
    """Rows beyond the window: backward reads the count and recomputes on the standard path (the device then
    cools down), giving the standard path's gradients, as eagerly."""
    x, w, _, t = _exp_case(scale=0.5)
    with torch.no_grad():
        x[21] *= 80.0 if x.dtype == torch.float16 else 800.0
    loss, got, want, _ = _compiled_step(x, w, None, t, chunk_size=chunk_size)
    assert_close(loss, want, TOL[x.dtype], "loss")
    assert exp_logits._cool_down[x.device] == exp_logits.COOL_DOWN
    assert path.fell_back == ([1] if chunk_size is None else [])
    standard = torch.autograd.grad(flce.linear_cross_entropy(x, w, t, backend="triton", chunk_size=chunk_size),
                                   (x, w))  # cooling down: the eager call takes the standard path
    for name, a, e in zip(("input", "weight"), got, standard):
        assert_close(a, e.double(), TOL[x.dtype] / 10, f"grad_{name}")


@needs_triton
def test_compiled_standard_path_where_the_exp_path_could_run(path, monkeypatch):
    """Forward took the standard path (here: cooling down) where the outputs leave room for the exp-logits
    path: its flag says so and backward takes the standard path's GEMMs."""
    x, w, _, t = _exp_case()
    monkeypatch.setitem(exp_logits._cool_down, x.device, 5)
    loss, got, want, exact = _compiled_step(x, w, None, t)
    assert path.taken == [] and exp_logits._cool_down[x.device] == 4
    for name, a, e in zip(("input", "weight"), got, exact):
        assert_close(a, e, TOL[x.dtype], f"grad_{name}")


@pytest.mark.gpu
def test_gpu_inductor_and_cuda_graphs_match_float64():
    """bf16 at a small batch (a single chunk: the thin grad_weight kernel) and a larger one (several chunks),
    compiled by inductor with CUDA graphs (``mode="reduce-overhead"``), replayed on new targets: the loss and
    gradients as close to float64 as the eager call's (the standard path, which a captured call takes)."""
    for n, chunk_size in ((16, None), (2048, 512)):
        x, w, _, t = _case(n, 512, 8192, torch.bfloat16, False)
        compiled = torch.compile(_loss, mode="reduce-overhead", fullgraph=True)
        for seed in range(3):
            t = torch.randint(0, 8192, (n,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(x, w, t, chunk_size=chunk_size)
            loss, got = loss.clone(), [g.clone() for g in _grads(loss, (x, w))]
            eager = _grads(flce.linear_cross_entropy(x, w, t, chunk_size=chunk_size), (x, w))
            want, leaves = reference_loss(x, w, t)
            exact = _grads(want, leaves)
            assert_loss_close(loss, want, 1e-3)
            for name, a, b, e in zip(("input", "weight"), got, eager, exact):
                bound = max(1.05 * rel_err(b, e), rel_err(e.to(torch.bfloat16), e))
                assert_close(a, e, bound, f"grad_{name} (eager {rel_err(b, e):.3g}), seed {seed}, {n} rows")


@pytest.mark.gpu
def test_gpu_bad_target_in_a_cuda_graph_stops_the_process():
    """Inside a captured graph nothing is read on the host: a bad target trips a device-side assert, as eager
    F.cross_entropy's does on CUDA (run in a child process: the assert ends its CUDA context)."""
    script = textwrap.dedent("""
        import torch, flce
        f = torch.compile(lambda x, w, t: flce.linear_cross_entropy(x, w, t), mode="reduce-overhead", fullgraph=True)
        x = torch.randn(16, 256, device="cuda", requires_grad=True)
        w = torch.nn.Parameter(torch.randn(1000, 256, device="cuda"))
        t = torch.randint(0, 1000, (16,), device="cuda")
        for _ in range(3):  # warm-up runs, then the capture
            torch.compiler.cudagraph_mark_step_begin()
            x.grad = w.grad = None  # the graphs' outputs are overwritten at the next replay
            f(x, w, t).backward()
        torch.cuda.synchronize()
        print("captured", flush=True)
        t[3] = 1000
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = w.grad = None
        f(x, w, t).backward()
        torch.cuda.synchronize()
        print("no error")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert "captured" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert "no error" not in done.stdout and done.returncode != 0, done.stdout[-2000:] + done.stderr[-3000:]


@settings(deadline=None, max_examples=12)  # opcheck runs each op several ways: about a second a case here
@given(n=st.integers(0, 24), hidden=st.integers(1, 16), vocab=st.integers(1, 60),
       chunk=st.sampled_from([None, 1, 5, 8]), bias=st.booleans(), class_weight=st.booleans(), opts=fuzz_options,
       num_items=st.sampled_from([None, None, 13.0, "tensor"]), accum=st.sampled_from([None, torch.float32]),
       cast=st.booleans(), needs=st.lists(st.booleans(), min_size=3, max_size=3),
       backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16))
def test_the_ops_pass_opcheck_on_random_cases(n, hidden, vocab, chunk, bias, class_weight, opts, num_items, accum, cast,
                                              needs, backend, seed):
    """``test_the_ops_pass_opcheck`` over random shapes, options, chunkings, casts and gradient masks: the fake
    implementations lay out what the real ops return in every case."""
    dtype = torch.float32 if backend == "torch" else torch.float16
    x, w, b, t = _case(n, hidden, vocab, dtype, bias, seed)
    cw = torch.rand(vocab, device=DEVICE) + 0.5 if class_weight else None
    items = None if opts["reduction"] == "none" else num_items
    tensor_items = torch.tensor(13.0, device=DEVICE) if items == "tensor" else None
    options = (-100, opts["label_smoothing"], opts["z_loss"], opts["softcap"], opts["temperature"], opts["reduction"],
               chunk, accum, torch.float16 if cast else dtype, backend, True)
    needs = [need and leaf is not None for need, leaf in zip(needs, (x, w, b))]
    args = (x, w, b, t, cw, tensor_items, None if tensor_items is not None else items, *options, needs)
    torch.library.opcheck(loss_op._forward_op, args)
    if not any(needs):
        return
    loss, *kept = loss_op._forward_op(*args)
    inputs = [a.detach() if a is not None else None for a in (torch.rand_like(loss) + 0.5, x, w, b, t, cw, *kept)]
    torch.library.opcheck(loss_op._backward_op, (*inputs, *options, needs))
