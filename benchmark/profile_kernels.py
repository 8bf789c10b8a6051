"""Kernel-by-kernel GPU time of the floor's three GEMMs, of flce steps and of peers' steps, in one process.

GPU only. Usage: PYTHONPATH=src python benchmark/profile_kernels.py [--shape 8192x4096x128256]
[--chunk-sizes default,8192] [--accum-dtype bfloat16] [--low-memory] [--exp-logits-off]
[--row-align-bytes 16,128] [--peers quack,compile]. Prints, per
variant, the summed CUDA time of each kernel name over ``--steps`` steps and the wall time per step, so the
gap between a step and its kernels is visible.
"""

from __future__ import annotations

import argparse
import time
from unittest.mock import patch

import torch

import flce


def _table(prof, steps: int) -> str:
    rows = [(e.key, e.device_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    lines = [f"  {ms:8.3f} ms  x{n:<3d} {name[:90]}" for name, ms, n in rows[:14]]
    return "\n".join(lines + [f"  {total:8.3f} ms  kernels per step"])


def _run(name, fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / steps
    print(f"{name}: {wall:.3f} ms per step (wall, profiled)\n{_table(prof, steps)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--chunk-sizes", default="default")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--accum-dtype", default=None, choices=[None, "bfloat16", "float32"],
                   help="flce's grad_weight accumulator (bfloat16 with --chunk-sizes 512: the lean setting)")
    p.add_argument("--low-memory", action="store_true", help="also profile low_memory=True")
    p.add_argument("--exp-logits-off", action="store_true",
                   help="also profile the default step with the exp-logits path off (exp_logits.py)")
    p.add_argument("--row-align-bytes", default=None,
                   help="also profile the default step with these row strides of the logits buffers "
                        "(gemm.ROW_ALIGN_BYTES; they differ only where V is no multiple of 8)")
    p.add_argument("--peers", default="",
                   help="also profile these methods of suite_lce (quack, compile, liger, ...), where they can run")
    args = p.parse_args()
    bt, hidden, vocab = map(int, args.shape.split("x"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(bt, hidden, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).to(dt).requires_grad_()
    t = torch.randint(0, vocab, (bt,), device=dev)
    big = torch.empty(bt, vocab, device=dev, dtype=dt)

    def floor():
        xd, wd = x.detach(), w.detach()
        torch.mm(xd, wd.t(), out=big)
        torch.mm(big, wd)
        torch.mm(big.t(), xd)

    _run("floor", floor, args.steps)
    del big
    torch.cuda.empty_cache()
    accum = getattr(torch, args.accum_dtype) if args.accum_dtype else None
    for spec in args.chunk_sizes.split(","):
        chunk = None if spec == "default" else int(spec)

        def step():
            x.grad = w.grad = None
            flce.linear_cross_entropy(x, w, t, chunk_size=chunk, accum_dtype=accum).backward()

        _run(f"flce chunk_size={spec}", step, args.steps)
        torch.cuda.empty_cache()
        if args.exp_logits_off and chunk is None:
            from flce import exp_logits

            with patch.object(exp_logits, "MIN_ROWS", 1 << 62):
                _run("flce, exp-logits path off", step, args.steps)
            torch.cuda.empty_cache()
    for align in args.row_align_bytes.split(",") if args.row_align_bytes else ():
        from flce import gemm

        def aligned_step():
            x.grad = w.grad = None
            flce.linear_cross_entropy(x, w, t).backward()

        with patch.object(gemm, "ROW_ALIGN_BYTES", int(align)):
            _run(f"flce, rows of {align} bytes", aligned_step, args.steps)
        torch.cuda.empty_cache()
    if args.low_memory:
        def low_memory_step():
            x.grad = w.grad = None
            flce.linear_cross_entropy(x, w, t, low_memory=True).backward()

        _run("flce low_memory=True", low_memory_step, args.steps)
        torch.cuda.empty_cache()
        from flce.kernels import block_gemm_triton

        fused = block_gemm_triton.supported
        block_gemm_triton.supported = lambda *a, **k: False  # backward's blocks: cuBLAS, then the block kernel
        _run("flce low_memory=True, cuBLAS + block kernel", low_memory_step, args.steps)
        block_gemm_triton.supported = fused
        torch.cuda.empty_cache()
    for name in filter(None, args.peers.split(",")):
        _run_peer(name, x, w, t, args.steps)
    big = torch.empty(bt, vocab, device=dev, dtype=dt)
    _run("floor again", floor, args.steps)


def _run_peer(name: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, steps: int) -> None:
    """A peer's step as the bench calls it (``suite_lce.METHODS``), or why it cannot run here."""
    from suite_lce import METHODS, UNAVAILABLE

    why = UNAVAILABLE.get(name, lambda device: None)(x.device)
    if why or METHODS.get(name) is None:
        print(f"{name}: skipped ({why or 'not a peer of suite_lce'})", flush=True)
        return

    def step():
        x.grad = w.grad = None
        METHODS[name](x, w, t).backward()

    _run(name, step, steps)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
