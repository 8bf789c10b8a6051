"""mm_into: write or accumulate into a (possibly wider) output; the out_dtype path and its fallback;
mm_new: the same GEMM into a new tensor; linear_into: with a bias, rounded once."""

import pytest
import torch
from reference import poisoned_padded_copy, rel_err

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


@pytest.mark.parametrize("n", [64, 40, 21])
def test_mm_new_padded_rows(device, n):
    """``padded``: the rows start 128 bytes apart (``padded_rows``) whatever n, a view of a wider allocation
    where n bf16 values are no whole line (40: 16-byte rows otherwise, which the row kernels read 20% slower)."""
    a, b = torch.randn(33, 48, device=device).bfloat16(), torch.randn(48, n, device=device).bfloat16()
    out = gemm.mm_new(a, b, torch.bfloat16, padded=True)
    assert out.shape == (33, n) and out.stride(0) == gemm.padded_width(n, 2) and out.data_ptr() % 16 == 0
    assert rel_err(out, a.double() @ b.double()) < 1e-2


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


@pytest.mark.parametrize("row_align", [16, 128])
def test_padded_rows_start_aligned(device, monkeypatch, row_align):
    """Rows start ``ROW_ALIGN_BYTES`` apart, padded by less than that; contiguous where cols fill whole rows."""
    monkeypatch.setattr(gemm, "ROW_ALIGN_BYTES", row_align)
    for cols, dtype in ((37, torch.bfloat16), (40, torch.bfloat16), (64, torch.bfloat16), (37, torch.float32),
                        (3, torch.float64)):
        t = gemm.padded_rows(5, cols, dtype, device)
        assert t.shape == (5, cols) and t.stride(1) == 1 and t.dtype == dtype
        assert (t.stride(0) * t.element_size()) % row_align == 0 and t.data_ptr() % 16 == 0
        assert t.stride(0) - cols < row_align // t.element_size() and t.is_contiguous() == (t.stride(0) == cols)


def test_splits_cut_unit_stride_extents_only(monkeypatch):
    """Which of (m, n, k) a GEMM cuts: an extent that is unit-stride in an operand or the output and not a
    multiple of 16 bytes (8 bf16 values; an extent of 8 or fewer stays)."""
    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    a, b = torch.empty(37, 29).bfloat16(), torch.empty(29, 21).bfloat16()
    assert gemm._splits(a, b, unit_n=False) == (0, 16, 24)  # a row-major: k; b row-major: n
    assert gemm._splits(a, b, unit_n=False, unit_m=True) == (32, 16, 24)  # a column-major output: m too
    assert gemm._splits(torch.empty(29, 37).bfloat16().t(), torch.empty(21, 29).bfloat16().t(), False) == (32, 0, 24)
    assert gemm._splits(torch.empty(37, 7).bfloat16(), torch.empty(7, 40).bfloat16(), True) == (0, 0, 0)
    assert gemm._splits(torch.empty(37, 29).float(), torch.empty(29, 41).float(), True) == (0, 0, 0)  # 16-bit only
    # a column sum as a GEMV: the ones vector's unit strides say nothing; the transposed matrix cuts m
    assert gemm._splits(torch.empty(29, 300).bfloat16()[:, :37].t(), torch.ones(29, 1).bfloat16(), True) == (32, 0, 0)
    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", False)
    assert gemm._splits(a, b, unit_n=True) == (0, 0, 0)  # on the CPU only when asked


@pytest.mark.parametrize("batch", [(), (3,)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["k", "n", "m"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_split_gemm_rounds_once(device, monkeypatch, batch, accumulate, layout, out_dtype):
    """A GEMM (or a batch of them) cut into an aligned part and a remainder of M, N or K (``_split_gemm``)
    gives the plain GEMM's result: into a 16-bit output a cut of K sums both parts in float32 and rounds once
    (two roundings read ~1.4x the rounding of the exact result)."""
    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    m, n, k = {"k": (64, 48, 1003), "n": (64, 1003, 48), "m": (1003, 48, 64)}[layout]
    a = torch.randn(*batch, m, k, device=device).bfloat16()
    if layout == "m":  # column-major: m is the unit-stride extent
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    b = torch.randn(*batch, k, n, device=device).bfloat16()
    start = torch.randn(*batch, m, n, device=device).to(out_dtype)
    out = start.clone()
    assert gemm._split_gemm(out, a, b, accumulate, batched=bool(batch))
    want = a.double() @ b.double() + (start.double() if accumulate else 0.0)
    if out_dtype == torch.bfloat16:  # one rounding of the exact sum, as the plain (add)mm
        assert rel_err(out, want) <= 1.02 * rel_err(want.to(out_dtype), want)
    else:
        assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_linear_into_rounds_once(device, dtype, batch):
    """out = a @ b + bias with the bias inside the GEMM's float32 sums, rounded once as F.linear / baddbmm: every
    value but those the float32 sums put across a rounding boundary is the exact result rounded (the bias added
    to the rounded product matched it in 69% of the values here). Batched: a group-major view of a batch-major
    buffer, as the grouped linear writes it."""
    a = torch.randn(*batch, 64, 100, device=device).to(dtype)
    b = (torch.randn(*batch, 100, 1000, device=device) * 0.8).to(dtype)
    bias = (torch.randn(*batch, 1000, device=device) * 4).to(dtype)
    out = torch.full((64, *batch, 1000), float("nan"), dtype=dtype, device=device)
    out = out.transpose(0, 1) if batch else out  # poisoned: must be overwritten
    gemm.linear_into(out, a, b, bias)
    exact = a.double() @ b.double() + (bias.double()[:, None, :] if batch else bias.double())
    assert (out == exact.to(dtype)).double().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,cols,padded", [(64, 100, 1001, True), (1, 100, 1000, False), (300, 24, 1003, False),
                                                (16, 256, 4099, True)])
def test_linear_into_rounds_once_off_the_epilogue(device, dtype, rows, k, cols, padded, monkeypatch):
    """Where cuBLASLt's bias epilogue is not taken (an unaligned vocabulary, padded rows, one row), the sums go
    through float32 pieces (here of 40 rows), each value rounded once: cuBLAS's plain GEMM with a 16-bit C rounded
    the product first in some kernels (16 x 4096 x 128257 with padded rows: 73% of the bf16 values the exact ones
    rounded, 99.8% in float32 pieces; H200, benchmark/NOTES.md)."""
    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)  # the pieces on the CPU too
    monkeypatch.setattr(gemm, "LINEAR_PIECE_BYTES", 40 * cols * 4)
    a = torch.randn(rows, k, device=device).to(dtype)
    b = (torch.randn(k, cols, device=device) * 0.8).to(dtype)
    bias = (torch.randn(cols, device=device) * 4).to(dtype)
    out = gemm.padded_rows(rows, cols, dtype, device) if padded else torch.empty(rows, cols, dtype=dtype,
                                                                                  device=device)
    out.fill_(float("nan"))  # poisoned: must be overwritten
    gemm.linear_into(out, a, b.t().contiguous().t() if padded else b, bias)
    exact = a.double() @ b.double() + bias.double()
    assert (out == exact.to(dtype)).double().mean() >= 0.99


@pytest.mark.parametrize("accumulate", [False, True])
def test_padded_rows_of_the_first_operand(device, accumulate):
    """A first operand in rows padded beyond its columns (``padded_rows``, as the logits buffer for backward's
    grad_input GEMM): the padding, poisoned here, takes no part (the CPU's bf16 GEMM of torch 2.13 read it)."""
    a = poisoned_padded_copy(torch.randn(64, 500, device=device).bfloat16())
    b = torch.randn(500, 48, device=device).bfloat16()
    out = torch.zeros(64, 48, device=device)
    gemm.mm_into(out, a, b, accumulate=accumulate)
    assert rel_err(out, a.double() @ b.double()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cut_gemms_past_2_31_elements(dtype):
    """A logits buffer of more than 2**31 elements at a vocabulary that is no multiple of 8 (16800 rows of
    128257, as one chunk of 32768 x 128257 would be): the three cut GEMMs, each checked on its remainder and on
    the buffer's last rows (writing the remainder columns in place failed in cuBLAS)."""
    rows, hidden, vocab = 16800, 64, 128257
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    w = torch.randn(vocab, hidden, device="cuda", generator=g).to(dtype)
    logits = gemm.padded_rows(rows, vocab, dtype, x.device)
    assert logits.shape[0] * logits.stride(0) > 2**31
    gemm.mm_into(logits, x, w.t(), accumulate=False)
    tail = slice(rows - 64, rows)
    assert rel_err(logits[tail], x[tail].double() @ w.double().t()) < 1e-2
    assert rel_err(logits[:, -3:], x.double() @ w[-3:].double().t()) < 1e-2
    logits.copy_(torch.rand(rows, vocab, device="cuda", generator=g, dtype=dtype) - 0.5)
    # float32 sums over 128257 terms read ~5e-5 (H200); a term left out would read ~3e-3
    grad_input = torch.empty(rows, hidden, device="cuda")
    gemm.mm_into(grad_input, logits, w, accumulate=False)
    assert rel_err(grad_input[tail], logits[tail].double() @ w.double()) < 3e-4
    grad_weight = torch.zeros(vocab, hidden, device="cuda")
    gemm.mm_into(grad_weight, logits.t(), x, accumulate=True)
    assert rel_err(grad_weight[-9:], logits[:, -9:].double().t() @ x.double()) < 3e-4
    torch.cuda.synchronize()
