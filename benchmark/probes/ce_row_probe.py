"""Probe (session 5, H100): a CE kernel that loads each row once (the whole row in registers, one
read and one write per logit) against flce's two-pass kernel (two reads and one write). Default options
only. GPU only: PYTHONPATH=src:benchmark python benchmark/probes/ce_row_probe.py. Result: the row
does not fit in registers at V=128256 (spills: ~170 GB/s), and at V=32000 one row per program in
flight is slower than two passes over many rows (1.5 against 2.2 TB/s)."""
from __future__ import annotations
import statistics, sys
import torch, triton, triton.language as tl
from common import timed_calls
from flce.kernels.ce_triton import ce_chunk_triton, LaunchConfig
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


def main():
    dev = torch.device("cuda")
    opts = LossOptions()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for rows, V in ((4096, 128256), (512, 128256), (8192, 32000), (2048, 128256)):
        src = torch.randn(rows, V, device=dev, dtype=torch.bfloat16) * 3
        t = torch.randint(0, V, (rows,), device=dev)
        t[::7] = -100
        scale = torch.full((), 1.0 / rows, device=dev)
        loss, lse = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
        ref = src.clone()
        ce_chunk_triton(ref, t, loss, lse, None, None, None, scale, opts)
        ref_loss = loss.clone()
        variants = {"flce two-pass": lambda b: ce_chunk_triton(b, t, loss, lse, None, None, None, scale, opts)}
        for pps in (1, 2, 4):
            for warps in (16, 32):
                variants[f"once pps={pps} warps={warps}"] = (lambda b, p=pps, w=warps: launch_once(b, t, loss, lse, scale, p, w))
        buf = src.clone()
        gb = 2 * rows * V * 2 / 1e9
        for name, fn in variants.items():
            try:
                buf.copy_(src); fn(buf); torch.cuda.synchronize()
                err = ((buf.float() - ref.float()).abs().max().item(), (loss - ref_loss).abs().max().item())
                ms = statistics.median(timed_calls(lambda: fn(buf), 3, 20, dev))
                print(f"{rows}x{V} {name:26s} {ms:7.3f} ms  {gb / ms * 1e3:6.0f} GB/s (1R+1W)  max diff grad {err[0]:.2e} loss {err[1]:.2e}", flush=True)
            except Exception as e:
                print(f"{rows}x{V} {name:26s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
