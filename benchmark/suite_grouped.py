"""Grouped suite: flce.grouped_linear against a per-group loop and autograd bmm (seed 000), and
flce.grouped_linear_cross_entropy against a per-group loop of the fused loss and eager logits.

Grouped linear, ``y[b, g] = x[b, g] @ W[g].T`` with x: (B*G, in) read as (B, G, in) and y: (B*G, out),
the seed's interface. Methods: ``loop`` (F.linear per group, then stack), ``bmm`` (autograd torch.bmm on
permuted views; the (B*G, out) result is a copy), ``bmm-strided-out`` (no autograd: the seed's single
strided bmm, the forward target; in fwd+bwd the three strided bmm calls alone, the floor of this
design), ``flce`` and ``flce-group-major`` ((G, B, in) input).
Grouped loss: G heads of a vocabulary, mean CE over all tokens. Methods: ``lce-loop`` (one
flce.linear_cross_entropy per head), ``eager`` ((B, G, V) logits + F.cross_entropy), ``flce``.

"fwd" runs under no_grad; "fwd+bwd" returns the gradients of input and weight (torch.autograd.grad).
``x_loop`` is the loop's time over the method's, per problem, shape and mode.

    PYTHONPATH=src python benchmark/bench.py --suite grouped      # or: python benchmark/suite_grouped.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import add_speedup, make_row, measure, progress, wanted

NAME = "grouped"
COLUMNS = ["problem", "method", "mode", "dtype", "shape", "median_ms", "tflops", "x_loop", "peak_mb", "status"]
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
LINEAR_METHODS = ("loop", "bmm", "bmm-strided-out", "flce", "flce-group-major")
LOSS_METHODS = ("lce-loop", "eager", "flce")


@dataclass(frozen=True)
class Cell:
    """problem "linear": B x G x in -> out; problem "lce": B positions x G heads, H -> V."""

    problem: str
    batch: int
    groups: int
    d_in: int
    d_out: int
    dtype: torch.dtype

    @property
    def shape(self) -> str:
        return f"B{self.batch} G{self.groups} {self.d_in}->{self.d_out}"

    def flops(self, mode: str) -> float:
        return (6 if mode == "fwd+bwd" else 2) * self.batch * self.groups * self.d_in * self.d_out


def cells(args) -> list[Cell]:
    if args.quick or args.device.type != "cuda":
        return [Cell("linear", 64, 3, 64, 96, torch.float32), Cell("lce", 32, 2, 32, 200, torch.float32)]
    return [Cell("linear", 2560, 12, 1024, 3072, torch.bfloat16),  # seed 000's shape
            Cell("lce", 2048, 4, 2048, 32000, torch.bfloat16)]     # multi-token prediction heads


# ---------------------------------------------------------------- grouped linear methods

def _linear_forward(method: str, x: torch.Tensor, w: torch.Tensor, cell: Cell) -> torch.Tensor:
    import flce

    B, G = cell.batch, cell.groups
    if method == "loop":
        x3 = x.view(B, G, -1)
        return torch.stack([F.linear(x3[:, g], w[g]) for g in range(G)], dim=1).view(B * G, -1)
    if method == "bmm":
        y = torch.bmm(x.view(B, G, -1).transpose(0, 1), w.transpose(1, 2))  # (G, B, out)
        return y.transpose(0, 1).reshape(B * G, -1)
    if method == "bmm-strided-out":
        out = torch.empty(B, G, cell.d_out, dtype=x.dtype, device=x.device)
        torch.bmm(x.view(B, G, -1).transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(B * G, -1)
    return flce.grouped_linear(x, w, group_major=method == "flce-group-major")


def _linear_fn(method: str, cell: Cell, mode: str, device: torch.device):
    x = torch.randn(cell.batch * cell.groups, cell.d_in, device=device, dtype=cell.dtype, requires_grad=True)
    w = (torch.randn(cell.groups, cell.d_out, cell.d_in, device=device) / cell.d_in**0.5).to(cell.dtype)
    w.requires_grad_()
    dy = torch.randn(cell.batch * cell.groups, cell.d_out, device=device, dtype=cell.dtype)
    if method == "bmm-strided-out" and mode == "fwd+bwd":
        return lambda: _three_strided_bmms(x.detach(), w.detach(), dy, cell)
    return _timed(lambda: _linear_forward(method, x, w, cell), mode, (x, w), dy)


def _three_strided_bmms(x, w, dy, cell: Cell):
    """The floor of the strided design: y, grad_x, grad_w as three bmm calls, no autograd."""
    B, G = cell.batch, cell.groups
    x3, dy3 = x.view(B, G, -1).transpose(0, 1), dy.view(B, G, -1).transpose(0, 1)  # (G, B, .) views
    y = _linear_forward("bmm-strided-out", x, w, cell)
    grad_x = torch.empty_like(x)
    torch.bmm(dy3, w, out=grad_x.view(B, G, -1).transpose(0, 1))
    return y, grad_x, torch.bmm(dy3.transpose(1, 2), x3)


# ---------------------------------------------------------------- grouped loss methods

def _loss(method: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    import flce

    if method == "flce":
        return flce.grouped_linear_cross_entropy(x, w, t)
    if method == "eager":
        logits = torch.einsum("bgh,gvh->bgv", x, w)
        return F.cross_entropy(logits.flatten(0, 1).float(), t.flatten())
    total = (t != -100).sum()
    return sum(flce.linear_cross_entropy(x[:, g], w[g], t[:, g], num_items_in_batch=total)
               for g in range(w.shape[0]))


def _loss_fn(method: str, cell: Cell, mode: str, device: torch.device):
    x = torch.randn(cell.batch, cell.groups, cell.d_in, device=device, dtype=cell.dtype, requires_grad=True)
    w = (torch.randn(cell.groups, cell.d_out, cell.d_in, device=device) * 2 / cell.d_in**0.5).to(cell.dtype)
    w.requires_grad_()
    t = torch.randint(0, cell.d_out, (cell.batch, cell.groups), device=device)
    return _timed(lambda: _loss(method, x, w, t), mode, (x, w))


def _timed(compute, mode: str, inputs: tuple, grad_output=None):
    """What is timed: ``compute()`` under no_grad ("fwd"), or it and the gradients of ``inputs``."""
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return compute()
        return forward
    return lambda: torch.autograd.grad(compute(), inputs, grad_output)


# ---------------------------------------------------------------- the suite

def run(args) -> list[dict]:
    plan = []
    for cell in cells(args):
        methods = LINEAR_METHODS if cell.problem == "linear" else LOSS_METHODS
        for mode in wanted(args, ("fwd", "fwd+bwd"), "modes"):
            plan += [(cell, m, mode) for m in wanted(args, methods, "methods")]
    rows = []
    with progress(len(plan), NAME) as step:
        for cell, method, mode in plan:
            make = _linear_fn if cell.problem == "linear" else _loss_fn
            measured = measure(make(method, cell, mode, args.device), args, cell.flops(mode))
            rows.append(make_row(NAME, method, mode, cell.shape, measured, problem=cell.problem,
                                 dtype=DTYPES[cell.dtype], B=cell.batch, G=cell.groups, d_in=cell.d_in,
                                 d_out=cell.d_out))
            step(f"{cell.problem} {method} {mode}")
    # x_loop: the per-group loop's median over this row's (>1: faster than the loop)
    return add_speedup(rows, "x_loop", ("loop", "lce-loop"), ("problem", "shape", "mode"))


if __name__ == "__main__":
    import bench

    sys.exit(bench.main(["--suite", NAME, *sys.argv[1:]]))
