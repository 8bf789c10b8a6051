"""The three GEMMs of one step alone at small BT (cuBLAS), with the transposed grad_weight and the
K=1 outer product as alternatives, against a 1 GB copy: the parts of the byte floor.

    PYTHONPATH=src python benchmark/small_bt_gemms.py
"""

from __future__ import annotations

import torch

from common import median_ms

HIDDEN, VOCAB = 4096, 128256


def main() -> None:
    device = torch.device("cuda")
    w = torch.randn(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16)
    gw = torch.empty_like(w)
    for bt in (1, 4, 16, 64, 256):
        x = torch.randn(bt, HIDDEN, device=device, dtype=torch.bfloat16)
        dl = torch.randn(bt, VOCAB, device=device, dtype=torch.bfloat16)
        gx, logits = torch.empty_like(x), torch.empty_like(dl)
        fns = {
            "logits": lambda: torch.mm(x, w.t(), out=logits),
            "gin": lambda: torch.mm(dl, w, out=gx),
            "gw": lambda: torch.mm(dl.t(), x, out=gw),
            "gw_T": lambda: torch.mm(x.t(), dl, out=gw.view(HIDDEN, VOCAB)),
            "copy_1GB": lambda: gw.copy_(w),
        }
        if bt == 1:
            fns["gw_outer_mul"] = lambda: torch.mul(dl.t(), x, out=gw)
        print(bt, {k: round(median_ms(fn, 5, 30, device), 3) for k, fn in fns.items()}, flush=True)


if __name__ == "__main__":
    main()
