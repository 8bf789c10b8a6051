"""Probe: are the Hopper GEMMs' tiles (``kernels/logits_triton.TILE``, ``kernels/block_gemm_triton.TILE``)
right away from the 4096 x 4096 x 128256 shape they were picked at? Times the logits GEMM with tile
statistics at the row counts of the small-batch and small-vocabulary cells, and the low-memory backward's
block GEMM at its two block shapes, for a set of tile configurations, against cuBLAS's plain GEMM (and,
for the block GEMM, cuBLAS + the standalone block kernel). Each configuration is checked against cuBLAS
before it is timed; timings are medians of interleaved rounds. Result (H200, `results/2026-11-24-h200-dcb7d1d/
tile_sweep_2e212d7.txt`): the default tile is the best Triton tile or within 2% of it everywhere it fits;
against cuBLAS 1.007x at 8192 x 4096 x 128256, 1.04-1.07x at 512-4096 rows, 1.11x at 256 rows and at H
2048; the block GEMM 1.12-1.13x cuBLAS with every tile (as cuBLAS + the block kernel). GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/tile_sweep_probe.py [--quick] [--shapes 8192x1024x151936,...]
"""
from __future__ import annotations

import argparse

import torch
import triton
from common import median_of_rounds, unshifted_logits

from flce.kernels import block_gemm_triton, logits_triton
from flce.kernels.ce_block_torch import RowTerms
from flce.kernels.ce_block_triton import ce_block_triton
from flce.kernels.logits_triton import TileConfig
from flce.options import LossOptions

CONFIGS = [
    TileConfig(),  # the default: 128 x 256 x 64, 3 stages, 8 warps, group 8
    TileConfig(stages=4),
    TileConfig(group=16),
    TileConfig(block_m=64, block_n=256, warps=4),
    TileConfig(block_m=64, block_n=256, stages=4, warps=4),
    TileConfig(block_m=128, block_n=128, warps=4),
    TileConfig(block_m=128, block_n=128, stages=4, warps=8),
    TileConfig(block_m=128, block_n=256, block_k=128, stages=2),
    TileConfig(block_m=256, block_n=128, warps=8),
    TileConfig(block_m=128, block_n=256, stages=2),
    TileConfig(block_m=128, block_n=128, stages=5, warps=8),
    TileConfig(block_m=128, block_n=128, block_k=128, stages=3, warps=8),
]
LOGITS_SHAPES = [(256, 4096, 128256), (512, 4096, 128256), (1024, 4096, 128256), (4096, 4096, 128256),
                 (8192, 2048, 32000), (8192, 4096, 128256)]
BLOCK_SHAPES = [(8192, 4096, 4096), (32768, 4096, 1024)]  # rows, hidden, block columns (64 MiB blocks)


def logits_sweep(device, configs, reps, shapes=LOGITS_SHAPES):
    opts = LossOptions()
    for rows, hidden, vocab in shapes:
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5).bfloat16()
        out = torch.empty(rows, vocab, device=device, dtype=torch.bfloat16)
        want = x @ w.t()
        fns = {"cuBLAS mm": lambda: torch.mm(x, w.t(), out=out)}
        for cfg in configs:
            tiles = triton.cdiv(vocab, cfg.block_n)
            mx = torch.empty(rows, tiles, device=device)
            se = torch.empty_like(mx)

            def call(cfg=cfg, mx=mx, se=se):
                logits_triton.TILE = cfg
                logits_triton.logits_with_tile_stats(x, w, None, out, mx, se, opts)
            try:
                call()
                # the GEMM stores the logits less their tile max (2afee14): add it back
                got = unshifted_logits(out, mx, cfg.block_n)
                err = ((got - want.float()).abs().max() / want.float().abs().max()).item()
                assert err < 1e-2, f"wrong result: {err:.2e}"
                fns[str(tuple(cfg))] = call
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {rows}x{hidden}x{vocab} {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:100]}")
        logits_triton.TILE = TileConfig()
        times = median_of_rounds(fns, device, reps)
        base = times["cuBLAS mm"]
        print(f"logits GEMM + stats, {rows} x {hidden} x {vocab}:", flush=True)
        for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {name:42s} {ms:8.4f} ms  {ms / base:6.3f}x cuBLAS", flush=True)


def block_sweep(device, configs, reps):
    opts = LossOptions()
    for rows, hidden, cols in BLOCK_SHAPES:
        vocab = 128256
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(cols, hidden, device=device) * hidden ** -0.5).bfloat16()
        out = torch.empty(rows, cols, device=device, dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device=device)
        lse = torch.full((rows,), 12.0, device=device)
        terms = RowTerms(target, lse, None, None, torch.tensor(1.0 / rows, device=device))

        def cublas_plus_kernel():
            torch.mm(x, w.t(), out=out)
            ce_block_triton(out, 4096, vocab, terms, opts)
        cublas_plus_kernel()
        want = out.float().clone()
        fns = {"cuBLAS mm": lambda: torch.mm(x, w.t(), out=out), "cuBLAS + block kernel": cublas_plus_kernel}
        for cfg in configs:
            def call(cfg=cfg):
                block_gemm_triton.TILE = cfg
                block_gemm_triton.block_logits_grad_triton(x, w, None, out, 4096, vocab, terms, opts)
            try:
                call()
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                assert err < 2e-2, f"wrong result: {err:.2e}"
                fns[str(tuple(cfg))] = call
            except Exception as e:  # noqa: BLE001
                print(f"  block {rows}x{hidden}x{cols} {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:100]}")
        block_gemm_triton.TILE = TileConfig()
        times = median_of_rounds(fns, device, reps)
        base = times["cuBLAS mm"]
        print(f"block GEMM + gradient, {rows} rows x {hidden} x {cols} columns:", flush=True)
        for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {name:42s} {ms:8.4f} ms  {ms / base:6.3f}x cuBLAS", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="three configurations, fewer calls")
    p.add_argument("--shapes", help="logits GEMM shapes ROWSxHxV[,...] instead of the defaults; no block GEMM sweep")
    p.add_argument("--groups", help="only the default tile with these grouped-order widths, e.g. 8,16,32")
    args = p.parse_args()
    device = torch.device("cuda")
    configs = CONFIGS[:3] if args.quick else CONFIGS
    if args.groups:
        configs = [TileConfig(group=int(g)) for g in args.groups.split(",")]
    reps = 5 if args.quick else 10
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if args.shapes:
        logits_sweep(device, configs, reps, [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")])
        return
    logits_sweep(device, configs, reps)
    block_sweep(device, configs, reps)


if __name__ == "__main__":
    main()
