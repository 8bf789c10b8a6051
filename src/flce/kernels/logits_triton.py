"""The logits GEMM with the CE kernel's first pass in its epilogue (Hopper).

logits = x_c @ W^T (+ b) as a persistent Triton GEMM over TMA tensor descriptors. Each (BM, BN) output
tile also yields, per row, the max and the sum of exp(z - max) of its BN logits z (after temperature and
softcap, from the values as stored); it stores the logits less their max over the tile, where a logit that
carries probability rounds to nearly nothing (``_store_shifted``). The CE kernel combines a row's tile partials into its
log-sum-exp and then reads each logit once (1 read + 1 write of the logits instead of 2 + 1). On an H100
this GEMM ran 4% faster than cuBLAS at 4096 x 4096 x 128256 in isolation and ~2% under sustained load with
the logits stored as such (benchmark/probes/logits_tma_gemm_probe.py); storing them less their tile max costs
it ~1-2% (benchmark/NOTES.md).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from . import nvidia_major
from .ce_triton import _sm_count
from .fast_exp_triton import exp_ftz
from .softcap_triton import capped, tile_shift


class TileConfig(NamedTuple):
    """GEMM tile (block_m x block_n, k-steps of block_k), pipeline stages, warps, grouped order width.
    From benchmark/probes/logits_tma_gemm_probe.py on an H100 (commit 6de0f32): 5.73 ms against cuBLAS
    6.00 at 4096 x 4096 x 128256; 128 x 128 tiles and 256 x 128 were slower."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    warps: int = 8
    group: int = 8


TILE = TileConfig()
# Fewest chunk rows for this path: below it the GEMM is a memory-bound pass over W that cuBLAS serves
# well and the CE kernel's reads are few (small batches keep their launch-count-tuned path).
MIN_ROWS = 256


@triton.jit
def _tile_coords(tile, grid_m, grid_n, GROUP: tl.constexpr):
    """Grouped order: GROUP row tiles in a row use each W tile while it is in L2."""
    width = GROUP * grid_n
    first_m = (tile // width) * GROUP
    size_m = min(grid_m - first_m, GROUP)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    """The (BM, BN) tile of x @ w^T (+ bias) at (m0, n0) in float32, and its column indices (BN,)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ks in range(tl.cdiv(K, BK)):
        a = x_desc.load([m0, ks * BK])
        w = w_desc.load([n0, ks * BK])
        acc = tl.dot(a, w.T, acc)
    cols = n0 + tl.arange(0, BN)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc, cols


@triton.jit
def _logits_stats_kernel(x_desc, w_desc, out_desc, bias_ptr, max_ptr, sum_ptr, M, N, K, inv_temp, softcap,
                         HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SUM: tl.constexpr, OUTPUT: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                         PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    # One program per SM walks the tiles; flatten lets the next tile's loads start during this epilogue.
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc, cols = tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS, BM, BN, BK)
        tile_epilogue(acc, cols, out_desc, max_ptr, sum_ptr, m0, n0, pid_n, grid_n, M, N, inv_temp, softcap,
                      HAS_SOFTCAP, HAS_SUM, OUTPUT)


@triton.jit
def tile_epilogue(acc, cols, out_desc, max_ptr, sum_ptr, m0, n0, pid_n, grid_n, M, N, inv_temp, softcap,
                  HAS_SOFTCAP: tl.constexpr, HAS_SUM: tl.constexpr, OUTPUT: tl.constexpr):
    """What OUTPUT says of the float32 (BM, BN) tile ``acc`` at (m0, n0) stored through ``out_desc``, and
    its rows' max of r and (``HAS_SUM``) sum of exp(z - max z) written at column ``pid_n`` of the (M, grid_n)
    statistics."""
    if OUTPUT == STORE_EXP:
        row_max, row_sum = _store_exp(acc, cols, out_desc, m0, n0, N, inv_temp)
    else:
        row_max, row_sum = _store_shifted(acc, cols, out_desc, m0, n0, N, inv_temp, softcap, HAS_SOFTCAP,
                                          OUTPUT == STORE_LOGITS, HAS_SUM)
    rows = m0 + tl.arange(0, acc.shape[0])
    stat = rows.to(tl.int64) * grid_n + pid_n
    tl.store(max_ptr + stat, row_max, mask=rows < M)
    if HAS_SUM:
        tl.store(sum_ptr + stat, row_sum, mask=rows < M)


# What the GEMM writes besides its statistics: the logits (less their tile max: ``_store_shifted``), e = exp(z)
# (``_store_exp``), or nothing (a loss without gradients needs the statistics alone: ``loss_only.py``).
STORE_LOGITS = tl.constexpr(0)
STORE_EXP = tl.constexpr(1)
STORE_NOTHING = tl.constexpr(2)


# Rows of a tile whose max z lies in [EXP_LOW, EXP_HIGH] store exp(z) (STORE_EXP): at e^60 float32 keeps a
# factor e^28 of headroom below overflow for the sums, at e^-80 the tile's largest terms are normal floats.
# Beyond, a row stores exp(z - max) instead and its lse says so to the caller (``exp_rows_triton``).
EXP_HIGH = tl.constexpr(60.0)
EXP_LOW = tl.constexpr(-80.0)


@triton.jit
def _store_shifted(acc, cols, out_desc, m0, n0, N, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr, STORE: tl.constexpr,
                   SUM: tl.constexpr):
    """Store d = r - shift, r = acc / T and shift = the row's max of r over the tile (``tile_shift``: with a
    softcap at most a limit), if ``STORE``; return each row's tile max of r and (``SUM``) sum of exp(z - max z)
    of the values as stored, z = softcap(d + shift) (z = r without softcap; softcap is increasing, so max z =
    softcap(max r)). A rounded logit is off by up to |r| 2^-9 in bf16: 2.3x the bf16 rounding of the exact
    gradients at logits of std 3, 8.5x at std 6 (a trained model's), the error every method that stores bf16
    logits makes (benchmark/NOTES.md). Stored less its tile max, a logit that carries probability is off by
    |r - max| 2^-9, near 0; the CE kernel adds the shift back in float32 (``ce_triton``)."""
    valid = cols[None, :] < N
    r = tl.where(valid, acc * inv_temp, float("-inf"))
    row_max = tl.max(r, 1)
    shift = tile_shift(row_max, softcap, HAS_SOFTCAP)[:, None]
    d = r - shift
    if STORE:
        stored = d.to(out_desc.dtype)
        out_desc.store([m0, n0], stored)
        d = stored.to(tl.float32)
    row_sum = row_max  # without SUM: the caller takes the shift alone (``log_probs``)
    if SUM:
        if HAS_SOFTCAP:  # one tanh per logit
            z = tl.where(valid, capped(d + shift, 1.0, softcap, HAS_SOFTCAP), float("-inf"))
            e = exp_ftz(z - capped(row_max, 1.0, softcap, HAS_SOFTCAP)[:, None])
        else:
            e = exp_ftz(d)
        row_sum = tl.sum(e, 1)
    return row_max, row_sum


@triton.jit
def _store_exp(acc, cols, out_desc, m0, n0, N, inv_temp):
    """Store e = exp(z - shift), z = acc / T unrounded and shift = 0 unless the row's tile max lies outside
    [EXP_LOW, EXP_HIGH] (then the max), and return each row's tile max of z and sum of exp(z - max): one
    exp per logit, no branch that would stall the tile loop."""
    z = tl.where(cols[None, :] < N, acc * inv_temp, float("-inf"))
    row_max = tl.max(z, 1)
    shift = tl.where((row_max > EXP_HIGH) | (row_max < EXP_LOW), row_max, 0.0)
    e = exp_ftz(z - shift[:, None])
    out_desc.store([m0, n0], e.to(out_desc.dtype))
    return row_max, tl.sum(e, 1) * tl.exp(shift - row_max)


def num_tiles(vocab: int) -> int:
    """Tile partials per row: columns of the (rows, num_tiles) max and sum buffers."""
    return triton.cdiv(vocab, TILE.block_n)


def tma_ready(t: torch.Tensor, check_address: bool = True) -> bool:
    """A tensor descriptor needs unit inner stride, 16-byte aligned outer strides and base address."""
    aligned = t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
    return aligned and (not check_address or t.data_ptr() % 16 == 0)


# Tests set this to run the path under TRITON_INTERPRET=1 (fp16 only: the interpreter of triton 3.9
# reads bf16 through tensor descriptors wrongly). Never for CPU users: it is slow there.
ALLOW_INTERPRETER = False


def hopper(device: torch.device) -> bool:
    """Whether this path's GPU generation is there (an NVIDIA GPU of capability 9 or newer; the interpreter
    in tests)."""
    if device.type != "cuda":
        return ALLOW_INTERPRETER and os.environ.get("TRITON_INTERPRET") == "1"
    return nvidia_major(device) >= 9


def supported(x_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None, check_address: bool = True, device: torch.device | None = None) -> bool:
    """Whether this path can run the chunk (Hopper or newer, 16-bit floats, TMA-able layouts, a unit-stride
    bias, enough rows, a vocabulary), storing into ``out`` if given: its rows must start 16-byte aligned too
    (``tma_ready``; at any V a buffer from ``gemm.padded_rows`` does). Without ``check_address`` the base
    addresses are not asked (fake tensors have none); ``device``: the operands' (where they are meta tensors)."""
    return (
        x_c.shape[0] >= MIN_ROWS
        and weight.shape[0] > 0
        and x_c.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x_c.dtype
        and (bias is None or bias.stride(0) == 1)
        and tma_ready(x_c, check_address)
        and tma_ready(weight, check_address)
        and (out is None or tma_ready(out, check_address))
        and hopper(device or x_c.device)
    )


def logits_with_tile_stats(
    x_c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile_max: torch.Tensor,
    tile_sum: torch.Tensor | None,
    opts: LossOptions,
    store_exp: bool = False,
) -> None:
    """Per row and tile of ``block_n`` columns, of the logits r = (x_c @ weight^T (+ bias)) / T: in out, r
    less the row's tile max of r (with a softcap, at most a limit: ``softcap_triton.tile_shift``); in
    tile_max, that max; in tile_sum (if given), the sum of exp(z - max z) with z = softcap(r) (z = r without
    softcap), of the values as stored (``_store_shifted``). With ``store_exp`` (no
    softcap), out = exp(z) instead (exp(z - tile max) in rows whose tile max lies outside [EXP_LOW,
    EXP_HIGH]), from z unrounded, and the statistics are those of the unrounded z (``exp_logits.py``).

    Shapes: x_c (n, H), weight (V, H), bias (V,) or None, out (n, V) in x_c's dtype,
    tile_max / tile_sum (n, num_tiles(V)) float32 contiguous. Check ``supported`` first.
    """
    assert not (store_exp and (opts.softcap is not None or tile_sum is None)), "store_exp: sums, no softcap"
    _launch(x_c, weight, bias, out, tile_max, tile_sum, opts, STORE_EXP if store_exp else STORE_LOGITS)


def tile_stats(x_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile_max: torch.Tensor,
               tile_sum: torch.Tensor, opts: LossOptions) -> None:
    """The statistics of ``logits_with_tile_stats`` alone, of the unrounded logits; nothing else is written.
    Shapes as there. Check ``supported`` first."""
    _launch(x_c, weight, bias, None, tile_max, tile_sum, opts, STORE_NOTHING)


def _launch(x_c, weight, bias, out, tile_max, tile_sum, opts: LossOptions, output: int):
    """Returns the launched kernel (its registers and shared memory, for probes)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, hidden = x_c.shape
    vocab = weight.shape[0]
    config = TILE  # read at call time: tests shrink it for the interpreter
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    programs = min(_sm_count(x_c.device.index), triton.cdiv(n, bm) * triton.cdiv(vocab, bn))
    x_desc = TensorDescriptor.from_tensor(x_c, [bm, bk])
    return _logits_stats_kernel[(programs,)](
        x_desc,
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        x_desc if out is None else TensorDescriptor.from_tensor(out, [bm, bn]),  # never written without out
        bias if bias is not None else tile_max,
        tile_max,
        tile_max if tile_sum is None else tile_sum,  # never written without tile_sum
        n,
        vocab,
        hidden,
        1.0 / opts.temperature,
        float(opts.softcap or 1.0),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=opts.softcap is not None,
        HAS_SUM=tile_sum is not None,
        OUTPUT=output,
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP=config.group,
        PROGRAMS=programs,
        num_stages=config.stages,
        num_warps=config.warps,
    )
