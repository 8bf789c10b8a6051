"""A chunk's weight-gradient update, acc += dlogits^T @ x_c, with the sum done by TMA reduce-add stores (Hopper).

With several chunks the float32 (V, H) accumulator takes one update per chunk. cuBLAS's beta = 1 epilogue
reads each float32 tile back before it writes it (2.1 GB read and written per chunk at 128256 x 4096), which
costs ~0.35 ms a chunk on an H200 that its beta = 0 GEMM does not. This persistent Triton GEMM hands its tile
to the TMA unit as a reduce-add (``cp.reduce.async.bulk.tensor``): the add happens in L2, nothing is read
back into the SM, and the next tile's MMAs start at once. Measured alone on an H200 at 6144 rows
(``benchmark/probes/grad_w_reduce_probe.py``): 9.99 ms against cuBLAS's 10.35 (addmm) and 9.99 (mm,
beta = 0); at 2048 rows it is slower than addmm (4.16 against 3.72 ms), hence ``MIN_ROWS``.

Operands as the chunk loop holds them, both row-major: dlogits (rows, V) and x_c (rows, H); the GEMM reads
both transposed from shared memory (wgmma's transpose bits). Each output element gets exactly one add per
call, so the result does not depend on the order in which tiles finish.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .ce_triton import _sm_count
from .logits_triton import TileConfig, _tile_coords, _tma_ready, hopper

# 128 x 256 tiles stored in two 128 x 128 halves (half the shared memory to stage the float32 tile, which
# leaves room for three pipeline stages); a wider grouped order (16 row tiles share each x_c tile).
TILE = TileConfig(block_m=128, block_n=256, block_k=64, stages=3, warps=8, group=16)
# Fewest chunk rows (the GEMM's K) for this path: with fewer the MMAs do not cover the reduce traffic.
MIN_ROWS = 4096


@triton.jit
def _weight_grad_kernel(a_desc, b_desc, acc_desc, M, N, K, INTERPRET: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    """acc (M, N) float32 += A^T @ B; A stored (K, M), B stored (K, N)."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        tile_sum = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            tile_sum = tl.dot(a_desc.load([ks * BK, m0]).T, b_desc.load([ks * BK, n0]), tile_sum)
        left, right = tile_sum.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
        _add_half(acc_desc, m0, n0, left, INTERPRET)
        _add_half(acc_desc, m0, n0 + BN // 2, right, INTERPRET)


@triton.jit
def _add_half(acc_desc, m0, n0, value, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter has no TMA reduce: the same sum through a load and a store
        acc_desc.store([m0, n0], acc_desc.load([m0, n0]) + value)
    else:
        acc_desc.atomic_add([m0, n0], value)


def supported(acc: torch.Tensor, dl: torch.Tensor, x_c: torch.Tensor) -> bool:
    """Whether this path takes the update: a float32 accumulator, 16-bit operands of one dtype, TMA-able
    layouts, enough rows, and Hopper or newer (the interpreter in tests)."""
    return (
        acc.dtype == torch.float32
        and dl.dtype in (torch.bfloat16, torch.float16)
        and x_c.dtype == dl.dtype
        and dl.shape[0] >= MIN_ROWS
        and acc.is_contiguous()
        and all(_tma_ready(t) for t in (acc, dl, x_c))
        and hopper(acc.device)
    )


def add_weight_grad(acc: torch.Tensor, dl: torch.Tensor, x_c: torch.Tensor) -> None:
    """acc += dl^T @ x_c in float32. Shapes: acc (V, H), dl (n, V), x_c (n, H). Check ``supported`` first."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, vocab = dl.shape
    hidden = x_c.shape[1]
    config = TILE  # read at call time: tests shrink it for the interpreter
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    programs = min(_sm_count(acc.device.index), triton.cdiv(vocab, bm) * triton.cdiv(hidden, bn))
    _weight_grad_kernel[(programs,)](
        TensorDescriptor.from_tensor(dl, [bk, bm]),
        TensorDescriptor.from_tensor(x_c, [bk, bn]),
        TensorDescriptor.from_tensor(acc, [bm, bn // 2]),
        vocab,
        hidden,
        rows,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP=config.group,
        PROGRAMS=programs,
        num_stages=config.stages,
        num_warps=config.warps,
    )
