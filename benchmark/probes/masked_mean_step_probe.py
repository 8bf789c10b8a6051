"""Probe: a training step whose loss is a masked mean over ``reduction="none"`` rows, (rows * mask).sum() /
mask.sum() (10% of the rows masked), bf16, gradients of input and weight: the per-row grad_output path, for
A/B runs of two trees. Per shape BT x H x V: the median and minimum of 24 CUDA-event timings (3 warm-up
steps first), ms, and the peak memory above the inputs. GPU only:

    PYTHONPATH=<tree>/src python benchmark/probes/masked_mean_step_probe.py 8192x4096x128256,1024x4096x128256
"""
from __future__ import annotations

import sys

import torch

import flce


def step_times(rows: int, hidden: int, vocab: int) -> tuple[list[float], float]:
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    mask = (torch.rand(rows, device="cuda") >= 0.1).float()

    def step():
        losses = flce.linear_cross_entropy(x, w, t, reduction="none")
        return torch.autograd.grad((losses * mask).sum() / mask.sum(), (x, w))

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
    main(sys.argv[1] if len(sys.argv) > 1 else "8192x4096x128256,32768x4096x128256,1024x4096x128256")
