"""Small batches are launch-bound: where a step's host time goes, and what it costs in a running loop.

    PYTHONPATH=src:benchmark python benchmark/small_bt_host.py 1 16 64          (steady loop, per step)
    PYTHONPATH=src:benchmark python benchmark/small_bt_host.py 16 --host         (host time per step)

Default: GPU time per step as bench.py takes it (CUDA events around each call of a steady loop, the
first quarter of each round left out) and the host's time per call in the same loop. ``--host``:
the host's time per step with the GPU held busy (nothing waits for it), for flce, eager, and a
minimal Function that makes flce's launches with no bookkeeping (the floor for flce's structure).
Every variant runs in interleaved rounds, so all see the same host speed, which drifts by up to 2x
on shared machines; pin the process (``taskset -c 4 ...``) for steadier numbers. A copy of an older
flce importable as ``flce_old`` (on PYTHONPATH) is measured beside the current one.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import host_us_per_call

import flce
from flce.kernels.ce_triton import ce_chunk_triton
from flce.kernels.targets_triton import count_targets_triton
from flce.options import LossOptions

HIDDEN, VOCAB = 4096, 128256
OPTS = LossOptions()
ROUNDS = 25


class _Minimal(torch.autograd.Function):
    """count, logits GEMM, CE kernel, sum * scale; backward: scale dlogits, two GEMMs."""

    @staticmethod
    def forward(ctx, x, w, t):
        counts, scale = count_targets_triton(t, -100, w.shape[0])
        logits = torch.mm(x, w.t())
        loss, lse = torch.empty(x.shape[0], device=x.device), torch.empty(x.shape[0], device=x.device)
        ce_chunk_triton(logits, t, loss, lse, None, None, None, scale, OPTS)
        ctx.saved = (logits, x, w)
        return loss.sum() * scale

    @staticmethod
    def backward(ctx, g):
        dl, x, w = ctx.saved
        dl.mul_(g)
        return dl @ w, dl.t() @ x, None


def _inputs(bt: int):
    dev = torch.device("cuda")
    x = torch.randn(bt, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, device=dev) * HIDDEN**-0.5).to(torch.bfloat16).requires_grad_()
    return x, w, torch.randint(0, VOCAB, (bt,), device=dev)


def _losses(x, w, t) -> dict:
    losses = {
        "eager": lambda: F.cross_entropy((x @ w.t()).float(), t),
        "minimal Function": lambda: _Minimal.apply(x, w, t),
        "flce": lambda: flce.linear_cross_entropy(x, w, t),
        "flce unchecked": lambda: flce.linear_cross_entropy(x, w, t, validate_target=False),
    }
    try:
        import flce_old

        losses["old flce"] = lambda: flce_old.linear_cross_entropy(x, w, t)
        losses["old flce unchecked"] = lambda: flce_old.linear_cross_entropy(x, w, t, validate_target=False)
    except ImportError:
        pass
    return losses


def _report(bt: int, unit: str, samples: dict[str, list[float]], extra: dict[str, list[float]] | None = None):
    for name, values in samples.items():
        q = statistics.quantiles(values, n=4)
        line = f"BT={bt} {name}: {statistics.median(values):.3f} {unit} (quartiles {q[0]:.3f}-{q[2]:.3f})"
        if extra:
            line += f", host {statistics.median(extra[name]):.3f} ms/step"
        print(line, flush=True)


def steady(bt: int, calls: int = 40, rounds: int = 8) -> None:
    x, w, t = _inputs(bt)

    def step(loss):
        def run():
            x.grad = w.grad = None
            loss().backward()
        return run

    steps = {name: step(loss) for name, loss in _losses(x, w, t).items()}
    gpu = {name: [] for name in steps}
    host = {name: [] for name in steps}
    for fn in steps.values():
        fn()
    for _ in range(rounds):
        for name, fn in steps.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(calls)]
            start = time.perf_counter()
            for a, b in events:
                a.record()
                fn()
                b.record()
            host[name].append((time.perf_counter() - start) / calls * 1e3)
            torch.cuda.synchronize()
            gpu[name] += [a.elapsed_time(b) for a, b in events[calls // 4:]]  # past the ramp-up
    _report(bt, "ms/step", gpu, host)


def host_only(bt: int, steps: int = 30) -> None:
    x, w, t = _inputs(bt)
    variants = {name: (lambda loss=loss: torch.autograd.grad(loss(), (x, w)))
                for name, loss in _losses(x, w, t).items() if "unchecked" in name or "flce" not in name}
    variants["flce forward only"] = lambda: flce.linear_cross_entropy(x, w, t)  # the check, not its wait
    variants["flce forward only, unchecked"] = lambda: flce.linear_cross_entropy(x, w, t, validate_target=False)
    times = host_us_per_call(variants, rounds=ROUNDS, calls=steps, sleep_cycles=200_000_000)
    _report(bt, "us/step on the host", times)


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [16]
    for size in sizes:
        (host_only if "--host" in sys.argv else steady)(size)
