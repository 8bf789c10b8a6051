"""Probe (session 5): CE kernels that read each logit once (1R+1W) against flce's two-pass kernel
(2R+1W), default options only. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/ce_one_read_probe.py --kernel row    (H100: ce_row_probe.txt)
    PYTHONPATH=src:benchmark python benchmark/probes/ce_one_read_probe.py --kernel split  (H100: ce_split_row_probe.txt)

``row``: the whole row in registers, one program per row. The row does not fit at V=128256 (spills:
~170 GB/s), and at V=32000 one row per program in flight is slower than two passes over many rows
(1.5 against 2.2 TB/s).
``split``: every row split over S programs that keep their segment in registers; partial (max, sum exp,
target logit) go through global memory and the siblings of a row wait for each other (a cooperative
launch keeps them all resident), then each writes its segment's gradient. Correct, but slower than two
passes (best 1.55 against 1.08 ms at 4096 x 128256): co-residency allows 2-4 programs per SM, and each
waits for its row's siblings before it writes, so few loads are in flight. Under TRITON_INTERPRET only
S = 1 can run (programs run one after another, none can wait).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from common import timed_calls

from flce.kernels.ce_triton import ce_chunk_triton
from flce.options import LossOptions


@triton.jit
def _ce_row_once(logits_ptr, stride_row, target_ptr, scale_ptr, loss_ptr, lse_ptr, n_rows, V, ignore_index,
                 BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    mask = cols < V
    scale = tl.load(scale_ptr)
    for row_i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + tl.cast(row_i, tl.int64) * stride_row
        y = tl.load(target_ptr + row_i)
        valid = y != ignore_index
        raw = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
        z = raw.to(tl.float32)
        m = tl.max(z, 0)
        s = tl.sum(tl.exp(z - m), 0)
        lse = m + tl.log(s)
        z_y = tl.sum(tl.where(cols == y, z, 0.0), 0)
        tl.store(loss_ptr + row_i, tl.where(valid, lse - z_y, 0.0))
        tl.store(lse_ptr + row_i, tl.where(valid, lse, 0.0))
        p = tl.exp(z - lse)
        g = (p - tl.where(cols == y, 1.0, 0.0)) * scale
        g = tl.where(valid, g, 0.0)
        tl.store(row_ptr + cols, g.to(raw.dtype), mask=mask)


def launch_once(logits, t, loss, lse, scale, pps, warps):
    n, V = logits.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _ce_row_once[(min(n, pps * sms),)](logits, logits.stride(0), t, scale, loss, lse, n, V, -100,
                                        BLOCK_V=triton.next_power_of_2(V), num_warps=warps)


@triton.jit
def _ce_split_row(logits_ptr, stride_row, target_ptr, scale_ptr, loss_ptr, lse_ptr, part_ptr, count_ptr,
                  n_rows, V, ignore_index, S: tl.constexpr, S_POW: tl.constexpr, SEG: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid % S
    group = pid // S
    groups = tl.num_programs(0) // S
    cols = seg * SEG + tl.arange(0, SEG)
    mask = cols < V
    scale = tl.load(scale_ptr)
    sib = tl.arange(0, S_POW)
    for row_i in range(group, n_rows, groups):
        row = tl.cast(row_i, tl.int64)
        row_ptr = logits_ptr + row * stride_row
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        raw = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
        z = raw.to(tl.float32)
        m = tl.max(z, 0)
        s = tl.sum(tl.exp(z - m), 0)
        zy = tl.sum(tl.where(cols == y, z, 0.0), 0)
        base = part_ptr + (row * S + seg) * 3
        tl.store(base, m)
        tl.store(base + 1, s)
        tl.store(base + 2, zy)
        tl.debug_barrier()
        tl.atomic_add(count_ptr + row, 1, sem="release")
        while tl.atomic_add(count_ptr + row, 0, sem="acquire") < S:
            pass
        tl.debug_barrier()
        pb = part_ptr + (row * S + sib) * 3
        ms = tl.load(pb, mask=sib < S, other=float("-inf"), volatile=True)
        ss = tl.load(pb + 1, mask=sib < S, other=0.0, volatile=True)
        zys = tl.load(pb + 2, mask=sib < S, other=0.0, volatile=True)
        mm = tl.max(ms, 0)
        lse = mm + tl.log(tl.sum(ss * tl.exp(ms - mm), 0))
        if seg == 0:
            tl.store(loss_ptr + row, tl.where(valid, lse - tl.sum(zys, 0), 0.0))
            tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
        g = (tl.exp(z - lse) - tl.where(cols == y, 1.0, 0.0)) * scale
        tl.store(row_ptr + cols, tl.where(valid, g, 0.0).to(raw.dtype), mask=mask)


def launch_split(logits, t, loss, lse, scale, seg, warps, per_sm, coop=True):
    n, V = logits.shape
    S = triton.cdiv(V, seg)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    groups = max(min(n, per_sm * sms // S), 1)
    part = torch.empty(n, S, 3, device=logits.device)
    count = torch.zeros(n, dtype=torch.int32, device=logits.device)
    kw = {"launch_cooperative_grid": True} if coop else {}
    _ce_split_row[(groups * S,)](logits, logits.stride(0), t, scale, loss, lse, part, count, n, V, -100,
                                 S=S, S_POW=triton.next_power_of_2(S), SEG=seg, num_warps=warps, **kw)


def _variants(kernel: str, t, loss, lse, scale) -> dict:
    if kernel == "row":
        return {f"once pps={pps} warps={warps}": (lambda b, p=pps, w=warps: launch_once(b, t, loss, lse, scale, p, w))
                for pps in (1, 2, 4) for warps in (16, 32)}
    return {f"split seg={seg} w={warps} per_sm={per_sm}":
            (lambda b, a=seg, w=warps, p=per_sm: launch_split(b, t, loss, lse, scale, a, w, p))
            for seg, warps in ((4096, 4), (8192, 8), (8192, 4), (16384, 16), (16384, 8)) for per_sm in (1, 2, 4, 8)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", choices=("row", "split"), default="split")
    kernel = p.parse_args().kernel
    dev = torch.device("cuda")
    opts = LossOptions()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    shapes = ((4096, 128256), (512, 128256), (8192, 32000)) + (((16, 128256),) if kernel == "split" else ((2048, 128256),))
    for rows, V in shapes:
        src = torch.randn(rows, V, device=dev, dtype=torch.bfloat16) * 3
        t = torch.randint(0, V, (rows,), device=dev)
        t[::7] = -100
        scale = torch.full((), 1.0 / rows, device=dev)
        loss, lse = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
        ref = src.clone()
        ce_chunk_triton(ref, t, loss, lse, None, None, None, scale, opts)
        ref_loss = loss.clone()
        variants = {"flce two-pass": lambda b: ce_chunk_triton(b, t, loss, lse, None, None, None, scale, opts)}
        variants.update(_variants(kernel, t, loss, lse, scale))
        buf = src.clone()
        gb = 2 * rows * V * 2 / 1e9
        for name, fn in variants.items():
            try:
                buf.copy_(src)
                fn(buf)
                torch.cuda.synchronize()
                err = ((buf.float() - ref.float()).abs().max().item(), (loss - ref_loss).abs().max().item())
                ms = statistics.median(timed_calls(lambda: fn(buf), 3, 20, dev))
                print(f"{rows}x{V} {name:36s} {ms:7.3f} ms {gb / ms * 1e3:6.0f} GB/s (1R+1W)  "
                      f"max diff grad {err[0]:.1e} loss {err[1]:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a launch too large for co-residency: say so
                print(f"{rows}x{V} {name:36s} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
