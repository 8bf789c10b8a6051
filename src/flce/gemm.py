"""GEMMs that write (or accumulate) into a preallocated output, possibly wider than their operands.

``out_dtype`` lets cuBLAS keep a float32 result from bf16/fp16 operands with no temporary. Where it is
missing (CPU builds, older torch), the operands are upcast instead: same result, more memory traffic.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Flipped by tests to exercise the fallback on builds that do have out_dtype.
FORCE_FALLBACK = False
# cuBLAS's fast kernels want every unit-stride extent and leading dimension a multiple of 16 bytes: with one
# vocabulary entry more than 128256 (a token added to Llama 3's) its GEMMs of an 8192 x 4096 x 128257 step
# took 203 ms against 37.6 (H200, benchmark/NOTES.md, Odd vocabularies). GEMMs on such extents run as an
# aligned part and a remainder (``_split_gemm``), on buffers whose rows start 16-byte aligned
# (``padded_rows``). Tests set SPLIT_ON_CPU to run the split where cuBLAS is not.
ALIGN_BYTES = 16
# The row stride of ``padded_rows`` buffers, in bytes (a multiple of ALIGN_BYTES): rows that start on a 128-byte
# line took the CE kernel 20% less time than rows 16-byte aligned, and the GEMMs ~1% (H200, benchmark/NOTES.md, The
# row kernels at odd V). Common vocabularies (32000, 128256, 151936, ...) fill whole lines: no padding there.
ROW_ALIGN_BYTES = 128
SPLIT_ON_CPU = False

_OPS = {False: (torch.mm, torch.addmm), True: (torch.bmm, torch.baddbmm)}  # (write, accumulate)


@functools.lru_cache(maxsize=None)
def _probe_out_dtype(device_type: str, batched: bool = False) -> bool:
    mm, addmm = _OPS[batched]
    try:
        shape = (1, 2, 2) if batched else (2, 2)
        a = torch.ones(shape, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(shape, dtype=torch.float32, device=device_type)
        mm(a, a, out_dtype=torch.float32, out=acc)
        addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc.flatten()[0].item() == 4.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def supports_out_dtype(device: torch.device, batched: bool = False) -> bool:
    """Whether (b)mm/add(b)mm(out_dtype=float32) works for half-precision operands on this device type."""
    return not FORCE_FALLBACK and _probe_out_dtype(device.type, batched)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b; ``out`` may be wider (float32) than the operands."""
    if a.shape[1] == 1:
        # An outer product (one row, e.g. grad_weight at batch 1): cuBLAS's K=1 kernel writes the
        # (V, H) result at a third of copy speed (0.83 ms at 128256 x 4096 on an H200). A zero second
        # term leaves every value unchanged; it is added to a.t()'s rows, so that a stays column-major
        # with its long leading dimension (a [V, 2] row-major copy drew an align2 kernel: 0.54 ms).
        a, b = F.pad(a.t(), (0, 0, 0, 1)).t(), F.pad(b, (0, 0, 0, 1))
    _gemm_into(out, a, b, accumulate, batched=False)


def linear_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = a @ b + bias: (m, n) = (m, k) @ (k, n) + (n,), or batched (G, m, n) = (G, m, k) @ (G, k, n) + (G, n),
    the bias inside the GEMM's float32 sums, so that 16-bit values are rounded once, as F.linear's (a bias added
    to the rounded product rounds twice: up to 1.5 ulps of a logit where F.linear's is off by 0.5). On CUDA a
    contiguous 16-bit ``out`` of aligned extents takes the bias as F.linear does, in cuBLASLt's epilogue (also
    0.77-0.81x the time of the GEMM and an add at 255-8192 rows x 128256 / 32000 columns, H200). Elsewhere the bias
    fills ``out`` and the GEMM adds its sums to it: once rounded on the CPU, while some of cuBLAS's kernels round
    the product before adding a 16-bit C (28% of the values an ulp off at 48 x 32 x 1000, H200); cuBLASLt, where
    ``out`` is a strided view or an extent unaligned, picked kernels 3.6x slower, so there (and at one row) a 2-D
    CUDA ``out`` takes float32 sums in pieces (``_linear_in_pieces``)."""
    batched = out.dim() == 3
    if bias is not None and not batched and (out.is_cuda or SPLIT_ON_CPU) and out.element_size() == 2:
        if out.is_cuda and out.is_contiguous() and min(a.shape) > 1 and not any(_splits(a, b, unit_n=True)):
            torch.addmm(bias.to(out.dtype), a, b, out=out)
        else:  # one row, an unaligned extent or a strided out: float32 sums in pieces, rounded once
            _linear_in_pieces(out, a, b, bias)
        return
    if bias is not None:
        out.copy_(bias[:, None, :] if batched else bias)  # broadcast over the rows (rounded to out's dtype)
    (bmm_into if batched else mm_into)(out, a, b, accumulate=bias is not None)


# Bytes of the float32 piece in which ``linear_into`` sums a bias head's logits where cuBLASLt's epilogue is not
# taken (cuBLAS's plain GEMM may round its product before adding a 16-bit C: a logit then rounds twice).
LINEAR_PIECE_BYTES = 64 << 20


def _linear_in_pieces(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> None:
    """out (m, n) = a @ b + bias from float32 sums of at most ``LINEAR_PIECE_BYTES`` at a time, each value
    rounded once into out's dtype."""
    rows = max(1, min(out.shape[0], LINEAR_PIECE_BYTES // max(1, out.shape[1] * 4)))
    acc = torch.empty(rows, out.shape[1], dtype=torch.float32, device=out.device)
    for start in range(0, out.shape[0], rows):
        part = acc[: min(rows, out.shape[0] - start)]
        part.copy_(bias)  # over every row, exactly
        mm_into(part, a[start:start + rows], b, accumulate=True)
        out[start:start + rows].copy_(part)


def mm_new(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, padded: bool = False) -> torch.Tensor:
    """a @ b as a new (m, n) tensor of ``dtype``: contiguous, or with ``padded`` rows that start 128-byte
    aligned (``padded_rows``: a buffer the row kernels and other GEMMs read). Where ``mm_into`` would add
    nothing to the plain GEMM (same dtype or float32 through ``out_dtype``, K > 1, aligned extents, rows whole
    128-byte lines or not ``padded``) torch allocates the output itself, contiguous: one host call fewer on
    launch-bound steps."""
    n = b.shape[1]
    if (a.shape[1] != 1 and not (padded and padded_width(n, dtype.itemsize) != n)
            and not any(_splits(a, b, unit_n=True))):
        if dtype == a.dtype:
            return torch.mm(a, b)
        if dtype == torch.float32 and supports_out_dtype(a.device):
            return torch.mm(a, b, out_dtype=dtype)
    if padded:
        out = padded_rows(a.shape[0], n, dtype, a.device)
    else:
        out = torch.empty((a.shape[0], n), dtype=dtype, device=a.device)
    mm_into(out, a, b, accumulate=False)
    return out


def padded_width(cols: int, itemsize: int) -> int:
    """cols rounded up to a whole number of ``ROW_ALIGN_BYTES`` (128) of ``itemsize``-byte values: the row stride
    of ``padded_rows``."""
    per = max(ROW_ALIGN_BYTES // itemsize, 1)
    return -(-cols // per) * per


def padded_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty (rows, cols) tensor whose rows start 128-byte aligned (``ROW_ALIGN_BYTES``): contiguous when cols
    allows, else a view of a slightly wider allocation (row stride rounded up), which GEMMs and TMA descriptors
    take."""
    width = padded_width(cols, dtype.itemsize)
    if width == cols:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    return torch.empty(rows, width, dtype=dtype, device=device)[:, :cols]


def first_cols(t: torch.Tensor, k: int) -> torch.Tensor:
    """t[:, :k] (a GEMM operand's first k columns), without a dispatcher call when that is all of t."""
    return t if k == t.shape[1] else t[:, :k]


# Rows from which a GPU sums columns as a GEMV (``column_sums_into``).
GEMV_MIN_ROWS = 1024


def column_sums_into(out: torch.Tensor, a: torch.Tensor, *, accumulate: bool) -> torch.Tensor:
    """out (C,) = a (n, C) summed over its rows (or out += that), in out's dtype. On a GPU from
    ``GEMV_MIN_ROWS`` rows as a GEMV against ones (float32 inside): there torch's sum over dim 0 into a wider
    dtype keeps a staging buffer of 132-141 MiB (8192 x 3712 to 8192 x 20480 bf16) and 501 MiB at 8192 x
    128256 where the GEMV takes none, at the same speed from 20480 columns (H200,
    benchmark/results/2026-11-26-h200-eafbb74/column_sums.txt); at 256 rows the sum needs no buffer and is
    twice as fast."""
    if not a.is_cuda or a.shape[0] < GEMV_MIN_ROWS:
        part = a.sum(0, dtype=out.dtype)
        return out.add_(part) if accumulate else out.copy_(part)
    ones = torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)
    mm_into(out[:, None], a.t(), ones, accumulate=accumulate)
    return out


def bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """Batched ``mm_into``: out[i] = a[i] @ b[i] (or +=). ``out`` may be a strided view (any row stride,
    e.g. a permuted (B, G, N) buffer seen as (G, B, N)): cuBLAS writes it in place through ldc/strideC."""
    _gemm_into(out, a, b, accumulate, batched=True)


def _splits(a: torch.Tensor, b: torch.Tensor, unit_n: bool, unit_m: bool = False) -> tuple[int, int, int]:
    """(m, n, k) of a 16-bit (batched) GEMM cut down to the multiple of 8 below wherever that extent runs along
    unit stride in an operand (or, per ``unit_n`` / ``unit_m``, in the output) and is no such multiple: where
    ``_split_gemm`` cuts. All zeros where nothing needs a cut (and off CUDA, unless ``SPLIT_ON_CPU``)."""
    if not (a.is_cuda or SPLIT_ON_CPU) or a.element_size() != 2:
        return 0, 0, 0
    per = ALIGN_BYTES // a.element_size()
    (m, k), n = a.shape[-2:], b.shape[-1]

    def cut(size: int, unit: bool) -> int:
        return size // per * per if unit and size > per and size % per else 0

    # A vector's strides say nothing of its layout: an operand counts only where its other extent is > 1.
    return (cut(m, unit_m or (a.stride(-2) == 1 and k > 1)), cut(n, unit_n or (b.stride(-1) == 1 and k > 1)),
            cut(k, (a.stride(-1) == 1 and m > 1) or (b.stride(-2) == 1 and n > 1)))


def _reads_past_rows(a: torch.Tensor) -> bool:
    """Whether torch would read past a's rows: on the CPU (torch 2.13) a bf16 (add)mm whose first operand has
    rows padded beyond its columns (``padded_rows``) takes the padding into its sums."""
    return (a.device.type == "cpu" and a.dtype == torch.bfloat16 and a.shape[-2] > 1
            and a.stride(-1) == 1 and a.stride(-2) != a.shape[-1])


def _split_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, batched: bool) -> bool:
    """out (+)= a @ b (each batch) as GEMMs on 16-byte multiples plus a remainder of fewer than 8 (16-bit)
    rows, columns or terms, if an extent needs it (``_splits``); False if none does. A cut of K sums the two
    products in float32 before the output's one rounding."""
    m, n, k = _splits(a, b, out.stride(-1) == 1 and out.shape[-2] > 1, out.stride(-2) == 1 and out.shape[-1] > 1)
    if m:
        _gemm_into(out[..., :m, :], a[..., :m, :], b, accumulate, batched)
        _gemm_into(out[..., m:, :], a[..., m:, :], b, accumulate, batched)
    elif n:
        _gemm_into(out[..., :n], a, b[..., :n], accumulate, batched)
        _narrow_into(out[..., n:], a, b[..., n:], accumulate, batched)
    elif k:
        wide = out if out.element_size() > 2 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        _gemm_into(wide, a[..., :k], b[..., :k, :], accumulate and wide is out, batched)
        _gemm_into(wide, a[..., k:], b[..., k:, :], True, batched)
        if wide is not out and accumulate:
            out.add_(wide)
        elif wide is not out:
            out.copy_(wide)
    return bool(m or n or k)


def _narrow_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, batched: bool) -> None:
    """out (+)= a @ b for the fewer than 8 columns a cut of N leaves, through a contiguous product in float32 (one
    rounding, as addmm's): cuBLAS failed writing them in place into a buffer of more than 2**31 elements
    (CUBLAS_STATUS_EXECUTION_FAILED, else an illegal address; 32768 x 128257 logits, H200, torch 2.11)."""
    part = torch.empty(out.shape, dtype=torch.promote_types(out.dtype, torch.float32), device=out.device)
    _gemm_into(part, a, b, False, batched)
    if accumulate:
        out.add_(part)
    else:
        out.copy_(part)


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, batched: bool) -> None:
    if _split_gemm(out, a, b, accumulate, batched):
        return
    if _reads_past_rows(a):
        a = a.contiguous()
    mm, addmm = _OPS[batched]
    kwargs = {}
    if out.dtype != a.dtype:
        if out.dtype == torch.float32 and supports_out_dtype(out.device, batched):
            kwargs["out_dtype"] = torch.float32
        else:
            a, b = a.to(out.dtype), b.to(out.dtype)
    if accumulate:
        addmm(out, a, b, out=out, **kwargs)
    else:
        mm(a, b, out=out, **kwargs)
