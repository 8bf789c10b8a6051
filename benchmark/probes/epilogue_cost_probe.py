"""Probe: what the Hopper logits GEMM's epilogue costs at small H, part by part. The same persistent
128 x 256 Triton GEMM (``logits_triton``'s tile, grouped order and mainloop) run with a growing epilogue:

- ``store``: the float32 tile rounded and stored, nothing else (Triton's GEMM rate);
- ``max``: the rows' tile max, the tile stored less it, the max written (no exponential);
- ``stats``: flce's statistics without the store (``STORE_NOTHING``, a loss without gradients);
- ``lean``: flce's stored logits and statistics without the column mask and the temperature's multiply
  (exact only where V is a multiple of 256 and T = 1; timing only);
- ``flce``: ``logits_with_tile_stats`` as the chunk loop runs it (``STORE_LOGITS``);

against cuBLAS's plain GEMM of the same shape. Medians of interleaved rounds, ms. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/epilogue_cost_probe.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from common import median_of_rounds
from triton.tools.tensor_descriptor import TensorDescriptor

from flce.kernels import logits_triton as lt
from flce.kernels.ce_triton import _sm_count
from flce.kernels.fast_exp_triton import exp_ftz
from flce.options import LossOptions

SHAPES = [(2752, 1024, 151936), (8192, 1024, 151936), (8192, 2048, 128256), (8192, 4096, 128256)]
STORE, MAX, LEAN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _variant_kernel(x_desc, w_desc, out_desc, max_ptr, sum_ptr, M, N, K, MODE: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
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
        else:
            row_max = tl.max(acc, 1)
            stored = (acc - row_max[:, None]).to(out_desc.dtype)
            out_desc.store([m0, n0], stored)
            tl.store(max_ptr + stat, row_max, mask=rows < M)
            tl.store(sum_ptr + stat, tl.sum(exp_ftz(stored.to(tl.float32)), 1), mask=rows < M)


def variant(mode, x, w, out, stats):
    cfg = lt.TILE
    n, vocab = x.shape[0], w.shape[0]
    programs = min(_sm_count(x.device.index), triton.cdiv(n, cfg.block_m) * triton.cdiv(vocab, cfg.block_n))
    _variant_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
        TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n]), stats[0], stats[1], n, vocab, x.shape[1],
        MODE=mode, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP=cfg.group, PROGRAMS=programs,
        num_stages=cfg.stages, num_warps=cfg.warps)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    opts = LossOptions()
    for rows, hidden, vocab in SHAPES:
        x = torch.randn(rows, hidden, device=dev).bfloat16()
        w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).bfloat16()
        out = torch.empty(rows, vocab, device=dev, dtype=torch.bfloat16)
        stats = torch.empty(2, rows, lt.num_tiles(vocab), device=dev)
        fns = {
            "cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
            "store": lambda: variant(STORE, x, w, out, stats),
            "max": lambda: variant(MAX, x, w, out, stats),
            "stats": lambda: lt.tile_stats(x, w, None, stats[0], stats[1], opts),
            "lean": lambda: variant(LEAN, x, w, out, stats),
            "flce": lambda: lt.logits_with_tile_stats(x, w, None, out, stats[0], stats[1], opts),
        }
        want = (x @ w.t()).float()
        variant(STORE, x, w, out, stats)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"store variant wrong: {err:.2e}"
        times = median_of_rounds(fns, dev, reps=10)
        base = times["cuBLAS mm"]
        tflop = 2 * rows * hidden * vocab / 1e12
        print(f"{rows} x {hidden} x {vocab}:", flush=True)
        for name, ms in times.items():
            print(f"  {name:10s} {ms:8.4f} ms  {ms / base:6.3f}x cuBLAS  {tflop / ms * 1e3:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
