"""Probe (session 5, H200): formulations of the lean setting's short-K grad_W update, and its other
GEMMs, under both cuBLAS libraries (torch.backends.cuda.preferred_blas_library). GPU only:
PYTHONPATH=src:benchmark python benchmark/probes/lean_gemm_variants.py"""
from __future__ import annotations
import statistics

import torch
from common import timed_calls

import flce

bt, hidden, vocab, c = 8192, 4096, 128256, 512
dev, dt = torch.device("cuda"), torch.bfloat16
x = torch.randn(bt, hidden, device=dev, dtype=dt)
w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).to(dt)
t = torch.randint(0, vocab, (bt,), device=dev)
gw = torch.zeros_like(w)
x_c, dl = x[:c], torch.randn(c, vocab, device=dev, dtype=dt) * 1e-3
out = torch.empty(c, vocab, device=dev, dtype=dt)

def bmm_split(k):
    """The same update as k batched GEMMs over vocabulary slices (cuBLAS may pick another kernel)."""
    g, d = gw.view(k, vocab // k, hidden), dl.t().unflatten(0, (k, vocab // k))
    xb = x_c.expand(k, c, hidden)
    return lambda: g.baddbmm_(d, xb)

xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
def lean():
    xg.grad = wg.grad = None
    flce.linear_cross_entropy(xg, wg, t, chunk_size=c, accum_dtype=torch.bfloat16).backward()
def default():
    xg.grad = wg.grad = None
    flce.linear_cross_entropy(xg, wg, t).backward()

variants = {
    "grad_W addmm_": lambda: gw.addmm_(dl.t(), x_c),
    "grad_W transposed addmm_": lambda: gw.t().addmm_(x_c.t(), dl),
    "grad_W baddbmm x2": bmm_split(2),
    "grad_W baddbmm x3": bmm_split(3),
    "grad_W mm (beta 0)": lambda: torch.mm(dl.t(), x_c, out=gw),
    "logits mm": lambda: torch.mm(x_c, w.t(), out=out),
    "grad_x mm": lambda: torch.mm(dl, w),
    "flce lean": lean,
    "flce default": default,
}
print(torch.cuda.get_device_name(), torch.__version__)
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    times = {k: [] for k in variants}
    for _ in range(5):
        for k, fn in variants.items():
            times[k] += timed_calls(fn, 2, 5, dev)
    for k, ts in times.items():
        print(f"{lib:9s} {k:28s} {statistics.median(ts):8.3f} ms")
