"""Probe: a loss without gradients with softcap, z-loss and label smoothing, on the statistics-only path (``loss_only.py``:
the logits GEMM keeps its tile statistics, nothing of the logits is written) against flce's chunked loop
(each chunk's logits stored, then read back by the CE kernel; ``loss_only.try_run`` turned off), beside
the floor (the one cuBLAS logits GEMM) in the same run. Both readings (loop and mixed), the worse shown;
peak MB above the inputs; ``loss_vs_chunked``: the two paths' mean losses, relative.

    PYTHONPATH=src:benchmark python benchmark/probes/loss_only_options_probe.py [--reps 20] [--options plain,smoothing]
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from common import markdown_table, measure_steps

import flce
from flce import loss_only

COLUMNS = ["cell", "options", "method", "ms_loop", "ms_mixed", "x_floor", "peak_mb", "loss_vs_chunked", "status"]
CELLS = ["8192x4096x128256", "1024x4096x128256", "8192x2048x32000"]
OPTIONS = {"plain": {}, "softcap": {"softcap": 30.0}, "z-loss": {"z_loss": 1e-4},
           "softcap+z-loss": {"softcap": 30.0, "z_loss": 1e-4}, "smoothing": {"label_smoothing": 0.1}}


@contextlib.contextmanager
def chunked_loop():
    """flce with its statistics-only path off: the chunked loop serves every no-grad loss."""
    try_run = loss_only.try_run
    loss_only.try_run = lambda *a, **k: False
    try:
        yield
    finally:
        loss_only.try_run = try_run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of {list(OPTIONS)}")
    args = p.parse_args()
    args.device, args.timing = torch.device("cuda"), ("loop", "mixed")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for cell in CELLS:
        n, h, v = (int(s) for s in cell.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 * 2).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        for label in args.options.split(","):
            kw = OPTIONS[label]
            @torch.no_grad()
            def stats_only(kw=kw):
                return flce.linear_cross_entropy(x, w, t, **kw)

            @torch.no_grad()
            def chunked(kw=kw):
                with chunked_loop():
                    return flce.linear_cross_entropy(x, w, t, **kw)

            calls = {"floor": lambda: (lambda: x @ w.t()), "stats-only": lambda f=stats_only: f,
                     "chunked": lambda f=chunked: f}
            measured = measure_steps(calls, args, flops=2.0 * n * h * v)
            gap = ((stats_only() - chunked()).abs() / chunked().abs()).item()
            floor = measured["floor"]["median_ms"]
            for name, m in measured.items():
                rows.append({"cell": cell, "options": label, "method": name, "ms_loop": m.get("ms_loop"),
                             "ms_mixed": m.get("ms_mixed"), "x_floor": m["median_ms"] / floor,
                             "peak_mb": m["peak_mb"], "loss_vs_chunked": gap if name == "stats-only" else None,
                             "status": m["status"]})
            print(markdown_table(rows[-3:], COLUMNS), flush=True)
    print("\n# all\n\n" + markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
