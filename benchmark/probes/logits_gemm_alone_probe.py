"""Probe: the Hopper logits GEMM with its tile statistics alone (what the chunk loop stores: the logits less
their tile max since 2afee14), its registers and spills, and cuBLAS's plain GEMM of the same shape; median and
best of 30 CUDA-event timings, ms. GPU only; run it once per tree to compare two:

    PYTHONPATH=<tree>/src python benchmark/probes/logits_gemm_alone_probe.py [rows, default 6144] [softcap]
"""
from __future__ import annotations

import sys

import torch

import flce
from flce.kernels import logits_triton as lt
from flce.options import LossOptions

H, V = 4096, 128256


def times(call) -> list[float]:
    out = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return sorted(out)


def main(rows: int, softcap: float | None = None) -> None:
    x = torch.randn(rows, H, device="cuda").bfloat16()
    w = (torch.randn(V, H, device="cuda") * H**-0.5).bfloat16()
    out = torch.empty(rows, V, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(2, rows, lt.num_tiles(V), device="cuda")

    def gemm():
        return lt._launch(x, w, None, out, stats[0], stats[1], LossOptions(softcap=softcap), lt.STORE_LOGITS)

    kernel = gemm()
    print(flce.__file__, "regs", kernel.n_regs, "spills", kernel.n_spills)
    mine, theirs = times(gemm), times(lambda: torch.mm(x, w.t(), out=out))
    print(f"rows {rows}, softcap {softcap}: GEMM with statistics median {mine[15]:.3f} ms min {mine[0]:.3f}; cuBLAS mm median "
          f"{theirs[15]:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6144, float(sys.argv[2]) if len(sys.argv) > 2 else None)
