"""Where the time of one flce forward+backward goes, stage by stage, against the three-GEMM floor.

GPU only. Usage: PYTHONPATH=src python benchmark/breakdown.py [--shapes 8192x4096x128256,...]
Prints a table and writes breakdown.json under $OUT (default ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import flce
from flce.gemm import mm_into
from flce.kernels import ce_chunk
from flce.options import LossOptions
from flce.planner import plan_chunks


def event_times(fn, reps=10, warmup=3) -> list[float]:
    """Sorted CUDA-event times of ``reps`` calls of fn (ms), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def head_inputs(rows: int, hidden: int, vocab: int, dtype=torch.bfloat16):
    """A language-model head's (x, W, targets) on the GPU, x and W requiring grad, logits of unit scale."""
    x = torch.randn(rows, hidden, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(dtype).requires_grad_()
    return x, w, torch.randint(0, vocab, (rows,), device="cuda")


def median_ms(fn, reps=10, warmup=3):
    return statistics.median(event_times(fn, reps, warmup))


def stages(bt, hidden, vocab, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    x, w, t = head_inputs(bt, hidden, vocab, dtype)
    plan = plan_chunks(bt, vocab, dtype, dtype, weight_grad_hidden=hidden)  # the plan flce's step uses
    rows = plan.rows
    out = {"shape": f"{bt}x{hidden}x{vocab}", "chunk_rows": rows, "chunks": plan.num_chunks,
           "accum": str(plan.accum_dtype).replace("torch.", "")}

    def flce_step():
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t).backward()

    def unchecked_step():  # no host sync: validate_target=False
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t, validate_target=False).backward()

    big = torch.empty(bt, vocab, device=dev, dtype=dtype) if bt * vocab * 2 < 12e9 else None

    def floor():
        if big is None:
            return
        xd, wd = x.detach(), w.detach()
        torch.mm(xd, wd.t(), out=big)
        torch.mm(big, wd)
        torch.mm(big.t(), xd)

    buf = torch.empty(rows, vocab, device=dev, dtype=dtype)
    acc = torch.empty(vocab, hidden, device=dev, dtype=plan.accum_dtype)
    gx = torch.empty_like(x)
    loss, lse = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
    scale = torch.ones((), device=dev)
    opts = LossOptions()

    def gemms_only():
        xd, wd = x.detach(), w.detach()
        for i, (s, e) in enumerate(plan.bounds()):
            lg = buf[: e - s]
            torch.mm(xd[s:e], wd.t(), out=lg)
            mm_into(gx[s:e], lg, wd, accumulate=False)
            mm_into(acc, lg.t(), xd[s:e], accumulate=i > 0)

    def ce_only():
        for s, e in plan.bounds():
            ce_chunk("triton", buf[: e - s], t[s:e], loss[: e - s], lse[: e - s], None, None, None, scale, opts)

    def eager():
        x.grad = w.grad = None
        torch.nn.functional.cross_entropy((x @ w.t()).float(), t).backward()

    buf.normal_()
    out["floor_ms"] = median_ms(floor) if big is not None else float("nan")
    big = None  # frees the logits-sized buffer before the flce steps (floor reads it no more)
    out["flce_ms"] = median_ms(flce_step)
    out["flce_unchecked_ms"] = median_ms(unchecked_step)
    if plan.num_chunks > 1:  # what twice the chunk height (and buffer memory) would buy
        def wide_step():
            x.grad = w.grad = None
            flce.linear_cross_entropy(x, w, t, chunk_size=2 * rows).backward()
        out["flce_2x_chunk_ms"] = median_ms(wide_step)
    out["gemms_chunked_ms"] = median_ms(gemms_only)
    buf.normal_()
    out["ce_kernel_ms"] = median_ms(ce_only)
    ce_bytes = 3 * bt * vocab * dtype.itemsize  # two reads + one write per logit
    out["ce_kernel_GBps"] = ce_bytes / out["ce_kernel_ms"] / 1e6
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flce_step()
    out["flce_peak_extra_GB"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    try:
        out["eager_ms"] = median_ms(eager, reps=5) if bt * vocab <= 8192 * 128256 else float("nan")
    except torch.OutOfMemoryError:
        out["eager_ms"] = float("nan")
    out["flce_over_floor"] = out["flce_ms"] / out["floor_ms"]
    return out


def profile(bt, hidden, vocab, dtype=torch.bfloat16):
    """Kernel-by-kernel CUDA time of one flce step, and the host time of the call."""
    import time

    dev = torch.device("cuda")
    x = torch.randn(bt, hidden, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (bt,), device=dev)

    def step():
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"host time of one step at {bt}x{hidden}x{vocab}: {host * 1e3:.2f} ms (returns before the GPU ends)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="", help="shape to profile with torch.profiler, e.g. 1024x4096x128256")
    p.add_argument("--shapes", default="8192x4096x128256,1024x4096x128256,32768x4096x128256,8192x2048x32000,"
                                       "1x4096x128256,16x4096x128256,64x4096x128256,256x4096x128256")
    args = p.parse_args()
    if args.profile:
        profile(*map(int, args.profile.split("x")))
    rows = []
    for spec in args.shapes.split(","):
        bt, h, v = map(int, spec.split("x"))
        rows.append(stages(bt, h, v))
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    outdir = os.environ.get("OUT", "out")
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "breakdown.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    keys = ["shape", "chunks", "floor_ms", "flce_ms", "flce_unchecked_ms", "flce_2x_chunk_ms", "flce_over_floor", "gemms_chunked_ms", "ce_kernel_ms",
            "ce_kernel_GBps", "flce_peak_extra_GB", "eager_ms"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r.get(k, float('nan')):.3f}" if isinstance(r.get(k, 0.0), float) else str(r[k])
                         for k in keys))


if __name__ == "__main__":
    main()
