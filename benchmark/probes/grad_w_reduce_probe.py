"""Probe: a chunk's weight-gradient update, acc (V, H) float32 += dlogits_c^T @ x_c, through TMA reduce-adds
(``kernels/weight_grad_triton.py``) against cuBLAS's ``addmm(out_dtype=float32)`` into the accumulator (its
beta = 1 epilogue reads each float32 tile back) and cuBLAS's plain ``mm`` (beta = 0: the read-back's cost is
the difference), at the chunk heights the planner makes at 32768 x 4096 x 128256 (6144 rows, a last chunk of
2048) and 4096, for a few tiles. Kernels alone, medians of interleaved rounds; each tile is checked against
float64 first. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/grad_w_reduce_probe.py [--rows 6144,4096,2048]
"""
from __future__ import annotations

import argparse

import torch
import triton
from common import median_of_rounds

from flce.kernels import weight_grad_triton as wg
from flce.kernels.logits_triton import TileConfig

TILES = [
    wg.TILE,
    TileConfig(128, 256, 64, 3, 8, 8),
    TileConfig(128, 256, 64, 2, 8, 16),
    TileConfig(128, 128, 64, 4, 8, 8),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="6144,4096,2048")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for rows in map(int, a.rows.split(",")):
        dl = (torch.randn(rows, a.vocab, device=dev) * 1e-2).bfloat16()
        x = torch.randn(rows, a.hidden, device=dev).bfloat16()
        acc0 = torch.randn(a.vocab, a.hidden, device=dev)
        want = acc0.double().cpu() + (dl.t().float() @ x.float()).double().cpu()
        acc = acc0.clone()
        fns = {"cuBLAS addmm (beta 1)": lambda: torch.addmm(acc, dl.t(), x, out_dtype=torch.float32, out=acc),
               "cuBLAS mm (beta 0)": lambda: torch.mm(dl.t(), x, out_dtype=torch.float32, out=acc)}
        for tile in TILES:
            def update(tile=tile):
                wg.TILE = tile
                wg.add_weight_grad(acc, dl, x)
            acc.copy_(acc0)
            update()
            err = ((acc.double().cpu() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, f"{tile}: wrong result, {err:.1e}"
            fns[f"reduce-add {tuple(tile)}"] = update
        times = median_of_rounds(fns, dev, reps=5)
        wg.TILE = TILES[0]
        base = times["cuBLAS addmm (beta 1)"]
        print(f"grad_W update, {rows} rows x {a.hidden} x {a.vocab}:", flush=True)
        for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {name:48s} {ms:7.3f} ms  {ms / base:6.3f}x addmm", flush=True)


if __name__ == "__main__":
    main()
