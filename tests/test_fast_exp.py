"""The GEMM epilogues' exp (kernels/fast_exp_triton.py) against exp."""

import pytest
import torch

from flce.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                reason="triton cannot run here")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
fast_exp = pytest.importorskip("flce.kernels.fast_exp_triton")
PTX, exp_ftz = fast_exp.PTX, fast_exp.exp_ftz


@triton.jit
def _exp_ftz_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, exp_ftz(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_exp_ftz_matches_exp_and_flushes_below_the_normal_range(device):
    """``fast_exp_triton.exp_ftz`` (the GEMM epilogues' exp): within a few float32 ulps of exp over the range
    the epilogues see, exact at the special values, and results below 2^-126 flushed to zero on NVIDIA GPUs
    (``tl.exp`` under the interpreter, which keeps them)."""
    x = torch.cat([torch.empty(4000, device=device).uniform_(-87.0, 88.0), torch.randn(1000, device=device),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -100.0, -88.0], device=device)])
    out = torch.full_like(x, 123.0)
    _exp_ftz_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = torch.exp(x.double())
    normal = (want >= 2.0**-126) & torch.isfinite(want)
    # ex2.approx of the float32 product x log2(e): 2 ulp, plus that product's rounding, ~|x| 2^-24 relative
    rel = (out[normal].double() - want[normal]).abs() / want[normal]
    assert (rel <= 2.0**-21 + x[normal].double().abs() * 2.0**-23).all(), rel.max()
    tiny = (want < 2.0**-126) & ~torch.isnan(x)
    assert tiny.sum() >= 3 and (out[tiny] >= 0).all() and (out[tiny] < 2.0**-126).all()
    if PTX:  # NVIDIA: ex2.approx.ftz
        assert (out[tiny] == 0).all()
    assert out[-7:-5].tolist() == [1.0, 1.0] and out[-5] == float("inf") and out[-4] == 0.0
    assert torch.isnan(out[-3])
