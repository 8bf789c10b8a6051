"""Probe: where a small-batch training step's host time goes in a running loop (the bench's loop reading),
not with the GPU held busy (``host_parts.py``). At 16 x 2048 x 32000 the GPU's work is ~0.15 ms, so the loop's
time per step is the host's. Prints, per variant: the loop's wall time per step (one sync at the end), the
host's time inside each call, then a cProfile of flce's steps (by own time and by cumulative time) and the
torch ops one step dispatches. ``--phases`` instead: the host's time in forward and in backward, with autograd's
backward on its CUDA device thread (the default) and on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``), two rounds, then one profiled step's CPU ops and kernels in
time order with their thread. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/step_host_probe.py [--phases] [BTxHxV ...]
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import running_loop_ms

import flce

STEPS = 300


def variants(x, w, t):
    def flce_step(**kw):
        def step():
            xs = x.detach().clone().requires_grad_()
            return torch.autograd.grad(flce.linear_cross_entropy(xs, w, t, **kw), (xs, w))
        return step

    def eager_step():
        xs = x.detach().clone().requires_grad_()
        return torch.autograd.grad(F.cross_entropy((xs @ w.t()).float(), t), (xs, w))

    return {"flce": flce_step(), "flce unchecked": flce_step(validate_target=False), "eager": eager_step}


def phase_times(x, w, t, loss, n: int = 200) -> list[float]:
    """Median host microseconds of (forward, backward) over n steps of ``loss(x, w, t)``."""
    fw, bw = [], []
    for i in range(n + 20):
        xs = x.detach().clone().requires_grad_()
        t1 = time.perf_counter()
        out = loss(xs, w, t)
        t2 = time.perf_counter()
        torch.autograd.grad(out, (xs, w))
        t3 = time.perf_counter()
        if i >= 20:
            fw.append(t2 - t1)
            bw.append(t3 - t2)
    torch.cuda.synchronize()
    return [statistics.median(v) * 1e6 for v in (fw, bw)]


def phases(x, w, t) -> None:
    losses = {"flce": flce.linear_cross_entropy,
              "flce unchecked": lambda *a: flce.linear_cross_entropy(*a, validate_target=False),
              "eager": lambda xs, w, t: F.cross_entropy((xs @ w.t()).float(), t)}
    print("host us, forward / backward")
    for _ in range(2):
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            where = "device thread" if threads else "calling thread"
            for name, loss in losses.items():
                fw, bw = phase_times(x, w, t, loss)
                print(f"{name:16s} backward on the {where}: {fw:.0f} / {bw:.0f}")
    torch.autograd.set_multithreading_enabled(True)
    step = variants(x, w, t)["flce"]
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    last = [e for e in events if e.name == "LinearCrossEntropyFunction"][-1].time_range.start
    print("\n-- the last profiled step: where, thread, start us, duration us, name")
    t0 = None
    for e in events:
        if e.time_range.start < last - 200:
            continue
        t0 = e.time_range.start if t0 is None else t0
        where = "GPU" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu"
        print(f"{where} tid={e.thread % 1000:4d} {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  "
              f"{e.name[:90]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--phases"]
    shapes = args or ["16x2048x32000", "16x4096x128256"]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for spec in shapes:
        bt, hidden, vocab = map(int, spec.split("x"))
        x = torch.randn(bt, hidden, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, vocab, (bt,), device="cuda")
        if "--phases" in sys.argv:
            print(f"\n== {spec}")
            phases(x, w, t)
            continue
        fns = variants(x, w, t)
        rounds = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                rounds[name].append(running_loop_ms(fn, x.device, STEPS))
        print(f"\n== {spec}: wall ms per step / host ms inside a call, three rounds")
        for name, r in rounds.items():
            print(f"{name:16s} " + "  ".join(f"{a:.3f}/{b:.3f}" for a, b in r))
        step = fns["flce"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        profile.disable()
        for key in ("tottime", "cumulative"):
            print(f"\n-- cProfile of {STEPS} flce steps, by {key}")
            pstats.Stats(profile).sort_stats(key).print_stats(30)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print("\n-- torch ops of 10 flce steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))


if __name__ == "__main__":
    main()
