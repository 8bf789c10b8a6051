"""mm_into: write or accumulate into a (possibly wider) output; the out_dtype path and its fallback;
mm_new: the same GEMM into a new tensor."""

import pytest
import torch
from reference import rel_err

from flce import gemm


@pytest.mark.parametrize("force_fallback", [False, True])
@pytest.mark.parametrize("out_dtype,op_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float64, torch.bfloat16),
])
def test_mm_into_matches_float64(device, monkeypatch, force_fallback, out_dtype, op_dtype):
    monkeypatch.setattr(gemm, "FORCE_FALLBACK", force_fallback)
    a1, b1, a2, b2 = (torch.randn(s, device=device).to(op_dtype) for s in ((33, 70), (70, 19), (33, 50), (50, 19)))
    out = torch.full((33, 19), float("nan"), dtype=out_dtype, device=device)  # poisoned: must be overwritten
    gemm.mm_into(out, a1, b1, accumulate=False)
    gemm.mm_into(out, a2, b2, accumulate=True)
    want = a1.double() @ b1.double() + a2.double() @ b2.double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(op_dtype, 1e-2)
    assert out.dtype == out_dtype
    assert rel_err(out, want) < tol


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_outer_product_is_exact(device, out_dtype):
    """K = 1 (a batch of one row) goes through a zero-padded K = 2 GEMM: the same single products."""
    a, b = torch.randn(37, 1, device=device).bfloat16(), torch.randn(1, 21, device=device).bfloat16()
    out = torch.full((37, 21), float("nan"), dtype=out_dtype, device=device)
    gemm.mm_into(out, a.t().t(), b, accumulate=False)
    assert torch.equal(out, (a.double() @ b.double()).to(out_dtype))
    if out_dtype == torch.float32:  # a product of two bf16 values is exact in float32, and so is twice it
        gemm.mm_into(out, a, b, accumulate=True)
        assert torch.equal(out, 2 * (a.double() @ b.double()).float())


@pytest.mark.parametrize("k", [1, 40])
@pytest.mark.parametrize("out_dtype,op_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
])
def test_mm_new_matches_float64(device, k, out_dtype, op_dtype):
    """A fresh (m, n) result in the asked dtype, through torch's own allocation or mm_into's rules (K = 1,
    a wider output); the transposed operand is how backward passes dlogits."""
    a, b = torch.randn(k, 33, device=device).to(op_dtype), torch.randn(k, 19, device=device).to(op_dtype)
    out = gemm.mm_new(a.t(), b, out_dtype)
    assert out.shape == (33, 19) and out.dtype == out_dtype and out.is_contiguous()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(op_dtype, 1e-2)
    assert rel_err(out, a.double().t() @ b.double()) < tol


def test_fallback_is_used_where_out_dtype_is_missing():
    """CPU torch has no mm(out_dtype=...): the probe says so and the upcast path still accumulates in fp32."""
    cpu = torch.device("cpu")
    assert not gemm.supports_out_dtype(cpu)
    a = torch.randn(64, 512).bfloat16()
    b = torch.randn(512, 8).bfloat16()
    acc = torch.zeros(64, 8)
    for _ in range(4):
        gemm.mm_into(acc, a, b, accumulate=True)
    exact = 4 * (a.double() @ b.double())
    # Rounding each partial product to bf16 first would be ~1e-3 off; fp32 accumulation is ~1e-7.
    assert rel_err(acc, exact) < 1e-5


@pytest.mark.gpu
def test_out_dtype_available_on_cuda():
    assert gemm.supports_out_dtype(torch.device("cuda"))


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("out_dtype,op_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.float64, torch.float64)])
def test_column_sums_into(device, monkeypatch, gemv, n, out_dtype, op_dtype):
    """Sums over rows, written then accumulated, of a whole matrix and of its first columns (row stride wider
    than the columns read): against float64, for one row too; on a GPU as a GEMV and as torch's sum."""
    monkeypatch.setattr(gemm, "GEMV_MIN_ROWS", 1 if gemv else 1 << 30)
    a1, a2 = (torch.randn(n, 300, device=device).to(op_dtype) for _ in range(2))
    out = torch.full((120,), float("nan"), dtype=out_dtype, device=device)  # poisoned: must be overwritten
    gemm.column_sums_into(out, a1[:, :120], accumulate=False)
    gemm.column_sums_into(out, a2[:, :120], accumulate=True)
    want = a1[:, :120].double().sum(0) + a2[:, :120].double().sum(0)
    assert out.dtype == out_dtype
    assert rel_err(out, want) < {torch.float64: 1e-12}.get(op_dtype, 1e-5)
