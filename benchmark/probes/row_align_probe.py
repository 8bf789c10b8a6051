"""Probe: the row stride of the padded logits buffers (``gemm.ROW_ALIGN_BYTES``) at vocabularies that are no
multiple of 8. Per shape and alignment: flce's training step (mean loss, gradients of x and W) and the three
GEMMs as flce runs them on a buffer of that row stride (the logits through ``function.chunk_logits``: the Hopper
GEMM with tile statistics where it applies; backward's two through ``gemm.mm_into``: aligned part plus
remainder); median of 12 CUDA-event timings per round, rounds taking turns (every other one in reverse), ms. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/row_align_probe.py [ROWSxHxV,...] [ALIGN,...] [ROUNDS]
"""
from __future__ import annotations

import sys

import torch
from breakdown import event_times, head_inputs

import flce
from flce import gemm
from flce.function import chunk_logits
from flce.options import LossOptions

SHAPES = "8192x4096x128256,8192x4096x128257,8192x2048x32000,8192x2048x32001,32768x4096x128257"


def median(fn) -> float:
    times = event_times(fn, 12, 3)
    return times[len(times) // 2]


def gemms(x, w, dl) -> tuple[float, float, float]:
    out_x = torch.empty_like(x, dtype=torch.float32)
    out_w = torch.empty_like(w, dtype=torch.float32)
    opts = LossOptions()
    return (median(lambda: chunk_logits(x, w, None, dl, opts, "triton")),
            median(lambda: gemm.mm_into(out_x, dl, w, accumulate=False)),
            median(lambda: gemm.mm_into(out_w, dl.t(), x, accumulate=False)))


def main(shapes: str, aligns: str, rounds: int) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flce.__file__, flush=True)
    for shape in shapes.split(","):
        rows, hidden, vocab = map(int, shape.split("x"))
        x, w, t = head_inputs(rows, hidden, vocab)
        results: dict[int, list] = {int(a): [] for a in aligns.split(",")}
        for i in range(rounds):
            for align in list(results)[::1 - 2 * (i % 2)]:  # every other round in reverse: drift cancels
                gemm.ROW_ALIGN_BYTES = align
                step = median(lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w)))
                dl = gemm.padded_rows(rows, vocab, torch.bfloat16, x.device)
                parts = gemms(x.detach(), w.detach(), dl)
                results[align].append((step, parts, dl.stride(0)))
                dl = None
                torch.cuda.empty_cache()
        for align, runs in results.items():
            steps = " / ".join(f"{s:.3f}" for s, _, _ in runs)
            parts = " | ".join(" / ".join(f"{p:.3f}" for p in ps) for _, ps, _ in runs)
            print(f"{shape} rows of {align} B (stride {runs[0][2]}): step {steps} ms; "
                  f"logits / grad_input / grad_weight {parts}", flush=True)
        x = w = t = None  # freed before the next shape (not del: the lambdas above close over them)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else SHAPES, sys.argv[2] if len(sys.argv) > 2 else "16,128,256",
         int(sys.argv[3]) if len(sys.argv) > 3 else 2)
