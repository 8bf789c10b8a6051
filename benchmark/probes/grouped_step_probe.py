"""Probe: one grouped-loss training step (``flce.grouped_linear_cross_entropy``, bf16, mean per head, 10% of the
targets ignored, gradients of input and weight), for A/B runs of two trees. Per shape B x G x H x V: the median
and minimum of 24 CUDA-event timings (3 rounds of 8, after 3 warm-up steps), ms, and the peak memory above the
inputs. GPU only:

    PYTHONPATH=<tree>/src python benchmark/probes/grouped_step_probe.py 8192x2x4096x128256,2048x4x2048x32000
"""
from __future__ import annotations

import sys

import torch

import flce


def step_times(batch: int, groups: int, hidden: int, vocab: int) -> tuple[list[float], float]:
    x = torch.randn(batch, groups, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(groups, vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (batch, groups), device="cuda")
    t[torch.rand(batch, groups, device="cuda") < 0.1] = -100

    def step():
        return torch.autograd.grad(flce.grouped_linear_cross_entropy(x, w, t), (x, w))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(24):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def main(shapes: str) -> None:
    torch.manual_seed(0)
    for spec in shapes.split(","):
        times, peak = step_times(*map(int, spec.split("x")))
        print(f"{spec}: median {times[len(times) // 2]:.3f} ms  min {times[0]:.3f}  peak +{peak:.0f} MiB", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "8192x2x4096x128256,1024x2x4096x128256,2048x4x2048x32000")
