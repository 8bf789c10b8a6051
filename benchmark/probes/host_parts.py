"""Probe: host microseconds of each piece of a small-batch flce step on a CUDA device, with
the GPU held busy so nothing waits. GPU only:
PYTHONPATH=src:benchmark taskset -c 4 python benchmark/probes/host_parts.py. Result (H100 host,
``results/2026-11-24-h100-c4f27ea/host_parts_53db34f.txt``): flce 445 us unchecked against eager 236; no
single piece dominates (a Triton launch 44, torch.mm 28, an autograd Function with autograd.grad 96).
("checked" waits in backward for the target check, so there it times the GPU's held-busy work.)"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from common import host_us_per_call

import flce
from flce import checks, planner
from flce.kernels.ce_triton import ce_chunk_triton
from flce.options import LossOptions

dev = torch.device("cuda")
BT, H, V = 16, 4096, 128256
x = torch.randn(BT, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (BT,), device=dev)
xd, wd = x.detach(), w.detach()
logits = torch.mm(xd, wd.t())
loss, lse, scale = torch.empty(BT, device=dev), torch.empty(BT, device=dev), torch.ones((), device=dev)
counts = torch.zeros(3, dtype=torch.int64, device=dev)
opts = LossOptions()


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        return None, None


pieces = {
    "torch.empty(16) f32": lambda: torch.empty(BT, device=dev),
    "torch.zeros(3) int64": lambda: torch.zeros(3, dtype=torch.int64, device=dev),
    "pinned empty(3) + copy_ + Event + record": lambda: (torch.empty(3, dtype=torch.int64, pin_memory=True)
                                                        .copy_(counts, non_blocking=True), torch.cuda.Event().record()),
    "torch.mm 16x4096 @ 4096x128256": lambda: torch.mm(xd, wd.t()),
    "dl.mul_(0-d)": lambda: logits.mul_(scale),
    "0-d * 0-d": lambda: scale * scale,
    "ce_chunk_triton": lambda: ce_chunk_triton(logits, t, loss, lse, None, None, None, scale, opts),
    "check_tensors": lambda: checks.check_tensors(x, w, t, None, None),
    "plan_chunks": lambda: planner.plan_chunks(BT, V, torch.bfloat16, torch.bfloat16, weight_grad_hidden=H),
    "trivial Function fwd+autograd.grad": lambda: torch.autograd.grad(Trivial.apply(x, w), (x, w), allow_unused=True),
    "flce forward, no grad": lambda: flce.linear_cross_entropy(xd, wd, t, validate_target=False),
    "flce forward (graph), unchecked": lambda: flce.linear_cross_entropy(x, w, t, validate_target=False),
    "flce fwd+bwd, unchecked": lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t, validate_target=False), (x, w)),
    "flce fwd+bwd, checked": lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w)),
    "eager fwd+bwd": lambda: torch.autograd.grad(F.cross_entropy((x @ w.t()).float(), t), (x, w)),
}
times = host_us_per_call(pieces, sleep_cycles=50_000_000)
print(torch.cuda.get_device_name())
for name, v in times.items():
    print(f"{name:44s} {statistics.median(v):7.1f} us")
