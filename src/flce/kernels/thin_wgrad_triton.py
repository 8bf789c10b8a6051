"""grad_weight at a few rows: out (V, H) = a^T (V, K) @ (b * g) (K, H), K <= THIN_K, in one write-bound launch.

At a batch of up to 16 rows grad_weight is an outer product: each (V, H) value is a dot product of K <= 16 terms, so
the GEMM is a stream of V x H stores. On an H200 cuBLAS's kernel takes 0.29 ms for 128256 x 4096 in bf16 (3.6 TB/s),
after the scale of b (torch's mixed-dtype multiply: two more launches); this kernel takes 0.23-0.25 ms in the step
(benchmark/NOTES.md, Small batches). It scales b's tile by g in float32 and rounds it to b's dtype, as that multiply
does (the same operand, rounded once), then makes one tensor-core dot per output tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

THIN_K = 16  # the most rows it takes: beyond, cuBLAS is faster (K = 32: 0.34 ms against 0.29, K = 64: 0.38)
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 4  # the fastest of six tilings at K = 1-16 (H200)


@triton.jit
def _thin_wgrad_kernel(a_ptr, b_ptr, g_ptr, out_ptr, M, N, K, stride_ak, stride_am, stride_bk, stride_bn,
                       stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak,
                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=(rk[:, None] < K) & (rn[None, :] < N),
                other=0.0)
    b = (b.to(tl.float32) * tl.load(g_ptr).to(tl.float32)).to(a.dtype)
    acc = tl.dot(a, b)  # K padded with zeros to BLOCK_K = 16, the least a dot takes
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def thin_wgrad_triton(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = a.t() @ (b * g), b * g rounded to b's dtype. a (K, M), b (K, N): one 16-bit dtype, any strides;
    g: a 0-d device tensor; K <= THIN_K; out: any dtype and strides."""
    k, m = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _thin_wgrad_kernel[grid](a, b, g, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                             out.stride(0), out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=16, num_warps=NUM_WARPS)
    return out
