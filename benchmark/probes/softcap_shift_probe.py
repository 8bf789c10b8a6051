"""Probe (CPU, torch only): which shift the logits GEMM should take off a tile's logits r before rounding them to
bf16 when a softcap c follows, z = c tanh(r / c). Simulates the stored values and the gradient d loss / d r in
float64 (256-column tiles, rows of logits of std ``sigma``, targets drawn from the capped softmax, the gradient
rounded to bf16 as the CE kernel stores it) and prints its error as a multiple of the bf16 rounding of the exact
gradient, per shift: none (the logits rounded as such: eager and flce up to 0201d95), the tile's max of r, that
max capped at 2c, c, c / 2 or r* = c asinh(c / 2) / 2 (``softcap_triton.tile_shift``), and 0. The median and
worst over seeds:

    python benchmark/probes/softcap_shift_probe.py [seeds, default 8]
"""
from __future__ import annotations

import math
import statistics
import sys

import torch

ROWS, VOCAB, TILE = 128, 8192, 256


def grad(r: torch.Tensor, c: float, target: torch.Tensor) -> torch.Tensor:
    """d CE / d r per row (unscaled), float64."""
    u = r / c
    g = torch.softmax(c * torch.tanh(u), 1)
    g[torch.arange(r.shape[0]), target] -= 1
    return g / torch.cosh(u) ** 2


def errors(sigma: float, c: float, gen: torch.Generator) -> dict[str, float]:
    r = torch.randn(ROWS, VOCAB, dtype=torch.float64, generator=gen) * sigma
    gumbel = -torch.log(-torch.log(torch.rand(ROWS, VOCAB, dtype=torch.float64, generator=gen)))
    target = (c * torch.tanh(r / c) + gumbel).argmax(1)
    exact = grad(r, c, target)
    rounding = (exact.bfloat16().double() - exact).norm() / exact.norm()
    tile_max = r.view(ROWS, VOCAB // TILE, TILE).amax(2)
    limits = {"none (eager)": None, "tile max": math.inf, "2c": 2 * c, "c": c, "c/2": c / 2,
              "r*": c * math.asinh(c / 2) / 2, "0": 0.0}
    out = {}
    for name, limit in limits.items():
        if limit is None:
            stored = r.bfloat16().double()
        else:
            shift = tile_max.clamp(max=limit).repeat_interleave(TILE, 1)
            stored = shift + (r - shift).bfloat16().double()
        got = grad(stored, c, target).bfloat16().double()
        out[name] = ((got - exact).norm() / exact.norm() / rounding).item()
    return out


def main(seeds: int) -> None:
    print(f"x the bf16 rounding of the exact gradient, median / worst of {seeds} seeds ({ROWS} x {VOCAB})")
    for sigma in (3.0, 6.0, 12.0):
        for c in (0.1, 1.0, 5.0, 15.0, 30.0, 100.0):
            runs: dict[str, list[float]] = {}
            for seed in range(seeds):
                for name, err in errors(sigma, c, torch.Generator().manual_seed(seed)).items():
                    runs.setdefault(name, []).append(err)
            cells = " ".join(f"{k} {statistics.median(v):.2f}/{max(v):.2f}" for k, v in runs.items())
            print(f"std {sigma:g} c {c:g}: {cells}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
