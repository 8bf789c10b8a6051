"""The row kernels of the exp-logits path (``exp_logits.py``) and of a loss without gradients (``loss_only.py``).

Forward (``exp_rows``), one program per row at a time and no pass over the vocabulary: the row's lse from
the logits GEMM's tile statistics, z at the target as a float32 dot of x with the target's weight row (plus
its bias), the loss, the coefficient a = w_y / T * exp(-lse) that turns the stored e = exp(z) into
softmax / T, and the one-hot term: for a confident target (p_y >= 1/2) written into e, e[y] = exp(lse) *
expm1(z_y - lse), so that a * e[y] = w_y / T * (p_y - 1) with no cancellation; else kept apart as
target_coef = w_y / T, which backward subtracts exactly (then the dominant -w_y / T is rounded once, not
with both GEMM operands). Rows whose lse leaves [lse_lo, lse_hi], or that hold a tile the GEMM stored
shifted, are counted: their e may have overflowed, flushed or been stored at another scale (the caller
falls back).
Backward: ``row_scale`` (out[r] = (src[r] * a[r] - target_coef[r] * W[y_r]) * g, cast to out's dtype) and
``subtract_target_rows`` (grad_weight's one-hot term).
Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from .ce_triton import _finish_mean, _sm_count, _tile_stats_lse, target_dot, tile_block
from .logits_triton import EXP_LOW
from .softcap_triton import capped


@triton.jit
def _expm1(d):
    """exp(d) - 1 to float32 precision near 0 as well (a series below |d| = 1e-2; Triton has no expm1)."""
    return tl.where(tl.abs(d) < 1e-2, d * (1.0 + d * (0.5 + d * (1.0 / 6.0))), tl.exp(d) - 1.0)


@triton.jit
def _lowest(max_ptr, n_tiles, BLOCK_T: tl.constexpr):
    """The smallest of a row's tile maxima."""
    low = float("inf")
    for start in range(0, n_tiles, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        low = tl.minimum(low, tl.min(tl.load(max_ptr + t, mask=t < n_tiles, other=float("inf")), 0))
    return low


@triton.jit
def _row_loss(row, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, target_ptr, class_weight_ptr, tile_max_ptr,
              tile_sum_ptr, loss_ptr, lse_ptr, sum_z_ptr, weight_total_ptr, V, H, n_tiles, ignore_index, inv_temp,
              z_loss, softcap, smoothing, HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """One row's loss w_y (lse - z_y) (+ z_loss lse^2) and lse written (0 on an ignored row, NaN loss on an
    unchecked target outside [0, V)), from the GEMM's tile statistics and z_y from a float32 dot of x with
    the target's weight row (plus its bias), over T, softcapped. With smoothing s the target's term is
    weighted 1 - s and s / V (sum_j c_j lse - sum_j c_j z_j) added, from the row's ``sum_z`` and the 0-d
    ``weight_total`` (as the CE kernel's, ce_torch._block). Returns the target (clamped into [0, V)),
    whether the row counts, whether its target is bad, lse, z_y and w_y."""
    y = tl.load(target_ptr + row)
    valid = y != ignore_index
    bad = valid & ((y < 0) | (y >= V))  # an unchecked bad target: NaN loss and gradient, never a number
    y = tl.minimum(tl.maximum(y, 0), V - 1)
    lse = _tile_stats_lse(tile_max_ptr + row * n_tiles, tile_sum_ptr + row * n_tiles, n_tiles, softcap, HAS_SOFTCAP,
                          BLOCK_T)
    z_y = capped(target_dot(x_ptr, stride_x, w_ptr, stride_w, bias_ptr, row, y, H, HAS_BIAS, BLOCK_H), inv_temp,
                 softcap, HAS_SOFTCAP)
    w_y = tl.load(class_weight_ptr + y).to(tl.float32) if HAS_WEIGHT else 1.0
    loss = w_y * (lse - z_y)
    if HAS_SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing / V * (tl.load(weight_total_ptr) * lse - tl.load(sum_z_ptr + row))
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss + tl.where(bad, float("nan"), 0.0), 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    return y, valid, bad, lse, z_y, w_y


@triton.jit
def _loss_rows_kernel(x_ptr, stride_x, w_ptr, stride_w, bias_ptr, target_ptr, class_weight_ptr, tile_max_ptr,
                      tile_sum_ptr, loss_ptr, lse_ptr, sum_z_ptr, weight_total_ptr, n_rows, V, H, n_tiles, ignore_index,
                      inv_temp, z_loss, softcap, smoothing, HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_i, tl.int64)
        _row_loss(row, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, target_ptr, class_weight_ptr, tile_max_ptr,
                  tile_sum_ptr, loss_ptr, lse_ptr, sum_z_ptr, weight_total_ptr, V, H, n_tiles, ignore_index, inv_temp,
                  z_loss, softcap, smoothing, HAS_BIAS, HAS_WEIGHT, HAS_Z_LOSS, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_H,
                  BLOCK_T)


def loss_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
              class_weight: torch.Tensor | None, tile_stats: tuple[torch.Tensor, torch.Tensor], loss: torch.Tensor,
              lse: torch.Tensor, opts: LossOptions,
              smoothing_sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Each row's loss and lse (n,) float32 from the logits GEMM's (n, T) tile statistics alone (no logits
    stored: ``loss_only.py``), as ``exp_rows`` computes them, with z-loss and softcap (the statistics' own).
    x (n, H), weight (V, H) with unit-stride rows, bias (V,) or None, target (n,) int64, class_weight (V,)
    or None. Label smoothing needs ``smoothing_sums``: each row's sum_j c_j z_j (n,) and sum_j c_j (0-d),
    float32, c the class weights (ones without)."""
    n, hidden = x.shape
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert (smoothing_sums is not None) == (opts.label_smoothing > 0.0), "label smoothing needs its sums"
    tile_max, tile_sum = tile_stats
    sum_z, weight_total = smoothing_sums if smoothing_sums is not None else (loss, loss)
    _loss_rows_kernel[(min(n, 16 * _sm_count(x.device.index)),)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else loss, target,
        class_weight if class_weight is not None else loss, tile_max, tile_sum, loss, lse, sum_z, weight_total, n,
        weight.shape[0], hidden, tile_max.shape[1], opts.ignore_index, 1.0 / opts.temperature, float(opts.z_loss),
        float(opts.softcap or 1.0), float(opts.label_smoothing), HAS_BIAS=bias is not None,
        HAS_WEIGHT=class_weight is not None, HAS_Z_LOSS=opts.z_loss > 0.0, HAS_SOFTCAP=opts.softcap is not None,
        HAS_SMOOTHING=smoothing_sums is not None, **_row_blocks(hidden, tile_max.shape[1]), num_warps=4,
    )


def _row_blocks(hidden: int, n_tiles: int) -> dict:
    return dict(BLOCK_H=min(1024, triton.next_power_of_2(hidden)), BLOCK_T=tile_block(n_tiles))


@triton.jit
def _exp_rows_kernel(e_ptr, stride_e, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, target_ptr, class_weight_ptr,
                     tile_max_ptr, tile_sum_ptr, loss_ptr, lse_ptr, coef_ptr, target_coef_ptr, key_ptr, counts_ptr,
                     total_ptr, scale_ptr, miss_ptr, n_rows, V, H, n_tiles, ignore_index, inv_temp, lse_lo, lse_hi,
                     HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, MEAN_BY_COUNT: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    n_valid = tl.zeros((), dtype=tl.int64)
    n_bad = tl.zeros((), dtype=tl.int64)
    misses = tl.zeros((), dtype=tl.int32)
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row_i, tl.int64)
        y, valid, bad, lse, z_y, w_y = _row_loss(row, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, target_ptr,
                                                 class_weight_ptr, tile_max_ptr, tile_sum_ptr, loss_ptr, lse_ptr,
                                                 loss_ptr, loss_ptr, V, H, n_tiles, ignore_index, inv_temp, 0.0, 1.0,
                                                 0.0, HAS_BIAS, HAS_WEIGHT, False, False, False, BLOCK_H, BLOCK_T)
        poison = tl.where(bad, float("nan"), 0.0)
        if MEAN_BY_COUNT:
            n_valid += valid.to(tl.int64)
            n_bad += bad.to(tl.int64)
        low = _lowest(tile_max_ptr + row * n_tiles, n_tiles, BLOCK_T)
        tl.store(coef_ptr + row, tl.where(valid, w_y * inv_temp * tl.exp(-lse) + poison, 0.0))
        # The one-hot term: folded into e for a confident target (a * e[y] = w_y / T * (p_y - 1), no
        # cancellation), else left to backward as its own exact term (-w_y / T at the target).
        fold = valid & (z_y - lse >= -0.6931471805599453)  # p_y >= 1/2
        tl.store(e_ptr + row * stride_e + y, (tl.exp(lse) * _expm1(z_y - lse)).to(e_ptr.dtype.element_ty), mask=fold)
        apart = valid & ~fold
        tl.store(target_coef_ptr + row, tl.where(apart, w_y * inv_temp + poison, 0.0))
        tl.store(key_ptr + row, tl.where(apart, y, V).to(tl.int32))  # backward's sort key: rows apart first
        # Outside the window, or a tile stored shifted (``logits_triton.EXP_LOW``); NaN counts too.
        misses += ((lse < lse_lo) | (lse > lse_hi) | (lse != lse) | (low < EXP_LOW)).to(tl.int32)
    tl.atomic_add(miss_ptr, misses)
    if MEAN_BY_COUNT:
        _finish_mean(loss_ptr, counts_ptr, total_ptr, scale_ptr, n_rows, n_valid, n_bad, BLOCK_H)


def exp_rows(e: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
             class_weight: torch.Tensor | None, tile_stats: tuple[torch.Tensor, torch.Tensor], loss: torch.Tensor,
             lse: torch.Tensor, coef: torch.Tensor, target_coef: torch.Tensor, keys: torch.Tensor, misses: torch.Tensor,
             opts: LossOptions,
             window: tuple[float, float], counts: torch.Tensor | None = None, total: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> None:
    """Launch the forward row kernel. e (n, V), unit-stride rows: the stored exp(z), its target entries rewritten;
    x (n, H), weight (V, H) with unit-stride rows, bias (V,) or None: the GEMM's operands; target (n,) int64;
    tile_stats: the GEMM's (n, T) max and sum; loss, lse, coef, target_coef (n,) float32 outputs (0 on
    ignored rows; target_coef: w_y / T where the one-hot term is left to backward, else 0); keys (n,) int32:
    the target where target_coef is not 0, else V (``subtract_target_rows`` sorts them);
    misses (1,) int32, incremented by the rows outside ``window`` (see the module docstring). With ``counts``
    ((3,) int64 zeros) the kernel finishes the mean as the CE kernel does (``ce_chunk``): ``scale`` = 1 /
    valid rows, ``total`` = the mean."""
    n, vocab = e.shape
    hidden = x.shape[1]
    assert e.stride(1) == 1 and x.stride(1) == 1 and weight.stride(1) == 1
    tile_max, tile_sum = tile_stats
    mean_by_count = counts is not None
    _exp_rows_kernel[(min(n, 16 * _sm_count(e.device.index)),)](
        e, e.stride(0), x, x.stride(0), weight, weight.stride(0), bias if bias is not None else loss, target,
        class_weight if class_weight is not None else loss, tile_max, tile_sum, loss, lse, coef, target_coef, keys,
        counts if mean_by_count else misses, total if mean_by_count else loss, scale if mean_by_count else loss,
        misses, n, vocab, hidden, tile_max.shape[1], opts.ignore_index,
        1.0 / opts.temperature, float(window[0]), float(window[1]), HAS_BIAS=bias is not None,
        HAS_WEIGHT=class_weight is not None, MEAN_BY_COUNT=mean_by_count, **_row_blocks(hidden, tile_max.shape[1]),
        num_warps=4,
    )


@triton.jit
def _row_scale_kernel(src_ptr, stride_src, out_ptr, stride_out, coef_ptr, scale_ptr, w_ptr, stride_w, target_ptr,
                      target_coef_ptr, n_cols, V, HAS_TARGET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(scale_ptr).to(tl.float32)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + row * stride_src + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    v = v * tl.load(coef_ptr + row)
    if HAS_TARGET:
        tc = tl.load(target_coef_ptr + row)
        if tc != 0.0:  # NaN (a poisoned row) too
            y = tl.minimum(tl.maximum(tl.load(target_ptr + row), 0), V - 1)
            v -= tc * tl.load(w_ptr + y * stride_w + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (v * g).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def row_scale(src: torch.Tensor, coef: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
              target_term: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[r] = (src[r] * coef[r] - target_coef[r] * weight[target[r]]) * scale in out's dtype (float32
    math; the second term with ``target_term`` = (weight (V, m), target (n,), target_coef (n,))).
    src and out (n, m) with unit-stride rows; coef: (n,) float32; scale: 0-d."""
    assert src.stride(1) == 1 and out.stride(1) == 1 and src.shape == out.shape
    n, m = src.shape
    w, target, target_coef = target_term if target_term is not None else (src, coef, coef)
    if n and m:
        block = min(4096, triton.next_power_of_2(m))
        _row_scale_kernel[(n, triton.cdiv(m, block))](
            src, src.stride(0), out, out.stride(0), coef, scale, w, w.stride(0), target, target_coef, m, w.shape[0],
            HAS_TARGET=target_term is not None, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _target_rows_kernel(grad_ptr, stride_grad, x_ptr, stride_x, order_ptr, keys_ptr, target_coef_ptr, scale_ptr,
                        n, H, V, BLOCK_H: tl.constexpr):
    """The program at sorted position i leads the run of rows with its target if it is the run's first:
    grad[y] -= scale * sum of target_coef[r] * x[r] over the run, summed in float32, rounded once."""
    i = tl.program_id(0)
    y = tl.load(keys_ptr + i)
    prev = tl.load(keys_ptr + i - 1, mask=i > 0, other=-1)
    if (y < V) & (prev != y):
        g = tl.load(scale_ptr).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            j = i
            more = i < n
            while more:
                r = tl.load(order_ptr + j)
                acc += tl.load(target_coef_ptr + r) * tl.load(x_ptr + r * stride_x + h, mask=h < H, other=0.0).to(
                    tl.float32)
                j += 1
                more = (j < n) & (tl.load(keys_ptr + j, mask=j < n, other=-1) == y)
            ptrs = grad_ptr + y * stride_grad + h
            old = tl.load(ptrs, mask=h < H, other=0.0).to(tl.float32)
            tl.store(ptrs, (old - g * acc).to(grad_ptr.dtype.element_ty), mask=h < H)


def subtract_target_rows(grad: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, target_coef: torch.Tensor,
                         scale: torch.Tensor, order: torch.Tensor | None = None) -> None:
    """grad[v] -= scale * sum over rows r with keys[r] = v of target_coef[r] * x[r]: the one-hot term of
    grad_weight, one float32 sum and one rounding per vocabulary row (rows with the same key are runs after
    a stable sort; keys = V or more mark rows without the term; no atomics, deterministic, no host sync).
    grad (V, H) with unit-stride rows; x (n, H); keys (n,) int32; target_coef (n,). With ``order`` (n,), the
    keys are already in that order (``keys[i]`` is row ``order[i]``'s) and each key below V forms one run."""
    n, hidden = x.shape
    if n == 0:
        return
    if order is None:
        keys, order = torch.sort(keys, stable=True)
    _target_rows_kernel[(n,)](grad, grad.stride(0), x, x.stride(0), order, keys, target_coef, scale, n, hidden,
                              grad.shape[0], BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=4)
