"""kernels/thin_wgrad_triton.py: grad_weight at a few rows in one launch, and function.weight_grad_new's routing."""

import pytest
import torch
from conftest import DEVICE
from reference import TOL, poisoned_padded_copy, reference_loss, rel_err

import flce
from flce import function
from flce.kernels import triton_available

# bf16 only on a GPU: the CPU interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584)
DTYPES = [torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float16]
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")


def _operands(k: int, m: int, n: int, dtype: torch.dtype):
    """dl (k, m) with padded NaN-poisoned rows (as backward's dlogits), x (k, n), a 0-d scale away from 1."""
    dl = poisoned_padded_copy(torch.randn(k, m, device=DEVICE).to(dtype))
    x = torch.randn(k, n, device=DEVICE).to(dtype)
    return dl, x, torch.rand((), device=DEVICE) + 0.25


def _want(dl, x, g):
    """float64 dl^T @ (x * g), x * g rounded to x's dtype first (the operand both paths use)."""
    return dl.double().t() @ (x.float() * g).to(x.dtype).double()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", ["same", torch.float32])
@pytest.mark.parametrize("k,m,n", [(1, 203, 77), (5, 130, 129), (11, 71, 40), (16, 257, 131)])
def test_kernel_matches_float64(dtype, out_dtype, k, m, n):
    """Every value within one rounding of its float64 value (float32 output: float32 accumulation), odd
    tails in both output dims, K from 1 to THIN_K, dl read from padded rows without their NaN padding."""
    from flce.kernels.thin_wgrad_triton import THIN_K, thin_wgrad_triton

    assert k <= THIN_K
    out_dtype = dtype if out_dtype == "same" else out_dtype
    dl, x, g = _operands(k, m, n, dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    thin_wgrad_triton(dl, x, g, out)
    want = _want(dl, x, g)
    ulp = torch.finfo(out_dtype).eps * want.abs() + torch.finfo(out_dtype).tiny
    assert torch.isfinite(out).all()
    assert ((out.double() - want).abs() <= ulp + 1e-6 * want.abs().max()).all()


@needs_triton
def test_kernel_writes_a_strided_output():
    """A transposed output view gets the same values as a dense one."""
    from flce.kernels.thin_wgrad_triton import thin_wgrad_triton

    dl, x, g = _operands(7, 90, 50, torch.float16)
    dense = thin_wgrad_triton(dl, x, g, torch.empty(90, 50, dtype=torch.float32, device=DEVICE))
    strided = thin_wgrad_triton(dl, x, g, torch.empty(50, 90, dtype=torch.float32, device=DEVICE).t())
    assert torch.equal(dense, strided)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k", [3, 16, 17])
def test_weight_grad_new_routes_few_rows_to_the_kernel(backend, k, monkeypatch):
    """The Triton backend takes the thin kernel up to THIN_K rows of a 16-bit dtype (the interpreter's: float16),
    cuBLAS above it and for the torch backend; both agree with float64."""
    if backend == "triton" and not triton_available(DEVICE):
        pytest.skip("triton cannot run here")
    from flce.kernels import thin_wgrad_triton as thin

    calls, real = [], thin.thin_wgrad_triton
    monkeypatch.setattr(thin, "thin_wgrad_triton", lambda *a: calls.append(1) or real(*a))
    dl, x, g = _operands(k, 150, 70, torch.float16)
    got = function.weight_grad_new(dl[:, :150], x, g, torch.float32, backend)
    assert len(calls) == (backend == "triton" and k <= thin.THIN_K)
    assert got.shape == (150, 70) and got.dtype == torch.float32
    want = _want(dl, x, g)
    assert ((got.double() - want).abs() <= 1e-5 * want.abs().max()).all()


@needs_triton
@pytest.mark.parametrize("n,grad_output", [(1, 1.0), (7, 0.3), (16, 2.5)])
def test_loss_at_few_rows_takes_the_kernel(n, grad_output, monkeypatch):
    """flce.linear_cross_entropy at a few rows (one chunk, mean): grad_weight from the thin kernel, with the mean's
    scale and grad_output, against float64 autograd; grad_input as before."""
    from flce.kernels import thin_wgrad_triton as thin

    calls, real = [], thin.thin_wgrad_triton
    monkeypatch.setattr(thin, "thin_wgrad_triton", lambda *a: calls.append(1) or real(*a))
    dtype = DTYPES[-1]
    x = torch.randn(n, 48, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(301, 48, device=DEVICE) / 4).to(dtype).requires_grad_()
    target = torch.randint(0, 301, (n,), device=DEVICE)
    (flce.linear_cross_entropy(x, w, target, backend="triton") * grad_output).backward()
    ref, (x64, w64, _) = reference_loss(x, w, target)
    (ref * grad_output).backward()
    assert calls == [1]
    assert rel_err(w.grad, w64.grad) < TOL[dtype] and rel_err(x.grad, x64.grad) < TOL[dtype]
