"""Probe: the vocab-parallel loss on two GPUs at a Llama-3-8B head (bf16, H 4096, V 128256 split in two):
one forward+backward's time (median and best of 20 CUDA-event timings, ms, rank 0), and with logits of a trained
model's spread (std 6, targets drawn from the softmax) each gradient's error as a multiple of the bf16 rounding of
the exact one (grad_input, this rank's weight shard; float64 reference). Run it once per tree to compare two:

    PYTHONPATH=<tree>/src:benchmark torchrun --nproc_per_node=2 benchmark/probes/vocab_parallel_probe.py [rows]
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from breakdown import event_times
from suite_lce import _sampled_targets

import flce
from flce.distributed import vocab_parallel_linear_cross_entropy

H, V = 4096, 128256


def exact_grads(x, w, t, start, end, rows=1024):
    """d mean CE / d(x, w[start:end]) in float64, chunk by chunk (every rank holds the full weight here)."""
    w64 = w.double()
    gx, gw = torch.empty(x.shape, dtype=torch.float64, device=x.device), torch.zeros_like(w64[start:end])
    for s in range(0, x.shape[0], rows):
        x_c = x[s:s + rows].double()
        dz = torch.softmax(x_c @ w64.t(), 1)
        dz[torch.arange(x_c.shape[0], device=x.device), t[s:s + rows]] -= 1
        gx[s:s + rows] = dz @ w64
        gw.addmm_(dz[:, start:end].t(), x_c)
    return gx / x.shape[0], gw / x.shape[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main(rows: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    start, end = rank * V // world, (rank + 1) * V // world
    gen = torch.Generator(device="cuda").manual_seed(0)  # the same problem on every rank
    for std in (1.0, 6.0):
        x = torch.randn(rows, H, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(V, H, device="cuda", generator=gen) * std * H**-0.5).bfloat16()
        t = _sampled_targets(x, w, gen)
        leaves = [x.clone().requires_grad_(), w[start:end].clone().requires_grad_()]

        def step():
            return torch.autograd.grad(vocab_parallel_linear_cross_entropy(leaves[0], leaves[1], t), leaves)

        got = step()
        exact = exact_grads(x, w, t, start, end)
        errs = " / ".join(f"{rel(g, e) / rel(e.bfloat16(), e):.3f}" for g, e in zip(got, exact))
        del exact
        times = event_times(step, reps=20)
        if rank == 0:
            print(f"{flce.__file__} {rows} x {H} x {V} over {world} GPUs, logit std {std:g}: median "
                  f"{times[len(times) // 2]:.3f} ms, best {times[0]:.3f}; grad_input / grad_weight shard "
                  f"{errs} x the bf16 rounding (rank 0)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
