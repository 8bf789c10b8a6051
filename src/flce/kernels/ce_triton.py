"""The cross-entropy kernel: per row, loss and d loss / d logits, written over the logits in place.

One program per row, two passes over the vocabulary in blocks: an online softmax (max, sum of
exponentials, weighted sum of logits for smoothing, argmax for accuracy), then the gradient. Given the
logits GEMM's per-tile statistics (``logits_triton.py``, Hopper), one pass: the lse comes from them,
and the gradient pass also gathers what the loss needs; that GEMM stores each logit less its tile's max,
which the kernel adds back (``load_z``). All
arithmetic is float32 whatever the storage dtype of the logits. Runs on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (how CI tests it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..gemm import padded_width
from ..options import LossOptions
from .fast_exp_triton import exp_ftz
from .softcap_triton import capped, capped_slope, tile_shift


@triton.jit
def _extras(z_in, z, mask, cols, class_weight_ptr, sum_z, best, best_idx, HAS_WEIGHT: tl.constexpr,
            HAS_SMOOTHING: tl.constexpr, COMPUTE_ACC: tl.constexpr):
    """One block's share of the (class-weighted) sum of z for smoothing and of the argmax for accuracy
    (z: -inf where masked; any shape, ``cols`` its column indices); the first index wins ties."""
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            sum_z += tl.sum(tl.where(mask, w * z_in, 0.0))
        else:
            sum_z += tl.sum(tl.where(mask, z_in, 0.0))
    if COMPUTE_ACC:
        block_max = tl.max(z)
        block_arg = tl.min(tl.where(z == block_max, cols, 2147483647))
        best_idx = tl.where(block_max > best, block_arg, best_idx)
        best = tl.maximum(best, block_max)
    return sum_z, best, best_idx


@triton.jit
def block_cols(start, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """Columns [start, start + BLOCK_V) as (BLOCK_V / VEC, VEC), and each row's first, (BLOCK_V / VEC,): a row
    of the block is one load of VEC values and lies inside one of the logits GEMM's tiles (a multiple of VEC
    wide), so a thread takes one tile max for all VEC (``load_z``)."""
    lead = start + tl.arange(0, BLOCK_V // VEC) * VEC
    return lead, lead[:, None] + tl.arange(0, VEC)[None, :]


@triton.jit
def load_z(row_ptr, tile_max_row, lead, cols, mask, V, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr,
           SHIFTED: tl.constexpr, TILE_N: tl.constexpr):
    """(z, dz / dr) of a ``block_cols`` block of a row's stored values (``capped_slope``; its placeholder slope
    without softcap). ``SHIFTED``: r = logits / T less its tile's shift, as the logits GEMM stores it
    (``logits_triton._store_shifted``), the shift added back from the row's tile maxima at ``tile_max_row``
    (TILE_N columns a tile; ``tile_shift``); else the logits."""
    raw = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = inv_temp
    if SHIFTED:
        tile_max = tl.load(tile_max_row + lead // TILE_N, mask=lead < V, other=0.0)
        raw += tile_shift(tile_max, softcap, HAS_SOFTCAP)[:, None]
        scale = 1.0
    return capped_slope(raw, scale, softcap, HAS_SOFTCAP)


@triton.jit
def load_z_at(row_ptr, tile_max_row, y, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr, SHIFTED: tl.constexpr,
              TILE_N: tl.constexpr):
    """z at column ``y`` of a row's stored values, as ``load_z`` reads them."""
    raw = tl.load(row_ptr + y).to(tl.float32)
    scale = inv_temp
    if SHIFTED:
        raw += tile_shift(tl.load(tile_max_row + y // TILE_N), softcap, HAS_SOFTCAP)
        scale = 1.0
    return capped(raw, scale, softcap, HAS_SOFTCAP)


@triton.jit
def target_dot(x_ptr, stride_x, w_ptr, stride_w, bias_ptr, row, y, H, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr):
    """A row's logit at column ``y`` before temperature and softcap, x[row] . W[y] (+ b[y]), as a float32 dot of the
    16-bit operands: unrounded, where a stored logit carries its 16-bit rounding."""
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        xr = tl.load(x_ptr + row * stride_x + h, mask=h < H, other=0.0).to(tl.float32)
        dot += xr * tl.load(w_ptr + y * stride_w + h, mask=h < H, other=0.0).to(tl.float32)
    r_y = tl.sum(dot, 0)
    if HAS_BIAS:
        r_y += tl.load(bias_ptr + y).to(tl.float32)
    return r_y


@triton.jit
def row_start(logits_ptr, row, stride_row, VEC: tl.constexpr, GROUPED: tl.constexpr):
    """The address of a row. ``GROUPED`` (``whole_groups``): the stride is a multiple of VEC, written so that the
    compiler knows it, and so that every row starts 16-byte aligned."""
    if GROUPED:
        stride_row = stride_row // VEC * VEC
    return logits_ptr + row * stride_row


@triton.jit
def group_end(V):
    """V rounded up to whole groups of 8 (16 bytes of 16-bit values), as the compiler can tell: a mask
    ``cols < group_end(V)`` is constant over each aligned group, so its accesses stay 16 bytes wide."""
    return tl.multiple_of((V + 7) // 8 * 8, 8)


@triton.jit
def _row_stats(row_ptr, class_weight_ptr, V, inv_temp, softcap, HAS_WEIGHT: tl.constexpr,
               HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_ACC: tl.constexpr,
               BLOCK_V: tl.constexpr, GROUPED: tl.constexpr = False):
    """Pass 1 over a row of V logits: running max m and sum of exp(z - m) (online softmax), the
    (class-weighted) sum of z for smoothing, and the argmax for accuracy stats. ``GROUPED``: as in
    ``_write_row_grad_once``, the row read in whole 16-byte groups (``group_end``), any padding left out."""
    m = float("-inf")
    s = 0.0
    sum_z = 0.0
    best = float("-inf")
    best_idx = 0
    io_end = group_end(V) if GROUPED else V
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        raw = tl.load(row_ptr + cols, mask=cols < io_end, other=0.0).to(tl.float32)
        z_in = capped(raw, inv_temp, softcap, HAS_SOFTCAP)
        z = tl.where(mask, z_in, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that start with -inf logits
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
        m = m_new
        sum_z, best, best_idx = _extras(z_in, z, mask, cols, class_weight_ptr, sum_z, best, best_idx, HAS_WEIGHT,
                                        HAS_SMOOTHING, COMPUTE_ACC)
    return m, s, sum_z, best_idx


@triton.jit
def _tile_stats_lse(max_ptr, sum_ptr, n_tiles, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A row's log-sum-exp from the logits GEMM's per-tile (max r, sum exp(z - max z)) partials, max z =
    softcap(max r) (``logits_triton._store_shifted``)."""
    m, s = tile_stats_max_sum(max_ptr, sum_ptr, n_tiles, softcap, HAS_SOFTCAP, BLOCK_T)
    return m + tl.log(s)


@triton.jit
def tile_stats_max_sum(max_ptr, sum_ptr, n_tiles, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A row's max of z and sum of exp(z - max) from the logits GEMM's per-tile partials (see
    ``_tile_stats_lse``): -inf and 0 for no tiles."""
    m = float("-inf")
    s = 0.0
    for start in range(0, n_tiles, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        tile_max = capped(tl.load(max_ptr + t, mask=t < n_tiles, other=float("-inf")), 1.0, softcap, HAS_SOFTCAP)
        tile_sum = tl.load(sum_ptr + t, mask=t < n_tiles, other=0.0)
        m_new = tl.maximum(m, tl.max(tile_max, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.where(tile_sum > 0.0, tile_sum * tl.exp(tile_max - m_ref), 0.0), 0)
        m = m_new
    return m, s


@triton.jit
def _grad_block(z, slope, cols, mask, class_weight_ptr, y, lse, extra_coef, target_coef, smoothing_per_class, scale,
                keep, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_EXTRA: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr):
    """dz_j = scale * (target_coef * (p_j - [j == y]) + extra_coef * p_j - smoothing_per_class * w_j), chained
    through softcap (times ``slope``, dz / dr from ``capped_slope``); ``scale`` includes 1/T. The scale meets
    the per-row coefficients, not the elements, and ``extra_coef`` is read only with ``HAS_EXTRA``:
    few operations per element, as the low-memory GEMM's epilogue wants. Exact zeros where not ``keep``
    (never 0 * NaN). p_y - 1 is formed before any product: exact for a confident target (p_y >= 1/2), so a
    small target gradient is not the difference of two rounded O(1) terms."""
    p = exp_ftz(z - lse)
    g = (target_coef * scale) * tl.where(cols == y, p - 1.0, p)
    if HAS_EXTRA:  # smoothing or z-loss
        g += (extra_coef * scale) * p
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            g -= (smoothing_per_class * scale) * w
        else:
            g -= smoothing_per_class * scale
    if HAS_SOFTCAP:
        g = g * slope
    return tl.where(keep, g, 0.0)


@triton.jit
def _write_row_grad(row_ptr, out_row_ptr, class_weight_ptr, V, y, lse, extra_coef, target_coef, smoothing_per_class,
                    scale, keep, inv_temp, softcap, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                    HAS_EXTRA: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
                    GROUPED: tl.constexpr = False):
    """Pass 2: the gradient (``_grad_block``) of the row at ``row_ptr`` written at ``out_row_ptr`` (over the row
    itself, or into a narrower buffer; ``GROUPED``: the padding's included, as in ``_row_stats``). Backwards over V:
    the blocks pass 1 read last are likeliest still in L2."""
    last = (V - 1) // BLOCK_V * BLOCK_V
    io_end = group_end(V) if GROUPED else V
    for back in range(0, V, BLOCK_V):
        cols = (last - back) + tl.arange(0, BLOCK_V)
        mask = cols < V
        io_mask = cols < io_end
        raw = tl.load(row_ptr + cols, mask=io_mask, other=0.0).to(tl.float32)
        z, slope = capped_slope(raw, inv_temp, softcap, HAS_SOFTCAP)
        g = _grad_block(z, slope, cols, mask, class_weight_ptr, y, lse, extra_coef, target_coef, smoothing_per_class,
                        scale, keep, HAS_WEIGHT, HAS_SMOOTHING, HAS_EXTRA, HAS_SOFTCAP)
        tl.store(out_row_ptr + cols, g.to(out_row_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _write_row_grad_once(row_ptr, tile_max_ptr, class_weight_ptr, V, y, lse, extra_coef, target_coef,
                         smoothing_per_class, scale, keep, inv_temp, softcap, HAS_WEIGHT: tl.constexpr,
                         HAS_SMOOTHING: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                         COMPUTE_ACC: tl.constexpr, TILE_N: tl.constexpr,
                         WRITE: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, GROUPED: tl.constexpr = False):
    """The only pass when lse is known beforehand (tile statistics): the gradient written over the row
    (``WRITE``), and the sum of z and argmax that the loss and accuracy need, from the same read. The values
    are r less its tile's shift (``load_z``: the row's (T,) tile maxima at ``tile_max_ptr``). ``GROUPED``
    (``whole_groups``): the row starts 16-byte aligned and ends in a whole group of VEC values (at V or in
    padding), so the loads and stores take whole groups, a 16-byte access each, the padding's included (a mask
    of cols < V would split them where V is no multiple of 16); sums and maxima keep the exact mask."""
    sum_z = 0.0
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        lead, cols = block_cols(start, BLOCK_V, VEC)
        mask = cols < V
        io_mask = (lead < V)[:, None] if GROUPED else mask
        z_in, slope = load_z(row_ptr, tile_max_ptr, lead, cols, io_mask, V, inv_temp, softcap, HAS_SOFTCAP, True,
                             TILE_N)
        z = tl.where(mask, z_in, float("-inf"))
        sum_z, best, best_idx = _extras(z_in, z, mask, cols, class_weight_ptr, sum_z, best, best_idx, HAS_WEIGHT,
                                        HAS_SMOOTHING, COMPUTE_ACC)
        if WRITE:
            g = _grad_block(z_in, slope, cols, mask, class_weight_ptr, y, lse, extra_coef, target_coef,
                            smoothing_per_class, scale, keep, HAS_WEIGHT, HAS_SMOOTHING, HAS_EXTRA, HAS_SOFTCAP)
            tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=io_mask)
    return sum_z, best_idx


@triton.jit
def _finish_mean(loss_ptr, counts_ptr, total_ptr, scale_ptr, n_rows, n_valid, n_bad, BLOCK: tl.constexpr):
    """A whole batch's mean in the kernel that made its rows (saves small batches three launches): every
    program adds its target counts, and the last one to finish sums all rows' losses in a fixed order
    (deterministic) and writes the mean and its scale 1 / max(valid, 1)."""
    tl.atomic_add(counts_ptr, n_valid)
    tl.atomic_add(counts_ptr + 1, n_bad)
    tl.debug_barrier()  # this program's loss stores come before its release below
    done = tl.atomic_add(counts_ptr + 2, 1)  # acq_rel, GPU scope
    if done == tl.num_programs(0) - 1:
        tl.debug_barrier()
        valid_total = tl.atomic_add(counts_ptr, 0)
        total = 0.0
        for start in range(0, n_rows, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            total += tl.sum(tl.load(loss_ptr + offs, mask=offs < n_rows, other=0.0, volatile=True), 0)
        scale = 1.0 / tl.maximum(valid_total.to(tl.float32), 1.0)
        tl.store(scale_ptr, scale)
        tl.store(total_ptr, total * scale)


@triton.jit
def _ce_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    grad_stride_row,
    target_ptr,
    class_weight_ptr,
    weight_sum_ptr,
    scale_ptr,
    loss_ptr,
    lse_ptr,
    correct_ptr,
    counts_ptr,
    total_ptr,
    tile_max_ptr,
    tile_sum_ptr,
    n_tiles,
    x_ptr,
    stride_x,
    w_ptr,
    stride_w,
    bias_ptr,
    H,
    rows_per_group,
    stride_xg,
    stride_wg,
    stride_bg,
    n_rows,
    V,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    inv_temp,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    COMPUTE_ACC: tl.constexpr,
    MEAN_BY_COUNT: tl.constexpr,
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
    n_valid = tl.zeros((), dtype=tl.int64)
    n_bad = tl.zeros((), dtype=tl.int64)
    # Each program takes rows round-robin, so one launch serves any chunk height.
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_i, tl.int64)
        row_ptr = row_start(logits_ptr, row, stride_row, VEC, GROUPED)
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        # An unchecked target outside [0, V) poisons its row (NaN loss and gradient), never a number.
        bad = valid & ((y < 0) | (y >= V))
        poison = tl.where(bad, float("nan"), 0.0)
        if MEAN_BY_COUNT:
            n_valid += valid.to(tl.int64)
            n_bad += bad.to(tl.int64)
        y = tl.minimum(tl.maximum(y, 0), V - 1)  # safe index for ignored (or unchecked) targets

        tile_max_row = tile_max_ptr + row * n_tiles  # (T,) when SHIFTED
        if EXACT_Y:  # from the GEMM's operands: a stored value carries its rounding (|z - tile max| / 256)
            g = row // rows_per_group  # the group's operands (grouped heads; else g = 0)
            z_y = capped(target_dot(x_ptr + g * stride_xg, stride_x, w_ptr + g * stride_wg, stride_w,
                                    bias_ptr + g * stride_bg, row - g * rows_per_group, y, H, HAS_BIAS, BLOCK_H),
                         inv_temp, softcap, HAS_SOFTCAP)
        else:
            z_y = load_z_at(row_ptr, tile_max_row, y, inv_temp, softcap, HAS_SOFTCAP, SHIFTED, TILE_N)  # before pass 2
        if HAS_WEIGHT:
            w_y = tl.load(class_weight_ptr + y).to(tl.float32)
            w_sum = tl.load(weight_sum_ptr).to(tl.float32)
        else:
            w_y = 1.0
            w_sum = V * 1.0
        if SHIFTED:  # the logits GEMM's statistics came with the values: the lse from them, no pass for it
            lse = _tile_stats_lse(tile_max_row, tile_sum_ptr + row * n_tiles, n_tiles, softcap, HAS_SOFTCAP, BLOCK_T)
            sum_z = 0.0
            best_idx = 0
            if not COMPUTE_GRAD and (HAS_SMOOTHING or COMPUTE_ACC):
                sum_z, best_idx = _write_row_grad_once(
                    row_ptr, tile_max_row, class_weight_ptr, V, y, lse, 0.0, 0.0, 0.0, 0.0, valid, inv_temp, softcap,
                    HAS_WEIGHT, HAS_SMOOTHING, False, HAS_SOFTCAP, COMPUTE_ACC, TILE_N, False, BLOCK_V, VEC, GROUPED)
        else:
            m, s, sum_z, best_idx = _row_stats(row_ptr, class_weight_ptr, V, inv_temp, softcap, HAS_WEIGHT,
                                               HAS_SMOOTHING, HAS_SOFTCAP, COMPUTE_ACC, BLOCK_V, GROUPED)
            lse = m + tl.log(s)

        if COMPUTE_GRAD:
            # Times the reduction's scale; ignored rows get exact zeros.
            extra_coef = 0.0  # the part of dz / dp that is not the target's (1 - smoothing) * w_y
            if HAS_SMOOTHING:
                extra_coef += smoothing / V * w_sum
            if HAS_Z_LOSS:
                extra_coef += 2.0 * z_loss * lse
            if MEAN_BY_COUNT:
                scale = 1.0  # the mean's scale is known only at the end: backward applies it
            elif SCALE_PER_ROW:
                scale = tl.load(scale_ptr + row).to(tl.float32)
            else:
                scale = tl.load(scale_ptr).to(tl.float32)
            scale = scale * inv_temp + poison
            if SHIFTED:
                sum_z, best_idx = _write_row_grad_once(
                    row_ptr, tile_max_row, class_weight_ptr, V, y, lse, extra_coef, (1.0 - smoothing) * w_y,
                    smoothing / V, scale, valid, inv_temp, softcap, HAS_WEIGHT, HAS_SMOOTHING,
                    HAS_SMOOTHING or HAS_Z_LOSS, HAS_SOFTCAP, COMPUTE_ACC, TILE_N, True, BLOCK_V, VEC, GROUPED)
            else:
                _write_row_grad(row_ptr, row_start(grad_ptr, row, grad_stride_row, VEC, GROUPED), class_weight_ptr,
                                V, y, lse, extra_coef, (1.0 - smoothing) * w_y, smoothing / V, scale, valid, inv_temp,
                                softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SMOOTHING or HAS_Z_LOSS, HAS_SOFTCAP, BLOCK_V,
                                GROUPED)

        loss = (1.0 - smoothing) * w_y * (lse - z_y)
        if HAS_SMOOTHING:
            loss += smoothing / V * (w_sum * lse - sum_z)
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, loss + poison, 0.0))
        tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
        if COMPUTE_ACC:
            tl.store(correct_ptr + row, (valid & (best_idx == y)).to(tl.float32))
    if MEAN_BY_COUNT:
        _finish_mean(loss_ptr, counts_ptr, total_ptr, scale_ptr, n_rows, n_valid, n_bad, BLOCK_V)


@dataclass(frozen=True)
class LaunchConfig:
    """programs_per_sm: grid size per SM (rows are dealt out round-robin); block_v: vocabulary columns
    per step. Defaults from benchmark/tune_ce.py on an H200 (``--ce-shapes``, commit 041c599: 0.912 ms
    for 4096 x 128256 bf16 against 1.095 for 8 / 8192 / 16 warps, and best or within 5% of the best at
    1024 x 128256 and 8192 x 32000; see benchmark/NOTES.md).

    few_rows_*: the launch for chunks of at most ``few_rows_per_sm`` rows per SM (small batches). Each
    row's program then has its SM nearly to itself and its time is the latency of its block loop, so
    wider blocks put more bytes in flight (commit a48998c, x 128256: 0.058 / 0.060 / 0.057 / 0.100 ms
    at 1 / 16 / 64 / 256 rows against 0.069 / 0.095 / 0.071 / 0.110 for the default launch)."""

    programs_per_sm: int = 16
    block_v: int = 8192
    num_warps: int = 8
    few_rows_per_sm: int = 2
    few_rows_block_v: int = 32768
    few_rows_warps: int = 16


LAUNCH = LaunchConfig()  # what ce_chunk_triton launches unless given a config (tests shrink its blocks)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 4  # interpreter: the grid size only changes how rows are dealt out
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def shift_args(tile_max: torch.Tensor | None, vocab: int, dummy: torch.Tensor) -> dict:
    """A kernel's arguments for the logits GEMM's (n, T) tile maxima that came with its values (``load_z``'s
    ``SHIFTED``), or for none."""
    if tile_max is None:
        return dict(tile_max_ptr=dummy, n_tiles=0, SHIFTED=False, TILE_N=1)
    return dict(tile_max_ptr=tile_max, n_tiles=tile_max.shape[1], SHIFTED=True,
                TILE_N=tile_width(vocab, tile_max.shape[1]))


def target_dot_args(operands: tuple | None, dummy: torch.Tensor, exact: bool = True, grouped: bool = False) -> dict:
    """A row kernel's arguments for ``target_dot`` (its ``EXACT_Y``): the logits GEMM's operands (x (n, H), W (V, H),
    bias (V,) or None), unit-stride rows, or None (then none is read; nor without ``exact``). ``grouped`` (the CE
    kernel): also its group arguments, and operands may be G groups' (x (G, c, H), W (G, V, H), bias (G, V) or None)
    for rows laid out group by group, c to a group."""
    x, w, bias = operands if operands is not None else (dummy[:, None], dummy[:, None], None)
    assert operands is None or (x.stride(-1) == 1 and w.stride(-1) == 1), "the operands' rows must be contiguous"
    assert grouped or operands is None or x.dim() == 2, "grouped operands take the CE kernel"
    args = dict(x_ptr=x, stride_x=x.stride(-2), w_ptr=w, stride_w=w.stride(-2),
                bias_ptr=dummy if bias is None else bias, H=x.shape[-1], EXACT_Y=exact and operands is not None,
                HAS_BIAS=bias is not None, BLOCK_H=min(1024, triton.next_power_of_2(x.shape[-1])))
    if grouped:
        group = x.dim() == 3
        args.update(rows_per_group=x.shape[-2] if group else max(x.shape[0], 1),
                    stride_xg=x.stride(0) if group else 0, stride_wg=w.stride(0) if group else 0,
                    stride_bg=bias.stride(0) if group and bias is not None else 0)
    return args


def tile_block(n_tiles: int) -> int:
    """Tile partials of a row that ``tile_stats_max_sum`` combines per step (its BLOCK_T)."""
    return min(triton.next_power_of_2(max(n_tiles, 1)), 1024)


def tile_width(vocab: int, n_tiles: int) -> int:
    """The logits GEMM's tile width (a power of two) from the number of tiles it made of ``vocab`` columns:
    the one power of two in [vocab / n_tiles, vocab / (n_tiles - 1)); with one tile any width >= vocab
    serves."""
    return triton.next_power_of_2(triton.cdiv(vocab, n_tiles))


def whole_groups(logits: torch.Tensor, vec: int) -> bool:
    """Whether the row kernels should take a (n, V) 16-bit logits buffer in whole groups of ``vec`` values, a
    16-byte access each (their ``GROUPED``), where the compiler cannot see that on its own (V or the row stride
    no multiple of 16). The rows must start 16-byte aligned, and the groups end at V (V a multiple of ``vec``) or
    in the padding of a ``gemm.padded_rows`` buffer, which holds nothing (the last row's included)."""
    n, vocab = logits.shape
    stride, size = logits.stride(0), logits.element_size()
    if vocab % 16 == 0 and stride % 16 == 0:
        return False  # launch arguments divisible by 16 are specialized: the plain form is grouped already
    if vec * size != 16 or stride % vec != 0 or logits.data_ptr() % 16 != 0:
        return False
    if vocab % vec == 0:
        return True
    width = -(-vocab // vec) * vec
    ends_inside = logits.storage_offset() + (n - 1) * stride + width <= logits.untyped_storage().nbytes() // size
    return stride == padded_width(vocab, size) and ends_inside


def ce_chunk_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    correct: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    opts: LossOptions,
    counts: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    tile_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: LaunchConfig | None = None,
    grad_out: torch.Tensor | None = None,
    operands: tuple | None = None,
) -> None:
    """Launch the kernel on one chunk (``config``: ``LAUNCH`` if None). See ``kernels.ce_chunk`` for the
    contract."""
    config = config or LAUNCH
    n, vocab = logits.shape
    if n == 0:
        return
    grad_out = logits if grad_out is None else grad_out
    assert logits.stride(1) == 1 and grad_out.stride(1) == 1, "logits rows must be contiguous"
    assert grad_out is logits or tile_stats is None, "the one-pass kernel writes over its logits"
    dummy = loss  # placeholder pointer for disabled features (never read)
    sms = _sm_count(logits.device.index)
    few_rows = n <= config.few_rows_per_sm * sms
    block_v = min(triton.next_power_of_2(vocab), config.few_rows_block_v if few_rows else config.block_v)
    warps = config.few_rows_warps if few_rows else config.num_warps
    programs = min(n, config.programs_per_sm * sms)
    vec = min(8, block_v)  # the one pass's columns per row of its 2-D block: one 16-byte load of 16-bit values
    _ce_kernel[(programs,)](
        logits,
        logits.stride(0),
        grad_out,
        grad_out.stride(0),
        target,
        class_weight if class_weight is not None else dummy,
        weight_sum if weight_sum is not None else dummy,
        grad_scale if grad_scale is not None else dummy,
        loss,
        lse,
        correct if correct is not None else dummy,
        counts if counts is not None else dummy,
        total if total is not None else dummy,
        tile_sum_ptr=tile_stats[1] if tile_stats is not None else dummy,
        n_rows=n,
        V=vocab,
        ignore_index=opts.ignore_index,
        smoothing=float(opts.label_smoothing),
        z_loss=float(opts.z_loss),
        softcap=float(opts.softcap or 1.0),
        inv_temp=1.0 / opts.temperature,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_Z_LOSS=opts.z_loss > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        COMPUTE_GRAD=grad_scale is not None,
        SCALE_PER_ROW=grad_scale is not None and grad_scale.dim() == 1,
        COMPUTE_ACC=correct is not None,
        MEAN_BY_COUNT=counts is not None,
        BLOCK_V=block_v,
        BLOCK_T=tile_block(tile_stats[0].shape[1] if tile_stats is not None else 0),
        VEC=vec,
        GROUPED=whole_groups(logits, vec) and (grad_out is logits or whole_groups(grad_out, vec)),
        num_warps=max(4, min(warps, block_v // 512)),
        **shift_args(tile_stats[0] if tile_stats is not None else None, vocab, dummy),
        **target_dot_args(operands, dummy, grouped=True),
    )
