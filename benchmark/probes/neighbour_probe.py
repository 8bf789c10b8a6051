"""Probe: why does flce read slower in the bench's mixed reading (methods taking turns call by call) than in
its loop reading? Runs the mixed reading's turn-taking (``common.mixed_times``' scheme: one call per
method per round, order shuffled per round, CUDA events around each call, no sync between calls) for
flce, its low-memory mode, eager and the floor, and reports each method's median call time by the method
that ran just before it, next to its time in its own loop. Result (H200, `results/2026-11-24-h200-827518b/
neighbour_probe.txt`): every method runs slower after the GEMM-heavy floor or flce and faster after eager
(the GPU's clock under its power limit); flce's own time is the same in both readings (8192 rows: 37.93 ms
in its loop, 37.98 mixed) while the floor's drops (37.81 -> 37.10): the mixed reading's higher x_floor is
the floor's gain, not flce's loss. The allocator's expandable segments change nothing. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/neighbour_probe.py [--shape 8192x4096x128256] [--rounds 40]
        [--peers liger,cce,compile]
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict

import torch
import torch.nn.functional as F
from common import timed_steps
from suite_lce import METHODS

import flce


def steps(x, w, t, peers=()):
    """Per method, a function that makes one step's fresh leaves and returns the call to time; ``peers``: methods of
    ``suite_lce.METHODS`` to add (their loss functions at their defaults)."""
    logits = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    def step_of(loss):
        def make():
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            return lambda: torch.autograd.grad(loss(xl, wl, t), (xl, wl))
        return make

    def fused(**kw):
        return step_of(lambda xl, wl, tl: flce.linear_cross_entropy(xl, wl, tl, **kw))

    eager = step_of(lambda xl, wl, tl: F.cross_entropy(F.linear(xl, wl).float(), tl))

    def floor():
        def run():
            torch.mm(x, w.t(), out=logits)
            torch.mm(logits, w)
            torch.mm(logits.t(), x)
        return run

    return {"flce": fused(), "flce-unchecked": fused(validate_target=False), "flce-low-memory": fused(low_memory=True),
            "eager": eager, "floor": lambda: floor(), **{name: step_of(METHODS[name]) for name in peers}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--peers", default="", help="comma-separated methods of suite_lce to add (liger, cce, compile)")
    a = p.parse_args()
    bt, hidden, vocab = map(int, a.shape.split("x"))
    dev = torch.device("cuda")
    x = torch.randn(bt, hidden, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=dev) * 2 / hidden**0.5).bfloat16()
    t = torch.randint(0, vocab, (bt,), device=dev)
    makes = steps(x, w, t, [name for name in a.peers.split(",") if name])
    print(torch.cuda.get_device_name(), "torch", torch.__version__, a.shape, flush=True)
    own = {name: statistics.median(timed_steps(make, 3, 10, dev)) for name, make in makes.items()}
    samples = []  # (method, predecessor, start event, end event)
    previous = None
    for r in range(a.rounds + 1):
        order = list(makes)
        random.Random(r).shuffle(order)
        for name in order:
            call = makes[name]()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            if r:
                samples.append((name, previous, start, end))
            previous = name
    torch.cuda.synchronize()
    by = defaultdict(list)
    for name, prev, start, end in samples:
        by[(name, prev)].append(start.elapsed_time(end))
        by[(name, "any")].append(start.elapsed_time(end))
    for name in makes:
        cells = [f"own loop {own[name]:7.2f}"]
        for prev in [*makes, "any"]:
            if by[(name, prev)]:
                cells.append(f"after {prev} {statistics.median(by[(name, prev)]):7.2f} (n={len(by[(name, prev)])})")
        print(f"{name:16s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
