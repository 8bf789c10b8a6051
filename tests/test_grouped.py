"""flce.grouped_linear / GroupedLinear (and gemm.bmm_into) against a per-group float64 loop."""

import math

import pytest
import torch
from conftest import capture_graph
from reference import TOL, assert_close, rel_err

import flce
from flce import gemm, grouped

SHAPES = [  # (B, G, in, out): odd sizes, G = 1, B = 1, out not a multiple of 8
    (5, 3, 7, 13),
    (1, 4, 6, 9),
    (6, 1, 5, 11),
    (9, 2, 16, 24),
]


def make_case(B, G, d_in, d_out, dtype, device, *, group_major=False, bias=True):
    shape = (G, B, d_in) if group_major else (B, G, d_in)
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    w = (torch.randn(G, d_out, d_in, device=device) / d_in**0.5).to(dtype).requires_grad_()
    b = torch.randn(G, d_out, device=device).to(dtype).requires_grad_() if bias else None
    return x, w, b


def loop_reference(x, w, b, group_major):
    """y[:, g] = x[:, g] @ W[g].T + b[g], group by group in float64; returns (y, float64 leaves)."""
    leaves = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b)]
    x64, w64, b64 = leaves
    dim = 0 if group_major else 1
    outs = []
    for g in range(w64.shape[0]):
        y_g = x64.select(dim, g) @ w64[g].T
        outs.append(y_g + b64[g] if b64 is not None else y_g)
    return torch.stack(outs, dim), leaves


def check_against_loop(x, w, b, group_major, tol):
    y = flce.grouped_linear(x, w, b, group_major=group_major)
    ref, (x64, w64, b64) = loop_reference(x, w, b, group_major)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous()
    assert_close(y, ref, tol, "output")
    grad = torch.randn_like(ref)
    y.backward(grad.to(y.dtype))
    ref.backward(grad)
    for name, got, want in (("grad_input", x.grad, x64.grad), ("grad_weight", w.grad, w64.grad),
                            ("grad_bias", b.grad if b is not None else None, b64.grad if b is not None else None)):
        if want is not None:
            assert got.dtype == x.dtype, name
            assert_close(got, want, tol, name)


@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize("B,G,d_in,d_out", SHAPES)
def test_matches_per_group_loop(device, group_major, B, G, d_in, d_out):
    x, w, b = make_case(B, G, d_in, d_out, torch.float32, device, group_major=group_major)
    check_against_loop(x, w, b, group_major, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_major", [False, True])
def test_half_precision_without_bias(device, dtype, group_major):
    x, w, b = make_case(33, 3, 40, 27, dtype, device, group_major=group_major, bias=False)
    check_against_loop(x, w, b, group_major, TOL[dtype])


@pytest.mark.parametrize("group_major", [False, True])
def test_gradcheck_float64(device, group_major):
    x, w, b = make_case(3, 2, 4, 5, torch.float64, device, group_major=group_major)
    assert torch.autograd.gradcheck(lambda *a: flce.grouped_linear(*a, group_major=group_major), (x, w, b))


@pytest.mark.parametrize("group_major", [False, True])
def test_2d_input_is_the_flattened_layout(device, group_major):
    """(B*G, in) holds rows b*G + g (batch-major) or g*B + b (group-major); the output is flattened alike."""
    B, G, d_in, d_out = 5, 3, 6, 7
    x3, w, b = make_case(B, G, d_in, d_out, torch.float32, device, group_major=group_major)
    x2 = x3.detach().reshape(B * G, d_in).requires_grad_()
    y2 = flce.grouped_linear(x2, w, b, group_major=group_major)
    ref, _ = loop_reference(x3, w, b, group_major)
    assert y2.shape == (B * G, d_out)
    assert_close(y2, ref.reshape(B * G, d_out), 1e-5)
    y2.sum().backward()
    assert x2.grad.shape == x2.shape


def test_leading_dims(device):
    """Batch-major (..., G, in) and group-major (G, ..., in) with several batch dims."""
    G, d_in, d_out = 3, 5, 4
    w = torch.randn(G, d_out, d_in, device=device)
    x_bm = torch.randn(2, 4, G, d_in, device=device)
    y = flce.grouped_linear(x_bm, w)
    assert y.shape == (2, 4, G, d_out)
    assert_close(y, torch.einsum("...gi,goi->...go", x_bm.double(), w.double()), 1e-5)
    x_gm = torch.randn(G, 2, 4, d_in, device=device)
    y = flce.grouped_linear(x_gm, w, group_major=True)
    assert y.shape == (G, 2, 4, d_out)
    assert_close(y, torch.einsum("g...i,goi->g...o", x_gm.double(), w.double()), 1e-5)


@pytest.mark.parametrize("group_major", [False, True])
def test_writes_in_place_without_copies(device, monkeypatch, group_major):
    """Each GEMM reads the caller's tensors and writes the buffers that are returned (the output, the
    gradients autograd hands to .grad), through strided views: no contiguous copies on the way."""
    calls = []
    real = grouped.bmm_into
    spy = lambda out, a, b, accumulate: calls.append(  # noqa: E731
        (out.untyped_storage().data_ptr(), a.untyped_storage().data_ptr())) or real(out, a, b, accumulate=accumulate)
    for module in (grouped, gemm):  # forward's GEMM runs through gemm.linear_into
        monkeypatch.setattr(module, "bmm_into", spy)
    x, w, _ = make_case(6, 3, 8, 10, torch.float32, device, group_major=group_major, bias=False)
    y = flce.grouped_linear(x, w, group_major=group_major)
    (fwd_out, fwd_a), = calls
    assert fwd_out == y.untyped_storage().data_ptr() and fwd_a == x.untyped_storage().data_ptr()
    grad = torch.randn_like(y)
    y.backward(grad)
    (gx_out, gx_a), (gw_out, gw_a) = calls[1:]
    assert gx_out == x.grad.untyped_storage().data_ptr() and gx_a == grad.untyped_storage().data_ptr()
    assert gw_out == w.grad.untyped_storage().data_ptr() and gw_a == grad.untyped_storage().data_ptr()


def test_only_the_gradients_asked_for(device):
    x, w, b = make_case(4, 2, 6, 5, torch.float32, device)
    w.requires_grad_(False)
    flce.grouped_linear(x, w, b).sum().backward()
    assert x.grad is not None and w.grad is None and b.grad is not None
    x2 = x.detach()
    w.requires_grad_(True)
    flce.grouped_linear(x2, w).sum().backward()
    ref, (_, w64, _) = loop_reference(x2, w, None, False)
    ref.sum().backward()
    assert_close(w.grad, w64.grad, 1e-5)


def test_expanded_grad_output(device):
    """A stride-0 grad (from .sum()) still gives the right gradients."""
    x, w, b = make_case(5, 3, 4, 6, torch.float32, device)
    flce.grouped_linear(x, w, b).sum().backward()
    ref, (x64, w64, b64) = loop_reference(x, w, b, False)
    ref.sum().backward()
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert_close(got, want, 1e-5)


def test_empty_batch(device):
    x, w, b = make_case(0, 3, 4, 6, torch.float32, device)
    y = flce.grouped_linear(x, w, b)
    assert y.shape == (0, 3, 6)
    y.sum().backward()
    assert torch.all(w.grad == 0) and torch.all(b.grad == 0) and x.grad.shape == x.shape


def test_autocast_bf16_with_fp32_parameters(device):
    x, w, b = make_case(7, 3, 16, 12, torch.float32, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = flce.grouped_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    ref, (x64, w64, b64) = loop_reference(x, w, b, False)
    assert_close(y, ref, 3e-2, "output")
    grad = torch.randn_like(ref)
    y.backward(grad.to(y.dtype))
    ref.backward(grad)
    for name, got, want in (("grad_input", x.grad, x64.grad), ("grad_weight", w.grad, w64.grad),
                            ("grad_bias", b.grad, b64.grad)):
        assert got.dtype == torch.float32, name
        assert_close(got, want, 3e-2, name)


def test_module_init_and_forward(device):
    torch.manual_seed(3)
    G, d_in, d_out = 4, 64, 48
    mod = flce.GroupedLinear(G, d_in, d_out, device=device)
    assert mod.weight.shape == (G, d_out, d_in) and mod.bias.shape == (G, d_out)
    bound = 1 / math.sqrt(d_in)  # nn.Linear's bound for weight and bias alike
    for p in (mod.weight, mod.bias):
        assert p.abs().max() <= bound
        assert p.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.15)  # uniform's std, not a constant
    linear = torch.nn.Linear(d_in, d_out)
    assert linear.weight.abs().max() <= bound  # the rule we copy
    x = torch.randn(5, G, d_in, device=device)
    assert_close(mod(x), loop_reference(x, mod.weight, mod.bias, False)[0], 1e-5)
    gm = flce.GroupedLinear(G, d_in, d_out, bias=False, group_major=True, device=device, dtype=torch.float64)
    assert gm.bias is None and gm.weight.dtype == torch.float64
    x_gm = torch.randn(G, 5, d_in, device=device, dtype=torch.float64)
    assert_close(gm(x_gm), loop_reference(x_gm, gm.weight, None, True)[0], 1e-12)
    assert "num_groups=4" in repr(mod) and "group_major=True" in repr(gm)


@pytest.mark.parametrize("args", [(0, 4, 4), (2, 0, 4), (2, 4, -1), (2.0, 4, 4), (True, 4, 4)])
def test_module_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        flce.GroupedLinear(*args)


@pytest.mark.parametrize("x_shape,w_shape,b_shape,group_major,match", [
    ((4, 3, 5), (2, 6, 5), None, False, "G = 2"),          # wrong group count
    ((3, 4, 5), (2, 6, 5), None, True, "G = 2.*dim 0"),   # group-major expects G first
    ((4, 3, 5), (3, 6, 7), None, False, r"\(\.\.\., 7\)"),  # wrong in_features
    ((4, 3, 5), (3, 6, 5), (3, 5), False, "bias"),
    ((7, 5), (3, 6, 5), None, False, "multiple"),          # 2-D rows not divisible by G
    ((5,), (3, 6, 5), None, False, "at least 2 dims"),
    ((4, 3, 5), (6, 5), None, False, r"\(G, out, in\)"),
    ((4, 3, 5), (0, 6, 5), None, False, "one group"),
])
def test_bad_shapes_raise(x_shape, w_shape, b_shape, group_major, match):
    b = torch.randn(b_shape) if b_shape else None
    with pytest.raises(ValueError, match=match):
        flce.grouped_linear(torch.randn(x_shape), torch.randn(w_shape), b, group_major=group_major)


def test_bad_types_raise():
    w = torch.randn(3, 6, 5)
    with pytest.raises(TypeError, match="input"):
        flce.grouped_linear(torch.ones(4, 3, 5, dtype=torch.long), w)
    with pytest.raises(TypeError, match="share a dtype"):
        flce.grouped_linear(torch.randn(4, 3, 5, dtype=torch.float64), w)
    with pytest.raises(TypeError, match="weight"):
        flce.grouped_linear(torch.randn(4, 3, 5), [[1.0]])


@pytest.mark.parametrize("force_fallback", [False, True])
@pytest.mark.parametrize("out_dtype,op_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
])
def test_bmm_into_strided_out_matches_float64(device, monkeypatch, force_fallback, out_dtype, op_dtype):
    """Write then accumulate into a permuted (B, G, N) buffer seen as (G, B, N), possibly wider."""
    monkeypatch.setattr(gemm, "FORCE_FALLBACK", force_fallback)
    G, B, N = 3, 17, 11
    a1, b1, a2, b2 = (torch.randn(s, device=device).to(op_dtype)
                      for s in ((G, B, 20), (G, 20, N), (G, B, 9), (G, 9, N)))
    buf = torch.full((B, G, N), float("nan"), dtype=out_dtype, device=device)  # poisoned: must be overwritten
    out = buf.transpose(0, 1)
    gemm.bmm_into(out, a1, b1, accumulate=False)
    gemm.bmm_into(out, a2, b2, accumulate=True)
    want = (a1.double() @ b1.double() + a2.double() @ b2.double()).transpose(0, 1)
    tol = 1e-5 if op_dtype == out_dtype == torch.float32 else 1e-2
    assert buf.dtype == out_dtype
    assert rel_err(buf, want) < tol


def test_bmm_fallback_accumulates_in_fp32():
    cpu = torch.device("cpu")
    assert not gemm.supports_out_dtype(cpu, batched=True)
    a, b = torch.randn(2, 64, 512).bfloat16(), torch.randn(2, 512, 8).bfloat16()
    acc = torch.zeros(2, 64, 8)
    for _ in range(4):
        gemm.bmm_into(acc, a, b, accumulate=True)
    assert rel_err(acc, 4 * (a.double() @ b.double())) < 1e-5  # bf16 partial sums would be ~1e-3 off


# ---------------------------------------------------------------- GPU: real shapes, CUDA graphs

@pytest.mark.gpu
def test_gpu_out_dtype_available_for_bmm():
    assert gemm.supports_out_dtype(torch.device("cuda"), batched=True)


@pytest.mark.gpu
@pytest.mark.parametrize("group_major", [False, True])
def test_gpu_real_shape_bf16(group_major):
    """B=2560, G=12, 1024 -> 3072 in bf16 (the benchmark's shape) against the float64 loop."""
    x, w, b = make_case(2560, 12, 1024, 3072, torch.bfloat16, torch.device("cuda"), group_major=group_major)
    check_against_loop(x, w, b, group_major, TOL[torch.bfloat16])


@pytest.mark.parametrize("group_major", [False, True])
def test_three_gemms_and_no_copies(device, group_major):
    """Forward + backward from a 2-D (B*G, in) input is three bmm calls and no copy op: every operand is
    a strided view that the GEMM takes as it is. (On CUDA, a view cuBLAS could not take would show
    up here as the aten::clone that bmm makes; a CPU build may copy inside bmm without one.)"""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, w, _ = make_case(256, 4, 128, 192, dtype, device, group_major=group_major, bias=False)
    x2 = x.detach().reshape(-1, 128).requires_grad_()
    dy = torch.randn(x2.shape[0], 192, device=device, dtype=dtype)
    torch.autograd.grad(flce.grouped_linear(x2, w, group_major=group_major), (x2, w), dy)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(flce.grouped_linear(x2, w, group_major=group_major), (x2, w), dy)
    names = [e.name for e in prof.events()]
    assert names.count("aten::bmm") == 3, sorted(set(names))
    copies = [n for n in names if n in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")]
    assert not copies, copies


@pytest.mark.gpu
@pytest.mark.parametrize("group_major", [False, True])
def test_gpu_cuda_graph_capture_and_replay(group_major):
    """Forward and backward captured once, replayed on new data: same numbers as eager."""
    dev = torch.device("cuda")
    mod = flce.GroupedLinear(4, 256, 384, group_major=group_major, device=dev, dtype=torch.bfloat16)
    shape = (4, 512, 256) if group_major else (512, 4, 256)
    static_x = torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(*shape[:-1], 384, device=dev, dtype=torch.bfloat16)

    def step():
        y = mod(static_x)
        y.backward(static_dy)
        return y

    def clear_grads():
        for p in (static_x, mod.weight, mod.bias):
            p.grad = None

    graph, static_y = capture_graph(step, clear_grads)

    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
            static_dy.copy_(torch.randn_like(static_dy))
        graph.replay()  # grads were None at capture: the replay assigns them, it does not accumulate
        x = static_x.detach().clone().requires_grad_()
        w = mod.weight.detach().clone().requires_grad_()
        b = mod.bias.detach().clone().requires_grad_()
        y = flce.grouped_linear(x, w, b, group_major=group_major)
        y.backward(static_dy)
        torch.cuda.synchronize()
        assert_close(static_y, y, 1e-6, "output")
        for got, want in ((static_x.grad, x.grad), (mod.weight.grad, w.grad), (mod.bias.grad, b.grad)):
            assert_close(got, want, 1e-6)
