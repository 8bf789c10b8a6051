"""Probe: the CE folded into the GEMMs (issue 18's ceiling question). No CE pass at all:

1. the logits GEMM's epilogue stores p' = exp(z - m_t) in float16 (m_t: the row's max over the output
   tile's 256 columns) instead of z, the per-tile (m_t, sum p'), and z at each row's target;
2. a few torch ops turn the tile statistics into each row's lse and loss and each (row, tile) scale
   s = exp(m_t - lse) * g (g: the mean's 1 / rows);
3. grad_input = dz @ W and grad_W = dz^T @ x as Triton GEMMs whose A-operand prologue forms
   dz = p' * s - g * onehot(target) in registers (a multiply and a select per element, no exp) and
   rounds it to bf16 for the MMA.

Today's step instead writes z, makes one CE pass (1 read + 1 write of every logit: 4.2 GB, ~1.2 ms on an
H200 at 8192 x 4096 x 128256) and runs cuBLAS for both backward GEMMs. The probe times each piece
against its cuBLAS counterpart, the whole sequence against the three cuBLAS GEMMs (the floor) and
against flce's step, and checks loss and gradients against float32. Mean reduction, no options: it
measures the ceiling, it is not a product path. Result (H200, `results/2026-11-24-h200-dcb7d1d/
ce_in_gemm_2e212d7.txt`): the same Triton GEMM without the prologue 12.49 ms against cuBLAS 12.36, with it
26.5-27.0 ms (grad_W 27.0); the step 1.85x the floor against flce's 1.06: Triton 3.6's register-operand
wgmma does not hide the prologue. The route that worked scales rows instead (``row_scaled_exp_probe.py``). GPU only (``--small`` checks the arithmetic on the CPU
under TRITON_INTERPRET=1, in float16):

    PYTHONPATH=src:benchmark python benchmark/probes/ce_in_gemm_probe.py [--rows 8192]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flce.kernels.logits_triton import _tile_coords

STAT_COLS = 256  # columns per statistics tile (the logits GEMM's BN)


@triton.jit
def _logits_exp_kernel(x_desc, w_desc, p_desc, target_ptr, max_ptr, sum_ptr, zt_ptr, M, N, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                       PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            acc = tl.dot(x_desc.load([m0, ks * BK]), w_desc.load([n0, ks * BK]).T, acc)
        cols = n0 + tl.arange(0, BN)
        rows = m0 + tl.arange(0, BM)
        z = tl.where(cols[None, :] < N, acc, float("-inf"))
        row_max = tl.max(z, 1)
        p = tl.exp(z - row_max[:, None])
        p_desc.store([m0, n0], p.to(p_desc.dtype))
        stat = rows.to(tl.int64) * grid_n + pid_n
        tl.store(max_ptr + stat, row_max, mask=rows < M)
        tl.store(sum_ptr + stat, tl.sum(p, 1), mask=rows < M)
        y = tl.load(target_ptr + rows, mask=rows < M, other=-1)
        hit = cols[None, :] == y[:, None]
        zt = tl.sum(tl.where(hit, acc, 0.0), 1)
        tl.store(zt_ptr + rows, zt, mask=(rows < M) & (y >= n0) & (y < n0 + BN))


@triton.jit
def _grad_input_kernel(p_desc, w_desc, out_desc, scale_ptr, target_ptr, g, M, N, K, TILES,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAT: tl.constexpr,
                       GROUP: tl.constexpr, PROGRAMS: tl.constexpr, PLAIN: tl.constexpr = False):
    """out (M, N) = dz (M, K) @ W (K, N), dz = p' * s[row, col // STAT] - g * onehot formed per A tile.
    PLAIN (the control): out = p @ W from shared memory, no prologue (p in W's dtype)."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        rows = m0 + tl.arange(0, BM)
        y = tl.load(target_ptr + rows, mask=rows < M, other=-1)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            k0 = ks * BK
            if PLAIN:
                acc = tl.dot(p_desc.load([m0, k0]), w_desc.load([k0, n0]), acc)
            else:
                s = tl.load(scale_ptr + rows.to(tl.int64) * TILES + k0 // STAT, mask=rows < M, other=0.0)
                cols = k0 + tl.arange(0, BK)
                a = p_desc.load([m0, k0]).to(tl.float32) * s[:, None]
                a = tl.where(cols[None, :] == y[:, None], a - g, a)
                acc = tl.dot(a.to(w_desc.dtype), w_desc.load([k0, n0]), acc)
        out_desc.store([m0, n0], acc.to(out_desc.dtype))


@triton.jit
def _grad_weight_kernel(p_desc, x_desc, out_desc, scale_ptr, target_ptr, g, M, N, K, TILES,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAT: tl.constexpr,
                        GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    """out (M = V, N = H) = dz^T @ x, dz (K = rows, M) formed per tile from p' as above; BM divides STAT."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        vcols = m0 + tl.arange(0, BM)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            rows = ks * BK + tl.arange(0, BK)
            s = tl.load(scale_ptr + rows.to(tl.int64) * TILES + m0 // STAT, mask=rows < K, other=0.0)
            y = tl.load(target_ptr + rows, mask=rows < K, other=-1)
            a = p_desc.load([ks * BK, m0]).to(tl.float32) * s[:, None]
            a = tl.where(vcols[None, :] == y[:, None], a - g, a)
            acc = tl.dot(a.to(x_desc.dtype).T, x_desc.load([ks * BK, n0]), acc)
        out_desc.store([m0, n0], acc.to(out_desc.dtype))


class Config:
    def __init__(self, bm=128, bn=256, bk=64, stages=3, warps=8, group=8):
        self.bm, self.bn, self.bk, self.stages, self.warps, self.group = bm, bn, bk, stages, warps, group

    def __repr__(self):
        return f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps}"


def _programs(device, tiles):
    count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return min(count, tiles)


def logits_exp(x, w, target, p, tile_max, tile_sum, z_target, cfg):
    M, K = x.shape
    N = w.shape[0]
    programs = _programs(x.device, triton.cdiv(M, cfg.bm) * triton.cdiv(N, STAT_COLS))
    _logits_exp_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, [STAT_COLS, cfg.bk]),
        TensorDescriptor.from_tensor(p, [cfg.bm, STAT_COLS]), target, tile_max, tile_sum, z_target, M, N, K,
        BM=cfg.bm, BN=STAT_COLS, BK=cfg.bk, GROUP=cfg.group, PROGRAMS=programs, num_stages=cfg.stages,
        num_warps=cfg.warps)


def combine(tile_max, tile_sum, z_target):
    """lse, the mean loss and the (row, tile) scales s = exp(m_t - lse) / rows."""
    m = tile_max.max(1, keepdim=True).values
    lse = m.squeeze(1) + torch.log((tile_sum * torch.exp(tile_max - m)).sum(1))
    g = 1.0 / tile_max.shape[0]
    scale = torch.exp(tile_max - lse[:, None]).mul_(g)
    return (lse - z_target).mean(), scale, g


def grad_input(p, w, out, scale, target, g, cfg, plain=False):
    M, K = p.shape
    N = w.shape[1]
    programs = _programs(p.device, triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn))
    _grad_input_kernel[(programs,)](
        TensorDescriptor.from_tensor(p, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, [cfg.bk, cfg.bn]),
        TensorDescriptor.from_tensor(out, [cfg.bm, cfg.bn]), scale, target, g, M, N, K, scale.shape[1],
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, STAT=STAT_COLS, GROUP=cfg.group, PROGRAMS=programs, PLAIN=plain,
        num_stages=cfg.stages, num_warps=cfg.warps)


def grad_weight(p, x, out, scale, target, g, cfg):
    K, M = p.shape
    N = x.shape[1]
    programs = _programs(p.device, triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn))
    _grad_weight_kernel[(programs,)](
        TensorDescriptor.from_tensor(p, [cfg.bk, cfg.bm]), TensorDescriptor.from_tensor(x, [cfg.bk, cfg.bn]),
        TensorDescriptor.from_tensor(out, [cfg.bm, cfg.bn]), scale, target, g, M, N, K, scale.shape[1],
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, STAT=STAT_COLS, GROUP=cfg.group, PROGRAMS=programs,
        num_stages=cfg.stages, num_warps=cfg.warps)


def reference(x, w, target):
    """Loss and gradients in float32 (TF32 off) from the 16-bit inputs."""
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(xf @ wf.t(), target)
    gx, gw = torch.autograd.grad(loss, (xf, wf))
    return loss.item(), gx, gw


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def main():
    p_ = argparse.ArgumentParser()
    p_.add_argument("--small", action="store_true", help="tiny float16 shapes (interpreter check)")
    p_.add_argument("--rows", type=int, default=8192)
    args = p_.parse_args()
    small = args.small
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float16 if small else torch.bfloat16
    M, H, V = (64, 64, 512) if small else (args.rows, 4096, 128256)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    x = torch.randn(M, H, device=device).to(dtype)
    w = (torch.randn(V, H, device=device) * H ** -0.5).to(dtype)
    target = torch.randint(0, V, (M,), device=device)
    tiles = triton.cdiv(V, STAT_COLS)
    p = torch.empty(M, V, device=device, dtype=torch.float16)
    tile_max = torch.empty(M, tiles, device=device)
    tile_sum = torch.empty_like(tile_max)
    z_target = torch.empty(M, device=device)
    gx = torch.empty(M, H, device=device, dtype=dtype)
    gw = torch.empty(V, H, device=device, dtype=dtype)
    small_cfg = Config(32, 32, 32, 2, 4, 4)
    fwd_cfg = Config(bm=32 if small else 128, bk=32 if small else 64)
    gin_cfgs = [small_cfg] if small else [Config(), Config(stages=4), Config(bn=128, warps=4), Config(bn=128),
                                          Config(bk=32, stages=4)]
    gw_cfgs = [small_cfg] if small else [Config(), Config(stages=4), Config(bn=128, warps=4), Config(bn=128),
                                         Config(bk=32, stages=4)]

    def ceiling(gin_cfg, gw_cfg):
        logits_exp(x, w, target, p, tile_max, tile_sum, z_target, fwd_cfg)
        loss, scale, g = combine(tile_max, tile_sum, z_target)
        grad_input(p, w, gx, scale, target, g, gin_cfg)
        grad_weight(p, x, gw, scale, target, g, gw_cfg)
        return loss

    ref_loss, ref_gx, ref_gw = reference(x, w, target)
    loss = ceiling(gin_cfgs[0], gw_cfgs[0])
    print(f"loss {loss.item():.6f} (float32 {ref_loss:.6f}); grad_x rel err {rel(gx, ref_gx):.2e}, "
          f"grad_W rel err {rel(gw, ref_gw):.2e}", flush=True)
    if not small:
        import flce
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        fl = flce.linear_cross_entropy(xl, wl, target)
        fgx, fgw = torch.autograd.grad(fl, (xl, wl))
        print(f"flce: loss {fl.item():.6f}; grad_x rel err {rel(fgx, ref_gx):.2e}, grad_W rel err "
              f"{rel(fgw, ref_gw):.2e}; bf16 rounding of the float32 gradients: grad_x "
              f"{rel(ref_gx.to(dtype), ref_gx):.2e}, grad_W {rel(ref_gw.to(dtype), ref_gw):.2e}", flush=True)
    assert abs(loss.item() - ref_loss) < 1e-2 * max(1.0, abs(ref_loss)), "loss"
    assert rel(gx, ref_gx) < 2e-2 and rel(gw, ref_gw) < 2e-2, "gradients"
    if small:
        print("small check ok")
        return
    timing(x, w, target, p, tile_max, tile_sum, z_target, gx, gw, scale_args=(fwd_cfg, gin_cfgs, gw_cfgs),
           ceiling=ceiling)


def median_ms(device):
    """med(fn, reps=10): the median ms of ``reps`` calls of fn after two untimed ones."""
    from common import timed_calls

    return lambda fn, reps=10: statistics.median(timed_calls(fn, 2, reps, device))


def flce_step(x, w, target):
    """One flce forward + backward on fresh leaves, as a training step runs it."""
    import flce

    def run():
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        torch.autograd.grad(flce.linear_cross_entropy(xl, wl, target), (xl, wl))
    return run


def compare_steps(steps: dict, med, rounds: int = 5) -> dict[str, list[float]]:
    """Each step's median ms over ``rounds`` interleaved rounds (the clock follows the load), printed
    against the first step (the floor); returns every round's reading."""
    samples = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(med(fn, 5))
    base = statistics.median(next(iter(samples.values())))
    for name, v in samples.items():
        ms = statistics.median(v)
        print(f"step {name:52s} {ms:8.3f} ms  {ms / base:6.3f}x floor   (rounds: "
              f"{', '.join(f'{t:.2f}' for t in v)})", flush=True)
    return samples


def timing(x, w, target, p, tile_max, tile_sum, z_target, gx, gw, scale_args, ceiling):
    device = x.device
    fwd_cfg, gin_cfgs, gw_cfgs = scale_args
    _, scale, g = combine(tile_max, tile_sum, z_target)
    logits = torch.empty(p.shape, device=device, dtype=x.dtype)
    dl = torch.randn(p.shape, device=device).mul_(1e-4).to(x.dtype)
    med = median_ms(device)

    def floor():
        torch.mm(x, w.t(), out=logits)
        torch.mm(dl, w, out=gx)
        torch.mm(dl.t(), x, out=gw)

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    parts = {
        "cuBLAS logits": lambda: torch.mm(x, w.t(), out=logits),
        "logits + exp epilogue": lambda: logits_exp(x, w, target, p, tile_max, tile_sum, z_target, fwd_cfg),
        "combine (torch)": lambda: combine(tile_max, tile_sum, z_target),
        "cuBLAS grad_input": lambda: torch.mm(dl, w, out=gx),
        "cuBLAS grad_W": lambda: torch.mm(dl.t(), x, out=gw),
    }
    p_plain = p.to(x.dtype)
    parts["grad_input no prologue (control)"] = lambda: grad_input(p_plain, w, gx, scale, target, g, Config(), True)
    for cfg in gin_cfgs:
        parts[f"grad_input prologue {cfg}"] = lambda cfg=cfg: grad_input(p, w, gx, scale, target, g, cfg)
    for cfg in gw_cfgs:
        parts[f"grad_W prologue {cfg}"] = lambda cfg=cfg: grad_weight(p, x, gw, scale, target, g, cfg)
    times = {}
    for name, fn in parts.items():
        try:
            times[name] = med(fn)
            print(f"  {name:44s} {times[name]:8.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects
            print(f"  {name:44s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    best_gin = min((c for c in gin_cfgs if f"grad_input prologue {c}" in times),
                   key=lambda c: times[f"grad_input prologue {c}"])
    best_gw = min((c for c in gw_cfgs if f"grad_W prologue {c}" in times), key=lambda c: times[f"grad_W prologue {c}"])
    compare_steps({"floor (3 cuBLAS GEMMs)": floor, "flce step": flce_step(x, w, target),
                   f"ceiling ({best_gin} / {best_gw})": lambda: ceiling(best_gin, best_gw)}, med)


if __name__ == "__main__":
    main()
