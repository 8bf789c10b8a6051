"""Probe: what the softcap costs each Triton pass that applies it, on a GPU, at Llama-3 shapes (bf16, 4096
rows, V = 128256, H = 4096): the CE kernel's two passes (loss and gradient, and loss alone), the logits
GEMM with its tile-statistics epilogue (Hopper) and the low-memory block kernel, each without softcap and
with softcap 30. The softcap's tanh and sech^2 come from ``softcap_triton`` (a range-reduced exp and an
IEEE reciprocal, no division by the softcap). Run on two trees to compare them:

    PYTHONPATH=src:benchmark python benchmark/probes/softcap_cost_probe.py
"""
from __future__ import annotations

import torch
from breakdown import median_ms

from flce.kernels import logits_triton
from flce.kernels.ce_block_torch import RowTerms
from flce.kernels.ce_block_triton import ce_block_triton
from flce.kernels.ce_triton import ce_chunk_triton
from flce.options import LossOptions

ROWS, VOCAB, HIDDEN, BLOCK_COLS = 4096, 128256, 4096, 16384


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    src = torch.randn(ROWS, VOCAB, device=dev, dtype=torch.bfloat16) * 4
    buf = src.clone()
    t = torch.randint(0, VOCAB, (ROWS,), device=dev)
    loss, lse = torch.empty(ROWS, device=dev), torch.empty(ROWS, device=dev)
    scale = torch.ones((), device=dev)
    x = torch.randn(ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5
    tiles = torch.empty(2, ROWS, logits_triton.num_tiles(VOCAB), device=dev)
    block = src[:, :BLOCK_COLS].clone()
    lse_all = torch.logsumexp(src.float(), 1)
    for softcap in (None, 30.0):
        opts = LossOptions(softcap=softcap)

        def grad():
            buf.copy_(src)  # fresh logits (timed too: subtract the copy's line)
            ce_chunk_triton(buf, t, loss, lse, None, None, None, scale, opts)

        cases = {
            "copy of the logits alone": lambda: buf.copy_(src),
            "CE loss + gradient (two passes) after the copy": grad,
            "CE loss alone": lambda: ce_chunk_triton(src, t, loss, lse, None, None, None, None, opts),
            "logits GEMM + tile stats": lambda: logits_triton.logits_with_tile_stats(x, w, None, buf, tiles[0],
                                                                                   tiles[1], opts),
            f"low-memory block kernel ({BLOCK_COLS} columns)": lambda: ce_block_triton(
                block, 0, VOCAB, RowTerms(t, lse_all, None, None, scale), opts),
        }
        for name, fn in cases.items():
            if "GEMM" in name and not logits_triton.supported(x, w, None):
                continue
            ms = median_ms(fn, reps=20)
            print(f"softcap {softcap}: {name}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
