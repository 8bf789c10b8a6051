"""Probe: vocabularies that are not a multiple of 8 (a token added to Llama 3's 128256, or to Llama 2's 32000).
Per shape: a training step of flce's mean loss and of eager's (F.linear + F.cross_entropy in float32), median of
12 CUDA-event timings, ms; then cuBLAS's three GEMMs alone (logits x @ W^T, grad_input dl @ W, grad_weight
dl^T @ x), with the (rows, V) operand contiguous (row stride V) and in rows padded to 16 bytes. GPU only; run it
once per tree to compare two:

    PYTHONPATH=<tree>/src:benchmark python benchmark/probes/odd_vocab_probe.py [ROWSxHxV,...]
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from breakdown import event_times, head_inputs

import flce

SHAPES = "8192x4096x128256,8192x4096x128257,8191x4096x128257,16384x4096x128257,8192x2048x32000,8192x2048x32001," \
         "512x4096x128257,16x4096x128257"


def median(fn) -> float:
    times = event_times(fn, 12, 3)
    return times[len(times) // 2]


def main(shapes: str) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flce.__file__, flush=True)
    for shape in shapes.split(","):
        rows, hidden, vocab = map(int, shape.split("x"))
        x, w, t = head_inputs(rows, hidden, vocab)
        step = median(lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w)))
        eager = median(lambda: torch.autograd.grad(F.cross_entropy(F.linear(x, w).float(), t), (x, w)))
        xd, wd = x.detach(), w.detach()
        width = -(-vocab // 8) * 8
        gemms = []
        for name, dl in (("row stride V", torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)),
                         ("padded rows", torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)[:, :vocab])):
            parts = [median(lambda: torch.mm(xd, wd.t(), out=dl)), median(lambda: torch.mm(dl, wd)),
                     median(lambda: torch.mm(dl.t(), xd))]
            gemms.append(f"{name} {' / '.join(f'{p:.3f}' for p in parts)} (sum {sum(parts):.3f})")
        print(f"{shape}: flce step {step:.3f} ms, eager {eager:.3f}; cuBLAS logits / grad_input / grad_weight: "
              + "; ".join(gemms), flush=True)
        x = w = xd = wd = dl = None  # freed before the next shape (not del: the lambdas above close over them)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else SHAPES)
