"""Probe: a bias gradient's sum over rows, torch's ``sum(0, dtype=float32)`` against flce's GEMV against ones
(``gemm.column_sums_into``), on bf16 blocks of the shapes flce sums: time, bandwidth, the memory each adds
while it runs, and the GEMV's error against float64. Result (H200,
``results/2026-11-26-h200-eafbb74/column_sums.txt``): the sum keeps a staging buffer of 132-141 MiB from 2048
rows (501 MiB at 8192 x 128256), the GEMV none, at the same speed from 20480 columns; at 256 rows the sum
needs no buffer and is twice as fast (hence ``GEMV_MIN_ROWS``). GPU only:

    PYTHONPATH=src python benchmark/probes/column_sums_probe.py
"""
from __future__ import annotations

import torch

from flce import gemm

# (rows, columns summed, row stride): a single chunk's dlogits, borrowed and buffer blocks of the
# low-memory mode at 8192 x 4096 x 128256, a chunk's share of a quarter of the vocabulary, a small batch.
SHAPES = [(8192, 128256, 128256), (8192, 20480, 20480), (8192, 3712, 3712), (2048, 32064, 128256),
          (256, 128256, 128256)]


def ms_per_call(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def added_mib(fn) -> float:
    """MiB allocated above what was allocated before the call, at its peak."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    gemm.GEMV_MIN_ROWS = 1  # the GEMV at every size
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for n, cols, stride in SHAPES:
        a = torch.randn(n, stride, device="cuda").bfloat16()[:, :cols]
        out = torch.empty(cols, device="cuda")

        def by_sum():
            torch.sum(a, 0, dtype=torch.float32, out=out)

        def by_gemv():
            gemm.column_sums_into(out, a, accumulate=False)

        sum_mib, gemv_mib = added_mib(by_sum), added_mib(by_gemv)
        want = a.double().sum(0)
        err = ((out.double() - want).norm() / want.norm()).item()
        gb = n * cols * a.element_size() / 1e9
        t_sum, t_gemv = ms_per_call(by_sum), ms_per_call(by_gemv)
        print(f"{n}x{cols} (row stride {stride}): sum {t_sum:.3f} ms ({gb / t_sum:.2f} TB/s, +{sum_mib:.1f} MiB)  "
              f"gemv {t_gemv:.3f} ms ({gb / t_gemv:.2f} TB/s, +{gemv_mib:.1f} MiB), gemv rel err {err:.1e}")


if __name__ == "__main__":
    main()
