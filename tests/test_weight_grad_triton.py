"""The weight-gradient update through TMA reduce-adds (kernels/weight_grad_triton.py) against float64, and the
chunk loop that takes it for every chunk after the first.

On the CPU the kernel runs under TRITON_INTERPRET=1 with small tiles, in float16 only (the interpreter reads
bfloat16 through tensor descriptors wrongly) and with a load and a store for the reduce-add (the interpreter
has none); on a Hopper GPU the real TMA reduce runs, in bf16 too."""

import pytest
import torch
from conftest import DEVICE, ON_HOPPER
from reference import rel_err
from test_api import check

from flce.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")

wg = pytest.importorskip("flce.kernels.weight_grad_triton")
DTYPES = [torch.float16, torch.bfloat16] if ON_HOPPER else [torch.float16]


@pytest.fixture
def reduce_add(hopper_gemm, monkeypatch):
    """Let the update take small shapes (and the interpreter); count its calls."""
    monkeypatch.setattr(wg, "MIN_ROWS", 8)
    if not ON_HOPPER:
        monkeypatch.setattr(wg, "TILE", wg.TileConfig(32, 64, 16, 2, 4, 4))
    calls = []
    real = wg.add_weight_grad
    monkeypatch.setattr(wg, "add_weight_grad", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, hidden", [(40, 200, 72), (300, 1000, 264), (8, 64, 8)])
def test_update_matches_float64(reduce_add, dtype, rows, vocab, hidden):
    """acc + dl^T x for partial tiles in every dimension, from a non-zero accumulator."""
    acc = torch.randn(vocab, hidden, device=DEVICE)
    dl = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    want = acc.double() + dl.double().t() @ x.double()
    assert wg.supported(acc, dl, x)
    wg.add_weight_grad(acc, dl, x)
    assert rel_err(acc, want) <= 2e-6


def test_update_adds_once_per_call(reduce_add):
    """Two calls add twice (each element gets one add per call, whatever order tiles finish in)."""
    acc = torch.randn(200, 72, device=DEVICE)
    dl, x = (torch.randn(40, n, device=DEVICE).half() for n in (200, 72))
    want = acc.double() + 2 * (dl.double().t() @ x.double())
    wg.add_weight_grad(acc, dl, x)
    wg.add_weight_grad(acc, dl, x)
    assert rel_err(acc, want) <= 2e-6


def test_supported_refuses_what_it_cannot_take(reduce_add, monkeypatch):
    acc = torch.zeros(200, 72, device=DEVICE)
    dl, x = (torch.randn(40, n, device=DEVICE).half() for n in (200, 72))
    assert wg.supported(acc, dl, x)
    assert not wg.supported(acc.half(), dl, x)  # a 16-bit accumulator: cuBLAS writes it
    assert not wg.supported(acc, dl.float(), x.float())  # float32 operands
    assert not wg.supported(acc, dl, x.bfloat16())  # mixed operand dtypes
    assert not wg.supported(acc.t().contiguous().t(), dl, x)  # a transposed accumulator
    odd = torch.randn(40, 196, device=DEVICE).half()  # rows of 392 bytes: not 16-byte aligned, no TMA
    assert not wg.supported(torch.zeros(196, 72, device=DEVICE), odd, x)
    monkeypatch.setattr(wg, "MIN_ROWS", 41)
    assert not wg.supported(acc, dl, x)  # too few rows to cover the reduce traffic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunk_loop_takes_it_after_the_first_chunk(reduce_add, dtype, reduction):
    """Three chunks in training: the first writes the float32 accumulator, the next two add through the
    kernel; loss and every gradient as float64 says."""
    check("triton", dtype, DEVICE, shape=(80,), hidden=40, vocab=304, reduction=reduction, chunk_size=32,
          bias=True, ignore=0.2)
    assert reduce_add[-2:] == [32, 16]
