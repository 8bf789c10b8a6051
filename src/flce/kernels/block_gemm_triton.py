"""The low-memory backward's logits GEMM with the gradient in its epilogue (Hopper).

dz = d loss / d (x @ W_block^T + b_block) for a block of vocabulary columns and all rows, as one
persistent Triton GEMM over TMA tensor descriptors (the tiles, order and pipeline of
``logits_triton.py``). Each output tile is turned into its gradient from the rows' saved lse
(``ce_block_triton._block_grad``) before the one store, as the lse saw the logits: rounded to the logits'
dtype where forward stored them so, or unrounded (``RowTerms.exact_lse``).
The block's logits are never written or read back. The rows' terms are loaded before the tile's K loop and
the epilogue is a few operations per element (benchmark/NOTES.md, The precise low-memory mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from . import logits_triton
from .ce_block_torch import RowTerms
from .ce_block_triton import _block_grad, _block_row_terms, _one_hot_cols, row_arguments
from .ce_triton import _sm_count
from .logits_triton import TileConfig, _tile_coords, tile_logits

TILE = TileConfig()  # logits_triton's tile; tests shrink it for the interpreter


@triton.jit
def _block_grad_gemm_kernel(x_desc, w_desc, out_desc, bias_ptr, target_ptr, lse_ptr, scale_ptr, class_weight_ptr,
                            weight_sum_ptr, target_col_ptr, M, N, K, col_start, V, ignore_index, smoothing, z_loss,
                            softcap, inv_temp, HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                            HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                            SCALE_PER_ROW: tl.constexpr, HAS_TARGET_COL: tl.constexpr, ROUND_LOGITS: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                            PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        # The rows' terms before the K loop: their loads land while the tile's MMAs run.
        y, lse, target_coef, extra, scale, valid = _block_row_terms(
            rows, rows < M, target_ptr, lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index,
            smoothing, z_loss, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, SCALE_PER_ROW)
        y = _one_hot_cols(y, rows, rows < M, target_col_ptr, HAS_TARGET_COL)
        acc, cols = tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS, BM, BN, BK)
        if ROUND_LOGITS:  # the logits as forward stored them, so that their softmax matches the saved lse
            acc = acc.to(out_desc.dtype).to(tl.float32)
        g = _block_grad(acc, col_start + cols, cols < N, y, lse, target_coef, extra, scale, valid, class_weight_ptr,
                        V, smoothing, softcap, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP)
        out_desc.store([m0, n0], g.to(out_desc.dtype))


def supported(x: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether the fused path can run this block (the logits GEMM's conditions, ``logits_triton.supported``,
    and a TMA-able output: rows of a multiple of 8 columns)."""
    return logits_triton.supported(x, w_block, b_block, out)


def block_logits_grad_triton(x: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor | None, out: torch.Tensor,
                             col_start: int, vocab: int, terms: RowTerms, opts: LossOptions) -> None:
    """out = d loss / d logits of x @ w_block^T (+ b_block), the vocabulary columns [col_start, col_start + C)
    of all rows, times the rows' grad_scale. Shapes: x (n, H), w_block (C, H), b_block (C,) or None, out
    (n, C) in x's dtype; ``terms`` as in ``ce_block_torch``. Check ``supported`` first."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, hidden = x.shape
    cols = w_block.shape[0]
    config = TILE  # read at call time: tests shrink it for the interpreter
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    programs = min(_sm_count(x.device.index), triton.cdiv(n, bm) * triton.cdiv(cols, bn))
    pointers, scalars, flags = row_arguments(terms, opts)
    _block_grad_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w_block, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        terms.lse if b_block is None else b_block,
        *pointers, n, cols, hidden, col_start, vocab, *scalars, HAS_BIAS=b_block is not None, **flags,
        ROUND_LOGITS=not terms.exact_lse, BM=bm, BN=bn, BK=bk, GROUP=config.group, PROGRAMS=programs,
        num_stages=config.stages, num_warps=config.warps,
    )
