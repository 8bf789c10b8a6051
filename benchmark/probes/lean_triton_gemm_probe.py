"""Probe (session 5): a Triton kernel for the lean setting's grad_W update C[V, H] += dl^T @ x_c (bf16
C, K = chunk rows = 512) against cuBLAS's addmm_. GPU only:
PYTHONPATH=src:benchmark python benchmark/probes/lean_triton_gemm_probe.py. Result (H100): cuBLAS
1.11 ms, the best of 8 tile shapes of this (non-persistent, pointer-based) kernel 1.39 ms: a kernel
of our own would need TMA, persistence and epilogue overlap even to match cuBLAS."""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from common import timed_calls


@triton.jit
def _acc_gemm(c_ptr, a_ptr, b_ptr, M, N, K, stride_ak, stride_bk, stride_cm,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
              STAGES: tl.constexpr):
    """C (M, N) row-major += A @ B with A column-major (A[m, k] at a_ptr + m + k * stride_ak, i.e. dl^T),
    B row-major (K, N)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP * grid_n
    group = pid // width
    first_m = group * GROUP
    size_m = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    c = tl.load(c_ptrs, mask=cmask, other=0.0)
    tl.store(c_ptrs, (acc + c.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=cmask)


def launch(c, dl, x, BM, BN, BK, GROUP, STAGES, warps):
    K, M = dl.shape
    N = x.shape[1]
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _acc_gemm[grid](c, dl, x, M, N, K, dl.stride(0), x.stride(0), c.stride(0), BM=BM, BN=BN, BK=BK,
                    GROUP=GROUP, STAGES=STAGES, num_warps=warps)


def main():
    dev = torch.device("cuda")
    V, H, K = 128256, 4096, 512
    dl = torch.randn(K, V, device=dev, dtype=torch.bfloat16) * 1e-2
    x = torch.randn(K, H, device=dev, dtype=torch.bfloat16)
    c0 = torch.randn(V, H, device=dev, dtype=torch.bfloat16)
    want = (c0.float() + dl.float().t() @ x.float())
    c = c0.clone()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    ms = statistics.median(timed_calls(lambda: c.addmm_(dl.t(), x), 3, 20, dev))
    print(f"cuBLAS addmm_ {ms:.3f} ms  {2 * V * H * K / ms / 1e9:.0f} TFLOP/s")
    for BM, BN, BK, GROUP, STAGES, warps in ((128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 4, 8),
                                             (256, 128, 64, 8, 3, 8), (128, 256, 64, 16, 4, 8), (64, 256, 64, 8, 4, 4),
                                             (128, 128, 128, 8, 3, 8), (128, 256, 32, 8, 5, 8)):
        name = f"triton BM={BM} BN={BN} BK={BK} G={GROUP} S={STAGES} w={warps}"
        try:
            c.copy_(c0)
            launch(c, dl, x, BM, BN, BK, GROUP, STAGES, warps)
            torch.cuda.synchronize()
            err = ((c.float() - want).abs().max() / want.abs().max()).item()
            ms = statistics.median(timed_calls(lambda: launch(c, dl, x, BM, BN, BK, GROUP, STAGES, warps), 3, 20, dev))
            print(f"{name:48s} {ms:.3f} ms  {2 * V * H * K / ms / 1e9:.0f} TFLOP/s  rel err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects
            print(f"{name:48s} failed: {type(e).__name__}: {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
