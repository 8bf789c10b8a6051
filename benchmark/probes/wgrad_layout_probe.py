"""Probe: the several-chunk weight-gradient GEMM alone, in float32 (V, H) += dl^T x_c as flce runs it (layout A) and
transposed, (H, V) += x_c^T dl (layout B, whose bf16 gradient would then need a transposing cast), each with and without
the accumulation, on cuBLAS and cuBLASLt (``torch.backends.cuda.preferred_blas_library``), at chunk heights K, beside
the bf16 GEMM; then the plain and the transposing fp32 -> bf16 cast. Asked because quack's CUTLASS GEMM ran this
update faster inside its step than cuBLAS in flce's (``profile_kernels.py --peers quack``). Result (H200,
`results/2026-11-27-h200-8f4601b/wgrad_layouts.txt`, each case then the mean of 10 back-to-back calls): layout A
on cuBLAS is the fastest or level at every K. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/wgrad_layout_probe.py
"""
from __future__ import annotations

import torch
from common import median_ms

V, H = 128256, 4096


def ms(fn) -> float:
    return median_ms(fn, warmup=3, reps=10, device=torch.device("cuda"))


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    acc_a = torch.zeros(V, H, device="cuda")
    acc_b = torch.zeros(H, V, device="cuda")
    f32 = torch.float32
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for k in (2048, 4096, 6144, 8192):
            dl = torch.randn(k, V, device="cuda").bfloat16()
            x = torch.randn(k, H, device="cuda").bfloat16()
            tflop = 2 * V * H * k / 1e12
            cases = {
                "A (V,H) +=": lambda: torch.addmm(acc_a, dl.t(), x, out_dtype=f32, out=acc_a),
                "A (V,H) =": lambda: torch.mm(dl.t(), x, out_dtype=f32, out=acc_a),
                "B (H,V) +=": lambda: torch.addmm(acc_b, x.t(), dl, out_dtype=f32, out=acc_b),
                "B (H,V) =": lambda: torch.mm(x.t(), dl, out_dtype=f32, out=acc_b),
                "bf16 (V,H) =": lambda: torch.mm(dl.t(), x),
            }
            times = {name: ms(fn) for name, fn in cases.items()}
            print(f"{library} K={k}: " + "  ".join(f"{name} {t:.3f} ms {tflop / t * 1e3:.0f} TF/s"
                                                  for name, t in times.items()), flush=True)
    out = torch.empty(V, H, device="cuda", dtype=torch.bfloat16)
    print(f"cast (V,H) fp32 -> bf16 {ms(lambda: out.copy_(acc_a)):.3f} ms; "
          f"transposing cast (H,V) -> (V,H) {ms(lambda: out.copy_(acc_b.t())):.3f} ms")


if __name__ == "__main__":
    main()
