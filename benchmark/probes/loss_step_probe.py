"""Probe: one training step of a loss path, for A/B runs of two trees. Per shape: the median and minimum of 24
CUDA-event timings (3 warm-up steps first), ms, and the peak memory above the inputs; bf16, gradients of input
and weight. Kinds:

- ``grouped``, shapes B x G x H x V: ``flce.grouped_linear_cross_entropy``, a mean per head, 10% of the targets
  ignored;
- ``masked-mean``, shapes BT x H x V: ``reduction="none"`` rows, then (rows * mask).sum() / mask.sum() with 10%
  of the rows masked (the per-row grad_output path);
- ``mean``, ``smoothing``, ``softcap`` and ``low-memory``, shapes BT x H x V: ``flce.linear_cross_entropy``'s mean,
  as such, with ``label_smoothing=0.1`` (which keeps a single chunk on the standard path), with ``softcap=30.0``
  and with ``low_memory=True``;
- ``log-probs``, shapes BT x H x V: ``flce.linear_log_probs``' mean log-prob (TRL's head without entropy).

GPU only:

    PYTHONPATH=<tree>/src python benchmark/probes/loss_step_probe.py grouped 8192x2x4096x128256,2048x4x2048x32000
    PYTHONPATH=<tree>/src python benchmark/probes/loss_step_probe.py masked-mean 8192x4096x128256
"""
from __future__ import annotations

import sys

import torch

import flce


def grouped_step(batch: int, groups: int, hidden: int, vocab: int):
    x = torch.randn(batch, groups, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(groups, vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (batch, groups), device="cuda")
    t[torch.rand(batch, groups, device="cuda") < 0.1] = -100
    return lambda: torch.autograd.grad(flce.grouped_linear_cross_entropy(x, w, t), (x, w))


def masked_mean_step(rows: int, hidden: int, vocab: int):
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    mask = (torch.rand(rows, device="cuda") >= 0.1).float()

    def step():
        losses = flce.linear_cross_entropy(x, w, t, reduction="none")
        return torch.autograd.grad((losses * mask).sum() / mask.sum(), (x, w))

    return step


def mean_step(rows: int, hidden: int, vocab: int, **options):
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    return lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t, **options), (x, w))


def log_probs_step(rows: int, hidden: int, vocab: int):
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    return lambda: torch.autograd.grad(flce.linear_log_probs(x, w, t).log_probs.mean(), (x, w))


KINDS = {"grouped": grouped_step, "masked-mean": masked_mean_step, "mean": mean_step,
         "smoothing": lambda *shape: mean_step(*shape, label_smoothing=0.1),
         "softcap": lambda *shape: mean_step(*shape, softcap=30.0), "log-probs": log_probs_step,
         "low-memory": lambda *shape: mean_step(*shape, low_memory=True)}


def step_times(step) -> tuple[list[float], float]:
    """Sorted CUDA-event times of 24 steps (ms) and the peak memory above what was allocated before (MiB)."""
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


def main(kind: str, shapes: str) -> None:
    torch.manual_seed(0)
    for spec in shapes.split(","):
        times, peak = step_times(KINDS[kind](*map(int, spec.split("x"))))
        print(f"{spec}: median {times[len(times) // 2]:.3f} ms  min {times[0]:.3f}  peak +{peak:.0f} MiB", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
