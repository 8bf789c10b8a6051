"""Probe: does a GEMM run faster when memory-bound work sits between its calls? In the experts profile
(`results/2026-11-24-h200-dcb7d1d/experts_profile_16384_e46c389.txt`) the grouped_mm baseline's CUTLASS
GEMMs run at ~725 TFLOP/s inside a step that also spends 22 ms in elementwise kernels, flce's at ~650 in a
step that is 95% GEMMs. Times one grouped GEMM of the experts layer (Mixtral 8x7B's gate/up projection at
T = 16384, top-2: 32768 rows x 4096 x 28672, rows split evenly over 8 experts) and a plain GEMM of the LM
head (8192 x 4096 x 128256) back to back, and with a device-to-device copy of ``--copy-ms`` between calls;
only the GEMMs are timed (CUDA events). Result (H200, `results/2026-11-24-h200-827518b/gemm_neighbour_probe.txt`):
the grouped GEMM 652-663 TFLOP/s back to back, 720 with copies between; the LM-head GEMM 687-695 against
726: under the GPU's power limit a GEMM-dense step runs its GEMMs 5-9% slower. GPU only:

    PYTHONPATH=src python benchmark/probes/gemm_neighbour_probe.py [--copy-ms 3] [--calls 30]
"""
from __future__ import annotations

import argparse
import statistics

import torch


def timed(gemm, between, calls: int) -> float:
    """Median ms of ``gemm`` over ``calls`` calls, ``between`` (or nothing) run after each."""
    times = []
    for _ in range(calls + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm()
        end.record()
        if between is not None:
            between()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[3:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--copy-ms", type=float, default=3.0)
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    rows, hidden, inter2, experts = 32768, 4096, 28672, 8
    xs = torch.randn(rows, hidden, device=dev, dtype=bf16)
    gate_up = torch.randn(experts, inter2, hidden, device=dev, dtype=bf16) * hidden**-0.5
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (rows // experts)
    x8 = torch.randn(8192, 4096, device=dev, dtype=bf16)
    w = torch.randn(128256, 4096, device=dev, dtype=bf16) * 4096**-0.5
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    gemms = {
        "grouped_mm 32768 x 4096 x 28672 (8 experts)": (lambda: grouped(xs, gate_up.transpose(1, 2), offs=offs),
                                                          2 * rows * hidden * inter2),
        "mm 8192 x 4096 x 128256": (lambda: torch.mm(x8, w.t()), 2 * 8192 * 4096 * 128256),
    }
    src = torch.empty(1 << 28, device=dev, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    one = timed(lambda: dst.copy_(src), None, 5)
    copies = max(1, round(a.copy_ms / one))
    print(torch.cuda.get_device_name(), "torch", torch.__version__,
          f"copy of 1 GiB {one:.3f} ms, {copies} between calls", flush=True)

    def between():
        for _ in range(copies):
            dst.copy_(src)
    for name, (gemm, flop) in gemms.items():
        for label, gap in (("back to back", None), ("copies between", between), ("back to back", None)):
            ms = timed(gemm, gap, a.calls)
            print(f"{name:45s} {label:15s} {ms:8.3f} ms  {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
