"""Probe: the Hopper GEMMs of flce (the logits GEMM with its epilogue, the low-memory block GEMM) as
Triton 3.6's automatic warp specialization builds them (``tl.range(..., warp_specialize=True)`` with four
warps per group: one producer warp group issuing the TMA loads, two consumer groups each taking half of
the tile's rows through the MMAs and the epilogue) against the software-pipelined kernels flce runs.
The kernels make their tensor descriptors themselves: the partitioner splits the tiles' loads and stores
and rewrites the block of a descriptor made in the kernel, not a host descriptor's (with host descriptors
the loads overrun their shared-memory buffers: an illegal address). Times each kernel alone (alternating,
median of rounds) and checks that the outputs agree.

Result (H100, triton 3.6, `results/2026-11-25-h100-43f9f9c/ws_gemm_probe_f25399d.txt`): the
warp-specialized kernels compile (12 warps, setmaxnreg, no spills) but run 0-3.5% slower than the
pipelined ones, and their outputs are wrong (0.4-1.0 apart, relative): not a route on this Triton.
GPU only:

    PYTHONPATH=src python benchmark/probes/ws_gemm_probe.py [--rounds 7] [--warps 4] [--stages 3]
"""
from __future__ import annotations

import argparse
import contextvars
import statistics
import sys

import torch
import triton
import triton.language as tl

from flce.kernels import block_gemm_triton, logits_triton
from flce.kernels.ce_block_triton import _block_grad, _block_row_terms, row_arguments
from flce.kernels.logits_triton import STORE_EXP, STORE_LOGITS, _tile_coords, tile_epilogue, tile_logits


@triton.jit
def _logits_ws_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, max_ptr, sum_ptr, M, N, K, inv_temp,
                      HAS_BIAS: tl.constexpr, OUTPUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, warp_specialize=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc, cols = tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS, BM, BN, BK)
        tile_epilogue(acc, cols, out_desc, max_ptr, sum_ptr, m0, n0, pid_n, grid_n, M, N, inv_temp, 1.0, False,
                      True, OUTPUT)


@triton.jit
def _block_grad_ws_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, target_ptr, lse_ptr, scale_ptr, class_weight_ptr,
                          weight_sum_ptr, M, N, K, col_start, V, ignore_index, smoothing, z_loss, softcap, inv_temp,
                          HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                          HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
                          ROUND_LOGITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, warp_specialize=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        y, lse, target_coef, extra, scale, valid = _block_row_terms(
            rows, rows < M, target_ptr, lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index,
            smoothing, z_loss, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, SCALE_PER_ROW)
        acc, cols = tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS, BM, BN, BK)
        if ROUND_LOGITS:
            acc = acc.to(out_desc.dtype).to(tl.float32)
        g = _block_grad(acc, col_start + cols, cols < N, y, lse, target_coef, extra, scale, valid, class_weight_ptr,
                        V, smoothing, softcap, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP)
        out_desc.store([m0, n0], g.to(out_desc.dtype))


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(fn):
    """Run a launch with a torch scratch allocator for in-kernel descriptors, leaving the caller's unset."""
    def run():
        triton.set_allocator(_scratch)
        fn()
    contextvars.copy_context().run(run)


def logits_ws(x, w, out, tile_max, tile_sum, store_exp, warps=4, stages=3):
    t = logits_triton.TILE
    n, hidden = x.shape
    vocab = w.shape[0]
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                   triton.cdiv(n, t.block_m) * triton.cdiv(vocab, t.block_n))
    _launch(lambda: _logits_ws_kernel[(programs,)](
        x, w,
        out, tile_max, tile_max, tile_sum, n, vocab, hidden, 1.0, HAS_BIAS=False,
        OUTPUT=STORE_EXP if store_exp else STORE_LOGITS,
        BM=t.block_m, BN=t.block_n, BK=t.block_k, GROUP=t.group, PROGRAMS=programs, num_stages=stages,
        num_warps=warps))


def block_ws(x, w_block, out, col_start, vocab, terms, opts, warps=4, stages=3):
    t = block_gemm_triton.TILE
    n, hidden = x.shape
    cols = w_block.shape[0]
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                   triton.cdiv(n, t.block_m) * triton.cdiv(cols, t.block_n))
    pointers, scalars, flags = row_arguments(terms, opts)
    _launch(lambda: _block_grad_ws_kernel[(programs,)](
        x, w_block,
        out, terms.lse, *pointers, n, cols, hidden, col_start, vocab, *scalars, HAS_BIAS=False, **flags,
        ROUND_LOGITS=not terms.exact_lse, BM=t.block_m, BN=t.block_n, BK=t.block_k, GROUP=t.group,
        PROGRAMS=programs, num_stages=stages, num_warps=warps))


def _median_ms(fns: dict, rounds: int, reps: int) -> dict:
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for k, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                f()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / reps)
    return {k: statistics.median(v) for k, v in times.items()}


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    a = p.parse_args()
    from flce.kernels.ce_block_torch import RowTerms
    from flce.options import LossOptions
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    opts = LossOptions()
    for rows, hidden, vocab in ((4096, 4096, 128256), (8192, 4096, 128256), (32768, 4096, 128256), (8192, 2048, 32000)):
        torch.manual_seed(0)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device="cuda") * 2 / hidden**0.5).bfloat16()
        out_a, out_b = (torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nt = logits_triton.num_tiles(vocab)
        st_a = [torch.empty(rows, nt, device="cuda") for _ in range(2)]
        st_b = [torch.empty(rows, nt, device="cuda") for _ in range(2)]
        for store_exp in (True, False):
            base = lambda: logits_triton.logits_with_tile_stats(x, w, None, out_a, *st_a, opts, store_exp=store_exp)
            ws = lambda: logits_ws(x, w, out_b, *st_b, store_exp, a.warps, a.stages)
            base(); ws(); torch.cuda.synchronize()
            err = max(_rel(out_b, out_a), _rel(st_b[0], st_a[0]), _rel(st_b[1], st_a[1]))
            t = _median_ms({"base": base, "ws": ws, "cublas": lambda: torch.mm(x, w.t(), out=out_a)}, a.rounds, a.reps)
            print(f"logits {'exp' if store_exp else 'stats'} {rows}x{hidden}x{vocab}: pipelined {t['base']:.3f} ms, "
                  f"warp-specialized {t['ws']:.3f} ({t['ws'] / t['base']:.3f}x), cuBLAS {t['cublas']:.3f}; "
                  f"outputs apart {err:.2e}", flush=True)
        out_a = out_b = None  # free before the next shape (not del: the lambdas above close over them)
        cols = min(vocab, 4096 if rows <= 8192 else 40960) // 256 * 256
        target = torch.randint(0, vocab, (rows,), device="cuda")
        small = rows * vocab <= 8192 * 128256
        lse = torch.logsumexp((x.float() @ w.float().t()), 1) if small else torch.randn(rows, device="cuda") + 12
        terms = RowTerms(target, lse, None, None, torch.tensor(1.0 / rows, device="cuda"), True)
        g_a, g_b = (torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        wb = w[:cols]
        base = lambda: block_gemm_triton.block_logits_grad_triton(x, wb, None, g_a, 0, vocab, terms, opts)
        ws = lambda: block_ws(x, wb, g_b, 0, vocab, terms, opts, a.warps, a.stages)
        base(); ws(); torch.cuda.synchronize()
        t = _median_ms({"base": base, "ws": ws, "cublas": lambda: torch.mm(x, wb.t(), out=g_a)}, a.rounds, a.reps)
        base(); torch.cuda.synchronize()
        print(f"block grad {rows}x{hidden}x{cols}: pipelined {t['base']:.3f} ms, warp-specialized {t['ws']:.3f} "
              f"({t['ws'] / t['base']:.3f}x), cuBLAS {t['cublas']:.3f}; outputs apart {_rel(g_b, g_a):.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
