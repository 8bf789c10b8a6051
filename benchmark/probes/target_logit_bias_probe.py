"""Probe: where the losses' errors come from, bf16 peaked logits (std 6, targets drawn from the softmax) at 8192 x 4096
x 128256 and 1024 x 256 x 4096. Each row's loss against float64 (largest |error|, mean error) for flce on one device
(one chunk, 1024-row chunks, without gradients), the vocab-parallel loss on one rank, and eager; then the parts: the
lse from flce's GEMM's tile statistics, sum_j p_j delta_j with delta a stored value's rounding, and the mean error
of a row's max and of the target's logit from cuBLAS's float32 output, from flce's GEMM and from a float32 dot (the
tensor cores' float32 sums shrink every logit by ~4e-6 of itself; a dot does not). Results:
`results/2026-11-28-h200-01b6161/target_logit_bias_5194e45.txt`. GPU only (Hopper):

    PYTHONPATH=src:benchmark python benchmark/probes/target_logit_bias_probe.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from suite_lce import _sampled_targets

import flce
from flce import distributed as fd
from flce.kernels import logits_triton as lt
from flce.kernels.ce_triton import tile_width
from flce.options import LossOptions


def main(n=8192, H=4096, V=128256, rows=1024):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 6 * H**-0.5).bfloat16()
    t = _sampled_targets(x, w, gen)
    exact, m64, zt64, m32, zt32, mtile, dot = [], [], [], [], [], [], []
    lse_err, p_delta, delta_mean = [], [], []
    for s in range(0, n, rows):
        xs, ts = x[s:s + rows], t[s:s + rows]
        z = xs.double() @ w.double().t()
        lse64 = torch.logsumexp(z, 1)
        exact.append(lse64 - z.gather(1, ts[:, None])[:, 0])
        m64.append(z.amax(1))
        zt64.append(z.gather(1, ts[:, None])[:, 0])
        z32 = torch.mm(xs, w.t(), out_dtype=torch.float32)
        m32.append(z32.amax(1).double())
        zt32.append(z32.gather(1, ts[:, None])[:, 0].double())
        del z32
        out = torch.empty(rows, V, dtype=torch.bfloat16, device="cuda")
        tmax = torch.empty(rows, lt.num_tiles(V), dtype=torch.float32, device="cuda")
        tsum = torch.empty_like(tmax)
        lt.logits_with_tile_stats(xs, w, None, out, tmax, tsum, LossOptions())
        mtile.append(tmax.amax(1).double())
        mt = tmax.amax(1, keepdim=True)
        lse_err.append((mt[:, 0] + torch.log((tsum * torch.exp(tmax - mt)).sum(1))).double() - lse64)
        shift = tmax.double().repeat_interleave(tile_width(V, tmax.shape[1]), 1)[:, :V]
        delta = out.double() - (z - shift)  # the stored value's rounding
        p = torch.softmax(z, 1)
        p_delta.append((p * delta).sum(1))
        delta_mean.append(delta.mean(1))
        del z, p, delta, shift
        dot.append((xs.float() * w[ts].float()).sum(1).double())
    exact, m64, zt64 = torch.cat(exact), torch.cat(m64), torch.cat(zt64)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()  # the paths with gradients, forward only
    losses = {
        "flce": flce.linear_cross_entropy(xg, wg, t, reduction="none").detach(),
        "flce 1024-row chunks": flce.linear_cross_entropy(xg, wg, t, reduction="none", chunk_size=1024).detach(),
        "vocab-parallel": fd.vocab_parallel_linear_cross_entropy(xg, wg, t, reduction="none").detach(),
    }
    with torch.no_grad():
        losses["flce, no gradients"] = flce.linear_cross_entropy(x, w, t, reduction="none")
        losses["eager"] = torch.cat([F.cross_entropy(F.linear(x[s:s + rows], w).float(), t[s:s + rows],
                                                     reduction="none") for s in range(0, n, rows)])
    for k, v in losses.items():
        d = v.double() - exact
        print(f"{k}: row loss error max {d.abs().max():.2e}, mean {d.mean():+.2e}", flush=True)
    for k, v in (("lse from flce's tile statistics less float64's", lse_err),
                 ("sum_j p_j delta_j, delta: a stored value's rounding", p_delta), ("mean delta of a row", delta_mean)):
        v = torch.cat(v)
        print(f"{k}: mean {v.mean():+.2e}, mean |.| {v.abs().mean():.2e}, max |.| {v.abs().max():.2e}", flush=True)
    for k, v, ref in (("row max, cuBLAS float32 out", m32, m64), ("row max, flce's GEMM tile max", mtile, m64),
                      ("target logit, cuBLAS float32 out", zt32, zt64), ("target logit, float32 dot", dot, zt64)):
        d = torch.cat(v) - ref
        print(f"{k}: error mean {d.mean():+.2e}, mean |.| {d.abs().mean():.2e}, max |.| {d.abs().max():.2e}; "
              f"relative mean {(d / ref.abs()).mean():+.2e}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    main()
    main(n=1024, H=256, V=4096)
    dist.destroy_process_group()
