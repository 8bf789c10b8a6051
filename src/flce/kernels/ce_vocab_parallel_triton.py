"""Triton kernels of the two vocab-parallel stages (contract in ``ce_vocab_parallel``).

One program per row, blocks over the shard's columns, float32 arithmetic whatever the logits' dtype.
The row passes (online softmax, gradient written over the row) are the core kernel's own jit
functions, so both kernels compute the same z and gradient (the same softcap, ``softcap_triton``).
Given the Hopper logits GEMM's tile statistics (``SHIFTED``) the logits hold r less its tile's shift,
as the core kernel reads them, and stage 1 takes the row's max and sum from the statistics, and the target's
logit from a float32 dot of the GEMM's operands (``target_dot``, as the core kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from .ce_triton import (_row_stats, _write_row_grad, _write_row_grad_once, load_z_at, row_start, shift_args,
                        target_dot, target_dot_args, tile_block, tile_stats_max_sum, whole_groups)
from .softcap_triton import capped


@triton.jit
def _shard_stats_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    class_weight_ptr,
    out_ptr,
    tile_max_ptr,
    tile_sum_ptr,
    n_tiles,
    x_ptr,
    stride_x,
    w_ptr,
    stride_w,
    bias_ptr,
    H,
    n_rows,
    V,
    softcap,
    inv_temp,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SHIFTED: tl.constexpr,
    TILE_N: tl.constexpr,
    EXACT_Y: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    VEC: tl.constexpr,
    GROUPED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, stride_row, VEC, GROUPED)
    tile_max_row = tile_max_ptr + row * n_tiles  # (T,) when SHIFTED
    if SHIFTED:  # max and sum from the GEMM's epilogue; a read of the row only for smoothing's sum
        m, s = tile_stats_max_sum(tile_max_row, tile_sum_ptr + row * n_tiles, n_tiles, softcap, HAS_SOFTCAP, BLOCK_T)
        sum_z = 0.0
        if HAS_SMOOTHING:
            sum_z, _ = _write_row_grad_once(row_ptr, tile_max_row, class_weight_ptr, V, 0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                            False, inv_temp, softcap, HAS_WEIGHT, HAS_SMOOTHING, False, HAS_SOFTCAP,
                                            False, TILE_N, False, BLOCK_V, VEC, GROUPED)
    else:
        m, s, sum_z, _ = _row_stats(row_ptr, class_weight_ptr, V, inv_temp, softcap, HAS_WEIGHT, HAS_SMOOTHING,
                                    HAS_SOFTCAP, False, BLOCK_V, GROUPED)

    y = tl.load(target_ptr + row)
    here = y >= 0
    y = tl.maximum(y, 0)
    stored_y = load_z_at(row_ptr, tile_max_row, y, inv_temp, softcap, HAS_SOFTCAP, SHIFTED, TILE_N)
    z_y = stored_y
    if EXACT_Y:  # from the GEMM's operands: the stored value carries its rounding (|z - tile max| / 256)
        z_y = capped(target_dot(x_ptr, stride_x, w_ptr, stride_w, bias_ptr, row, y, H, HAS_BIAS, BLOCK_H), inv_temp,
                     softcap, HAS_SOFTCAP)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n_rows + row, s)
    tl.store(out_ptr + 2 * n_rows + row, tl.where(here, z_y, 0.0))
    if HAS_SMOOTHING:
        tl.store(out_ptr + 3 * n_rows + row, sum_z)
    tl.store(out_ptr + 4 * n_rows + row, tl.where(here, stored_y, 0.0))


@triton.jit
def _shard_grad_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    class_weight_ptr,
    lse_ptr,
    extra_coef_ptr,
    target_coef_ptr,
    scale_ptr,
    tile_max_ptr,
    n_tiles,
    V,
    smoothing_per_class,
    softcap,
    inv_temp,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SHIFTED: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
    GROUPED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, stride_row, VEC, GROUPED)
    y = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    extra_coef = tl.load(extra_coef_ptr + row)
    target_coef = tl.load(target_coef_ptr + row)
    scale = tl.load(scale_ptr + row)
    # y = -1 (target in another shard) matches no column; scale 0 marks an ignored row: exact zeros.
    # extra_coef comes per row from the host (smoothing and z-loss): always read.
    if SHIFTED:
        _write_row_grad_once(row_ptr, tile_max_ptr + row * n_tiles, class_weight_ptr, V, y, lse, extra_coef,
                             target_coef, smoothing_per_class, scale, scale != 0.0, inv_temp, softcap, HAS_WEIGHT,
                             HAS_SMOOTHING, True, HAS_SOFTCAP, False, TILE_N, True, BLOCK_V, VEC, GROUPED)
    else:
        _write_row_grad(row_ptr, row_ptr, class_weight_ptr, V, y, lse, extra_coef, target_coef, smoothing_per_class,
                        scale, scale != 0.0, inv_temp, softcap, HAS_WEIGHT, HAS_SMOOTHING, True, HAS_SOFTCAP, BLOCK_V,
                        GROUPED)


def _launch_shape(vocab: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(vocab), 4096)
    return block_v, 8 if block_v >= 2048 else 4


def shard_stats_triton(logits, target_local, class_weight, opts: LossOptions, out: torch.Tensor,
                       tile_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
                       operands: tuple | None = None) -> None:
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and out.is_contiguous(), "logits rows and out must be contiguous"
    block_v, num_warps = _launch_shape(vocab)
    _shard_stats_kernel[(n,)](
        logits, logits.stride(0), target_local,
        class_weight if class_weight is not None else out,  # placeholder pointer, never read
        out, tile_sum_ptr=out if tile_stats is None else tile_stats[1], n_rows=n, V=vocab,
        softcap=float(opts.softcap or 1.0), inv_temp=1.0 / opts.temperature,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        BLOCK_V=block_v,
        BLOCK_T=tile_block(0 if tile_stats is None else tile_stats[0].shape[1]),
        VEC=min(8, block_v),
        GROUPED=whole_groups(logits, min(8, block_v)),
        num_warps=num_warps,
        **shift_args(None if tile_stats is None else tile_stats[0], vocab, out),
        **target_dot_args(operands, out),
    )


def shard_grad_triton(logits, target_local, class_weight, lse, extra_coef, target_coef, scale,
                      smoothing_per_class: float, opts: LossOptions, tile_max: torch.Tensor | None = None) -> None:
    n, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    block_v, num_warps = _launch_shape(vocab)
    _shard_grad_kernel[(n,)](
        logits, logits.stride(0), target_local,
        class_weight if class_weight is not None else lse,  # placeholder pointer, never read
        lse, extra_coef, target_coef, scale, V=vocab, smoothing_per_class=float(smoothing_per_class),
        softcap=float(opts.softcap or 1.0), inv_temp=1.0 / opts.temperature,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        BLOCK_V=block_v,
        VEC=min(8, block_v),
        GROUPED=whole_groups(logits, min(8, block_v)),
        num_warps=num_warps,
        **shift_args(tile_max, vocab, lse),
    )
