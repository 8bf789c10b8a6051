"""Probe: the allocations alive at the peak of one flce step (torch's memory history), largest first, each with
the flce lines that made it; a head with and without a trainable bias. Found the bias gradient's staging buffer
of torch's sum in the low-memory mode's blocks (133 MiB at 8192 x 4096 x 128256, H200; gone with
``gemm.column_sums_into``: ``results/2026-11-26-h200-eafbb74/bias_memory.txt``). GPU only:

    PYTHONPATH=src python benchmark/probes/memory_trace_probe.py [--shape 8192x4096x128256] [--default-mode]
"""
from __future__ import annotations

import argparse

import torch

import flce


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--default-mode", action="store_true", help="flce's default mode instead of low_memory=True")
    a = p.parse_args()
    bt, hidden, vocab = map(int, a.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(bt, hidden, device="cuda").bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda") * 2 / hidden**0.5).bfloat16()
    b = (torch.randn(vocab, device="cuda") * 0.1).bfloat16()
    t = torch.randint(0, vocab, (bt,), device="cuda")

    def step(bias: bool):
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        bl = b.detach().requires_grad_() if bias else None
        loss = flce.linear_cross_entropy(xl, wl, t, linear_bias=bl, low_memory=not a.default_mode)
        return torch.autograd.grad(loss, (xl, wl) + ((bl,) if bias else ()))

    print(torch.cuda.get_device_name(), "torch", torch.__version__, a.shape, "default" if a.default_mode else "low_memory")
    for bias in (False, True):
        step(bias)  # warm: compiled kernels, cuBLAS workspaces
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        grads = step(bias)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        del grads
        peak, alive = _peak(snapshot["device_traces"][torch.cuda.current_device()])
        print(f"bias={bias}: peak of this step's allocations {peak / 2**20:.0f} MiB; alive then:")
        for event in sorted(alive, key=lambda e: -e["size"])[:8]:
            frames = [f for f in event.get("frames", []) if "flce" in f["filename"]]
            where = "; ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3])
            print(f"   {event['size'] / 2**20:9.1f} MiB  {where}")


def _peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """The most bytes the trace's allocations held at once, and those allocations."""
    live, held, peak, at_peak = {}, 0, 0, []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            held += event["size"]
            if held > peak:
                peak, at_peak = held, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            held -= live.pop(event["addr"])["size"]
    return peak, at_peak


if __name__ == "__main__":
    main()
