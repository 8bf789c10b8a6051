"""Probe: the share of a bias head's 16-bit logits that ``gemm.linear_into`` returns equal to the exact value
rounded once, at shapes on and off cuBLASLt's bias epilogue (one row, unaligned or padded vocabularies, V = 1).
PACKAGE is ``flce`` or a tree unpacked as a package (``probes/tree_ab.py``'s folders, on PYTHONPATH). GPU only:

    PYTHONPATH=src python benchmark/probes/linear_rounding_probe.py [PACKAGE]

Results: `results/2026-11-28-h200-18546e1/linear_into_rounding_da3bfe1.txt` (7a4ad9b against da3bfe1).
"""
from __future__ import annotations

import importlib
import sys

import torch

SHAPES = [(64, 100, 1001, True), (1, 100, 1000, False), (512, 8, 1, False), (300, 24, 1003, False),
          (48, 32, 1000, False), (16, 4096, 128257, True)]  # rows, H, V, padded rows


def main() -> None:
    package = sys.argv[1] if len(sys.argv) > 1 else "flce"
    gemm = importlib.import_module(package + ".gemm")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for rows, k, cols, padded in SHAPES:
            a = torch.randn(rows, k, device="cuda").to(dtype)
            b = (torch.randn(k, cols, device="cuda") * 0.8).to(dtype)
            bias = (torch.randn(cols, device="cuda") * 4).to(dtype)
            if padded:
                out = gemm.padded_rows(rows, cols, dtype, a.device)
            else:
                out = torch.empty(rows, cols, dtype=dtype, device="cuda")
            gemm.linear_into(out, a, b, bias)
            exact = a.double() @ b.double() + bias.double()
            share = (out == exact.to(dtype)).double().mean().item()
            print(package, dtype, (rows, k, cols, padded), f"{share:.4f}")


if __name__ == "__main__":
    main()
