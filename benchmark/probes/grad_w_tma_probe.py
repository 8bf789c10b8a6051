"""Probe: a chunk's grad_W update with a float32 accumulator, out = acc + dl^T @ x_c (K = 4096
rows), as a persistent Triton GEMM with TMA, against cuBLAS's addmm(out_dtype=float32). Two uses:
``out`` = acc (the update of every chunk but the last) and ``out`` a bf16 tensor (the last chunk: the
GEMM then writes the weight gradient directly, with no float32 result written and read back by a
separate cast, ~1.0 ms on an H100 at 128256 x 4096). Result (H100, `results/2026-11-24-h100-c4f27ea/
grad_w_tma_probe_7c5054c.txt`): cuBLAS 6.14 ms (+ cast 7.31); this kernel 9.11 ms with a float32 out and at best
7.35 with a bf16 out: no gain, the transposed dlogits operand costs it more than cuBLAS. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/grad_w_tma_probe.py
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from common import timed_calls
from triton.tools.tensor_descriptor import TensorDescriptor

from flce.kernels.logits_triton import _tile_coords


@triton.jit
def _acc_gemm(a_desc, b_desc, acc_desc, out_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    """out (M, N) = acc + A^T @ B; A stored (K, M), B (K, N); acc float32, out float32 or 16-bit."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        c = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            c = tl.dot(a_desc.load([ks * BK, m0]).T, b_desc.load([ks * BK, n0]), c)
        c += acc_desc.load([m0, n0])
        out_desc.store([m0, n0], c.to(out_desc.dtype))


def launch(out, acc, dl, x, BM, BN, BK, GROUP, stages, warps, programs):
    K, M = dl.shape
    N = x.shape[1]
    grid = (min(programs, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _acc_gemm[grid](TensorDescriptor.from_tensor(dl, [BK, BM]), TensorDescriptor.from_tensor(x, [BK, BN]),
                    TensorDescriptor.from_tensor(acc, [BM, BN]), TensorDescriptor.from_tensor(out, [BM, BN]),
                    M, N, K, BM=BM, BN=BN, BK=BK, GROUP=GROUP, PROGRAMS=grid[0], num_stages=stages, num_warps=warps)


def main():
    dev = torch.device("cuda")
    V, H, K = 128256, 4096, 4096
    dl = (torch.randn(K, V, device=dev) * 1e-2).bfloat16()
    x = torch.randn(K, H, device=dev).bfloat16()
    acc0 = torch.randn(V, H, device=dev)
    want = acc0.double() + dl.double().t() @ x.double()
    scale = want.abs().max().item()
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    acc = acc0.clone()
    ms = statistics.median(timed_calls(lambda: torch.addmm(acc, dl.t(), x, out_dtype=torch.float32, out=acc),
                                       2, 10, dev))
    print(f"cuBLAS addmm fp32 acc              {ms:.3f} ms", flush=True)
    wg = torch.empty(V, H, device=dev, dtype=torch.bfloat16)

    def last_cublas():
        torch.addmm(acc, dl.t(), x, out_dtype=torch.float32, out=acc)
        wg.copy_(acc)
    ms = statistics.median(timed_calls(last_cublas, 2, 10, dev))
    print(f"cuBLAS addmm fp32 acc + cast bf16  {ms:.3f} ms", flush=True)
    for BM, BN, BK, stages, warps in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 256, 64, 2, 8),
                                      (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4)):
        for out_dtype in (torch.float32, torch.bfloat16):
            name = f"tma BM={BM} BN={BN} BK={BK} S={stages} w={warps} out={str(out_dtype)[6:]}"
            try:
                acc = acc0.clone()
                out = acc if out_dtype == torch.float32 else wg
                launch(out, acc, dl, x, BM, BN, BK, 8, stages, warps, programs)
                err = ((out.double() - want).abs().max() / scale).item()
                ms = statistics.median(timed_calls(
                    lambda: launch(out, acc, dl, x, BM, BN, BK, 8, stages, warps, programs), 2, 10, dev))
                print(f"{name:52s} {ms:.3f} ms  rel err {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"{name:52s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
