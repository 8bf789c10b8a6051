"""Probe: could the logits GEMM itself produce the CE's first pass? A persistent Triton GEMM
with TMA (logits = x_c @ W^T, bf16 out) whose epilogue also writes per-row (max, sum exp) of each
(BM, BN) output tile, so that the CE kernel would read each logit once (1R+1W instead of 2R+1W: -2.9 ms
at 32768 rows on an H100). Worth it only if this GEMM runs within ~1% of cuBLAS. Result (H100,
`results/2026-11-24-h100-c4f27ea/logits_tma_gemm_probe_6de0f32.txt`): cuBLAS 6.00 ms, 128 x 256 x 64
tiles with 3 stages and 8 warps 5.76 ms without and 5.73 with the statistics; 128 x 128 and 256 x 128
tiles were slower. This became kernels/logits_triton.py. GPU only (CPU: --small under TRITON_INTERPRET=1
checks the arithmetic):

    PYTHONPATH=src:benchmark python benchmark/probes/logits_tma_gemm_probe.py
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flce.kernels.logits_triton import _tile_coords


@triton.jit
def _logits_tma(a_desc, w_desc, c_desc, max_ptr, sum_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr, STATS: tl.constexpr):
    """C (M, N) = A (M, K) @ W (N, K)^T; with STATS, per-row max and sum exp of each tile to (M, N / BN)."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    tiles = grid_m * grid_n
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([m0, ks * BK])
            w = w_desc.load([n0, ks * BK])
            acc = tl.dot(a, w.T, acc)
        out = acc.to(c_desc.dtype)
        c_desc.store([m0, n0], out)
        if STATS:
            cols = n0 + tl.arange(0, BN)
            z = tl.where(cols[None, :] < N, out.to(tl.float32), float("-inf"))
            mx = tl.max(z, 1)
            se = tl.sum(tl.exp(z - mx[:, None]), 1)
            rows = m0 + tl.arange(0, BM)
            tl.store(max_ptr + rows * grid_n + pid_n, mx, mask=rows < M)
            tl.store(sum_ptr + rows * grid_n + pid_n, se, mask=rows < M)


def launch(c, x, w, mx, se, BM, BN, BK, GROUP, stages, warps, stats, programs):
    M, K = x.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    c_desc = TensorDescriptor.from_tensor(c, [BM, BN])
    grid = (min(programs, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _logits_tma[grid](a_desc, w_desc, c_desc, mx, se, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=GROUP,
                      PROGRAMS=grid[0], STATS=stats, num_stages=stages, num_warps=warps)


def configs(small: bool):
    if small:
        return [(32, 32, 16, 4, 2, 4, st) for st in (False, True)]
    out = []
    for BM, BN, warps in ((128, 256, 8), (128, 128, 4), (128, 128, 8), (256, 128, 8)):
        for BK in (64, 128):
            for stages in (3, 4):
                for stats in (False, True):
                    out.append((BM, BN, BK, 8, stages, warps, stats))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="tiny shapes (interpreter check)")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    M, K, N = (64, 48, 200) if args.small else (4096, 4096, 128256)
    dtype = torch.float16 if args.small else torch.bfloat16  # interpreter: see kernels/logits_triton.py
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=g).to(dtype)
    w = (torch.randn(N, K, device=dev, generator=g) * K**-0.5).to(dtype)
    want = (x.double() @ w.double().t()).to(dtype)
    lse_want = torch.logsumexp(want.double(), 1)
    programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    if dev.type == "cuda":
        from common import timed_calls
        print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
        ms = statistics.median(timed_calls(lambda: torch.mm(x, w.t()), 3, 20, dev))
        print(f"cuBLAS mm {ms:.3f} ms  {2 * M * N * K / ms / 1e9:.0f} TFLOP/s", flush=True)
    for cfg in configs(args.small):
        BM, BN, BK, GROUP, stages, warps, stats = cfg
        name = f"tma BM={BM} BN={BN} BK={BK} S={stages} w={warps} stats={int(stats)}"
        try:
            c = torch.empty(M, N, device=dev, dtype=dtype)
            mx = torch.empty(M, triton.cdiv(N, BN), device=dev)
            se = torch.empty_like(mx)
            launch(c, x, w, mx, se, *cfg, programs)
            line = f"{name:46s} max diff {(c.double() - want.double()).abs().max().item():.1e}"
            if stats:
                lse = torch.logsumexp(mx.double() + se.double().log(), 1)
                line += f" lse diff {(lse - lse_want).abs().max().item():.1e}"
            if dev.type == "cuda":
                ms = statistics.median(timed_calls(lambda: launch(c, x, w, mx, se, *cfg, programs), 3, 20, dev))
                line += f"  {ms:.3f} ms  {2 * M * N * K / ms / 1e9:.0f} TFLOP/s"
            print(line, flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects
            print(f"{name:46s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
