"""Probe: the CE kernel's time per step at vocabularies that are no multiple of 16 and at logits rows of 16 or 128
bytes (``gemm.ROW_ALIGN_BYTES``), beside the aligned vocabulary. Per tree, shape and row alignment: the summed
CUDA time of the row kernels (``_ce_kernel``; with ``--log-probs`` the token-statistics kernels of
``linear_log_probs``' log-probs and entropy) and of all kernels per training step (torch.profiler, 10 steps), and
the step's median CUDA-event time over 15 calls; trees take turns per shape. ``--cublas-logits``: the logits from
cuBLAS, as on GPUs other than Hopper (the CE kernel's two-pass form, no tile statistics). GPU only:

    python benchmark/probes/ce_stride_probe.py TREE_SRC[,TREE_SRC...] [ROWSxHxV,...] [ALIGN,...] [--log-probs]
        [--cublas-logits]
"""
from __future__ import annotations

import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/: breakdown's helpers
SHAPES = "16384x2048x32000,16384x2048x32001,32768x4096x128256,32768x4096x128257,64x4096x128256,64x4096x128257"


def measure(shape: str, aligns: str, log_probs: bool, cublas: bool) -> None:
    import torch
    from breakdown import event_times, head_inputs

    import flce
    from flce import gemm
    from flce.kernels import logits_triton

    if cublas:
        logits_triton.supported = lambda *args, **kwargs: False

    x, w, t = head_inputs(*map(int, shape.split("x")))

    def step():
        if log_probs:
            stats = flce.linear_log_probs(x, w, t)
            return torch.autograd.grad(stats.log_probs.sum() + stats.entropy.sum(), (x, w))
        return torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w))

    names = ("_stats_kernel", "_grad_kernel") if log_probs else ("_ce_kernel",)

    for align in map(int, aligns.split(",")):
        gemm.ROW_ALIGN_BYTES = align
        times = event_times(step, 15, 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        rows_ms = sum(e.device_time_total for e in events if e.key in names) / 1e4
        total = sum(e.device_time_total for e in events) / 1e4
        print(f"{shape} rows of {align} B: step {times[7]:.3f} ms, kernels {total:.3f}, "
              f"{' + '.join(names)} {rows_ms:.3f}", flush=True)


def main(trees: str, shapes: str, aligns: str, flags: list[str]) -> None:
    for shape in shapes.split(","):
        for tree in trees.split(","):
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + BENCH}
            out = subprocess.run([sys.executable, __file__, "--measure", shape, aligns, *flags],
                                 capture_output=True, text=True, env=env)
            lines = [line for line in out.stdout.splitlines() if line.startswith(shape)] or out.stderr.splitlines()[-2:]
            print("\n".join(f"{tree}: {line}" for line in lines), flush=True)


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a in ("--log-probs", "--cublas-logits")]
    args = [a for a in sys.argv[1:] if a not in flags]
    if args[0] == "--measure":
        measure(args[1], args[2], "--log-probs" in flags, "--cublas-logits" in flags)
    else:
        main(args[0], args[1] if len(args) > 1 else SHAPES, args[2] if len(args) > 2 else "16,128", flags)
