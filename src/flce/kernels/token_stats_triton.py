"""Triton token-statistics kernels (contract: ``kernels.token_stats``).

Forward: one program per row (rows dealt out round-robin), one read of the row in blocks of the
vocabulary with an online softmax that also carries what entropy, log(sum p^2), the mean and the argmax
need. Backward: one read and one write of the recomputed row, which becomes the gradient of the logits.
Rows the Hopper logits GEMM stored less their tile max (``SHIFTED``) get it added back (``ce_triton.load_z``).
Where V or the row stride is no multiple of 16 (``GROUPED``, ``ce_triton.whole_groups``) both read and write
whole 16-byte groups of VEC values, a padding's included, as the CE kernel does. Float32 arithmetic whatever the
storage dtype; runs on CUDA and, under ``TRITON_INTERPRET=1``, the CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .ce_triton import (block_cols, load_z, load_z_at, row_start, shift_args, target_dot, target_dot_args,
                        whole_groups)
from .softcap_triton import capped
from .token_stats import RowStats, Transform

# Vocabulary columns per step, rows per SM in the grid, warps (the CE kernel's tuned defaults).
BLOCK_V = 8192
PROGRAMS_PER_SM = 16
NUM_WARPS = 8


@triton.jit
def _target(target_ptr, row, V, ignore_index):
    """(valid, NaN for an unchecked target outside [0, V) else 0, a safe column index)."""
    y = tl.load(target_ptr + row)
    valid = y != ignore_index
    poison = tl.where(valid & ((y < 0) | (y >= V)), float("nan"), 0.0)
    return valid, poison, tl.minimum(tl.maximum(y, 0), V - 1)


@triton.jit
def _stats_kernel(logits_ptr, stride_row, target_ptr, lse_ptr, log_probs_ptr, entropy_ptr, sum_sq_ptr, mean_ptr,
                  top1_ptr, tile_max_ptr, n_tiles, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, n_rows, V, H,
                  ignore_index, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr, HAS_LOG_PROBS: tl.constexpr,
                  HAS_ENTROPY: tl.constexpr, HAS_SUM_SQ: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr,
                  SHIFTED: tl.constexpr, TILE_N: tl.constexpr, EXACT_Y: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, GROUPED: tl.constexpr):
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_i, tl.int64)
        row_ptr = row_start(logits_ptr, row, stride_row, VEC, GROUPED)
        tile_max_row = tile_max_ptr + row * n_tiles
        valid, poison, y = _target(target_ptr, row, V, ignore_index)
        # Online softmax relative to the running max m: s = sum e, a = sum e * (z - m), q = sum e^2
        # with e = exp(z - m), so that entropy = log s - a / s adds two non-negative terms.
        m = float("-inf")
        s = 0.0
        a = 0.0
        q = 0.0
        z_sum = 0.0
        best = float("-inf")
        best_idx = 0
        for start in range(0, V, BLOCK_V):
            lead, cols = block_cols(start, BLOCK_V, VEC)
            mask = cols < V
            io_mask = (lead < V)[:, None] if GROUPED else mask  # the padding is read, then masked out
            z_in, _slope = load_z(row_ptr, tile_max_row, lead, cols, io_mask, V, inv_temp, softcap, HAS_SOFTCAP,
                                   SHIFTED, TILE_N)
            z = tl.where(mask, z_in, float("-inf"))
            block_max = tl.max(z)
            m_new = tl.maximum(m, block_max)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that starts with -inf logits
            alpha = tl.exp(m - m_ref)
            e = tl.exp(z - m_ref)
            if HAS_ENTROPY:
                shift = (tl.where(s > 0.0, m, m_ref) - m_ref) * s  # re-centres the old a on the new max
                a = alpha * (a + shift) + tl.sum(tl.where(mask, e * (z_in - m_ref), 0.0))
            if HAS_SUM_SQ:
                q = alpha * alpha * q + tl.sum(e * e)
            s = alpha * s + tl.sum(e)
            m = m_new
            if HAS_MEAN:
                z_sum += tl.sum(tl.where(mask, z_in, 0.0))
            if HAS_TOP1:
                block_arg = tl.min(tl.where(z == block_max, cols, 2147483647))  # the first index wins ties
                best_idx = tl.where(block_max > best, block_arg, best_idx)
                best = tl.maximum(best, block_max)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row, tl.where(valid, lse + poison, 0.0))
        if HAS_LOG_PROBS:
            if EXACT_Y:  # from the GEMM's operands: the stored value carries its rounding (|z - tile max| / 256)
                z_y = capped(target_dot(x_ptr, stride_x, w_ptr, stride_w, bias_ptr, row, y, H, HAS_BIAS, BLOCK_H),
                             inv_temp, softcap, HAS_SOFTCAP)
            else:
                z_y = load_z_at(row_ptr, tile_max_row, y, inv_temp, softcap, HAS_SOFTCAP, SHIFTED, TILE_N)
            tl.store(log_probs_ptr + row, tl.where(valid, z_y - lse + poison, 0.0))
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, tl.where(valid, log_s - a / s + poison, 0.0))
        if HAS_SUM_SQ:
            tl.store(sum_sq_ptr + row, tl.where(valid, tl.log(q) - 2.0 * log_s + poison, 0.0))
        if HAS_MEAN:
            tl.store(mean_ptr + row, tl.where(valid, z_sum / V + poison, 0.0))
        if HAS_TOP1:
            tl.store(top1_ptr + row, (valid & (poison == 0.0) & (best_idx == y)).to(tl.int8))


@triton.jit
def _grad_kernel(logits_ptr, stride_row, grad_ptr, grad_stride_row, target_ptr, lse_ptr, entropy_ptr, g_lp_ptr,
                 g_ent_ptr, tile_max_ptr, n_tiles, n_rows, V, ignore_index, inv_temp, softcap,
                 HAS_SOFTCAP: tl.constexpr, HAS_LP_GRAD: tl.constexpr, HAS_ENT_GRAD: tl.constexpr,
                 SHIFTED: tl.constexpr, TILE_N: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                 GROUPED: tl.constexpr):
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_i, tl.int64)
        row_ptr = row_start(logits_ptr, row, stride_row, VEC, GROUPED)
        out_row_ptr = row_start(grad_ptr, row, grad_stride_row, VEC, GROUPED)  # the row itself, or another buffer's
        tile_max_row = tile_max_ptr + row * n_tiles
        valid, poison, y = _target(target_ptr, row, V, ignore_index)
        lse = tl.load(lse_ptr + row)
        g_lp = 0.0
        g_ent = 0.0
        ent = 0.0
        if HAS_LP_GRAD:
            g_lp = tl.load(g_lp_ptr + row).to(tl.float32)
        if HAS_ENT_GRAD:
            g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
            ent = tl.load(entropy_ptr + row)
        for start in range(0, V, BLOCK_V):
            lead, cols = block_cols(start, BLOCK_V, VEC)
            mask = cols < V
            io_mask = (lead < V)[:, None] if GROUPED else mask  # the padding gets values nothing reads
            z, slope = load_z(row_ptr, tile_max_row, lead, cols, io_mask, V, inv_temp, softcap, HAS_SOFTCAP, SHIFTED,
                              TILE_N)
            log_p = z - lse
            p = tl.exp(log_p)
            g = tl.zeros((BLOCK_V // VEC, VEC), dtype=tl.float32)
            if HAS_LP_GRAD:
                g += g_lp * (tl.where(cols == y, 1.0, 0.0) - p)  # 1 - p_y formed before the product
            if HAS_ENT_GRAD:
                g -= g_ent * p * (log_p + ent)
            if HAS_SOFTCAP:
                g = g * slope
            g = tl.where(valid, g * inv_temp + poison, 0.0)
            tl.store(out_row_ptr + cols, g.to(grad_ptr.dtype.element_ty), mask=io_mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 4  # interpreter: the grid size only changes how rows are dealt out
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def _launch(logits: torch.Tensor) -> tuple[tuple[int], dict]:
    """(grid, the launch's constexprs and warps) for a (n, V) chunk."""
    n, vocab = logits.shape
    block_v = min(triton.next_power_of_2(vocab), BLOCK_V)
    vec = min(8, block_v)
    programs = min(n, PROGRAMS_PER_SM * _sm_count(logits.device.index))
    return (programs,), dict(BLOCK_V=block_v, VEC=vec, GROUPED=whole_groups(logits, vec),
                             num_warps=max(1, min(NUM_WARPS, block_v // 256)))


def row_stats_triton(logits: torch.Tensor, target: torch.Tensor, out: RowStats, tf: Transform,
                     tile_max: torch.Tensor | None = None, operands: tuple | None = None) -> None:
    """See ``kernels.token_stats.row_stats``."""
    n, vocab = logits.shape
    if n == 0:
        return
    assert logits.stride(1) == 1 and vocab >= 1, "rows must be contiguous and non-empty"
    grid, launch = _launch(logits)
    top1 = out.is_top1.view(torch.int8) if out.is_top1 is not None else None
    dummy = out.lse
    _stats_kernel[grid](
        logits, logits.stride(0), target, out.lse, *(dummy if t is None else t for t in (
            out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, top1)),
        n_rows=n, V=vocab, ignore_index=tf.ignore_index, inv_temp=tf.inv_temp, softcap=float(tf.softcap or 1.0),
        HAS_SOFTCAP=tf.softcap is not None, HAS_LOG_PROBS=out.log_probs is not None,
        HAS_ENTROPY=out.entropy is not None, HAS_SUM_SQ=out.log_sum_sq_probs is not None,
        HAS_MEAN=out.mean_logits is not None, HAS_TOP1=top1 is not None, **launch,
        **shift_args(tile_max, vocab, dummy), **target_dot_args(operands, dummy, exact=out.log_probs is not None))


def row_grad_triton(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                    grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, tf: Transform,
                    tile_max: torch.Tensor | None = None, grad_out: torch.Tensor | None = None) -> None:
    """See ``kernels.token_stats.row_grad``."""
    n, vocab = logits.shape
    if n == 0:
        return
    grad_out = logits if grad_out is None else grad_out
    assert logits.stride(1) == 1 and grad_out.stride(1) == 1 and vocab >= 1, "rows must be contiguous and non-empty"
    grid, launch = _launch(logits)
    launch["GROUPED"] &= grad_out is logits or whole_groups(grad_out, launch["VEC"])
    _grad_kernel[grid](
        logits, logits.stride(0), grad_out, grad_out.stride(0), target, lse, *(lse if t is None else t for t in (
            entropy, grad_log_probs, grad_entropy)),
        n_rows=n, V=vocab, ignore_index=tf.ignore_index, inv_temp=tf.inv_temp, softcap=float(tf.softcap or 1.0),
        HAS_SOFTCAP=tf.softcap is not None, HAS_LP_GRAD=grad_log_probs is not None,
        HAS_ENT_GRAD=grad_entropy is not None, **launch, **shift_args(tile_max, vocab, lse))
