"""Probe (session 5): does a method's place in bench.py's interleaved rounds change its small-batch
time? flce and flce-lean run the same kernels at BT <= 512 (one chunk, bf16 gradient either way), yet
the headline runs read lean 0.1-0.2 ms slower at BT 16 / 64. Here each is timed twice, in both orders.
GPU only: PYTHONPATH=src:benchmark python benchmark/probes/bench_order_probe.py"""
from __future__ import annotations

import types

import torch

import suite_lce
from common import measure_interleaved


def main():
    dev = torch.device("cuda")
    args = types.SimpleNamespace(device=dev, warmup=3, reps=20)
    print(torch.cuda.get_device_name())
    for bt in (16, 64):
        cell = suite_lce.Cell("probe", bt, 4096, 128256)
        x, w, t = suite_lce._make_inputs(cell, dev)
        fns = {}
        for tag in ("a", "b"):
            for method in ("flce", "flce-lean", "flce-unchecked"):
                fns[f"{method} ({tag})"] = suite_lce._loss_fn(method, x, w, t, "fwd+bwd")
        flops = 6 * bt * 4096 * 128256
        for name, m in measure_interleaved(fns, args, flops).items():
            print(f"BT={bt} {name:22s} {m['median_ms']:.3f} ms")
        fns = dict(reversed(list(fns.items())))
        for name, m in measure_interleaved(fns, args, flops).items():
            print(f"BT={bt} reversed {name:22s} {m['median_ms']:.3f} ms")


if __name__ == "__main__":
    main()
