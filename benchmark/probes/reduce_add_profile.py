"""Probe: kernel time per category inside training steps at 32768 x 4096 x 128256, with the weight-gradient
updates through TMA reduce-adds (``kernels/weight_grad_triton.py``) on and off, alternating, and the GPU's
SM clock and power sampled by nvidia-smi meanwhile. Tells whether the update's gain alone (``grad_w_reduce_probe.py``)
survives in a step. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/reduce_add_profile.py
"""
from __future__ import annotations

import statistics
import subprocess
import time
from unittest.mock import patch

import torch
from torch.profiler import ProfilerActivity, profile

import flce
from flce.kernels import weight_grad_triton

BT, H, V, STEPS = 32768, 4096, 128256, 4


def category(kernel: str) -> str:
    name = kernel.lower()
    for key, label in (("weight_grad", "triton grad_W update"), ("logits_stats", "triton logits GEMM"),
                       ("gemm", "cuBLAS GEMMs"), ("sm90", "cuBLAS GEMMs"), ("ce", "CE kernel")):
        if key in name:
            return label
    return "other"


def main():
    x = torch.randn(BT, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * 2 / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), device="cuda")

    def step():
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        torch.autograd.grad(flce.linear_cross_entropy(xl, wl, t), (xl, wl))

    def step_off():
        with patch.object(weight_grad_triton, "MIN_ROWS", 1 << 62):
            step()

    for name, fn in (("on", step), ("off", step_off)) * 2:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                fn()
            torch.cuda.synchronize()
        smi.terminate()
        samples = [tuple(map(float, line.split(","))) for line in smi.communicate()[0].splitlines()
                   if line.count(",") == 1]
        per_step: dict[str, float] = {}
        for e in prof.key_averages():
            per_step[category(e.key)] = per_step.get(category(e.key), 0.0) + e.device_time_total / 1e3 / STEPS
        parts = ", ".join(f"{k} {ms:.2f}" for k, ms in sorted(per_step.items()))
        print(f"reduce-add {name}: kernels per step (ms) {parts}; total {sum(per_step.values()):.2f}; SM clock median "
              f"{statistics.median(s[0] for s in samples):.0f} MHz, power median "
              f"{statistics.median(s[1] for s in samples):.0f} W ({len(samples)} samples)", flush=True)


if __name__ == "__main__":
    main()
