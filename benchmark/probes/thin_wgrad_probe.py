"""Probe: grad_weight at a few rows, cuBLAS (``mm_new`` after ``scaled_operand``: the path above THIN_K rows) against
the thin Triton kernel (``kernels/thin_wgrad_triton.py``) in six tilings, K = 1-128, at 128256 x 4096 and 32000 x 2048,
bf16 (and a float32 gradient at K = 16). CUDA-event medians, variants taking turns over three rounds. GPU only:

    PYTHONPATH=src python benchmark/probes/thin_wgrad_probe.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from breakdown import event_times  # noqa: E402
from flce.function import scaled_operand  # noqa: E402
from flce.gemm import mm_new, padded_rows  # noqa: E402
from flce.kernels import thin_wgrad_triton as thin  # noqa: E402

TILINGS = [(128, 128, 8), (128, 256, 8), (64, 256, 4), (256, 128, 8), (64, 128, 4), (128, 64, 4)]  # (M, N, warps)


def tiled(dl, x, g, out_dtype, block_m, block_n, warps):
    """The thin kernel in one tiling (BLOCK_K: K rounded up to a power of two >= 16, for K > THIN_K too)."""
    k, m = dl.shape
    n = x.shape[1]

    def run():
        out = torch.empty(m, n, device="cuda", dtype=out_dtype)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        thin._thin_wgrad_kernel[grid](dl, x, g, out, m, n, k, dl.stride(0), dl.stride(1), x.stride(0), x.stride(1),
                                      out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
                                      BLOCK_K=max(16, triton.next_power_of_2(k)), num_warps=warps)
        return out
    return run


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for vocab, hidden in [(128256, 4096), (32000, 2048)]:
        for k in [1, 4, 16, 32, 64, 128]:
            dl = padded_rows(k, vocab, torch.bfloat16, "cuda")
            dl.copy_(torch.randn(k, vocab, device="cuda"))
            x, g = torch.randn(k, hidden, device="cuda", dtype=torch.bfloat16), torch.tensor(0.3, device="cuda")
            for out_dtype in [torch.bfloat16, torch.float32] if k == 16 else [torch.bfloat16]:
                fns = {"cublas": lambda: mm_new(dl.t(), scaled_operand(x, g, "triton"), out_dtype)}
                want = fns["cublas"]().float()
                for bm, bn, warps in TILINGS:
                    fns[f"t{bm}x{bn}w{warps}"] = run = tiled(dl, x, g, out_dtype, bm, bn, warps)
                    err = (run().float() - want).abs().max().item()
                    if err > 1e-2 * want.abs().max().item():
                        print(f"MISMATCH {bm}x{bn}: {err}")
                times = {name: [] for name in fns}
                for _ in range(3):
                    for name, fn in fns.items():
                        times[name].append(statistics.median(event_times(fn, reps=40, warmup=1)))
                gb = vocab * hidden * out_dtype.itemsize / 1e9
                best = min((min(v), name) for name, v in times.items() if name != "cublas")
                print(f"V {vocab} H {hidden} K {k:3d} {str(out_dtype)[6:]:8s} out {gb:.2f} GB | "
                      + "  ".join(f"{name} {min(v):.3f}" for name, v in times.items())
                      + f" | best {best[1]} {gb / best[0]:.2f} TB/s against cublas {gb / min(times['cublas']):.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
