"""Probe: each row's logit at its target from a float32 dot of the GEMM's operands ("new", flce since 5194e45 /
01b6161) against the value the Hopper GEMM stored less its tile max ("old"), in the grouped heads' loss and the
vocab-parallel stage 1 (one rank over NCCL: the whole vocabulary). Per variant, peaked logits (std 6, targets drawn
from the softmax), bf16: the largest error of a row's loss and the mean loss's error against float64, and a
fwd+bwd step's median ms (CUDA events, the variants taking turns over 8 rounds). Results:
`results/2026-11-28-h200-01b6161/target_dot_ab*.txt`. GPU only (Hopper):

    PYTHONPATH=src:benchmark python benchmark/probes/target_dot_ab.py [grouped|vocab-parallel]
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
from breakdown import event_times
from suite_lce import _sampled_targets

import flce
from flce import distributed as fd
from flce import grouped_loss as gl
from flce.kernels import ce_chunk

NEW_GROUP_CE, NEW_SHARD_STATS = gl.ce_chunk, fd.shard_stats


def old_group_ce(*args, operands=None, **kw):
    ce_chunk(*args, **kw)


def old_shard_stats(backend, logits, target_local, cw, opts, out, tile_stats=None, operands=None):
    NEW_SHARD_STATS(backend, logits, target_local, cw, opts, out, tile_stats, None)


def use(variant):
    gl.ce_chunk = NEW_GROUP_CE if variant == "new" else old_group_ce
    fd.shard_stats = NEW_SHARD_STATS if variant == "new" else old_shard_stats


def exact_rows(x, w, t, b=None, rows=1024):
    out = []
    for s in range(0, x.shape[0], rows):
        z = x[s:s + rows].double() @ w.double().t()
        if b is not None:
            z += b.double()
        out.append(torch.logsumexp(z, 1) - z.gather(1, t[s:s + rows, None])[:, 0])
    return torch.cat(out)


def report(name, run, exact, rounds=8):
    errs = {}
    for v in ("new", "old"):
        use(v)
        with torch.no_grad():
            rows_loss = run("none").double().reshape(-1)
        d = (rows_loss - exact).abs()
        errs[v] = (d.max().item(), (rows_loss.mean() - exact.mean()).abs().item())
    times = {"new": [], "old": []}
    for _ in range(rounds):
        for v in ("new", "old"):
            use(v)
            times[v] += event_times(lambda: run("mean", grad=True), reps=10)
    for v in ("new", "old"):
        print(f"{name} {v}: median {statistics.median(times[v]):.3f} ms (best {min(times[v]):.3f}); row loss max err "
              f"{errs[v][0]:.2e}, mean loss err {errs[v][1]:.2e}", flush=True)
    use("new")


def grouped(B, G, H, V):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, G, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(G, V, H, device="cuda", generator=gen) * 6 * H**-0.5).bfloat16()
    t = torch.stack([_sampled_targets(x[:, g], w[g], gen) for g in range(G)], 1)
    exact = torch.stack([exact_rows(x[:, g], w[g], t[:, g]) for g in range(G)], 1).reshape(-1)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]

    def run(reduction, grad=False):
        loss = flce.grouped_linear_cross_entropy(leaves[0], leaves[1], t, reduction=reduction)
        return torch.autograd.grad(loss, leaves) if grad else loss
    report(f"grouped {B} x {G} heads x {H} x {V}", run, exact)


def vocab_parallel(n, H, V):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 6 * H**-0.5).bfloat16()
    t = _sampled_targets(x, w, gen)
    exact = exact_rows(x, w, t)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]

    def run(reduction, grad=False):
        loss = fd.vocab_parallel_linear_cross_entropy(leaves[0], leaves[1], t, reduction=reduction)
        return torch.autograd.grad(loss, leaves) if grad else loss
    report(f"vocab-parallel (1 rank) {n} x {H} x {V}", run, exact)


if __name__ == "__main__":
    which = sys.argv[1:] or ["grouped", "vocab-parallel"]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    if "grouped" in which:
        grouped(2048, 4, 2048, 32000)
        grouped(4096, 2, 4096, 128256)
        grouped(512, 4, 2048, 32000)
    if "vocab-parallel" in which:
        vocab_parallel(8192, 4096, 128256)
        vocab_parallel(1024, 4096, 128256)
    dist.destroy_process_group()
