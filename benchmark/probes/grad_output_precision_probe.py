"""Probe: bf16 gradients against float64 when grad_output is not 1 (gradient accumulation over three
micro-batches: 1/3) and the mean runs over a count that is no power of two (10% of the rows ignored), on
each path of the fused loss, beside eager PyTorch (bf16 logits materialized, ``.float()`` cross-entropy).
Prints each gradient's relative error as a multiple of eager's and of the bf16 rounding of the exact
gradient. GPU only; run it once per tree to compare two:

    PYTHONPATH=src python benchmark/probes/grad_output_precision_probe.py [label part, e.g. low_memory]
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import flce
from flce import exp_logits

H, V = 4096, 128256
# (label, rows, linear_cross_entropy keywords, whether the exp-logits path may run); "num_items": pass the
# count of valid rows as num_items_in_batch (the same mean, as the transformers Trainer passes it)
CASES = [
    ("16 rows (one chunk)", 16, {}, True),
    ("256 rows (one chunk)", 256, {}, True),
    ("1000 rows (one chunk)", 1000, {}, True),
    ("8192 rows (one chunk, exp-logits)", 8192, {}, True),
    ("8192 rows (one chunk, standard path)", 8192, {}, False),
    ("8192 rows (4 chunks, exp-logits)", 8192, {"chunk_size": 2048}, True),
    ("8192 rows (4 chunks, standard path)", 8192, {"chunk_size": 2048}, False),
    ("1000 rows (one chunk), num_items_in_batch", 1000, {"num_items": True}, True),
    ("8192 rows (4 chunks, exp-logits), num_items_in_batch", 8192, {"chunk_size": 2048, "num_items": True}, True),
    ("8192 rows (4 chunks, standard path), num_items_in_batch", 8192, {"chunk_size": 2048, "num_items": True}, False),
    ("8192 rows, low_memory=True", 8192, {"low_memory": True}, True),
    ("8192 rows, low_memory=True, num_items_in_batch", 8192, {"low_memory": True, "num_items": True}, True),
]


def reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rows: int = 1024):
    """d mean CE / d(x, w) in float64, chunk by chunk."""
    w64 = w.double()
    valid = t != -100
    gx, gw = torch.zeros(x.shape, dtype=torch.float64, device=x.device), torch.zeros_like(w64)
    for s in range(0, x.shape[0], rows):
        x_c, t_c, v_c = x[s:s + rows].double(), t[s:s + rows], valid[s:s + rows]
        dz = torch.softmax(x_c @ w64.t(), 1)
        dz[v_c, t_c[v_c]] -= 1
        dz[~v_c] = 0
        gx[s:s + rows] = dz @ w64
        gw.addmm_(dz.t(), x_c)
    n = valid.sum().double()
    return gx / n, gw / n


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # run only the cases whose label contains this
    print(torch.cuda.get_device_name(), "flce from", flce.__file__)
    print("| case | grad_output | grad_input: x eager / x rounding | grad_weight: x eager / x rounding |")
    print("|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    min_rows = exp_logits.MIN_ROWS
    for label, n, kw, exp_path in CASES:
        if only not in label:
            continue
        x = torch.randn(n, H, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(V, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
        t = torch.randint(0, V, (n,), device="cuda", generator=gen)
        t[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100
        exact = reference(x, w, t)
        kw = dict(kw)
        if kw.pop("num_items", False):
            kw["num_items_in_batch"] = int((t != -100).sum())
        exp_logits.MIN_ROWS = min_rows if exp_path else 1 << 40
        for g in (1.0, 1 / 3):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            got = torch.autograd.grad(flce.linear_cross_entropy(*leaves, t, **kw) * g, leaves)
            eager = torch.autograd.grad(F.cross_entropy((leaves[0] @ leaves[1].t()).float(), t) * g, leaves)
            cells = []
            for mine, theirs, want in zip(got, eager, exact):
                want = want * g
                err = rel(mine, want)
                cells.append(f"{err / rel(theirs, want):.3f} / {err / rel(want.to(torch.bfloat16), want):.3f}")
            print(f"| {label} | {g:.3g} | {cells[0]} | {cells[1]} |", flush=True)
            del got, eager
        exp_logits.MIN_ROWS = min_rows
        del exact
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
