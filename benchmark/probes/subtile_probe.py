"""Probe: do the Hopper GEMMs gain from a split epilogue? The persistent TMA GEMMs of flce
(``kernels/logits_triton.py``, ``kernels/block_gemm_triton.py``) finish each 128 x 256 tile in one piece:
the whole float32 tile, its epilogue's temporaries and a 64 KiB staging buffer for the TMA store. Here the
same kernels split the tile into two 128 x 128 halves after the K loop (as Triton's persistent-matmul
tutorial does on Hopper), each with its own epilogue and store: half the live temporaries, half the
staging buffer, which lets a 4-stage pipeline fit in shared memory (the whole-tile kernel fails there).

Times, against cuBLAS's plain GEMM: the low-memory backward's block GEMM with the gradient in its epilogue
at its two block shapes, and the logits GEMM with tile statistics at the cells where it trails cuBLAS
most (H 2048, fewer rows). Each variant is checked against flce's kernel first. Result (H100,
`results/2026-11-24-h100-c4f27ea/subtile_probe_4ca2ffc.txt`): the block GEMM 1.076-1.079 against 1.089x
cuBLAS at 8192 rows, 1.108 against 1.121 at 32768; the logits GEMM 1.036 against 1.071 at 4096 rows and
1.025 against 1.040 at 1024 (4 stages), equal at H 2048, 1.024-1.032 against 1.014 at 8192 rows. Inside a
step on an H200 (4ca2ffc, `results/2026-11-24-h200-827518b/split_epilogue_ab_4ca2ffc.txt`) equal or slower:
not kept. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/subtile_probe.py
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from common import median_of_rounds

from flce.kernels import block_gemm_triton, logits_triton
from flce.kernels.ce_block_torch import RowTerms
from flce.kernels.ce_block_triton import _block_grad, row_arguments
from flce.kernels.ce_triton import _sm_count
from flce.kernels.logits_triton import _tile_coords, tile_logits
from flce.options import LossOptions

REPS = 10
BLOCK_SHAPES = [(8192, 4096, 4096), (32768, 4096, 1024)]  # rows, hidden, block columns
LOGITS_SHAPES = [(8192, 2048, 32000), (4096, 4096, 128256), (1024, 4096, 128256), (8192, 4096, 128256)]


@triton.jit
def _halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _block_subtile_kernel(x_desc, w_desc, out_desc, bias_ptr, target_ptr, lse_ptr, scale_ptr, class_weight_ptr,
                          weight_sum_ptr, M, N, K, col_start, V, ignore_index, smoothing, z_loss, softcap, inv_temp,
                          HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                          HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                          PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    HALF: tl.constexpr = BN // 2
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc, cols = tile_logits(x_desc, w_desc, bias_ptr, m0, n0, N, K, HAS_BIAS, BM, BN, BK)
        rows = (m0 + tl.arange(0, BM)).to(tl.int64)
        a0, a1 = _halves(acc, BM, BN)
        c = n0 + tl.arange(0, HALF)
        g = _block_grad(a0.to(out_desc.dtype).to(tl.float32), rows, rows < M, col_start + c, c < N, target_ptr,
                        lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index, smoothing, z_loss,
                        softcap, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP, SCALE_PER_ROW)
        out_desc.store([m0, n0], g.to(out_desc.dtype))
        c = c + HALF
        g = _block_grad(a1.to(out_desc.dtype).to(tl.float32), rows, rows < M, col_start + c, c < N, target_ptr,
                        lse_ptr, scale_ptr, class_weight_ptr, weight_sum_ptr, V, ignore_index, smoothing, z_loss,
                        softcap, inv_temp, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP, SCALE_PER_ROW)
        out_desc.store([m0, n0 + HALF], g.to(out_desc.dtype))


@triton.jit
def _logits_subtile_kernel(x_desc, w_desc, out_desc, max_ptr, sum_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    HALF: tl.constexpr = BN // 2
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        m0, n0 = pid_m * BM, pid_n * BN
        acc, cols = tile_logits(x_desc, w_desc, max_ptr, m0, n0, N, K, False, BM, BN, BK)
        a0, a1 = _halves(acc, BM, BN)
        out0, out1 = a0.to(out_desc.dtype), a1.to(out_desc.dtype)
        out_desc.store([m0, n0], out0)
        out_desc.store([m0, n0 + HALF], out1)
        c0 = n0 + tl.arange(0, HALF)
        z0 = tl.where(c0[None, :] < N, out0.to(tl.float32), float("-inf"))
        z1 = tl.where(c0[None, :] + HALF < N, out1.to(tl.float32), float("-inf"))
        row_max = tl.maximum(tl.max(z0, 1), tl.max(z1, 1))
        row_sum = tl.sum(tl.exp(z0 - row_max[:, None]), 1) + tl.sum(tl.exp(z1 - row_max[:, None]), 1)
        rows = m0 + tl.arange(0, BM)
        stat = rows.to(tl.int64) * grid_n + pid_n
        tl.store(max_ptr + stat, row_max, mask=rows < M)
        tl.store(sum_ptr + stat, row_sum, mask=rows < M)


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def block_subtile(x, w, out, col_start, vocab, terms, opts, stages):
    cfg = block_gemm_triton.TILE
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n, cols = x.shape[0], w.shape[0]
    programs = min(_sm_count(x.device.index), triton.cdiv(n, bm) * triton.cdiv(cols, bn))
    pointers, scalars, flags = row_arguments(terms, opts)
    _block_subtile_kernel[(programs,)](
        _desc(x, [bm, bk]), _desc(w, [bn, bk]), _desc(out, [bm, bn // 2]), terms.lse, *pointers, n, cols,
        x.shape[1], col_start, vocab, *scalars, HAS_BIAS=False, **flags, BM=bm, BN=bn, BK=bk, GROUP=cfg.group,
        PROGRAMS=programs, num_stages=stages, num_warps=cfg.warps)


def logits_subtile(x, w, out, mx, se, stages):
    cfg = logits_triton.TILE
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n, vocab = x.shape[0], w.shape[0]
    programs = min(_sm_count(x.device.index), triton.cdiv(n, bm) * triton.cdiv(vocab, bn))
    _logits_subtile_kernel[(programs,)](
        _desc(x, [bm, bk]), _desc(w, [bn, bk]), _desc(out, [bm, bn // 2]), mx, se, n, vocab, x.shape[1],
        BM=bm, BN=bn, BK=bk, GROUP=cfg.group, PROGRAMS=programs, num_stages=stages, num_warps=cfg.warps)


def report(title, fns, check, device):
    for name in list(fns):
        if name.startswith("cuBLAS") or name == "flce":
            continue
        try:
            fns[name]()
            err = check()
            assert err < 2e-2, f"differs from flce's kernel: {err:.2e}"
        except Exception as e:  # noqa: BLE001 - a variant the compiler rejects
            print(f"  {title}: {name} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            del fns[name]
    times = median_of_rounds(fns, device, REPS)
    print(title, flush=True)
    for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"  {name:30s} {ms:8.4f} ms  {ms / times['cuBLAS mm']:6.3f}x cuBLAS", flush=True)


def main():
    device = torch.device("cuda")
    opts = LossOptions()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for rows, hidden, cols in BLOCK_SHAPES:
        vocab = 128256
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(cols, hidden, device=device) * hidden ** -0.5).bfloat16()
        out = torch.empty(rows, cols, device=device, dtype=torch.bfloat16)
        terms = RowTerms(torch.randint(0, vocab, (rows,), device=device), torch.full((rows,), 12.0, device=device),
                         None, None, torch.tensor(1.0 / rows, device=device))
        block_gemm_triton.block_logits_grad_triton(x, w, None, out, 4096, vocab, terms, opts)
        want = out.float().clone()
        fns = {"cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
               "flce": lambda: block_gemm_triton.block_logits_grad_triton(x, w, None, out, 4096, vocab, terms, opts)}
        for stages in (3, 4):
            fns[f"split epilogue, {stages} stages"] = (
                lambda s=stages: block_subtile(x, w, out, 4096, vocab, terms, opts, s))
        report(f"block GEMM + gradient, {rows} rows x {hidden} x {cols} columns:", fns,
               lambda: ((out.float() - want).abs().max() / want.abs().max()).item(), device)
    for rows, hidden, vocab in LOGITS_SHAPES:
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5).bfloat16()
        out = torch.empty(rows, vocab, device=device, dtype=torch.bfloat16)
        mx = torch.empty(rows, logits_triton.num_tiles(vocab), device=device)
        se = torch.empty_like(mx)
        logits_triton.logits_with_tile_stats(x, w, None, out, mx, se, opts)
        lse = (mx + se.log()).logsumexp(1)
        fns = {"cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
               "flce": lambda: logits_triton.logits_with_tile_stats(x, w, None, out, mx, se, opts)}
        for stages in (3, 4):
            fns[f"split epilogue, {stages} stages"] = lambda s=stages: logits_subtile(x, w, out, mx, se, s)
        report(f"logits GEMM + stats, {rows} x {hidden} x {vocab}:", fns,
               lambda: ((mx + se.log()).logsumexp(1) - lse).abs().max().item(), device)


if __name__ == "__main__":
    main()
