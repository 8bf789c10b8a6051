"""Probe: a small batch's logits in float32 (``flce.function.wide_logits``) against 16-bit ones, bf16 training steps
(loss, then torch.autograd.grad of input and weight) at a few row counts. Per setting: milliseconds per step in a
running loop (one sync at the end: a host-bound step shows its host's time) and the host's median time inside a
step, the median over rounds in which the two settings and the floor (the three cuBLAS GEMMs) take turns in an
order that turns each round; then the host's time to enqueue the logits GEMM alone, with and without
``out_dtype=torch.float32``, and flce's forward alone (its backward waits on the target check) in each setting.
GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/wide_logits_probe.py [BTxHxV ...]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from common import parse_shape, running_loop_ms

import flce
from flce import function

SHAPES = ["1x4096x128256", "16x4096x128256", "64x4096x128256", "200x4096x128256"]
ROUNDS = 9


def step_of(x, w, t, wide_rows: int | None):
    def step():
        if wide_rows is None:  # the floor: logits, grad_input, grad_weight
            z = x @ w.t()
            return z @ w, z.t() @ x
        function.WIDE_LOGITS_ROWS = wide_rows
        return torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w))
    return step


def enqueue_us(fn, calls: int = 50) -> float:
    """Host microseconds per call of ``fn`` while the GPU queue has room (few calls after a sync)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return spent / calls * 1e6


def main() -> None:
    dev = torch.device("cuda")
    default_rows = function.WIDE_LOGITS_ROWS
    print(torch.cuda.get_device_name(), "flce from", flce.__file__)
    print("| BT x H x V | setting | ms per step (loop) | host ms inside | x floor |")
    print("|---|---|---|---|---|")
    for spec in sys.argv[1:] or SHAPES:
        n, hidden, vocab = parse_shape(spec, "BTxHxV")
        x = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) * hidden**-0.5)
        t = torch.randint(0, vocab, (n,), device=dev)
        settings = {"float32 logits": default_rows, "16-bit logits": 0, "floor": None}
        readings = {name: [] for name in settings}
        for r in range(ROUNDS):  # the settings' order turns each round: none always follows the floor
            names = list(settings)[r % 3:] + list(settings)[:r % 3]
            for name in names:
                readings[name].append(running_loop_ms(step_of(x, w, t, settings[name]), dev, steps=100, warmup=10))
        function.WIDE_LOGITS_ROWS = default_rows
        floor = statistics.median(r[0] for r in readings["floor"])
        for name, got in readings.items():
            loop, inside = (statistics.median(r[i] for r in got) for i in range(2))
            print(f"| {spec} | {name} | {loop:.3f} | {inside:.3f} | {loop / floor:.3f} |", flush=True)
        x16 = x.detach()
        out16 = torch.empty(n, vocab, device=dev, dtype=torch.bfloat16)
        out32 = torch.empty(n, vocab, device=dev, dtype=torch.float32)
        plain = enqueue_us(lambda: torch.mm(x16, w.detach().t(), out=out16))
        wide = enqueue_us(lambda: torch.mm(x16, w.detach().t(), out_dtype=torch.float32, out=out32))
        print(f"| {spec} | enqueue the logits GEMM, us | 16-bit {plain:.1f} | float32 {wide:.1f} | |", flush=True)
        forward = {}
        for name, rows in list(settings.items())[:2] * 2:  # twice, in turn: the second reading of each kept
            function.WIDE_LOGITS_ROWS = rows
            forward[name] = enqueue_us(lambda: flce.linear_cross_entropy(x, w, t), calls=20)
        function.WIDE_LOGITS_ROWS = default_rows
        print(f"| {spec} | enqueue flce's forward, us | " + " | ".join(f"{k} {v:.1f}" for k, v in forward.items())
              + " | |", flush=True)


if __name__ == "__main__":
    main()
