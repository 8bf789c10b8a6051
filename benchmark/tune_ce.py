"""Tuning sweeps for the hot path (GPU only): CE kernel launch configs, and the chunked GEMMs'
cost by chunk height and accumulator dtype. Prints tables; writes tune.json under $OUT.

Usage: PYTHONPATH=src python benchmark/tune_ce.py
       PYTHONPATH=src python benchmark/tune_ce.py --ce-shapes 1024x128256 --block-v 8192,16384 (CE only)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from breakdown import median_ms

from flce.gemm import mm_into
from flce.kernels.ce_triton import LaunchConfig, ce_chunk_triton
from flce.options import LossOptions


def ce_sweep(rows, vocab, opts=LossOptions(), grid=((1, 2, 4, 8), (1024, 2048, 4096, 8192), (4, 8, 16))):
    dev = torch.device("cuda")
    src = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16) * 4
    buf = src.clone()
    t = torch.randint(0, vocab, (rows,), device=dev)
    loss, lse = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
    scale = torch.ones((), device=dev)
    out = []
    for pps in grid[0]:
        for block_v in grid[1]:
            for warps in grid[2]:
                cfg = LaunchConfig(pps, block_v, warps, few_rows_per_sm=0)  # exactly this launch
                try:
                    ms = median_ms(lambda: ce_chunk_triton(buf, t, loss, lse, None, None, None, scale, opts, config=cfg),
                                   reps=20)
                except Exception as e:  # a config the compiler rejects (e.g. registers)
                    print("skip", cfg, type(e).__name__)
                    continue
                gbps = 2 * rows * vocab * 2 / ms / 1e6  # one read + one write per logit
                out.append({"rows": rows, "vocab": vocab, "programs_per_sm": pps, "block_v": block_v,
                            "num_warps": warps, "ms": ms, "GBps_1r1w": gbps})
    out.sort(key=lambda r: r["ms"])
    return out


def gemm_sweep(bt=8192, hidden=4096, vocab=128256):
    dev = torch.device("cuda")
    x = torch.randn(bt, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16)
    gx = torch.empty_like(x)
    out = []
    for rows, accum in ((1024, torch.float32), (2048, torch.float32), (4096, torch.float32),
                        (2048, torch.bfloat16), (8192, torch.bfloat16)):
        buf = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
        acc = torch.empty(vocab, hidden, device=dev, dtype=accum)

        def loop():
            for i, s in enumerate(range(0, bt, rows)):
                lg = buf[: min(rows, bt - s)]
                torch.mm(x[s:s + rows], w.t(), out=lg)
                mm_into(gx[s:s + rows], lg, w, accumulate=False)
                mm_into(acc, lg.t(), x[s:s + rows], accumulate=i > 0)

        def wgrad_only():
            for i, s in enumerate(range(0, bt, rows)):
                mm_into(acc, buf.t(), x[s:s + rows], accumulate=i > 0)

        out.append({"rows": rows, "accum": str(accum), "three_gemms_ms": median_ms(loop),
                    "wgrad_ms": median_ms(wgrad_only)})
        buf = acc = None  # the closures hold their cells
        torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ce-shapes", default="", help="only the CE launch sweep, on these ROWSxV shapes")
    p.add_argument("--pps", default="1,2,4,8")
    p.add_argument("--block-v", default="1024,2048,4096,8192")
    p.add_argument("--warps", default="4,8,16")
    args = p.parse_args()
    if args.ce_shapes:
        grid = tuple(tuple(map(int, g.split(","))) for g in (args.pps, args.block_v, args.warps))
        res = {"device": torch.cuda.get_device_name(), "ce": {}}
        for spec in args.ce_shapes.split(","):
            rows, vocab = map(int, spec.split("x"))
            res["ce"][spec] = ce_sweep(rows, vocab, grid=grid)
            print(spec, *[f"{r['programs_per_sm']}/{r['block_v']}/{r['num_warps']}w: {r['ms']:.3f}"
                          for r in res["ce"][spec][:6]], sep="\n  ", flush=True)
        os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
        with open(os.path.join(os.environ.get("OUT", "out"), "tune_ce_shapes.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    res = {"device": torch.cuda.get_device_name(), "ce": {}, "gemm": gemm_sweep()}
    for rows, vocab in ((2048, 128256), (8192, 32000), (256, 128256)):
        res["ce"][f"{rows}x{vocab}"] = ce_sweep(rows, vocab)
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "tune.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in res["gemm"]:
        print(r)
    for key, rows in res["ce"].items():
        print(key, "best:")
        for r in rows[:4]:
            print("  ", r)
        base = [r for r in rows if (r["programs_per_sm"], r["block_v"], r["num_warps"]) == (2, 4096, 8)]
        print("   default:", base[0] if base else None)


if __name__ == "__main__":
    main()
