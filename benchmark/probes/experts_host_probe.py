"""Probe: where a small experts layer's time goes when the host, not the GPU, sets the pace. At H 1024 /
I 3584 (T = 4096, top-2 of 8) a forward + backward is ~1.5 ms of GPU work, about what the host needs to
launch it, so the bench's reading moves with the host's speed. Times, for flce's layer with ``auto``, with
the GEMM path forced to ``grouped_mm``, and through transformers' module (``module-auto``, the registered
backend): the host's time per call with the GPU held busy (nothing waits for it), the GPU time per call
back to back, and the bench's own reading (``timed_steps``, warm-up 3, 10 calls) in alternating order;
then the host cost of the dispatch's availability check and problem key per GEMM. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/experts_host_probe.py [TxHxI]      (default 4096x1024x3584)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import suite_experts as se
from common import timed_steps
from flce import experts as fx
from flce.kernels import experts_dispatch as dispatch


def main() -> None:
    tokens, hidden, inter = map(int, (sys.argv[1] if len(sys.argv) > 1 else "4096x1024x3584").split("x"))
    problem = se.make_problem(se.Cell(tokens, hidden, inter, 8, 2, torch.bfloat16), torch.device("cuda"))
    module = problem.module
    x, w = problem.hidden.detach().requires_grad_(), problem.weights.detach().requires_grad_()
    leaves = (x, w, module.gate_up_proj, module.down_proj)

    def layer(gemm):
        out = fx.experts_forward(x, problem.ids, w, module.gate_up_proj, module.down_proj, gemm=gemm)
        return torch.autograd.grad(out, leaves, problem.grad_out)

    def through_module():
        module.config._experts_implementation = "flce"
        return torch.autograd.grad(module(x, problem.ids, w), leaves, problem.grad_out)

    fns = {"auto": lambda: layer("auto"), "grouped_mm": lambda: layer("grouped_mm"), "module-auto": through_module}
    for fn in fns.values():
        fn(), fn()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    host = {name: [] for name in fns}
    for _ in range(15):
        for name, fn in fns.items():
            for _ in range(3):
                big @ big  # ~3 ms queued ahead: the calls below are timed on the host only
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            host[name].append((time.perf_counter() - t0) / 10 * 1e6)
            torch.cuda.synchronize()
    for name, fn in fns.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        back_to_back = start.elapsed_time(end) / 20 * 1e3
        print(f"{name:12s} host {statistics.median(host[name]):6.0f} us/call, back to back {back_to_back:6.0f} us/call")
    for name in ["grouped_mm", "module-auto", "auto"] * 2:
        ms = statistics.median(timed_steps(lambda n=name: fns[n], 3, 10, torch.device("cuda")))
        print(f"bench reading {name:12s} {ms:.3f} ms")
    a = torch.randn(tokens * 2, hidden, device="cuda", dtype=torch.bfloat16)
    wt = module.gate_up_proj.detach().transpose(1, 2)
    checks = (("availability check", lambda: dispatch._candidates("auto", "rows", a.device, a.dtype, (a, wt))),
              ("problem key", lambda: dispatch._key("rows", a, wt, experts=8)))
    for label, call in checks:
        t0 = time.perf_counter()
        for _ in range(1000):
            call()
        print(f"{label}: {(time.perf_counter() - t0) * 1e3:.1f} us per GEMM")


if __name__ == "__main__":
    main()
