"""Probe: what grad_input's float32 product costs against the bf16 GEMM it replaces on the chunked path
(``function.gradient_gemms`` with a split mean scale): torch.mm with a bf16 output, with ``out_dtype=float32``,
and the float32 output followed by the scale-and-cast (torch's multiply here; flce streams it through
``kernels.scale``). Median of CUDA-event timings over interleaved rounds, ms. GPU only:

    python benchmark/probes/gemm_out_dtype_probe.py [MxKxN,...]   # default: SHAPES
"""
from __future__ import annotations

import statistics
import sys

import torch

# (chunk rows, V, H): the chunks of 16384-32768 x 4096 x 128256, and of 32768 x 1024 x 32000
SHAPES = [(6144, 128256, 4096), (4096, 128256, 4096), (9216, 32000, 1024)]


def timed(fn, reps: int = 25) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(shapes: list[tuple[int, int, int]]) -> None:
    print(torch.cuda.get_device_name())
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
        out16, out32 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, n, device="cuda")
        scale = torch.tensor(0.7, device="cuda")
        runs = {
            "bf16 out": lambda: torch.mm(a, b, out=out16),
            "fp32 out": lambda: torch.mm(a, b, out_dtype=torch.float32, out=out32),
            "fp32 out + scale": lambda: torch.mul(torch.mm(a, b, out_dtype=torch.float32, out=out32), scale, out=out16),
        }
        readings = {name: [] for name in runs}
        for _ in range(4):
            for name, fn in runs.items():
                readings[name].append(timed(fn))
        print(m, k, n, {name: round(statistics.median(v), 4) for name, v in readings.items()}, flush=True)


if __name__ == "__main__":
    main([tuple(int(d) for d in s.split("x")) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else SHAPES)
