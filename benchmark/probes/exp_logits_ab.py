"""Probe: the exp-logits path (exp_logits.py) on and off, as a training loop runs it. Per shape, rounds of
``--steps`` back-to-back fwd+bwd steps of each variant (one sync per block of steps, fresh leaves each
step, the variants alternating per round), reported as the median ms per step over rounds, next to the
floor (three cuBLAS GEMMs) timed the same way. Results: `results/2026-11-24-h200-dcb7d1d/exp_logits_ab.txt`
(H200) and `results/2026-11-24-h100-c4f27ea/exp_logits_ab_dcb7d1d.txt` (H100): at dcb7d1d 8192 rows 1.017
against 1.024 (H200) and 1.015 against 1.029 (H100), 8192 x 2048 x 32000 1.059 / 1.072 and 1.064 / 1.084.
``--min-rows 256``: the path below 1024 rows does not pay (256 rows 1.261 against 1.138 off, H200,
`results/2026-11-25-h200-a8b06f6/exp_logits_min_rows_ab.txt`). ``--low-memory`` (the mode's forward chunks,
4bf56f1): 8192 rows 1.364 / 1.402 (H200,
`results/2026-11-24-h200-827518b/exp_logits_ab_low_memory.txt`) and 1.349 / 1.379 (H100,
`exp_logits_ab_low_memory_4bf56f1.txt`). ``--frozen-weight`` measured the reverted chunk path (457c722). Since 4de36ee the default mode also turns the
several-chunk path on and off (H100, `results/2026-11-27-h100-4de36ee/exp_chunks_ab.txt`: 32768 x 4096 x 128256
1.043 against 1.062, 8192 x 1024 x 151936 1.248 against 1.298). ``--low-memory --borrow`` compares the
mode's backward blocks that borrow grad_weight's storage (``LowMemoryPlan.blocks``) with buffer-only blocks
instead of the exp-logits path; ``--low-memory --share`` the mode with and without forward's share of grad_weight
(``LowMemoryPlan.forward_cols``); ``--autocast`` runs flce on float32 leaves under bf16 autocast; ``--bias`` gives
the head a trainable bias.
``--chunk-sizes`` times flce with fixed chunk heights beside the default plan, each with its peak memory
(`results/2026-11-26-h200-5ebccd8/chunk_size_ab_5ebccd8.txt`: within the spread at 32768 rows; one chunk at
16384 rows 1.009 against 1.029, 1.7 GB more).
``--base DIR`` compares this tree's Hopper GEMM kernels (the logits GEMM and the low-memory mode's fused
block GEMM) with another tree's, in the same steps (DIR holds that tree's ``src/flce`` copied as
``flce_base``: ``mkdir .ab && git archive REV src/flce | tar -x -C .ab && mv .ab/src/flce .ab/flce_base``), and
times the kernels alone (`results/2026-11-25-h100-1a6937c/ab_*.txt`). GPU only:

    PYTHONPATH=src python benchmark/probes/exp_logits_ab.py [--shapes 4096x4096x128256,...] [--rounds 7]
        [--low-memory [--borrow | --share]] [--base DIR] [--frozen-weight] [--autocast] [--bias] [--min-rows 256]
        [--chunk-sizes 8192,16384]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
import sys
import time
from unittest.mock import patch

import torch

import flce
import flce.low_memory as low_memory
from flce import exp_logits
from flce.kernels import block_gemm_triton, logits_triton


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1024x4096x128256,4096x4096x128256,8192x4096x128256,8192x2048x32000")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--low-memory", action="store_true", help="flce's low_memory=True mode (its forward chunks)")
    p.add_argument("--min-rows", type=int, default=None,
                   help="the path's least chunk rows for the 'flce' variant (default: exp_logits.MIN_ROWS)")
    p.add_argument("--frozen-weight", action="store_true", help="grad_input alone (a frozen LM head)")
    p.add_argument("--borrow", action="store_true",
                   help="with --low-memory: backward blocks borrowing grad_weight's storage on / off")
    p.add_argument("--share", action="store_true",
                   help="with --low-memory: forward's share of grad_weight (LowMemoryPlan.forward_cols) on / off")
    p.add_argument("--bias", action="store_true",
                   help="a trainable bias on the head (GPT-J, Phi-2): flce computes its gradient too (the floor has none)")
    p.add_argument("--autocast", action="store_true",
                   help="float32 input and weight, flce under bf16 autocast (fp32 master weights; the floor stays bf16)")
    p.add_argument("--chunk-sizes", default=None,
                   help="comma-separated chunk_size values: flce with each beside the default plan, with peak memory")
    p.add_argument("--base", default=None,
                   help="a folder holding another tree's src/flce as flce_base: its Hopper GEMM kernels against this tree's")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    base = _base_kernels(a.base) if a.base else None
    for spec in a.shapes.split(","):
        bt, hidden, vocab = map(int, spec.split("x"))
        x = torch.randn(bt, hidden, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device="cuda") * 2 / hidden**0.5).bfloat16()
        t = torch.randint(0, vocab, (bt,), device="cuda")
        logits = torch.empty(bt, vocab, device="cuda", dtype=torch.bfloat16)

        def floor():
            torch.mm(x, w.t(), out=logits)
            torch.mm(logits, w)
            torch.mm(logits.t(), x)

        leaf_dtype = torch.float32 if a.autocast else torch.bfloat16
        x_leaf, w_leaf = x.to(leaf_dtype), w.to(leaf_dtype)
        b_leaf = (torch.randn(vocab, device="cuda") * 0.1).to(leaf_dtype) if a.bias else None

        def flce_step(chunk_size=None):
            xl, wl = x_leaf.detach().requires_grad_(), w_leaf.detach().requires_grad_(not a.frozen_weight)
            leaves = (xl,) if a.frozen_weight else (xl, wl)
            bl = None if b_leaf is None else b_leaf.detach().requires_grad_()
            leaves += () if bl is None else (bl,)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.autocast):
                loss = flce.linear_cross_entropy(xl, wl, t, linear_bias=bl, low_memory=a.low_memory,
                                                 chunk_size=chunk_size)
            return torch.autograd.grad(loss, leaves)

        def variant(min_rows):
            def run():
                with patch.object(exp_logits, "MIN_ROWS", min_rows):
                    flce_step()
            return run

        def buffer_blocks_only():
            plan = low_memory.plan_low_memory
            with patch.object(low_memory, "plan_low_memory",
                              lambda *args, **kw: dataclasses.replace(plan(*args, **kw), grad_row_bytes=0)):
                flce_step()

        def no_share():
            plan = low_memory.plan_low_memory
            with patch.object(low_memory, "plan_low_memory",
                              lambda *args, **kw: plan(*args, **{**kw, "forward_share": False})):
                flce_step()

        def base_kernels():
            with (patch.object(block_gemm_triton, "block_logits_grad_triton", base["block"]),
                  patch.object(logits_triton, "logits_with_tile_stats", base["logits"])):
                flce_step()

        fns = {"floor": floor, "flce": variant(a.min_rows or exp_logits.MIN_ROWS)}
        if a.chunk_sizes:
            for cs in map(int, a.chunk_sizes.split(",")):
                fns[f"flce, chunk_size={cs}"] = lambda cs=cs: flce_step(cs)
        elif a.borrow:
            fns["flce, buffer blocks only"] = buffer_blocks_only
        elif a.share:
            fns["flce, no forward share"] = no_share
        elif base is not None:
            fns["flce, base kernels"] = base_kernels
            _time_kernels(x, w, t, base)
        else:
            fns["flce, exp-logits off"] = variant(1 << 62)
        times = {k: [] for k in fns}
        for r in range(a.rounds + 1):
            order = list(fns) if r % 2 else list(fns)[::-1]
            for name in order:
                fn = fns[name]
                fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(a.steps):
                    fn()
                torch.cuda.synchronize()
                if r:
                    times[name].append((time.perf_counter() - start) * 1e3 / a.steps)
        floor_ms = statistics.median(times["floor"])
        for name, v in times.items():
            ms = statistics.median(v)
            print(f"{spec} {name:22s} {ms:8.3f} ms  x_floor {ms / floor_ms:.3f}  (rounds {min(v):.3f}-{max(v):.3f})"
                  f"  peak {_peak_mib(fns[name]):7.0f} MiB above the inputs", flush=True)


def _peak_mib(fn) -> float:
    """Peak MiB allocated during one call above what was allocated before it (what it returns included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    del result
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _base_kernels(folder: str) -> dict:
    """The Hopper GEMM launchers of the tree copied as ``flce_base`` under ``folder`` (the block GEMM taking
    this tree's RowTerms: their first five fields)."""
    sys.path.insert(0, folder)
    block = importlib.import_module("flce_base.kernels.block_gemm_triton")
    logits = importlib.import_module("flce_base.kernels.logits_triton")
    row_terms = importlib.import_module("flce_base.kernels.ce_block_torch").RowTerms

    def block_launch(x, w_block, b_block, out, col_start, vocab, terms, opts):
        block.block_logits_grad_triton(x, w_block, b_block, out, col_start, vocab, row_terms(*terms[:5]), opts)

    return {"block": block_launch, "logits": logits.logits_with_tile_stats}


def _time_kernels(x, w, t, base: dict):
    """Each tree's kernels alone, alternating, median of 5 rounds: the logits GEMM storing exp(z) with its
    statistics over all of V, and the fused block GEMM (this tree's with the lse of unrounded logits, as
    after the exp-logits forward) at backward's widest block and at a 4096-column buffer block."""
    from triton.testing import do_bench

    from flce.kernels.ce_block_torch import RowTerms
    from flce.options import LossOptions

    n, hidden, vocab = *x.shape, w.shape[0]
    opts = LossOptions()
    terms = RowTerms(t, torch.full((n,), 11.0, device=x.device), None, None, torch.tensor(1.0 / n, device=x.device),
                     exact_lse=True)
    stats = torch.empty(2, n, logits_triton.num_tiles(vocab), dtype=torch.float32, device=x.device)
    cases = {}
    if n * vocab * 2 <= 8 << 30:
        e = torch.empty(n, vocab, dtype=x.dtype, device=x.device)
        cases[f"logits GEMM, store_exp, {n}x{hidden}x{vocab}"] = (
            2 * n * hidden * vocab, {tree: (lambda f=f: f(x, w, None, e, stats[0], stats[1], opts, store_exp=True))
                                     for tree, f in (("this tree", logits_triton.logits_with_tile_stats),
                                                     ("base", base["logits"]))})
    for cols in (40960, 4096):
        block, out = w[:cols], torch.empty(n, cols, dtype=x.dtype, device=x.device)
        cases[f"block GEMM, {n}x{hidden}x{cols}"] = (
            2 * n * hidden * cols, {tree: (lambda f=f, block=block, out=out: f(x, block, None, out, 0, vocab, terms, opts))
                                    for tree, f in (("this tree", block_gemm_triton.block_logits_grad_triton),
                                                    ("base", base["block"]))})
    for case, (flops, kernels) in cases.items():
        ms = {k: [] for k in kernels}
        for _ in range(5):
            for name, fn in kernels.items():
                ms[name].append(do_bench(fn, warmup=25, rep=200))
        for name, v in ms.items():
            m = statistics.median(v)
            print(f"{case} alone, {name:9s} {m:7.3f} ms {flops / m / 1e9:6.0f} TFLOP/s (rounds {min(v):.3f}-{max(v):.3f})",
                  flush=True)
        del kernels


if __name__ == "__main__":
    main()
