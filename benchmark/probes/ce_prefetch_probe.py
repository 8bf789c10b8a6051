"""Probe: the CE kernel's one-read pass (lse known from tile statistics) reaches ~2.7 TB/s on an
H100 against 3.0 for a device copy with the same read/write mix. Does loading the next block before
computing and storing the current one (a prefetch carried through the loop) close the gap? Plain
options only (no smoothing, softcap or weights). Result (H100, `results/2026-11-24-h100-c4f27ea/
ce_prefetch_probe_7c5054c.txt`): copy 3.02 TB/s; without prefetch 2.77-2.79 TB/s over seven launch shapes, with it
2.55-2.83: no gain. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/ce_prefetch_probe.py
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from common import timed_calls


@triton.jit
def _one_read(logits_ptr, stride, target_ptr, lse_ptr, n_rows, V, PREFETCH: tl.constexpr, BLOCK_V: tl.constexpr):
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + tl.cast(row_i, tl.int64) * stride
        y = tl.load(target_ptr + row_i)
        lse = tl.load(lse_ptr + row_i)
        cols = tl.arange(0, BLOCK_V)
        raw = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            if PREFETCH:
                nxt = cols + BLOCK_V
                raw_next = tl.load(row_ptr + nxt, mask=nxt < V, other=0.0)
            else:
                raw = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
            g = tl.exp(raw.to(tl.float32) - lse) - tl.where(cols == y, 1.0, 0.0)
            tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=cols < V)
            if PREFETCH:
                raw = raw_next


def main():
    dev = torch.device("cuda")
    n, v = 4096, 128256
    logits = (torch.randn(n, v, device=dev) * 2).bfloat16()
    t = torch.randint(0, v, (n,), device=dev)
    lse = torch.logsumexp(logits.float(), 1)
    want = torch.softmax(logits.float(), 1)
    want[torch.arange(n), t] -= 1
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty_like(logits)
    print(torch.cuda.get_device_name(), flush=True)
    ms = statistics.median(timed_calls(lambda: src.copy_(logits), 3, 20, dev))
    print(f"copy_ {ms:.3f} ms {2 * n * v * 2 / ms / 1e6:.0f} GB/s", flush=True)
    for prefetch in (False, True):
        for pps, block_v, warps in ((16, 8192, 8), (8, 8192, 8), (8, 4096, 4), (16, 4096, 4), (4, 16384, 16),
                                    (32, 2048, 4), (24, 4096, 4)):
            buf = logits.clone()
            grid = (min(n, pps * sms),)
            run = lambda: _one_read[grid](buf, buf.stride(0), t, lse, n, v, PREFETCH=prefetch, BLOCK_V=block_v,  # noqa: E731
                                          num_warps=warps)
            run()
            err = (buf.float() - want).abs().max().item()
            ms = statistics.median(timed_calls(run, 3, 20, dev))
            print(f"prefetch={int(prefetch)} pps={pps:2d} block_v={block_v:5d} warps={warps:2d}: {ms:.3f} ms "
                  f"{2 * n * v * 2 / ms / 1e6:.0f} GB/s  max err (first call) {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
