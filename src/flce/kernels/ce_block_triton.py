"""The column-block gradient kernel of the low-memory mode: d loss / d logits for a block of vocabulary
columns and all rows, written over the block's logits, from each row's saved log-sum-exp.

Elementwise given the lse: a 2-D grid of (rows, columns) tiles. ``_block_grad`` is also the epilogue of
the Hopper GEMM that computes the block's logits (``block_gemm_triton.py``). Float32 math (float64 for
float64 logits). Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from .ce_block_torch import RowTerms
from .ce_triton import _grad_block
from .softcap_triton import capped_slope


@triton.jit
def _block_row_terms(rows, row_mask, target_ptr, lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index,
                     smoothing, z_loss, inv_temp, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                     HAS_Z_LOSS: tl.constexpr, SCALE_PER_ROW: tl.constexpr):
    """What ``_block_grad`` needs of the R ``rows``, as (R,) vectors, with the CE kernel's per-row
    coefficients: the target (int32, clamped into [0, V)), lse, the target's and the extra coefficient, the
    scale (times 1/T, NaN on a row whose target is outside [0, V)) and whether the row counts. The GEMM
    loads these before its K loop, so their latency hides behind it."""
    y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (y != ignore_index)
    poison = tl.where(valid & ((y < 0) | (y >= V)), float("nan"), 0.0)
    y = tl.minimum(tl.maximum(y, 0), V - 1).to(tl.int32)  # int32: one compare per element, not two
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    zero = tl.zeros_like(lse)
    if HAS_WEIGHT:
        w_y = tl.load(class_weight_ptr + y, mask=row_mask, other=0.0).to(tl.float32)
        w_sum = tl.load(weight_sum_ptr).to(tl.float32)
    else:
        w_y = zero + 1.0
        w_sum = V * 1.0
    extra = zero  # the part of dz / dp that is not the target's (1 - smoothing) * w_y
    if HAS_SMOOTHING:
        extra += smoothing / V * w_sum
    if HAS_Z_LOSS:
        extra += 2.0 * z_loss * lse
    if SCALE_PER_ROW:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    else:
        scale = zero + tl.load(scale_ptr).to(tl.float32)
    return y, lse, (1.0 - smoothing) * w_y, extra, scale * inv_temp + poison, valid


@triton.jit
def _one_hot_cols(y, rows, row_mask, target_col_ptr, HAS_TARGET_COL: tl.constexpr):
    """The column whose one-hot term dz takes per row: the target, or ``target_col`` (-1: none)."""
    if HAS_TARGET_COL:
        return tl.load(target_col_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    return y


@triton.jit
def _block_grad(raw, cols, col_mask, y, lse, target_coef, extra, scale, valid, class_weight_ptr, V, smoothing, softcap,
                inv_temp, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr):
    """dz of a (R, C) tile of raw logits at vocabulary columns ``cols`` (C,), given its rows' terms
    (``_block_row_terms``); exact zeros on ignored (and masked) rows, NaN on rows whose target is outside
    [0, V)."""
    z, slope = capped_slope(raw, inv_temp, softcap, HAS_SOFTCAP)
    return _grad_block(z, slope, cols, col_mask, class_weight_ptr, y[:, None], lse[:, None], extra[:, None],
                       target_coef[:, None], smoothing / V, scale[:, None], valid[:, None], HAS_WEIGHT, HAS_SMOOTHING,
                       HAS_SMOOTHING or HAS_Z_LOSS, HAS_SOFTCAP)


@triton.jit
def _ce_block_kernel(logits_ptr, stride_row, target_ptr, lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr,
                     target_col_ptr, n_rows, n_cols, col_start, V, ignore_index, smoothing, z_loss, softcap, inv_temp,
                     HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, SCALE_PER_ROW: tl.constexpr, HAS_TARGET_COL: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    local = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, col_mask = rows < n_rows, local < n_cols
    ptrs = logits_ptr + rows[:, None] * stride_row + local[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    raw = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    y, lse, target_coef, extra, scale, valid = _block_row_terms(
        rows, row_mask, target_ptr, lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index, smoothing,
        z_loss, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, SCALE_PER_ROW)
    y = _one_hot_cols(y, rows, row_mask, target_col_ptr, HAS_TARGET_COL)
    g = _block_grad(raw, col_start + local, col_mask, y, lse, target_coef, extra, scale, valid, class_weight_ptr, V,
                    smoothing, softcap, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP)
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


# Tile of the standalone kernel: 8192 elements per program streams at copy speed (elementwise given lse).
BLOCK_R, BLOCK_C, WARPS = 16, 512, 8


def row_arguments(terms: RowTerms, opts: LossOptions) -> tuple[tuple, tuple, dict]:
    """The pointer and scalar arguments every low-memory kernel takes (after its own leading ones, in this
    order: target, lse, scale, class weights, weight sum, one-hot columns, then after V the loss's scalars)
    and its constexpr switches. Absent tensors point at lse (never read)."""
    target, lse, class_weight, weight_sum, grad_scale = terms[:5]
    pointers = (target, lse, grad_scale, lse if class_weight is None else class_weight,
                lse if weight_sum is None else weight_sum, lse if terms.target_col is None else terms.target_col)
    scalars = (opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 1.0),
               1.0 / opts.temperature)
    flags = dict(HAS_WEIGHT=class_weight is not None, HAS_SMOOTHING=opts.label_smoothing > 0.0,
                 HAS_Z_LOSS=opts.z_loss > 0.0, HAS_SOFTCAP=opts.softcap is not None,
                 SCALE_PER_ROW=grad_scale.dim() == 1, HAS_TARGET_COL=terms.target_col is not None)
    return pointers, scalars, flags


def ce_block_triton(logits: torch.Tensor, col_start: int, vocab: int, terms: RowTerms, opts: LossOptions) -> None:
    """Launch the kernel on one block. See ``ce_block_torch.ce_block_torch`` for the contract."""
    n, cols = logits.shape
    if n == 0 or cols == 0:
        return
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert logits.dtype != torch.float64, "float64 takes the torch twin (kernels.resolve_backend)"
    pointers, scalars, flags = row_arguments(terms, opts)
    _ce_block_kernel[(triton.cdiv(n, BLOCK_R), triton.cdiv(cols, BLOCK_C))](
        logits, logits.stride(0), *pointers, n, cols, col_start, vocab, *scalars, **flags,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=WARPS,
    )
