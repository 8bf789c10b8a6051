"""Probe: the host's cost of each layer of a Triton launch (flce's CE kernel, 35 arguments) and of the other pieces
of a small-batch step that no torch op replaces: flce's wrapper, Triton's ``JITFunction.run`` with the arguments
built, its binder alone, the compiled kernel's own runner and raw ``run``, the target check's pinned copy, and
autograd's backward on its device thread against the calling thread. Held-busy GPU (``common.host_us_per_call``),
then a caught-up loop (the GPU idle between calls, as in a host-bound step). GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/launch_parts_probe.py
"""
from __future__ import annotations

import statistics

import torch
from common import host_us_per_call, running_loop_ms
from triton.runtime import driver

from flce.checks import HostCopy
from flce.kernels.ce_triton import _ce_kernel, ce_chunk_triton
from flce.options import LossOptions

dev = torch.device("cuda")
BT, V = 16, 128256
logits = torch.randn(BT, V, device=dev, dtype=torch.bfloat16)
t = torch.randint(0, V, (BT,), device=dev)
loss, lse, total = torch.empty(BT, device=dev), torch.empty(BT, device=dev), torch.empty((), device=dev)
scale = torch.ones((), device=dev)
counts = torch.zeros(3, dtype=torch.int64, device=dev)
opts = LossOptions()


def ce_call():
    return ce_chunk_triton(logits, t, loss, lse, None, None, None, scale, opts, counts, total)


def captured_launch():
    """The CE kernel's launch arguments as flce passes them, and the compiled kernel Triton picked."""
    seen = {}
    run = _ce_kernel.run

    def spy(*args, grid, warmup, **kwargs):
        seen.update(args=args, grid=grid, kwargs=kwargs, kernel=run(*args, grid=grid, warmup=warmup, **kwargs))
        return seen["kernel"]

    _ce_kernel.run = spy
    try:
        ce_call()
    finally:
        _ce_kernel.run = run
    return seen["args"], seen["kwargs"], seen["grid"], seen["kernel"]


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        return None


def trivial_step(threads: bool):
    xg = torch.randn(16, 16, device=dev, requires_grad=True)

    def step():
        torch.autograd.set_multithreading_enabled(threads)
        torch.autograd.grad(Trivial.apply(xg), (xg,), allow_unused=True)
        torch.autograd.set_multithreading_enabled(True)
    return step


def main() -> None:
    args, kwargs, grid, kernel = captured_launch()
    binder = _ce_kernel.device_caches[torch.cuda.current_device()][4]
    values = list(binder(*args, **kwargs)[0].values())
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    kernel._init_handles()
    grid = (grid[0], 1, 1)
    runner = kernel[grid]
    print("arguments", len(values))
    pieces = {
        "ce_chunk_triton": ce_call,
        "_ce_kernel[grid](args, kwargs)": lambda: _ce_kernel[grid](*args, **kwargs),
        "binder only": lambda: binder(*args, **kwargs),
        "compiled[grid](*vals)": lambda: kernel[grid](*values),
        "runner(*vals) (grid bound)": lambda: runner(*values),
        "compiled.run raw": lambda: kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None,
                                               None, None, *values),
        "get_current_device+stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "torch.zeros(3)": lambda: torch.zeros(3, dtype=torch.int64, device=dev),
        "counts.zero_()": lambda: counts.zero_(),
        "pinned empty(3)": lambda: torch.empty(3, dtype=torch.int64, pin_memory=True),
        "HostCopy": lambda: HostCopy(counts),
        "HostCopy + query": lambda: HostCopy(counts).done(),
        "trivial fn + grad, threads": trivial_step(True),
        "trivial fn + grad, main thread": trivial_step(False),
        "0-d * 0-d": lambda: scale * scale,
    }
    times = host_us_per_call(pieces, sleep_cycles=50_000_000)
    print(torch.cuda.get_device_name())
    for name, v in times.items():
        print(f"{name:36s} {statistics.median(v):7.1f} us  (min {min(v):.1f})")
    loop = {"HostCopy+wait": lambda: HostCopy(counts).wait(),
            "HostCopy+query+wait+wait": lambda: (lambda h: (h.done(), h.wait(), h.wait().tolist()))(HostCopy(counts)),
            "zeros": pieces["torch.zeros(3)"], "ce_chunk_triton": ce_call,
            "runner": pieces["runner(*vals) (grid bound)"],
            "trivial threads": pieces["trivial fn + grad, threads"],
            "trivial main": pieces["trivial fn + grad, main thread"]}
    for _ in range(3):
        print("caught-up loop us:", {name: round(running_loop_ms(fn, dev)[0] * 1e3, 1) for name, fn in loop.items()})


if __name__ == "__main__":
    main()
