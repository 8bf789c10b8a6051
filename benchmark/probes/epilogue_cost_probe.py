"""Probe: what the Hopper logits GEMM's epilogue costs at small H, part by part. The same persistent
128 x 256 Triton GEMM (``logits_triton``'s tile, grouped order and mainloop) run with a growing epilogue:

- ``store``: the float32 tile rounded and stored, nothing else (Triton's GEMM rate);
- ``max``: the rows' tile max, the tile stored less it, the max written (no exponential);
- ``stats``: flce's statistics without the store (``STORE_NOTHING``, a loss without gradients);
- ``lean``: flce's stored logits and statistics without the column mask and the temperature's multiply
  (exact only where V is a multiple of 256 and T = 1; timing only);
- ``flce``: ``logits_with_tile_stats`` as the chunk loop runs it (``STORE_LOGITS``);
- ``halves`` (3 or 4 stages): flce's epilogue on each 128-column half of the tile in turn, with its own shift and
  statistics (twice the statistics columns; half the live temporaries and staging buffer, so 4 stages fit);
- ``sums first``: flce's epilogue with the tile's store issued after its sums instead of before (the same values
  stored and written; whether the store's shared-memory write delays the exponentials);

against cuBLAS's plain GEMM of the same shape. Medians of interleaved rounds, ms. ``--ttgir`` first prints where
the compiled flce kernel waits for its TMA stores (the ops of its tile loop that touch the store buffer). GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/epilogue_cost_probe.py [--ttgir]
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from common import median_of_rounds, unshifted_logits
from triton.tools.tensor_descriptor import TensorDescriptor

from flce.kernels import logits_triton as lt
from flce.kernels.ce_triton import _sm_count
from flce.kernels.fast_exp_triton import exp_ftz
from flce.options import LossOptions

SHAPES = [(2752, 1024, 151936), (8192, 1024, 151936), (8192, 2048, 128256), (8192, 4096, 128256)]
STORE, MAX, LEAN, LAST, HALVES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)


@triton.jit
def _variant_kernel(x_desc, w_desc, out_desc, max_ptr, sum_ptr, M, N, K, inv_temp, MODE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = lt._tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc, cols = lt.tile_logits(x_desc, w_desc, max_ptr, m0, n0, N, K, False, BM, BN, BK)
        rows = m0 + tl.arange(0, BM)
        stat = rows.to(tl.int64) * grid_n + pid_n
        if MODE == STORE:
            out_desc.store([m0, n0], acc.to(out_desc.dtype))
        elif MODE == MAX:
            r = tl.where(cols[None, :] < N, acc, float("-inf"))
            row_max = tl.max(r, 1)
            out_desc.store([m0, n0], (r - row_max[:, None]).to(out_desc.dtype))
            tl.store(max_ptr + stat, row_max, mask=rows < M)
        elif MODE == HALVES:
            HALF: tl.constexpr = BN // 2
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, HALF)), (0, 2, 1)))
            half_cols = n0 + tl.arange(0, HALF)
            _half_epilogue(a0, half_cols, out_desc, max_ptr, sum_ptr, rows, 2 * pid_n, 2 * grid_n, m0, n0, M, N,
                           inv_temp)
            _half_epilogue(a1, half_cols + HALF, out_desc, max_ptr, sum_ptr, rows, 2 * pid_n + 1, 2 * grid_n, m0,
                           n0 + HALF, M, N, inv_temp)
        elif MODE == LAST:
            r = tl.where(cols[None, :] < N, acc * inv_temp, float("-inf"))
            row_max = tl.max(r, 1)
            stored = (r - row_max[:, None]).to(out_desc.dtype)
            row_sum = tl.sum(exp_ftz(stored.to(tl.float32)), 1)
            tl.store(max_ptr + stat, row_max, mask=rows < M)
            tl.store(sum_ptr + stat, row_sum, mask=rows < M)
            out_desc.store([m0, n0], stored)
        else:
            row_max = tl.max(acc, 1)
            stored = (acc - row_max[:, None]).to(out_desc.dtype)
            out_desc.store([m0, n0], stored)
            tl.store(max_ptr + stat, row_max, mask=rows < M)
            tl.store(sum_ptr + stat, tl.sum(exp_ftz(stored.to(tl.float32)), 1), mask=rows < M)


@triton.jit
def _half_epilogue(acc, cols, out_desc, max_ptr, sum_ptr, rows, stat_col, stat_cols, m0, n0, M, N, inv_temp):
    """flce's epilogue (``_store_shifted`` without softcap) on one half of a tile."""
    r = tl.where(cols[None, :] < N, acc * inv_temp, float("-inf"))
    row_max = tl.max(r, 1)
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)  # a half past V: shift 0, sum 0
    stored = (r - shift[:, None]).to(out_desc.dtype)
    out_desc.store([m0, n0], stored)
    stat = rows.to(tl.int64) * stat_cols + stat_col
    tl.store(max_ptr + stat, row_max, mask=rows < M)
    tl.store(sum_ptr + stat, tl.sum(exp_ftz(stored.to(tl.float32)), 1), mask=rows < M)


def variant(mode, x, w, out, stats, stages=None):
    cfg = lt.TILE
    n, vocab = x.shape[0], w.shape[0]
    programs = min(_sm_count(x.device.index), triton.cdiv(n, cfg.block_m) * triton.cdiv(vocab, cfg.block_n))
    return _variant_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
        TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n // (2 if mode == HALVES else 1)]), stats[0],
        stats[1], n, vocab, x.shape[1], 1.0, MODE=mode, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        GROUP=cfg.group, PROGRAMS=programs, num_stages=stages or cfg.stages, num_warps=cfg.warps)


STORE_OPS = ("scf.for", "tma_store_wait", "local_store", "async_tma_copy_local_to_global", "math.exp", "tt.store",
             "warp_group_dot_wait")


def print_store_schedule(opts: LossOptions) -> None:
    """The lines of flce's compiled logits kernel (TTGIR) that order its TMA store against the tile loop."""
    dev = torch.device("cuda")
    x, w = torch.randn(512, 1024, device=dev).bfloat16(), torch.randn(1024, 1024, device=dev).bfloat16()
    out, stats = torch.empty(512, 1024, device=dev).bfloat16(), torch.empty(2, 512, lt.num_tiles(1024), device=dev)
    kernel = lt._launch(x, w, None, out, stats[0], stats[1], opts, lt.STORE_LOGITS)
    for number, line in enumerate(kernel.asm["ttgir"].splitlines()):
        if any(op in line for op in STORE_OPS):
            print(f"  {number:5d}  {line.strip().split(' loc(')[0][:150]}")


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    opts = LossOptions()
    if "--ttgir" in sys.argv:
        print_store_schedule(opts)
    for rows, hidden, vocab in SHAPES:
        x = torch.randn(rows, hidden, device=dev).bfloat16()
        w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).bfloat16()
        out = torch.empty(rows, vocab, device=dev, dtype=torch.bfloat16)
        stats = torch.empty(2, rows, lt.num_tiles(vocab), device=dev)
        half_stats = torch.empty(2, rows, 2 * lt.num_tiles(vocab), device=dev)
        fns = {
            "cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
            "store": lambda: variant(STORE, x, w, out, stats),
            "max": lambda: variant(MAX, x, w, out, stats),
            "stats": lambda: lt.tile_stats(x, w, None, stats[0], stats[1], opts),
            "lean": lambda: variant(LEAN, x, w, out, stats),
            "flce": lambda: lt.logits_with_tile_stats(x, w, None, out, stats[0], stats[1], opts),
            "sums first": lambda: variant(LAST, x, w, out, stats),
            "halves": lambda: variant(HALVES, x, w, out, half_stats),
            "halves, 4 st": lambda: variant(HALVES, x, w, out, half_stats, stages=4),
        }
        want = (x @ w.t()).float()
        variant(STORE, x, w, out, stats)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"store variant wrong: {err:.2e}"
        lt.logits_with_tile_stats(x, w, None, out, stats[0], stats[1], opts)
        flce_out, flce_stats = out.clone(), stats.clone()
        variant(LAST, x, w, out, stats)
        gap = max((out.float() - flce_out.float()).abs().max().item(), (stats - flce_stats).abs().max().item())
        assert gap < 1e-3, f"sums-first variant differs from flce's epilogue by {gap:.2e}"
        kernel = lt._launch(x, w, None, out, stats[0], stats[1], opts, lt.STORE_LOGITS)
        print(f"  flce: {kernel.n_regs} registers, {kernel.n_spills} spilled", flush=True)
        want = x.float() @ w.float().t()  # unrounded, as the epilogue's (TF32 is off by default)
        for stages in (3, 4):
            kernel = variant(HALVES, x, w, out, half_stats, stages)
            print(f"  halves, {stages} stages: {kernel.n_regs} registers, {kernel.n_spills} spilled", flush=True)
            got = unshifted_logits(out, half_stats[0], lt.TILE.block_n // 2)
            err = ((got - want).abs().max() / want.abs().max()).item()
            lse = (half_stats[0] + half_stats[1].log()).logsumexp(1)
            err = max(err, (lse - want.logsumexp(1)).abs().max().item())
            assert err < 1e-2, f"halves variant wrong ({stages} stages): {err:.2e}"
        times = median_of_rounds(fns, dev, reps=10)
        base = times["cuBLAS mm"]
        tflop = 2 * rows * hidden * vocab / 1e12
        print(f"{rows} x {hidden} x {vocab}:", flush=True)
        for name, ms in times.items():
            print(f"  {name:10s} {ms:8.4f} ms  {ms / base:6.3f}x cuBLAS  {tflop / ms * 1e3:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
