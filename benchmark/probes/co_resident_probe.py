"""Probe: two programs per SM for the Hopper logits GEMM, so that one program's epilogue (the tile
statistics' max, exp and sums, without warp specialization) runs under the other's MMAs, as a ping-pong
kernel would arrange by hand. Smaller tiles and fewer stages make two programs fit an SM's shared memory
and registers. Each configuration is checked against torch, then timed (median of interleaved rounds)
against cuBLAS's plain GEMM for the three epilogues: statistics alone (a loss without gradients), exp(z)
stored (the exp-logits path) and the logits stored (the chunked path). Prints each compiled kernel's
registers, spills and shared memory. Result (H100, ``results/2026-11-25-h100-c954f85/co_resident.txt``): every
two-program configuration is 1.24-1.68x cuBLAS where the default (one program of 128 x 256 tiles per SM)
is 1.00-1.16x: the smaller tiles cost far more than the overlap gives. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/co_resident_probe.py
"""
from __future__ import annotations


import torch
import triton
from common import median_of_rounds, unshifted_logits

from flce.kernels import logits_triton
from flce.kernels.ce_triton import _sm_count as sm_count
from flce.kernels.logits_triton import TileConfig
from flce.options import LossOptions

CONFIGS = [  # (tile, programs per SM)
    (TileConfig(), 1),  # the default: 128 x 256 x 64, 3 stages, 8 warps, one program per SM
    (TileConfig(block_n=128, stages=3, warps=4), 2),
    (TileConfig(block_n=128, stages=2, warps=4), 2),
    (TileConfig(block_n=128, stages=3, warps=8), 2),
    (TileConfig(block_m=64, block_n=256, stages=2, warps=4), 2),
]
SHAPES = [(8192, 4096, 128256), (1024, 4096, 128256), (8192, 2048, 32000)]
OUTPUTS = ("stats", "exp", "logits")
REPS = 10


def call_for(kind, cfg, per_sm, x, w, out, opts):
    tiles = triton.cdiv(w.shape[0], cfg.block_n)
    mx, se = torch.empty(2, x.shape[0], tiles, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def call():
        logits_triton.TILE = cfg
        logits_triton._sm_count = lambda index: sms * per_sm  # the launcher's grid: programs per SM
        stores = {"stats": logits_triton.STORE_NOTHING, "exp": logits_triton.STORE_EXP}
        output = stores.get(kind, logits_triton.STORE_LOGITS)
        return logits_triton._launch(x, w, None, None if kind == "stats" else out, mx, se, opts, output)

    def lse():
        top = mx.max(1, keepdim=True).values
        return top[:, 0] + (se * (mx - top).exp()).sum(1).log()

    def stored():
        """The stored tile as z: since 2afee14 the logits are stored less their tile max, added back here."""
        if kind == "logits":
            return unshifted_logits(out, mx, cfg.block_n)
        return out.float()
    return call, lse, stored


def main():
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    opts = LossOptions()
    for rows, hidden, vocab in SHAPES:
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5 * 2).bfloat16()
        out = torch.empty(rows, vocab, device=device, dtype=torch.bfloat16)
        z = x.float() @ w.float().t()  # unrounded, as the epilogue's z (TF32 is off by default)
        want_lse = z.logsumexp(1)
        for kind in OUTPUTS:
            fns = {"cuBLAS mm": lambda: torch.mm(x, w.t(), out=out)}
            for cfg, per_sm in CONFIGS:
                call, lse_of, stored = call_for(kind, cfg, per_sm, x, w, out, opts)
                name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} st{cfg.stages} w{cfg.warps} p{per_sm}"
                try:
                    kernel = call()
                    err = ((lse_of() - want_lse).abs().max()).item()
                    if kind != "stats":
                        ref = z.exp() if kind == "exp" else z
                        err = max(err, ((stored() - ref).abs().max() / ref.abs().max()).item())
                    assert err < 1e-2, f"wrong result: {err:.2e}"  # bf16 storage: 2^-8 relative
                    meta = kernel.metadata
                    print(f"  {kind} {name}: regs {kernel.n_regs} spills {kernel.n_spills} "
                          f"shared {meta.shared} B, err {err:.1e}", flush=True)
                    fns[name] = call
                except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                    print(f"  {kind} {name} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            logits_triton.TILE, logits_triton._sm_count = TileConfig(), sm_count
            times = median_of_rounds(fns, device, REPS)
            base = times["cuBLAS mm"]
            print(f"{kind}, {rows} x {hidden} x {vocab}:", flush=True)
            for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
                print(f"  {name:34s} {ms:8.4f} ms  {ms / base:6.3f}x cuBLAS", flush=True)
        x = w = out = z = None  # free before the next shape (not del: the lambdas above close over them)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
