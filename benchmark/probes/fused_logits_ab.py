"""Probe: what the fused logits GEMM (kernels/logits_triton.py) buys inside a whole step, and
how its CE kernel's one read should be launched. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/fused_logits_ab.py [--shapes 8192x4096x128256,...]

Part 1, per shape, interleaved (common.measure_interleaved): the floor, flce, flce with the exp-logits path
off (``exp_logits.py``), flce with the fused GEMM switched off too (cuBLAS logits + the two-pass CE kernel,
as before 6de0f32), with ``--group`` a wider grouped tile order, and flce with the given ``--chunk-rows``
(larger chunks: fewer read-modify-writes of the float32 accumulator). ``--part3``: the logits GEMM alone,
storing logits or exp(logits).
Part 2: the CE kernel alone on 4096 x 128256 bf16 with tile statistics, over launch configurations.
Results (`results/2026-11-24-h100-c4f27ea/`: `fused_logits_ab_6de0f32.txt`, `chunk_rows_ab_7c5054c.txt`,
`planner_6144_ab_7c5054c.txt`; `results/2026-11-24-h200-dcb7d1d/fused_logits_ab_6de0f32.txt`): the fused GEMM took
2.1 ms off 32768 rows on both GPUs (H100 1.077 -> 1.062x, H200 1.068 -> 1.054x) and ~0.3 ms off 8192 on
the H200; 6144-row chunks another 0.7-1.2 ms on the H100, 5504-row chunks cost 3 ms; the CE's one pass
runs at 2.7 TB/s (H100) / 3.6 (H200) whatever the launch shape, so the default launch stays. A grouped
order of 16 reads as 8 (`path_group_ab_2e212d7.txt`); `store_exp` costs the GEMM nothing
(`fused_logits_ab_exp_dcb7d1d.txt`, both in `results/2026-11-24-h200-dcb7d1d/`).
"""
from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace
from unittest.mock import patch

import torch
from common import measure_interleaved, timed_calls

import flce
from flce import exp_logits
from flce.kernels import logits_triton
from flce.kernels.ce_triton import LaunchConfig, ce_chunk_triton
from flce.options import LossOptions


def fused_off():
    return patch.object(logits_triton, "MIN_ROWS", 1 << 62)


def exp_off():
    return patch.object(exp_logits, "MIN_ROWS", 1 << 62)


def tile(**changes):
    return patch.object(logits_triton, "TILE", logits_triton.TILE._replace(**changes))


def step(x, w, t, **kw):
    def run():
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t, **kw).backward()
    return run


def floor(x, w):
    def run():
        logits = x @ w.t()
        x_grad = logits @ w
        w_grad = logits.t() @ x
        return x_grad, w_grad
    return run


def part1(shape, chunk_rows, args):
    bt, h, v = shape
    x = torch.randn(bt, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / h**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (bt,), device="cuda")
    flce_step = step(x, w, t)
    off = step(x, w, t)

    def cublas_two_pass():
        with fused_off(), exp_off():
            off()

    standard = step(x, w, t)

    def exp_logits_off():
        with exp_off():
            standard()
    fns = {"floor": floor(x.detach(), w.detach()), "flce": flce_step, "flce exp-logits off": exp_logits_off,
           "flce fused off": cublas_two_pass}
    if args.group:
        grouped = step(x, w, t)

        def wider_group():
            with tile(group=args.group):
                grouped()
        fns[f"flce group {args.group}"] = wider_group
    for rows in chunk_rows:
        if rows < bt:
            fns[f"flce chunk {rows}"] = step(x, w, t, chunk_size=rows)
    res = measure_interleaved(fns, args, 6.0 * bt * h * v)
    base = res["floor"]["median_ms"]
    for name, r in res.items():
        print(f"{bt}x{h}x{v} {name:22s} {r['median_ms']:8.3f} ms  x_floor {r['median_ms'] / base:.3f}  "
              f"peak {r['peak_mb']:.0f} MB  {r['status']}", flush=True)


def part2():
    n, v = 4096, 128256
    torch.manual_seed(0)
    logits = (torch.randn(n, v, device="cuda") * 2).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda")
    tiles = logits_triton.num_tiles(v)
    z = torch.nn.functional.pad(logits.float(), (0, tiles * logits_triton.TILE.block_n - v), value=float("-inf"))
    z = z.view(n, tiles, -1)
    tile_max = z.amax(2)
    tile_sum = (z - tile_max[..., None]).exp().sum(2)
    loss, lse, scale = torch.empty(n, device="cuda"), torch.empty(n, device="cuda"), torch.ones((), device="cuda")
    opts = LossOptions()
    buf = logits.clone()
    for pps, block_v, warps in ((16, 8192, 8), (8, 8192, 8), (4, 8192, 8), (16, 4096, 8), (8, 4096, 4),
                                (16, 4096, 4), (8, 16384, 16), (4, 16384, 16), (2, 32768, 16), (32, 2048, 4)):
        cfg = LaunchConfig(programs_per_sm=pps, block_v=block_v, num_warps=warps)
        ms = statistics.median(timed_calls(
            lambda: ce_chunk_triton(buf, t, loss, lse, None, None, None, scale, opts,
                                    tile_stats=(tile_max, tile_sum), config=cfg), 3, 20, torch.device("cuda")))
        print(f"CE one read 4096x128256 pps={pps:2d} block_v={block_v:5d} warps={warps:2d}: {ms:.3f} ms "
              f"{2 * n * v * 2 / ms / 1e6:.0f} GB/s", flush=True)
    ms = statistics.median(timed_calls(lambda: ce_chunk_triton(buf, t, loss, lse, None, None, None, scale, opts),
                                       3, 20, torch.device("cuda")))
    print(f"CE two passes 4096x128256 (default launch): {ms:.3f} ms {3 * n * v * 2 / ms / 1e6:.0f} GB/s", flush=True)


def part3(shape):
    """The logits GEMM alone, storing the logits (with their tile statistics) or exp(logits)."""
    rows, hidden, vocab = shape
    x = torch.randn(rows, hidden, device="cuda").bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).bfloat16()
    out = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(2, rows, logits_triton.num_tiles(vocab), device="cuda")
    fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=out)}
    for store_exp in (False, True):
        fns[f"store_exp={store_exp}"] = lambda s=store_exp: logits_triton.logits_with_tile_stats(
            x, w, None, out, stats[0], stats[1], LossOptions(), store_exp=s)
    times = {k: [] for k in fns}
    for _ in range(5):
        for name, fn in fns.items():
            times[name].append(statistics.median(timed_calls(fn, 2, 10, torch.device("cuda"))))
    for name, t in times.items():
        print(f"logits GEMM {rows}x{hidden}x{vocab} {name:16s} {statistics.median(t):8.3f} ms", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x4096x128256,32768x4096x128256")
    p.add_argument("--chunk-rows", default="5504")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--skip-part1", action="store_true")
    p.add_argument("--skip-part2", action="store_true")
    p.add_argument("--part3", action="store_true", help="the logits GEMM alone, store_exp off and on")
    p.add_argument("--group", type=int, default=0, help="also time flce with this grouped-order width")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    args = SimpleNamespace(device=torch.device("cuda"), reps=a.reps, warmup=2, group=a.group)
    if not a.skip_part1:
        for s in a.shapes.split(","):
            part1(tuple(int(d) for d in s.split("x")), [int(r) for r in a.chunk_rows.split(",") if r], args)
    if not a.skip_part2:
        part2()
    if a.part3:
        for s in a.shapes.split(","):
            part3(tuple(int(d) for d in s.split("x")))


if __name__ == "__main__":
    main()
