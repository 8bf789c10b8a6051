"""Chunk plan: how many rows of logits to materialize at once, and in which dtype to sum grad_weight.

Pure functions of shapes and dtypes, so they can be tested (and reasoned about) without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from . import exp_logits
from .gemm import padded_width

# Bytes of one chunk's logits buffer. 512 MiB holds 2048 rows of a 128256-entry bf16 vocabulary.
DEFAULT_MEMORY_BUDGET = 512 * 2**20
# Fewest rows per chunk when the budget would allow less: the grad_weight GEMM of a chunk reads and
# writes the whole (V, H) accumulator, so it needs K = rows of about 1000 (fp32 accumulator) to stay
# compute-bound on Hopper (intensity ~ rows / 4 FLOP/byte against a ridge of ~200-250).
MIN_ROWS = 1024
# Chunk heights are rounded up to this, which keeps GEMM tiles full.
ROW_ALIGN = 64
# ... or, where the budget allows it and no short last chunk results, to this: whole 1024-row blocks keep
# cuBLAS's 256-row tiles of the grad_input GEMM filling whole waves on a 132-SM Hopper GPU (H100, 32768
# rows: 6144-row chunks 148.7 ms, 4096 149.9, but 5504, a third of a wave short, 154.6 against 151.7).
WAVE_ROWS = 1024
# A chunk's float32 grad_input product on the exp-logits path (``exp_logits.grads_chunk``, where a plan
# budgets it) runs in pieces of whole tiles of PRODUCT_ALIGN columns, each at least MIN_PRODUCT_ELEMENTS
# (128 output tiles of 128 x 256: about one wave on a 132-SM GPU).
PRODUCT_ALIGN = 128
MIN_PRODUCT_ELEMENTS = 2**22


@dataclass(frozen=True)
class ChunkPlan:
    """rows: rows per chunk (the last one may be shorter); accum_dtype: grad_weight accumulator dtype;
    input_product_cols: grad_input columns per float32 product GEMM when a chunk computes its gradients
    from stored exponentials (``exp_logits.grads_chunk``: several chunks of ``plan_chunks``, or the
    low-memory plan's forward chunks), 0 where the plan budgets no such product (those chunks take the
    standard path)."""

    n_rows: int
    rows: int
    accum_dtype: torch.dtype
    input_product_cols: int = 0

    @property
    def num_chunks(self) -> int:
        return -(-self.n_rows // self.rows) if self.n_rows else 0

    def bounds(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each chunk."""
        for start in range(0, self.n_rows, self.rows):
            yield start, min(start + self.rows, self.n_rows)


def plan_chunks(
    n_rows: int,
    vocab: int,
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    *,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    weight_grad_hidden: int = 0,
    product_hidden: int = 0,
) -> ChunkPlan:
    """Choose chunk rows and the grad_weight accumulator dtype.

    Args:
        n_rows: tokens (BT). vocab: V. compute_dtype: dtype of the GEMMs and the logits buffer.
        grad_dtype: dtype the weight gradient is returned in (the weight's).
        chunk_size: rows per chunk chosen by the user (None: from ``memory_budget``).
        accum_dtype: accumulator chosen by the user (None: precise by default, see below).
        weight_grad_hidden: H when the weight gradient is wanted (0 otherwise).
        product_hidden: H when chunks may store exp(logits) (``exp_logits.grads_chunk``; 0 otherwise).

    With the weight gradient wanted and the default accumulator, memory is spent where chunking would
    spend it anyway. Several chunks hold, in forward, the float32 (V, H) accumulator and a chunk buffer of
    the budget plus the weight gradient's own size (forward frees the buffer before backward casts the
    accumulator into that gradient, so only the budget adds to the peak; at 128256 x 4096: 6144 rows,
    1.5 GB, and every chunk's accumulator pass is shared by three times as many rows as with the budget
    alone). One chunk whenever every row's logits fit in that same forward memory: the three GEMMs then run
    unchunked (grad_weight written once in its own dtype, no accumulator read and written per chunk, no
    final cast, and on Hopper no CE pass: ``exp_logits.py``); its backward holds the logits beside the new
    gradient, so the peak may exceed the chunked plan's by that gradient's size (0.5 GB at 128256 x 2048,
    where one chunk takes 8192 rows 8% faster than two; benchmark/NOTES.md, The chunk plan).

    Default accumulator: with one chunk the weight gradient is a single GEMM, so it is written straight
    in ``grad_dtype``; with several chunks partial sums are kept in float32 (or wider, if the gradient
    dtype is wider) so that the result is rounded once, not once per chunk.

    Several chunks of ``exp_logits.MIN_ROWS`` rows or more, summed in float32 (or with no weight gradient),
    get ``input_product_cols`` = H from ``product_hidden``, at any vocabulary: on Hopper each then stores
    exp(logits) and runs no CE pass, its grad_input from one float32 product of the chunk, the bytes the
    standard path's scaled product takes anyway (benchmark/NOTES.md, The exp-logits path).
    """
    if chunk_size is None:
        row_bytes = max(padded_width(vocab, compute_dtype.itemsize) * compute_dtype.itemsize, 1)  # padded rows
        accumulator = vocab * weight_grad_hidden * 4 if accum_dtype is None and grad_dtype.itemsize < 4 else 0
        # beside an accumulator the buffer also takes the gradient's size: freed before backward casts into it
        buffer = memory_budget + (vocab * weight_grad_hidden * grad_dtype.itemsize if accumulator else 0)
        if n_rows * row_bytes <= buffer + accumulator:  # what several chunks would hold in forward
            rows = max(n_rows, 1)
        else:
            rows = _balanced(n_rows, max(buffer // row_bytes, MIN_ROWS))
    else:
        rows = max(min(chunk_size, n_rows), 1)
    rows = max(rows, 1)
    if accum_dtype is None:
        single = n_rows <= rows
        accum_dtype = grad_dtype if single or grad_dtype.itemsize >= 4 else torch.float32
    summed = not weight_grad_hidden or accum_dtype.itemsize >= 4
    cols = product_hidden if exp_logits.MIN_ROWS <= rows < n_rows and summed else 0
    return ChunkPlan(n_rows=n_rows, rows=rows, accum_dtype=accum_dtype, input_product_cols=cols)


def product_cols(budget: int, rows: int, hidden: int) -> int:
    """Columns of a (rows, hidden) float32 product that ``budget`` bytes hold, in near-equal pieces of whole
    tiles; 0 if fewer than ``MIN_PRODUCT_ELEMENTS`` fit (a GEMM that short would not fill the GPU)."""
    most = max(budget, 0) // max(rows * 4, 1)
    if most >= hidden:
        return hidden
    most = most // PRODUCT_ALIGN * PRODUCT_ALIGN
    if most == 0 or most * rows < MIN_PRODUCT_ELEMENTS:
        return 0
    return min(round_up(cdiv(hidden, cdiv(hidden, most)), PRODUCT_ALIGN), most)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    return cdiv(a, multiple) * multiple


def weight_grad_hidden(weight: torch.Tensor) -> int:
    """``plan_chunks``' weight_grad_hidden for a (..., V, H) weight: H if its gradient will be computed."""
    return weight.shape[-1] if torch.is_grad_enabled() and weight.requires_grad else 0


def _balanced(n_rows: int, max_rows: int) -> int:
    """Rows per chunk for the fewest chunks of at most ``max_rows``, near-equal (no tiny, memory-bound
    last chunk), rounded up to WAVE_ROWS where that fits and leaves a last chunk of MIN_ROWS or more,
    else to ROW_ALIGN where that fits."""
    if n_rows <= max_rows:
        return max(n_rows, 1)
    chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // chunks)
    waves = -(-rows // WAVE_ROWS) * WAVE_ROWS
    if waves <= max_rows and n_rows - (-(-n_rows // waves) - 1) * waves >= min(MIN_ROWS, rows):
        return waves
    aligned = -(-rows // ROW_ALIGN) * ROW_ALIGN
    return aligned if aligned <= max_rows else rows
