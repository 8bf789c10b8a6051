"""Softcap on every Triton path against the torch path, to float32 rounding, for softcap in [1e-3, 1e30].

z = softcap * tanh(z / softcap): for a large softcap tanh's argument is tiny, where tanh computed as
1 - 2 / (exp(2x) + 1) cancels (softcap 1e6 once gave a loss off by 2e-3 and 1e30 collapsed every logit
to 0). Checked: the kernels' tanh itself, the CE kernel (two passes), the logits GEMM's epilogue with the
one-read CE kernel (Hopper; fp16 under the interpreter) and the vocab-parallel stage kernels. On a CPU
these run under TRITON_INTERPRET=1; the same functions run on a GPU, and the ``gpu`` cases add real
shapes there.
"""

import pytest
import torch
from reference import rel_err
from test_logits_triton import fused  # noqa: F401 - the fixture that lets the fused GEMM run here

import flce
from conftest import DEVICE
from flce.kernels import triton_available
from flce.kernels.ce_vocab_parallel import STATS, shard_grad, shard_stats
from flce.options import LossOptions

pytestmark = [pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here"),
              # the interpreter's numpy: exp overflows to inf where the kernels expect it
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

SOFTCAPS = [1e-3, 0.1, 1.0, 30.0, 1e6, 1e8, 1e30]
FP32_TOL = 2e-6  # a few float32 roundings, relative


triton = pytest.importorskip("triton")
tl = triton.language
_tanh = pytest.importorskip("flce.kernels.ce_triton")._tanh


@triton.jit
def _apply_tanh(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _tanh(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def tanh_through_kernel(x: torch.Tensor) -> torch.Tensor:
    """The kernels' tanh (ce_triton._tanh, shared by every Triton path) applied to float32 x."""
    out = torch.empty_like(x)
    _apply_tanh[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def test_kernel_tanh_is_accurate_everywhere():
    """Within 8 float32 ulps of float64 tanh from 1e-30 to 1e4 (both signs), exact at 0 and +-inf. (Under
    the interpreter within 1 ulp for |x| <= 0.625 and 3 beyond; CUDA's exp is an approximation of a few
    ulps. The cancelling formula was off by up to 100% for small |x|.)"""
    mags = torch.logspace(-30, 4, 4001, dtype=torch.float64)
    x = torch.cat([mags, -mags, torch.tensor([0.0, 0.625, -0.625, 0.6249, 0.6251])]).float()
    got = tanh_through_kernel(x.to(DEVICE)).cpu().double()
    want = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=torch.finfo(torch.float32).tiny)
    assert ((got - want).abs() / ulp).max() <= 8
    special = tanh_through_kernel(torch.tensor([float("inf"), -float("inf"), float("nan")], device=DEVICE)).cpu()
    assert special[0] == 1 and special[1] == -1 and special[2].isnan()


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
def test_fused_gemm_epilogue_softcap_matches_torch(fused, softcap):  # noqa: F811
    """fp16 logits (the interpreter's descriptors read fp16 correctly): both backends see the same
    rounded logits, so the float32 arithmetic after them agrees to float32 rounding."""
    loss_err, grad_err = softcap_case(DEVICE, torch.float16, 40, 32, 256, softcap)
    assert len(fused) == 1
    assert loss_err <= FP32_TOL and grad_err <= 2e-3  # gradients are stored in fp16: its rounding bounds them


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_fused_gemm_tile_stats_softcap(fused, softcap):  # noqa: F811
    """The epilogue's per-tile max and sum exp of the softcapped logits, against float64 on its own output."""
    import flce.kernels.logits_triton as lt
    from test_logits_triton import tile_stats_of

    n, hidden, vocab = 40, 32, 256
    x = torch.randn(n, hidden, device=DEVICE).half()
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5 * 3).half()
    opts = LossOptions(softcap=softcap)
    out = torch.empty(n, vocab, dtype=torch.float16, device=DEVICE)
    stats = torch.empty(2, n, lt.num_tiles(vocab), device=DEVICE)
    lt.logits_with_tile_stats(x, w, None, out, stats[0], stats[1], opts)
    want_max, want_sum = tile_stats_of(out, opts, lt.TILE.block_n)
    assert rel_err(stats[0], want_max) <= FP32_TOL and rel_err(stats[1], want_sum) <= FP32_TOL


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_vocab_parallel_stage_kernels_softcap_match_torch(softcap):
    n, v_local = 6, 300
    opts = LossOptions(label_smoothing=0.1, softcap=softcap, temperature=1.3)
    logits = torch.randn(n, v_local, device=DEVICE) * 3
    target_local = torch.randint(-1, v_local, (n,), device=DEVICE)
    class_w = torch.rand(v_local, device=DEVICE) + 0.2
    stats = {b: torch.zeros(STATS, n, device=DEVICE) for b in ("torch", "triton")}
    for b in stats:
        shard_stats(b, logits, target_local, class_w, opts, stats[b])
    assert rel_err(stats["triton"], stats["torch"]) <= FP32_TOL
    lse = stats["torch"][0] + stats["torch"][1].log() + 0.3
    coef, target_coef, scale = (torch.rand(n, device=DEVICE) + 0.5 for _ in range(3))
    grads = {}
    for b in ("torch", "triton"):
        grads[b] = logits.clone()
        shard_grad(b, grads[b], target_local, class_w, lse, coef, target_coef, scale, 0.1 / 1000, opts)
    assert rel_err(grads["triton"], grads["torch"]) <= FP32_TOL


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
