"""Probe: the Hopper logits GEMM with its tile statistics alone (what the chunk loop stores: the logits less
their tile max since 2afee14), its registers and spills, and cuBLAS's plain GEMM of the same shape; median and
best of 30 CUDA-event timings, ms. GPU only; run it once per tree to compare two:

    PYTHONPATH=<tree>/src:benchmark python benchmark/probes/logits_gemm_alone_probe.py [rows, default 6144] [softcap]
"""
from __future__ import annotations

import sys

import torch
from breakdown import event_times

import flce
from flce.kernels import logits_triton as lt
from flce.options import LossOptions

H, V = 4096, 128256


def main(rows: int, softcap: float | None = None) -> None:
    x = torch.randn(rows, H, device="cuda").bfloat16()
    w = (torch.randn(V, H, device="cuda") * H**-0.5).bfloat16()
    out = torch.empty(rows, V, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(2, rows, lt.num_tiles(V), device="cuda")

    def gemm():
        return lt._launch(x, w, None, out, stats[0], stats[1], LossOptions(softcap=softcap), lt.STORE_LOGITS)

    kernel = gemm()
    print(flce.__file__, "regs", kernel.n_regs, "spills", kernel.n_spills)
    mine, theirs = event_times(gemm, reps=30, warmup=0), event_times(lambda: torch.mm(x, w.t(), out=out), 30, 0)
    print(f"rows {rows}, softcap {softcap}: GEMM with statistics median {mine[15]:.3f} ms min {mine[0]:.3f}; "
          f"cuBLAS mm median {theirs[15]:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6144, float(sys.argv[2]) if len(sys.argv) > 2 else None)
