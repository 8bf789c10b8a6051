"""The low-memory mode's plan: forward row chunks and backward vocabulary blocks. Pure, like planner.py.

Forward (loss, lse, grad_input) runs the chunk loop over rows; backward recomputes the logits one
block of vocabulary columns at a time, for all rows at once, so that each block of grad_weight is one
GEMM over every row (float32 inside, rounded once). Only a small budget may add to the peak; the first
blocks borrow their scratch from the rows of grad_weight that later blocks write.

Forward may also take the first ``forward_cols`` rows of grad_weight: their float32 sum over its chunks
lives at the end of grad_weight's storage (allocated in forward, handed to backward), its logits buffer at
the start; backward rounds that sum into those rows and recomputes the logits of the other columns only.
At 8192 x 4096 x 128256 bf16 that is a quarter of the vocabulary: a quarter of a GEMM less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from .gemm import padded_width
from .planner import ROW_ALIGN, ChunkPlan, _balanced, cdiv, product_cols, round_up

# Bytes that the mode may add to the peak (64 MiB: 256 rows of a 128256-entry bf16 vocabulary, or
# 4096 vocabulary columns of 8192 rows).
LOW_MEMORY_BUDGET = 64 * 2**20
# Backward blocks are rounded down to whole GEMM tiles of this many columns.
BLOCK_ALIGN = 128
# Bytes per row and column of the Hopper logits GEMM's tile statistics (float32 max and sum per row and
# 256-column tile, ``kernels/logits_triton.py``), counted twice: the next chunk's are allocated while the
# last chunk's are still referenced.
STATS_BYTES_PER_COLUMN = 2 * 8 / 256
# Fewest grad_weight elements per backward block: the block's GEMM (cols x H output, K = all rows) then
# has 128 output tiles of 128 x 256, about one wave on a 132-SM GPU (1024 columns at H = 4096).
MIN_BLOCK_ELEMENTS = 2**22
# A block's scratch inside grad_weight starts on this many bytes (TMA needs 16).
SCRATCH_ALIGN = 256
# Fewest rows per forward chunk for forward to take a share of grad_weight when it has several chunks:
# each chunk after the first reads its float32 sum back (8 bytes per element of the share), which a
# chunk of K rows hides behind 2K FLOPs per element only for K of ~1000 or more (700 TFLOP/s against
# ~4 TB/s); shorter K also slows cuBLAS's GEMM itself (lean mode: K = 512 at 1.35x).
FORWARD_MIN_ROWS = 2048


class Block(NamedTuple):
    """Backward's vocabulary columns [start, end). ``scratch``: the byte offset inside grad_weight's storage
    where the block's dlogits (n, end - start) begin, followed by its weight rows cast to the compute dtype
    under autocast; None: they go in the budget's buffer."""

    start: int
    end: int
    scratch: int | None


@dataclass(frozen=True)
class LowMemoryPlan(ChunkPlan):
    """A ``ChunkPlan`` for forward's row chunks, plus backward's blocks: ``block_cols`` vocabulary columns per
    block of the budget's buffer; ``grad_row_bytes`` (one row of grad_weight; 0 when there is none) and
    ``scratch_col_bytes`` (a column's dlogits and cast weight row) size the blocks that borrow grad_weight."""

    block_cols: int = field(kw_only=True)
    grad_row_bytes: int = field(default=0, kw_only=True)
    scratch_col_bytes: int = field(default=0, kw_only=True)
    # Forward's share: grad_weight rows [0, forward_cols), summed in float32 (float64 for float64 math) at
    # byte ``forward_offset`` of grad_weight's storage; forward's copy of the weight in the compute dtype
    # (autocast) at byte 0, its logits buffer at ``forward_buffer``.
    forward_cols: int = field(default=0, kw_only=True)
    forward_offset: int = field(default=0, kw_only=True)
    forward_buffer: int = field(default=0, kw_only=True)

    def blocks(self, vocab: int, borrow: bool = True, start: int | None = None) -> Iterator[Block]:
        """Backward's blocks, in order, from column ``start`` (None: after forward's share); ``borrow``:
        grad_weight is being written.

        Blocks write grad_weight's rows front to back, so the rows after a block are free until later
        blocks write them: the block keeps its scratch at the end of them and can be as wide as that room
        allows (at 8192 x 4096 x 128256 bf16 the first takes close to a third of the vocabulary). Each such
        block is one GEMM where the buffer would take several narrow ones (fewer launches). Once the room
        holds no more than ``block_cols`` columns, the rest take near-equal blocks of the buffer."""
        start = self.forward_cols if start is None else start
        while borrow and self.grad_row_bytes:
            cols, scratch = self._borrowed(start, vocab)
            if cols <= self.block_cols:
                break
            yield Block(start, start + cols, scratch)
            start += cols
        rest = vocab - start
        width = min(round_up(cdiv(rest, cdiv(rest, self.block_cols)), BLOCK_ALIGN), self.block_cols) if rest else 1
        for s in range(start, vocab, width):
            yield Block(s, min(s + width, vocab), None)

    def _borrowed(self, start: int, vocab: int) -> tuple[int, int]:
        """The widest block from ``start`` whose scratch fits after its own rows of grad_weight, at the end of
        that storage, and the scratch's byte offset. Widths are whole multiples of ``block_cols``: with K = all
        rows, a grad_weight GEMM's partial last wave is long, and the buffer's width fills its waves (at
        32768 rows, 1024 columns are 128 tiles of 256 x 128: 724 TFLOP/s on an H100, where a 14208-column
        block ran at 632)."""
        row, col, unit = self.grad_row_bytes, self.scratch_col_bytes, self.block_cols
        total = vocab * row
        cols = max(total - start * row - SCRATCH_ALIGN, 0) // (row + col) // unit * unit
        scratch = (total - cols * col) // SCRATCH_ALIGN * SCRATCH_ALIGN
        while cols and (start + cols) * row > scratch:  # the alignment took more than SCRATCH_ALIGN
            cols -= unit
            scratch = (total - cols * col) // SCRATCH_ALIGN * SCRATCH_ALIGN
        return cols, scratch


def plan_low_memory(
    n_rows: int,
    vocab: int,
    hidden: int,
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    *,
    weight_grad: bool,
    weight_cast: bool = False,
    input_cast: bool = False,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    forward_share: bool = False,
) -> LowMemoryPlan:
    """Rows per forward chunk and vocabulary columns per backward block.

    Args:
        n_rows: tokens. vocab, hidden: V, H. compute_dtype: the GEMMs' dtype (logits and dlogits buffers).
        grad_dtype: the weight gradient's dtype (the weight's).
        weight_grad: whether backward allocates grad_weight (forward's buffer may then take its size).
        weight_cast / input_cast: the weight / input is cast to ``compute_dtype`` (autocast): the copies
            live beside the buffers and come out of the budget.
        chunk_size: forward's rows per chunk chosen by the user (None: from the budget).
        memory_budget: bytes (None: ``LOW_MEMORY_BUDGET``).
        forward_share: forward may sum a share of grad_weight (a 0-d reduction scale); taken where it
            fits (``_forward_share``).

    Forward's logits buffer: the budget, plus, when the weight gradient is wanted, that gradient's size:
    forward ends (and frees the buffer) before backward allocates it, so the peak is unchanged (at
    8192 x 4096 x 128256 bf16: 4096-row chunks instead of 256, whose GEMMs would be bound by reading W).
    What forward's budget leaves beside the buffer holds the float32 grad_input product of a chunk on the
    exp-logits path (``input_product_cols`` at a time, ``planner.product_cols``).
    Backward's (n_rows, block_cols) dlogits buffer takes the budget, but at least ``MIN_BLOCK_ELEMENTS``
    of grad_weight per block (its GEMM fills the GPU), and whole tiles of ``BLOCK_ALIGN`` columns; the
    blocks before it borrow grad_weight's storage (``LowMemoryPlan.blocks``).
    With forward's share the logits buffer takes at most half of grad_weight's storage (after the weight's
    cast copy under autocast, which then lives there too) and the share's float32 sum the rest; the
    chunk's tile statistics, its scaled (and cast) input rows and the product take the budget.
    """
    size = compute_dtype.itemsize
    memory_budget = LOW_MEMORY_BUDGET if memory_budget is None else memory_budget
    share = forward_share and weight_grad
    cast_bytes = vocab * hidden * size if weight_cast else 0  # forward's copy of the weight, then in the storage
    sizes = (vocab, hidden, size, grad_dtype.itemsize, 8 if compute_dtype == torch.float64 else 4, cast_bytes)
    forward_cols = forward_offset = forward_buffer = 0
    if chunk_size is None:
        budget = memory_budget
        if weight_grad:
            budget += vocab * hidden * grad_dtype.itemsize
            if weight_cast:  # forward's copy of the weight in compute_dtype
                budget -= vocab * hidden * size
        row_bytes = max(int(padded_width(vocab, size) * size + vocab * STATS_BYTES_PER_COLUMN), 1)  # padded rows
        rows = _balanced(n_rows, max(budget // row_bytes // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN))
        spare = budget - rows * row_bytes
        if share:
            side_bytes = max(int(vocab * STATS_BYTES_PER_COLUMN) + hidden * size * (2 if input_cast else 1), 1)
            room = vocab * hidden * grad_dtype.itemsize - cast_bytes
            most = min(room // 2 // max(vocab * size, 1), memory_budget // side_bytes)
            share_rows = _balanced(n_rows, max(most // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN))
            forward_cols, forward_offset, forward_buffer = _forward_share(n_rows, share_rows, *sizes)
            if forward_cols:
                rows, spare = share_rows, memory_budget - share_rows * side_bytes
    else:
        rows = min(chunk_size, n_rows)
        spare = memory_budget
        if share:
            forward_cols, forward_offset, forward_buffer = _forward_share(n_rows, rows, *sizes)
    rows = max(rows, 1)
    input_product_cols = product_cols(spare, rows, hidden)

    # Backward: the block's dlogits, its weight rows cast (autocast), and the input cast once.
    block_budget = memory_budget - (n_rows * hidden * size if input_cast else 0)
    col_bytes = max((n_rows + (hidden if weight_cast else 0)) * size, 1)
    cols = max(block_budget, 0) // col_bytes // BLOCK_ALIGN * BLOCK_ALIGN
    cols = max(cols, round_up(cdiv(MIN_BLOCK_ELEMENTS, max(hidden, 1)), BLOCK_ALIGN), BLOCK_ALIGN)
    if cols >= vocab:
        cols = max(vocab, 1)
    else:  # near-equal blocks: no narrow last one
        cols = round_up(cdiv(vocab, cdiv(vocab, cols)), BLOCK_ALIGN)
    return LowMemoryPlan(n_rows=n_rows, rows=rows, accum_dtype=grad_dtype, input_product_cols=input_product_cols,
                         block_cols=cols, grad_row_bytes=hidden * grad_dtype.itemsize if weight_grad else 0,
                         scratch_col_bytes=col_bytes, forward_cols=forward_cols, forward_offset=forward_offset,
                         forward_buffer=forward_buffer)


def _forward_share(n_rows: int, rows: int, vocab: int, hidden: int, size: int, grad_size: int, sum_size: int,
                   cast_bytes: int) -> tuple[int, int, int]:
    """(forward_cols, forward_offset, forward_buffer) for forward chunks of ``rows``: the most whole
    ``BLOCK_ALIGN`` columns whose sum (``sum_size`` bytes per element) fits in grad_weight's storage after
    the weight's cast copy (``cast_bytes``), the (rows, vocab) logits buffer and the share's own rounded
    rows (backward writes those before it reads the sum no more); zeros where none fits, or where several
    chunks are shorter than ``FORWARD_MIN_ROWS``."""
    if rows < min(n_rows, FORWARD_MIN_ROWS):
        return 0, 0, 0
    start = round_up(cast_bytes, SCRATCH_ALIGN)
    used = start + max(rows, 1) * padded_width(vocab, size) * size  # the buffer the loop borrows: >= 1 padded row
    total = vocab * hidden * grad_size
    cols = min(max(total - used, 0) // max(hidden * sum_size, 1), vocab * grad_size // (grad_size + sum_size))
    cols = cols // BLOCK_ALIGN * BLOCK_ALIGN
    while cols > 0:
        offset = (total - cols * hidden * sum_size) // SCRATCH_ALIGN * SCRATCH_ALIGN
        if offset >= max(used, cols * hidden * grad_size):
            return cols, offset, start
        cols -= BLOCK_ALIGN
    return 0, 0, 0
