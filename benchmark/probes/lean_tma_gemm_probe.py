"""Probe: the lean setting's grad_W update C[V, H] += dl^T @ x_c (bf16 C, K = 512 rows) as a
persistent Triton GEMM with TMA loads and stores, against cuBLAS's addmm_. A pointer-based kernel
(`lean_triton_gemm_probe.py` at 7102c05) was 25% slower than cuBLAS; this one keeps one program per SM,
loads A, B and C through tensor descriptors and flattens the tile loop so the next tile's loads are in
flight during the current tile's read-modify-write. C_EARLY loads C into the accumulator before the
k-loop instead of after it. Result (H100, `results/2026-11-24-h100-c4f27ea/lean_tma_gemm_probe_6de0f32.txt`):
cuBLAS 1.11 ms, this kernel at best 1.28 (128 x 128 x 64, 4 stages), and 2.0-2.6 with C loaded before
the k-loop: not used.
GPU only (CPU: --small under TRITON_INTERPRET=1 checks the arithmetic):

    PYTHONPATH=src:benchmark python benchmark/probes/lean_tma_gemm_probe.py
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
def _acc_gemm_tma(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP: tl.constexpr, PROGRAMS: tl.constexpr, C_EARLY: tl.constexpr):
    """C (M, N) += A^T @ B; A is stored (K, M) (dl, rows of the chunk by vocabulary), B (K, N)."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    tiles = grid_m * grid_n
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        if C_EARLY:
            acc = c_desc.load([m0, n0]).to(tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([ks * BK, m0])
            b = b_desc.load([ks * BK, n0])
            acc = tl.dot(a.T, b, acc)
        if not C_EARLY:
            acc += c_desc.load([m0, n0]).to(tl.float32)
        c_desc.store([m0, n0], acc.to(c_desc.dtype))


def launch(c, dl, x, BM, BN, BK, GROUP, stages, warps, c_early, programs):
    K, M = dl.shape
    N = x.shape[1]
    a_desc = TensorDescriptor.from_tensor(dl, [BK, BM])
    b_desc = TensorDescriptor.from_tensor(x, [BK, BN])
    c_desc = TensorDescriptor.from_tensor(c, [BM, BN])
    grid = (min(programs, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _acc_gemm_tma[grid](a_desc, b_desc, c_desc, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=GROUP,
                        PROGRAMS=grid[0], C_EARLY=c_early, num_stages=stages, num_warps=warps)


def configs(small: bool):
    if small:
        return [(32, 32, 16, 4, 2, 4, ce) for ce in (False, True)]
    out = []
    for BM, BN in ((128, 128), (128, 256), (256, 128)):
        for BK in (64, 128):
            for stages in (2, 3, 4):
                for warps in (4, 8):
                    for ce in (False, True):
                        if BM * BN >= 128 * 256 and warps == 4:
                            continue
                        out.append((BM, BN, BK, 8, stages, warps, ce))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="tiny shapes (interpreter check)")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    V, H, K = (256, 96, 48) if args.small else (128256, 4096, 512)
    # The interpreter (triton 3.9) reads bf16 through tensor descriptors wrongly: fp16 there.
    dtype = torch.float16 if args.small else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    dl = (torch.randn(K, V, device=dev, generator=g) * 1e-2).to(dtype)
    x = torch.randn(K, H, device=dev, generator=g).to(dtype)
    c0 = torch.randn(V, H, device=dev, generator=g).to(dtype)
    want = c0.double() + dl.double().t() @ x.double()
    want_once = want.to(dtype).double()  # the float64 answer rounded once: the best bf16 can do
    scale = want.abs().max().item()
    programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    if dev.type == "cuda":
        from common import timed_calls
        print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
        c = c0.clone()
        ms = statistics.median(timed_calls(lambda: c.addmm_(dl.t(), x), 3, 20, dev))
        print(f"cuBLAS addmm_ {ms:.3f} ms  {2 * V * H * K / ms / 1e9:.0f} TFLOP/s", flush=True)
    for cfg in configs(args.small):
        BM, BN, BK, GROUP, stages, warps, ce = cfg
        name = f"tma BM={BM} BN={BN} BK={BK} S={stages} w={warps} c_early={int(ce)}"
        try:
            c = c0.clone()
            launch(c, dl, x, *cfg, programs)
            err = ((c.double() - want).abs().max() / scale).item()
            err_once = ((want_once - want).abs().max() / scale).item()
            line = f"{name:50s} rel err {err:.1e} (once-rounded {err_once:.1e})"
            if dev.type == "cuda":
                ms = statistics.median(timed_calls(lambda: launch(c, dl, x, *cfg, programs), 3, 20, dev))
                line += f"  {ms:.3f} ms  {2 * V * H * K / ms / 1e9:.0f} TFLOP/s"
            print(line, flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects
            print(f"{name:50s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
