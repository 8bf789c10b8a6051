"""Triton kernels of the Mixtral experts layer: grouped GEMMs over expert-sorted rows, SwiGLU, combine.

Rows are token-expert pairs sorted by expert; ``offsets`` (E + 1,) int32 on the device holds where each
expert's rows start (``offsets[E]`` = rows in use; rows past it belong to dropped pairs and are never
read). Nothing here reads routing data on the host, so every launch has a static grid and can be
captured in a CUDA graph:

- ``grouped_rows_triton``: ``out[r] = a[r] @ w[e]`` for the rows r of expert e. The grid covers the
  worst case, ``cdiv(S, BLOCK_M) + E`` row tiles; each program finds its expert and row tile from
  ``offsets`` and tiles past the last expert return at once.
- ``grouped_wgrad_triton``: ``out[e] = a_e^T @ b_e``, one program per output tile and expert, the
  reduction running over that expert's rows (zero rows give a zero gradient).
- the activation (SwiGLU and its variants, relu2) forward / backward, the top-k combine (and its backward), the
  biases' per-expert sums: memory-bound, float32 inside.

On CUDA the GEMM tile sizes are autotuned per problem size; under the CPU interpreter (tests) one small
fixed configuration runs.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from . import nvidia_major
from .experts_torch import SWIGLU, Activation
from .softcap_triton import capped_slope

try:  # host-side TMA descriptors: triton 3.4+
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the TMA variant is simply not offered
    TensorDescriptor = None

# ------------------------------------------------------------------------------------ grouped GEMMs


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Consecutive programs walk GROUP_M row tiles per column tile, so weight tiles stay in L2.
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m
    return pid_m, pid_n


@triton.jit
def _wrap(idx, size, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    # In-bounds indices for unmasked loads; when tiles divide the size, say so, so that loads vectorize.
    if EVEN:
        return tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    return idx % size


@triton.jit
def _tile_rows(offsets_ptr, num_experts, pid_m, BLOCK_M: tl.constexpr):
    """Expert and row range [row_start, row_end) of the pid_m-th row tile; expert -1 past the last one."""
    expert = -1
    row_start = 0
    row_end = 0
    tiles_before = 0
    seg_start = tl.load(offsets_ptr)
    for e in range(num_experts):
        seg_end = tl.load(offsets_ptr + e + 1)
        n_tiles = tl.cdiv(seg_end - seg_start, BLOCK_M)
        hit = (pid_m >= tiles_before) & (pid_m < tiles_before + n_tiles)
        expert = tl.where(hit, e, expert)
        row_start = tl.where(hit, seg_start + (pid_m - tiles_before) * BLOCK_M, row_start)
        row_end = tl.where(hit, seg_end, row_end)
        tiles_before += n_tiles
        seg_start = seg_end
    return expert, row_start, row_end


@triton.jit
def _grouped_rows_kernel(
    a_ptr, w_ptr, out_ptr, offsets_ptr, num_experts, N, K, ROWS_BUCKET,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.num_programs(0) // num_pid_n, num_pid_n, GROUP_M)
    expert, row_start, row_end = _tile_rows(offsets_ptr, num_experts, pid_m, BLOCK_M)
    if expert < 0:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    # Clamped rows and wrapped columns: the main loop loads without masks; the store masks instead.
    rows_in = tl.where(rows < row_end, rows, row_start).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = _wrap(cols, N, BLOCK_N, EVEN_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols_in[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_in = ks < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_rows_tma_kernel(
    a_desc, w_desc, out_ptr, offsets_ptr, num_experts, N, K, ROWS_BUCKET, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_KN: tl.constexpr,
):
    # Same tiles as _grouped_rows_kernel, operands through TMA descriptors: a (S, K); w as (E*K, N)
    # when W_KN, else (E*N, K). A tile may run into the next expert's rows or weight rows: those only
    # reach rows and columns that are not stored, or meet zero-filled K columns of a.
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.num_programs(0) // num_pid_n, num_pid_n, GROUP_M)
    expert, row_start, row_end = _tile_rows(offsets_ptr, num_experts, pid_m, BLOCK_M)
    if expert < 0:
        return
    col_start = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([row_start, k * BLOCK_K])
        if W_KN:
            w = w_desc.load([expert * K + k * BLOCK_K, col_start])
        else:
            w = w_desc.load([expert * N + col_start, k * BLOCK_K]).T
        acc = tl.dot(a, w, acc)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, M, N, ROWS_BUCKET,
    stride_ar, stride_am, stride_br, stride_bn, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):
    expert = tl.program_id(1)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    seg_start = tl.load(offsets_ptr + expert)
    seg_end = tl.load(offsets_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_cols = a_ptr + _wrap(offs_m, M, BLOCK_M, EVEN_M)[:, None] * stride_am
    b_cols = b_ptr + _wrap(offs_n, N, BLOCK_N, EVEN_N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(seg_start, seg_end, BLOCK_K):  # the reduction runs over this expert's rows only
        rows = r + ks
        row_in = rows < seg_end
        a = tl.load(a_cols + rows.to(tl.int64)[None, :] * stride_ar, mask=row_in[None, :], other=0.0)
        b = tl.load(b_cols + rows.to(tl.int64)[:, None] * stride_br, mask=row_in[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def _config(bm, bn, bk, stages, warps, group_m=8, pre_hook=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_stages=stages, num_warps=warps, pre_hook=pre_hook)


def _set_tma_blocks(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bk, bn] if nargs["W_KN"] else [bn, bk]


def _prune_row_tiles(configs, named_args, **_):
    # Tall tiles only pay when experts get many rows, short ones only when they get few.
    rows = named_args["ROWS_BUCKET"]
    kept = [c for c in configs if not (c.kwargs["BLOCK_M"] > rows or (c.kwargs["BLOCK_M"] < 128 and rows >= 1024))]
    return kept or configs[:1]


def _quick_bench(kernel_call, quantiles):
    return do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


# Shorter autotuning runs where this triton accepts a benchmark function (3.2+).
_TUNE = {"do_bench": _quick_bench} if "do_bench" in inspect.signature(triton.autotune).parameters else {}


# Hopper-sized tiles; the small-M ones matter when few tokens reach each expert.
_ROWS_CONFIGS = [
    _config(128, 256, 64, 3, 8),
    _config(128, 128, 64, 4, 4),
    _config(256, 128, 64, 3, 8),
    _config(64, 256, 64, 4, 4),
    _config(64, 128, 64, 4, 4),
]
_TMA_CONFIGS = [
    _config(128, 256, 64, 3, 8, pre_hook=_set_tma_blocks),
    _config(128, 128, 64, 4, 4, pre_hook=_set_tma_blocks),
    _config(256, 128, 64, 3, 8, pre_hook=_set_tma_blocks),
    _config(64, 256, 64, 4, 4, pre_hook=_set_tma_blocks),
]
_WGRAD_CONFIGS = [
    _config(128, 256, 64, 3, 8),
    _config(256, 128, 64, 3, 8),
    _config(128, 128, 64, 4, 4),
    _config(128, 128, 32, 4, 4),
]
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}

_rows_kernel = triton.heuristics({
    "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
    "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0,
})(_grouped_rows_kernel)
_wgrad_kernel = triton.heuristics({
    "EVEN_M": lambda args: args["M"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0,
})(_grouped_wgrad_kernel)
_PRUNE = {"early_config_prune": _prune_row_tiles}
_rows_tuned = triton.autotune(_ROWS_CONFIGS, key=["N", "K", "ROWS_BUCKET", "stride_wk", "stride_ak"],
                              prune_configs_by=_PRUNE, **_TUNE)(_rows_kernel)
_rows_tma_tuned = triton.autotune(_TMA_CONFIGS, key=["N", "K", "ROWS_BUCKET", "W_KN"], prune_configs_by=_PRUNE,
                                  **_TUNE)(_grouped_rows_tma_kernel)
_wgrad_tuned = triton.autotune(_WGRAD_CONFIGS, key=["M", "N", "ROWS_BUCKET", "stride_am", "stride_bn"],
                               **_TUNE)(_wgrad_kernel)


def _rows_bucket(rows: int, num_experts: int) -> int:
    """Power of two near the mean rows per expert: the autotune key, so that tiles follow the load."""
    return triton.next_power_of_2(max(1, rows // max(1, num_experts)))


def grouped_rows_triton(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ w[e] for the rows of each expert e.

    Args:
        a: (S, K), unit stride along K. w: (E, K, N), any strides (a transposed view is fine).
        offsets: (E + 1,) int32, expert e owns rows [offsets[e], offsets[e+1]).
    Returns:
        (S, N) in a's dtype; rows at or past offsets[E] are left unwritten.
    """
    rows, k = a.shape
    num_experts, _, n = w.shape
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    args = (a, w, out, offsets, num_experts, n, k, _rows_bucket(rows, num_experts),
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1))
    _launch_rows(_rows_tuned, _rows_kernel, args, rows, n, num_experts, IEEE=a.dtype == torch.float32)
    return out


def _launch_rows(tuned, kernel, args, rows: int, n: int, num_experts: int, **flags) -> None:
    """Row tiles for the worst case (cdiv(S, BLOCK_M) + E) times column tiles; autotuned on CUDA."""

    def grid(meta):
        return ((triton.cdiv(rows, meta["BLOCK_M"]) + num_experts) * triton.cdiv(n, meta["BLOCK_N"]),)

    if args[2].device.type == "cuda":
        tuned[grid](*args, **flags)
    else:
        kernel[grid(_INTERPRETER_CONFIG)](*args, **_INTERPRETER_CONFIG, **flags)


def tma_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_rows_tma_triton` can take these operands: TMA (Hopper+) and its layout rules."""
    if TensorDescriptor is None or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    if a.device.type == "cuda" and nvidia_major(a.device) < 9:
        return False
    experts, k, n = w.shape
    dense_w = w.stride(0) == k * n and (w.stride(1), w.stride(2)) in ((n, 1), (1, k))
    aligned = all(t.data_ptr() % 16 == 0 for t in (a, w)) and k % 8 == 0 and n % 8 == 0
    return a.stride(1) == 1 and a.stride(0) == k and dense_w and aligned


def grouped_rows_tma_triton(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_rows_triton` with TMA loads (needs :func:`tma_ok`): a (S, K) contiguous, w (E, K, N)
    contiguous or the transposed view of a contiguous (E, N, K)."""
    rows, k = a.shape
    num_experts, _, n = w.shape
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    w_kn = w.stride(2) == 1
    block = _INTERPRETER_CONFIG["BLOCK_M"]  # replaced per configuration by _set_tma_blocks on CUDA
    a_desc = TensorDescriptor(a, [rows, k], [k, 1], [block, block])
    w_desc = (TensorDescriptor(w, [num_experts * k, n], [n, 1], [block, block]) if w_kn
              else TensorDescriptor(w, [num_experts * n, k], [k, 1], [block, block]))
    args = (a_desc, w_desc, out, offsets, num_experts, n, k, _rows_bucket(rows, num_experts), out.stride(0), 1)
    _launch_rows(_rows_tma_tuned, _grouped_rows_tma_kernel, args, rows, n, num_experts, W_KN=w_kn)
    return out


def grouped_wgrad_triton(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e]; zero for an expert without rows.

    Args:
        a: (S, M), b: (S, N), any strides. offsets: (E + 1,) int32 as in :func:`grouped_rows_triton`.
    Returns:
        (E, M, N) in a's dtype, float32 accumulation.
    """
    rows, m = a.shape
    n = b.shape[1]
    num_experts = offsets.numel() - 1
    out = torch.empty(num_experts, m, n, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    ieee = a.dtype == torch.float32
    args = (a, b, out, offsets, m, n, _rows_bucket(rows, num_experts),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2))

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), num_experts)

    if a.device.type == "cuda":
        _wgrad_tuned[grid](*args, IEEE=ieee)
    else:
        _wgrad_kernel[grid(_INTERPRETER_CONFIG)](*args, **_INTERPRETER_CONFIG, IEEE=ieee)
    return out


# ------------------------------------------------------------------------------ elementwise stages

_BLOCK = 1024


@triton.jit
def _load_pair(row_ptr, start, I, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A block's gate and up projections (columns start + [0, BLOCK) of each half) of a row of h (S, 2I), float32:
    the gate half first, or alternating (loaded as one contiguous run of 2 * BLOCK and split)."""
    if INTERLEAVED:
        both = 2 * start + tl.arange(0, 2 * BLOCK)
        pairs = tl.load(row_ptr + both, mask=both < 2 * I, other=0.0).to(tl.float32)
        return tl.split(tl.reshape(pairs, (BLOCK, 2)))
    cols = start + tl.arange(0, BLOCK)
    gate = tl.load(row_ptr + cols, mask=cols < I, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + I + cols, mask=cols < I, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _store_pair(row_ptr, start, I, gate, up, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    # _load_pair's inverse
    gate, up = gate.to(row_ptr.dtype.element_ty), up.to(row_ptr.dtype.element_ty)
    if INTERLEAVED:
        both = 2 * start + tl.arange(0, 2 * BLOCK)
        tl.store(row_ptr + both, tl.reshape(tl.join(gate, up), (2 * BLOCK,)), mask=both < 2 * I)
    else:
        cols = start + tl.arange(0, BLOCK)
        tl.store(row_ptr + cols, gate, mask=cols < I)
        tl.store(row_ptr + I + cols, up, mask=cols < I)


@triton.jit
def _gate_up(h_ptr, row, stride_h, I, start, bias_ptr, experts_ptr, stride_bias,
             HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    gate, up = _load_pair(h_ptr + row * stride_h, start, I, BLOCK, INTERLEAVED)
    if HAS_BIAS:  # the row's expert's bias (rows here are below n_valid: a real expert)
        gate_bias, up_bias = _load_pair(bias_ptr + tl.load(experts_ptr + row) * stride_bias, start, I, BLOCK,
                                        INTERLEAVED)
        gate += gate_bias
        up += up_bias
    return gate, up


@triton.jit
def _clamped(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """gate.clamp(max=limit), up.clamp(-limit, limit) as torch computes them (NaN stays NaN)."""
    if HAS_LIMIT:
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return gate, up


@triton.jit
def _swiglu_kernel(h_ptr, a_ptr, n_valid_ptr, bias_ptr, experts_ptr, I, stride_h, stride_a, stride_bias,
                   limit, alpha, up_offset, gate_cap, up_cap, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   INTERLEAVED: tl.constexpr, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(n_valid_ptr):  # rows of dropped pairs hold no data
        return
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < I
    gate, up = _gate_up(h_ptr, row, stride_h, I, start, bias_ptr, experts_ptr, stride_bias, HAS_BIAS, INTERLEAVED,
                        BLOCK)
    gate, up = _clamped(gate, up, limit, HAS_LIMIT)
    factor, _ = capped_slope(gate, 1.0, gate_cap, GATE_CAP)  # the sigmoid sees the gate itself
    up, _ = capped_slope(up, 1.0, up_cap, UP_CAP)
    act = factor * tl.sigmoid(alpha * gate) * (up + up_offset)
    tl.store(a_ptr + row * stride_a + cols, act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, n_valid_ptr, bias_ptr, experts_ptr, I, stride_h, stride_da,
                       stride_dh, stride_bias, limit, alpha, up_offset, gate_cap, up_cap, HAS_LIMIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, GATE_CAP: tl.constexpr,
                       UP_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(n_valid_ptr):
        return
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < I
    gate_in, up_in = _gate_up(h_ptr, row, stride_h, I, start, bias_ptr, experts_ptr, stride_bias, HAS_BIAS,
                              INTERLEAVED, BLOCK)
    gate, up = _clamped(gate_in, up_in, limit, HAS_LIMIT)
    up, up_slope = capped_slope(up, 1.0, up_cap, UP_CAP)
    up += up_offset
    da = tl.load(da_ptr + row * stride_da + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(alpha * gate)
    if GATE_CAP:  # d/dg of c tanh(g / c) sigmoid(alpha g)
        factor, gate_slope = capped_slope(gate, 1.0, gate_cap, True)
        act = factor * sig
        d_gate = da * up * (gate_slope * sig + alpha * factor * sig * (1.0 - sig))
    else:
        act = gate * sig
        d_gate = da * up * sig * (1.0 + alpha * gate * (1.0 - sig))
    d_up = da * act
    if UP_CAP:
        d_up *= up_slope
    if HAS_LIMIT:  # a clamped input gets no gradient (torch's clamp passes it where min <= x <= max)
        d_gate = tl.where(gate_in <= limit, d_gate, 0.0)
        d_up = tl.where((up_in >= -limit) & (up_in <= limit), d_up, 0.0)
    _store_pair(dh_ptr + row * stride_dh, start, I, d_gate, d_up, BLOCK, INTERLEAVED)
    # da is dead once read: the recomputed activation (for the down projection's weight grad) replaces it.
    tl.store(da_ptr + row * stride_da + cols, (act * up).to(da_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_kernel(h_ptr, a_ptr, n_valid_ptr, bias_ptr, experts_ptr, I, stride_h, stride_a, stride_bias, dh_ptr,
                  stride_dh, HAS_BIAS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    # relu(h)^2 into a; BACKWARD: a holds da on entry, dh = 2 da relu(h) is stored and a recomputed over da.
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(n_valid_ptr):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    h = _biased_row(h_ptr + row * stride_h, cols, mask, bias_ptr, experts_ptr + row, stride_bias, HAS_BIAS)
    positive = tl.maximum(h, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu keeps it
    a_row = a_ptr + row * stride_a + cols
    if BACKWARD:
        da = tl.load(a_row, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + row * stride_dh + cols, (2.0 * da * positive).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(a_row, (positive * positive).to(a_ptr.dtype.element_ty), mask=mask)


def activation_triton(h: torch.Tensor, n_valid: torch.Tensor, act: Activation = SWIGLU,
                      bias: torch.Tensor | None = None, row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`Activation` of h (S, 2I) (relu2: (S, I)) (unit column stride) -> (S, I); bias (E, 2I) (relu2: (E, I))
    (unit column stride) added to each row's expert's projection (``row_experts`` (S,) int64). Rows at or past
    ``n_valid`` ((1,) int32 on the device) are skipped (left unwritten)."""
    rows, inter = h.shape[0], h.shape[1] // 2 if act.gated else h.shape[1]
    a = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if a.numel():
        grid = (rows, triton.cdiv(inter, _BLOCK))
        common = (*_bias_args(bias, row_experts, h), inter, h.stride(0), a.stride(0), _bias_stride(bias))
        if act.gated:
            _swiglu_kernel[grid](h, a, n_valid, *common, *_swiglu_args(act), **_swiglu_flags(act, bias), BLOCK=_BLOCK)
        else:
            _relu2_kernel[grid](h, a, n_valid, *common, a, 0, HAS_BIAS=bias is not None, BACKWARD=False, BLOCK=_BLOCK)
    return a


def activation_backward_triton(h: torch.Tensor, da: torch.Tensor, n_valid: torch.Tensor, act: Activation = SWIGLU,
                               bias: torch.Tensor | None = None,
                               row_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, a (S, I)) from h and da (S, I), dh shaped as h; ``a`` is written over ``da``; rows past n_valid skipped."""
    rows, inter = da.shape
    dh = torch.empty(rows, h.shape[1], dtype=h.dtype, device=h.device)
    if da.numel():
        grid = (rows, triton.cdiv(inter, _BLOCK))
        biases, bias_stride = _bias_args(bias, row_experts, h), _bias_stride(bias)
        if act.gated:
            _swiglu_bwd_kernel[grid](h, da, dh, n_valid, *biases, inter, h.stride(0), da.stride(0), dh.stride(0),
                                     bias_stride, *_swiglu_args(act), **_swiglu_flags(act, bias), BLOCK=_BLOCK)
        else:  # da in, a out, in place
            _relu2_kernel[grid](h, da, n_valid, *biases, inter, h.stride(0), da.stride(0), bias_stride, dh,
                                dh.stride(0), HAS_BIAS=bias is not None, BACKWARD=True, BLOCK=_BLOCK)
    return dh, da


def _swiglu_args(act: Activation) -> tuple[float, ...]:
    # floats either way (absent: 0.0), so that a form's values do not each compile a kernel
    return (*(0.0 if v is None else float(v) for v in (act.limit, act.alpha, act.up_offset, act.gate_softcap,
                                                        act.up_softcap)),)


def _swiglu_flags(act: Activation, bias: torch.Tensor | None) -> dict[str, bool]:
    return {"HAS_LIMIT": act.limit is not None, "HAS_BIAS": bias is not None, "INTERLEAVED": act.interleaved,
            "GATE_CAP": act.gate_softcap is not None, "UP_CAP": act.up_softcap is not None}


def _bias_args(bias: torch.Tensor | None, row_experts: torch.Tensor | None, placeholder: torch.Tensor):
    if bias is None:
        return placeholder, placeholder
    if bias.stride(-1) != 1 or row_experts is None:
        raise ValueError("a bias needs unit column stride and the rows' experts (row_experts)")
    return bias, row_experts


def _bias_stride(bias: torch.Tensor | None) -> int:
    return 0 if bias is None else bias.stride(0)


@triton.jit
def _expert_sums_kernel(d_ptr, out_ptr, offsets_ptr, N, stride_d, stride_out,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r in range(start, end, BLOCK_R):  # a fixed order: the same sums on every run
        rows = r + tl.arange(0, BLOCK_R)
        ptrs = d_ptr + rows.to(tl.int64)[:, None] * stride_d + cols[None, :]
        acc += tl.load(ptrs, mask=(rows < end)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + expert.to(tl.int64) * stride_out + cols, tl.sum(acc, 0), mask=cols < N)


def expert_sums_triton(d: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """(E, N) float32: the sum of d's (S, N) rows (unit column stride) per expert, expert e's rows being
    [offsets[e], offsets[e + 1]) (a bias's gradient; ``row_experts`` is the torch twin's way to them)."""
    num_experts, n = offsets.numel() - 1, d.shape[1]
    out = torch.empty(num_experts, n, dtype=torch.float32, device=d.device)
    if out.numel():
        block_r, block_n = 32, 128
        _expert_sums_kernel[(num_experts, triton.cdiv(n, block_n))](
            d, out, offsets, n, d.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_N=block_n)
    return out


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, n_valid_ptr, bias_ptr, experts_ptr, H, stride_y, stride_out,
                    stride_bias, TOP_K: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    n_valid = tl.load(n_valid_ptr)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + token * TOP_K + j)
        in_use = cols < tl.where(p < n_valid, H, 0)  # a dropped pair's row is never read
        row = _biased_row(y_ptr + p * stride_y, cols, in_use, bias_ptr, experts_ptr + p, stride_bias, HAS_BIAS)
        if HAS_W:
            row = row * tl.load(w_ptr + token * TOP_K + j).to(tl.float32)
        acc += row
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _biased_row(row_ptr, cols, mask, bias_ptr, expert_ptr, stride_bias, HAS_BIAS: tl.constexpr):
    # a row of y in float32, plus its expert's bias (masked entries 0)
    row = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = tl.load(expert_ptr)  # E for a dropped pair, whose mask is empty
        row += tl.load(bias_ptr + expert * stride_bias + cols, mask=mask, other=0.0).to(tl.float32)
    return row


@triton.jit
def _combine_bwd_kernel(g_ptr, y_ptr, perm_ptr, w_ptr, dy_ptr, dw_ptr, n_valid_ptr, bias_ptr, experts_ptr, H,
                        stride_g, stride_y, stride_dy, stride_bias,
                        TOP_K: tl.constexpr, NEED_DW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    valid = p < tl.load(n_valid_ptr)
    pair = tl.load(perm_ptr + p)
    token = pair // TOP_K
    w = tl.load(w_ptr + pair).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        g = tl.load(g_ptr + token * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.where(valid, g * w, 0.0)
        tl.store(dy_ptr + p * stride_dy + cols, dy.to(dy_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            in_use = cols < tl.where(valid, H, 0)
            dot += g * _biased_row(y_ptr + p * stride_y, cols, in_use, bias_ptr, experts_ptr + p, stride_bias,
                                   HAS_BIAS)
    if NEED_DW:
        tl.store(dw_ptr + pair, tl.where(valid, tl.sum(dot, 0), 0.0).to(dw_ptr.dtype.element_ty))


def combine_triton(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, n_valid: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * (y[p] + bias[row_experts[p]]), p = pos[t, j], in float32 (rows at or past
    n_valid count as 0).

    y: (S, H) unit column stride; pos: (T, k) int64 contiguous; weights: (T, k) contiguous or None (all
    ones); n_valid: 0-d or (1,) int32 on the device; bias: (E, H) unit column stride, or None. Returns (T, H) in
    ``out_dtype``.
    """
    tokens, top_k = pos.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=y.device)
    if out.numel():
        _combine_kernel[(tokens, triton.cdiv(hidden, _BLOCK))](
            y, pos, weights if weights is not None else y, out, n_valid, *_bias_args(bias, row_experts, y), hidden,
            y.stride(0), out.stride(0), _bias_stride(bias), TOP_K=top_k, HAS_W=weights is not None,
            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return out


def combine_backward_triton(grad: torch.Tensor, y: torch.Tensor | None, perm: torch.Tensor, weights: torch.Tensor,
                            n_valid: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                            row_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of :func:`combine_triton` per sorted row p (pair ``perm[p]``, token ``perm[p] // k``).

    Returns dy (S, H) in ``dtype`` = weight * grad[token] (0 past n_valid) and, when ``y`` is given,
    d weights (T, k) = <grad[token], y[p] + bias[row_experts[p]]> in the weights' dtype.
    """
    rows, hidden = perm.numel(), grad.shape[1]
    dy = torch.empty(rows, hidden, dtype=dtype, device=grad.device)
    dw = torch.empty_like(weights) if y is not None else None
    if rows:
        _combine_bwd_kernel[(rows,)](
            grad, y if y is not None else grad, perm, weights, dy, dw if dw is not None else weights, n_valid,
            *_bias_args(bias, row_experts, grad), hidden, grad.stride(0), y.stride(0) if y is not None else 0,
            dy.stride(0), _bias_stride(bias), TOP_K=weights.shape[1], NEED_DW=y is not None,
            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return dy, dw
