"""Softcap on every Triton path against the torch path, to float32 rounding, for softcap in [1e-3, 1e30].

z = softcap * tanh(r / softcap): for a large softcap tanh's argument is tiny, where tanh computed as
1 - 2 / (exp(2x) + 1) cancels (softcap 1e6 once gave a loss off by 2e-3 and 1e30 collapsed every logit
to 0). For a small one tanh saturates, where its derivative 1 - tanh^2 cancels (softcap 1e-3 gave
gradients 7e-6 apart on an H100): both backends take sech^2 of the same u = r * (1 / softcap).
Checked: the kernels' tanh and sech^2 themselves, the CE kernel (two passes), the logits GEMM's epilogue
with the one-read CE kernel (Hopper; fp16 under the interpreter; against float64, as it stores the logits
less a shift where the torch path rounds them as such), the vocab-parallel stage kernels and
the token-statistics kernels. On a CPU these run under TRITON_INTERPRET=1, once more with CUDA's
approximate exp, log and division modelled; the same functions run on a GPU, and the ``gpu`` cases add
real shapes there.
"""

import numpy as np
import pytest
import torch
from reference import errors_in_roundings, peaked_case, reference_loss, rel_err

import flce
from flce import function
from conftest import DEVICE
from flce.kernels import triton_available
from flce.kernels.ce_vocab_parallel import STATS, shard_grad, shard_stats
from flce.kernels.softcap_torch import inverse, sech2_
from flce.options import LossOptions

pytestmark = [pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here"),
              # the interpreter's numpy: exp overflows to inf where the kernels expect it, and tanh's
              # polynomial branch (not taken there) gives inf - inf for an infinite argument
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SOFTCAPS = [1e-3, 0.1, 1.0, 30.0, 1e6, 1e8, 1e30]
FP32_TOL = 2e-6  # a few float32 roundings, relative


triton = pytest.importorskip("triton")
tl = triton.language
softcap_triton = pytest.importorskip("flce.kernels.softcap_triton")


@triton.jit
def _apply_tanh_sech2(x_ptr, tanh_ptr, sech2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    t, s = softcap_triton.tanh_sech2(x)
    tl.store(tanh_ptr + offs, t, mask=offs < n)
    tl.store(sech2_ptr + offs, s, mask=offs < n)


def tanh_sech2_through_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' tanh and sech^2 (softcap_triton, shared by every Triton path) applied to float32 x."""
    x = x.to(DEVICE)
    out = torch.empty_like(x), torch.empty_like(x)
    _apply_tanh_sech2[(triton.cdiv(x.numel(), 1024),)](x, *out, x.numel(), BLOCK=1024)
    return out[0].cpu(), out[1].cpu()


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in float32 ulps of the float64 value want (below the smallest normal float32, in units
    of the smallest subnormal 2^-149: the float32 grid there)."""
    f32 = torch.finfo(torch.float32)
    return (got.double() - want).abs() / (f32.eps * want.abs().clamp(min=f32.tiny))


def test_kernel_tanh_is_accurate_everywhere():
    """Within 8 float32 ulps of float64 tanh from 1e-30 to 1e4 (both signs), exact at 0 and +-inf. (Under
    the interpreter within 1.1 ulp; on CUDA the exponential and the division are approximations of a
    couple of ulps. The cancelling formula was off by up to 100% for small |x|.)"""
    mags = torch.logspace(-30, 4, 4001, dtype=torch.float64)
    x = torch.cat([mags, -mags, torch.tensor([0.0, 0.625, -0.625, 0.6249, 0.6251])]).float()
    got, _ = tanh_sech2_through_kernel(x)
    assert ulps(got, torch.tanh(x.double())).max() <= 8
    special, _ = tanh_sech2_through_kernel(torch.tensor([float("inf"), -float("inf"), float("nan")]))
    assert special[0] == 1 and special[1] == -1 and special[2].isnan()


def sech2_cases() -> torch.Tensor:
    """|x| in [0, 100], both signs, fine enough to cross every binade of sech^2 down through the subnormal
    floats (|x| ~ 44 to 52) to 0 (beyond ~52), plus tiny |x| where sech^2 rounds to 1."""
    x = torch.cat([torch.linspace(0, 100, 20001, dtype=torch.float64),
                   torch.logspace(-30, 0, 301, dtype=torch.float64)])
    return torch.cat([x, -x]).float()


def test_kernel_sech2_is_accurate_everywhere():
    """sech^2 = 4q / (1 + q)^2 with q = exp(-2|x|): within 8 + |x| float32 ulps of float64 over |x| in
    [0, 100] (CUDA's exp rounds its argument's product with log2 e to float32: |x| * 2^-23 relative; the
    interpreter's exp is exact, 2.6 ulps), where sech^2 is a normal float32; below that (|x| > ~43.7) it may
    flush to 0 (CUDA's exp does), harmless next to the O(1) terms of a gradient. 1 - tanh^2 was off by up
    to 100% once tanh rounds near 1 (|x| > ~4)."""
    x = sech2_cases()
    _, got = tanh_sech2_through_kernel(x)
    want = 1.0 / torch.cosh(x.double()).square()
    flushed = (want < torch.finfo(torch.float32).tiny) & (got == 0)
    assert ((ulps(got, want) <= 8 + x.abs().double()) | flushed).all()
    assert (got[x.abs() > 52] == 0).all() and (got[x.abs() < 43] > 0).all()
    _, special = tanh_sech2_through_kernel(torch.tensor([float("inf"), -float("inf"), float("nan")]))
    assert special[0] == 0 and special[1] == 0 and special[2].isnan()


def test_torch_sech2_is_accurate_everywhere():
    """The torch twin's sech^2 ((1 / cosh x)^2, in place) to the same bound, on this device."""
    x = sech2_cases()
    got = sech2_(x.to(DEVICE, copy=True)).cpu()
    assert ulps(got, 1.0 / torch.cosh(x.double()).square()).max() <= 8


@triton.jit
def _inverse(out_ptr, softcap):
    tl.store(out_ptr, softcap_triton.inverse(softcap, tl.float32))


@pytest.mark.parametrize("softcap", SOFTCAPS + [1e-30, 3e-39])
def test_softcap_inverse_matches_the_kernels(softcap):
    """Both backends take tanh and sech^2 of the same u = r * (1 / c): the torch twin's 1 / c equals the
    kernels' IEEE float32 division (and stays finite for a subnormal softcap)."""
    out = torch.empty(1, device=DEVICE)
    _inverse[(1,)](out, softcap)
    c32 = torch.tensor(softcap, dtype=torch.float32)
    want = torch.reciprocal(c32.double()).float().clamp(max=torch.finfo(torch.float32).max)
    assert out.item() == inverse(softcap, torch.float32) == want.item()


def softcap_case(device, dtype, n, hidden, vocab, softcap, chunk_size=None, **opts):
    """Loss and input/weight gradients of the triton backend against the torch backend (float32 math
    both) for one softcap; returns the relative errors (loss, worst gradient)."""
    torch.manual_seed(0)
    x = torch.randn(n, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5 * 3).to(dtype)
    t = torch.randint(0, vocab, (n,), device=device)
    out = {}
    for backend in ("torch", "triton"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = flce.linear_cross_entropy(xb, wb, t, softcap=softcap, backend=backend, chunk_size=chunk_size, **opts)
        loss.backward()
        out[backend] = (loss.detach(), xb.grad, wb.grad)
    errs = [rel_err(a, b) for a, b in zip(out["triton"], out["torch"])]
    return errs[0], max(errs[1:])


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("chunk_size", [None, 4])  # one chunk (backward GEMMs deferred), several
def test_ce_kernel_softcap_matches_torch(softcap, chunk_size):
    errs = softcap_case(DEVICE, torch.float32, 9, 16, 300, softcap, chunk_size, label_smoothing=0.1, z_loss=1e-3,
                        temperature=0.7)
    assert max(errs) <= FP32_TOL


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_fused_gemm_epilogue_softcap_against_float64(hopper_gemm_calls, monkeypatch, softcap):
    """fp16 logits (the interpreter's descriptors read fp16 correctly), of a trained model's spread. The torch
    path rounds the logits to fp16, the fused GEMM stores them less their tile's shift (``tile_shift``): its
    gradients stay near the fp16 rounding at every softcap, where the torch path's are 4.6-6.6x off it once
    the softcap leaves the largest logits unsaturated. (Deep in saturation, c = 0.1-1 here, both paths read
    1.1-1.7x, by seed either ahead: a few logits near 0 carry the gradient.) On CUDA the torch path would keep
    these 40 rows' logits in float32 (``function.wide_logits``): kept in 16 bits here, as on the CPU."""
    monkeypatch.setattr(function, "WIDE_LOGITS_ROWS", 0)
    x, w, _, t = peaked_case(40, 32, 256, torch.float16, DEVICE, softcap=softcap)
    want, (x64, w64, _) = reference_loss(x, w, t, softcap=softcap)
    exact = torch.autograd.grad(want, [x64, w64])
    errs = {}
    for backend in ("torch", "triton"):
        loss = flce.linear_cross_entropy(x, w, t, softcap=softcap, backend=backend)
        errs[backend] = [rel_err(loss, want), *errors_in_roundings(torch.autograd.grad(loss, [x, w]), exact,
                                                                   torch.float16)]
    assert len(hopper_gemm_calls) == 1
    assert errs["triton"][0] <= 2**-11  # the loss comes back in fp16
    assert max(errs["triton"][1:]) <= 2.5  # x the fp16 rounding of the exact gradients (1.3-1.7 here)
    if softcap >= 30:  # the largest logits (~18) unsaturated: the torch path's rounded logits show (4.6-6.6x)
        assert all(f <= t / 2 for f, t in zip(errs["triton"][1:], errs["torch"][1:]))


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_fused_gemm_tile_stats_softcap(hopper_gemm_calls, softcap):
    """The epilogue's per-tile max of r and sum exp(z - max z) of the softcapped stored values, against float64
    on its own output."""
    import flce.kernels.logits_triton as lt
    from test_logits_triton import stored_tile_sum, tile_stats_of

    n, hidden, vocab = 40, 32, 256
    x = torch.randn(n, hidden, device=DEVICE).half()
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5 * 3).half()
    out = torch.empty(n, vocab, dtype=torch.float16, device=DEVICE)
    stats = torch.empty(2, n, lt.num_tiles(vocab), device=DEVICE)
    lt.logits_with_tile_stats(x, w, None, out, stats[0], stats[1], LossOptions(softcap=softcap))
    want_max, _ = tile_stats_of(x.double() @ w.double().t(), LossOptions(), lt.TILE.block_n)
    want_sum = stored_tile_sum(out, stats[0], lt.TILE.block_n, softcap)
    assert rel_err(stats[0], want_max) <= FP32_TOL and rel_err(stats[1], want_sum) <= FP32_TOL


def vocab_parallel_case(softcap) -> tuple[float, float]:
    """Relative differences (stats, gradient) of the two vocab-parallel stages, triton against torch."""
    torch.manual_seed(0)
    n, v_local = 6, 300
    opts = LossOptions(label_smoothing=0.1, softcap=softcap, temperature=1.3)
    logits = torch.randn(n, v_local, device=DEVICE) * 3
    target_local = torch.randint(-1, v_local, (n,), device=DEVICE)
    class_w = torch.rand(v_local, device=DEVICE) + 0.2
    stats = {b: torch.zeros(STATS, n, device=DEVICE) for b in ("torch", "triton")}
    for b in stats:
        shard_stats(b, logits, target_local, class_w, opts, stats[b])
    lse = stats["torch"][0] + stats["torch"][1].log() + 0.3
    coef, target_coef, scale = (torch.rand(n, device=DEVICE) + 0.5 for _ in range(3))
    grads = {}
    for b in ("torch", "triton"):
        grads[b] = logits.clone()
        shard_grad(b, grads[b], target_local, class_w, lse, coef, target_coef, scale, 0.1 / 1000, opts)
    return rel_err(stats["triton"], stats["torch"]), rel_err(grads["triton"], grads["torch"])


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_vocab_parallel_stage_kernels_softcap_match_torch(softcap):
    assert max(vocab_parallel_case(softcap)) <= FP32_TOL


def log_probs_case(softcap) -> float:
    """Worst relative difference of log-probs, entropy and the input and weight gradients of a weighted sum
    of both, triton against torch (the token-statistics kernels)."""
    torch.manual_seed(0)
    x = torch.randn(9, 16, device=DEVICE)
    w = torch.randn(300, 16, device=DEVICE) / 4 * 3
    t = torch.randint(0, 300, (9,), device=DEVICE)
    g_lp, g_ent = torch.randn(9, device=DEVICE), torch.randn(9, device=DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        stats = flce.linear_log_probs(xb, wb, t, softcap=softcap, temperature=0.7, backend=backend)
        ((stats.log_probs * g_lp).sum() + (stats.entropy * g_ent).sum()).backward()
        out[backend] = (stats.log_probs.detach(), stats.entropy.detach(), xb.grad, wb.grad)
    return max(rel_err(a, b) for a, b in zip(out["triton"], out["torch"]))


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_token_stats_kernels_softcap_match_torch(softcap):
    assert log_probs_case(softcap) <= FP32_TOL


@pytest.fixture
def cuda_like_math(monkeypatch):
    """The interpreter's float32 exp, log and division as Triton computes them on NVIDIA GPUs: exp(x) =
    ex2.approx(x * log2 e) with the product in float32 (relative error ~|x| * 2^-24 besides ex2's own), log
    = lg2.approx * ln 2, x / y = div.full; the instructions' own errors drawn uniformly within about their
    stated bounds (2 ulps; lg2: 2^-22.6 absolute). IEEE division (``ieee_rounding``) stays exact."""
    from triton.runtime import interpreter

    rng = np.random.default_rng(0)
    builder = interpreter.InterpreterBuilder

    def noise(shape, size):
        return rng.uniform(-size, size, shape)

    def float32_only(name, fn):
        exact = getattr(builder, name)

        def op(self, *args):
            if any(a.data.dtype != np.float32 for a in args):
                return exact(self, *args)
            with np.errstate(all="ignore"):
                out = fn(*(a.data.astype(np.float64) for a in args))
            return interpreter.TensorHandle(np.asarray(out, dtype=np.float32), args[0].dtype.scalar)

        monkeypatch.setattr(builder, name, op)

    def exp(x):
        power = (x.astype(np.float32) * np.float32(1.4426950408889634)).astype(np.float64)
        return np.exp2(power) * (1.0 + noise(x.shape, 2.0**-22))

    def log(x):
        return (np.log2(x) + noise(x.shape, 2.0**-22.6)).astype(np.float32) * np.float32(np.log(2.0))

    float32_only("create_exp", exp)
    float32_only("create_log", log)
    float32_only("create_fdiv", lambda a, b: a / b * (1.0 + noise(np.broadcast(a, b).shape, 2.0**-22)))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="models CUDA under the interpreter; on a GPU the tests above "
                    "run the real arithmetic")
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_softcap_matches_torch_with_cuda_like_arithmetic(cuda_like_math, softcap):
    """With CUDA's approximate exp, log and division (the torch path stays exact), every Triton path above
    still agrees with torch to float32 rounding. The gradient's 1 - (z / softcap)^2 did not: 3e-4 apart at
    softcap 1e-3 and 4e-5 at 0.1 under this model."""
    ce = softcap_case(DEVICE, torch.float32, 9, 16, 300, softcap, 4, label_smoothing=0.1, z_loss=1e-3,
                      temperature=0.7)
    assert max(*ce, *vocab_parallel_case(softcap), log_probs_case(softcap)) <= FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_softcap_real_shape(softcap, dtype):
    """A real vocabulary on a GPU: bf16 takes the fused Hopper GEMM (1024 rows, V % 8 == 0) on an
    H100/H200, float32 the cuBLAS GEMM and the two-pass CE kernel. In bf16 the two backends' GEMMs round
    the logits differently: the mean loss still agrees to 5e-4 (the cancelling tanh was off by 2e-3 at
    softcap 1e6, 0.35 at 1e8), the gradients to bf16 rounding."""
    loss_err, grad_err = softcap_case(torch.device("cuda"), dtype, 1024, 256, 32000, softcap, label_smoothing=0.1)
    if dtype == torch.float32:
        assert max(loss_err, grad_err) <= 1e-5  # cuBLAS may use a different reduction order in each GEMM
    else:
        assert loss_err <= 5e-4 and grad_err <= 2e-2
