"""Triton kernels of the two vocab-parallel stages (contract in ``ce_vocab_parallel``).

One program per row, blocks over the shard's columns, float32 arithmetic whatever the logits' dtype.
Temperature and softcap come from the core kernel's ``_logits`` helper, so both kernels see the
same z.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from .ce_triton import _logits


@triton.jit
def _shard_stats_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    class_weight_ptr,
    out_ptr,
    n_rows,
    V,
    softcap,
    inv_temp,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    m = float("-inf")
    s = 0.0
    sum_z = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        raw = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z_in = _logits(raw, inv_temp, softcap, HAS_SOFTCAP)
        z = tl.where(mask, z_in, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that start with -inf logits
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
        m = m_new
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                sum_z += tl.sum(tl.where(mask, w * z_in, 0.0), 0)
            else:
                sum_z += tl.sum(tl.where(mask, z_in, 0.0), 0)

    y = tl.load(target_ptr + row)
    here = y >= 0
    raw_y = tl.load(row_ptr + tl.maximum(y, 0)).to(tl.float32)
    z_y = tl.where(here, _logits(raw_y, inv_temp, softcap, HAS_SOFTCAP), 0.0)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n_rows + row, s)
    tl.store(out_ptr + 2 * n_rows + row, z_y)
    if HAS_SMOOTHING:
        tl.store(out_ptr + 3 * n_rows + row, sum_z)


@triton.jit
def _shard_grad_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    class_weight_ptr,
    lse_ptr,
    coef_ptr,
    target_coef_ptr,
    scale_ptr,
    V,
    smoothing_per_class,
    softcap,
    inv_temp,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    y = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    target_coef = tl.load(target_coef_ptr + row)
    scale = tl.load(scale_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        raw = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = _logits(raw, inv_temp, softcap, HAS_SOFTCAP)
        g = coef * tl.exp(z - lse)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                g -= smoothing_per_class * w
            else:
                g -= smoothing_per_class
        g = tl.where(cols == y, g - target_coef, g)  # y = -1 matches no column
        if HAS_SOFTCAP:
            t = z / softcap
            g = g * (1.0 - t * t)
        g = tl.where(scale != 0.0, g * scale, 0.0)  # exact zeros on ignored rows
        tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _launch_shape(vocab: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(vocab), 4096)
    return block_v, 8 if block_v >= 2048 else 4


def shard_stats_triton(logits, target_local, class_weight, opts: LossOptions, out: torch.Tensor) -> None:
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and out.is_contiguous(), "logits rows and out must be contiguous"
    block_v, num_warps = _launch_shape(vocab)
    _shard_stats_kernel[(n,)](
        logits, logits.stride(0), target_local,
        class_weight if class_weight is not None else out,  # placeholder pointer, never read
        out, n, vocab, float(opts.softcap or 1.0), 1.0 / opts.temperature,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


def shard_grad_triton(logits, target_local, class_weight, lse, coef, target_coef, scale,
                      smoothing_per_class: float, opts: LossOptions) -> None:
    n, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    block_v, num_warps = _launch_shape(vocab)
    _shard_grad_kernel[(n,)](
        logits, logits.stride(0), target_local,
        class_weight if class_weight is not None else lse,  # placeholder pointer, never read
        lse, coef, target_coef, scale, vocab, float(smoothing_per_class),
        float(opts.softcap or 1.0), 1.0 / opts.temperature,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
