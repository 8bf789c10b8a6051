"""Probe: can Triton build the logits GEMM (``kernels/logits_triton.py``) as CUTLASS's two-CTA cluster, where a
pair of SMs shares each W tile through multicast TMA loads? Compiles the kernel, and a plain persistent TMA GEMM,
for sm_90 with ``num_ctas`` 1 and 2 and counts in the PTX what a cluster needs: the cluster launch
(``.reqnctapercluster``) and multicast loads (``.multicast::cluster``). No GPU needed (cross-compiles):

    PYTHONPATH=src python benchmark/probes/cluster_compile_probe.py

Result (`results/2026-11-26-h200-5ebccd8/cluster_compile_probe.txt`): triton 3.6 (the GPU machines') fails to
compile either kernel with num_ctas=2 ("Failed to find a valid layout"); triton 3.9 builds a cluster of two
but issues no multicast load; Gluon 3.6's Hopper TMA copy takes no multicast argument. The two-CTA form is not
reachable from Triton here.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flce.kernels import logits_triton


@triton.jit
def _plain_gemm(x_desc, w_desc, out_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PROGRAMS: tl.constexpr):
    grid_m = tl.cdiv(M, BM)
    for tile in tl.range(tl.program_id(0), grid_m * tl.cdiv(N, BN), PROGRAMS, flatten=True):
        m0, n0 = (tile % grid_m) * BM, (tile // grid_m) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(tl.cdiv(K, BK)):
            acc = tl.dot(x_desc.load([m0, ks * BK]), w_desc.load([n0, ks * BK]).T, acc)
        out_desc.store([m0, n0], acc.to(tl.bfloat16))


def _compile(fn, bm, bn, bk, ctas, extra_sig, extra_consts):
    sig = {"x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>",
           "out_desc": f"tensordesc<bf16[{bm},{bn}]>", **extra_sig}
    consts = dict(BM=bm, BN=bn, BK=bk, PROGRAMS=66, **extra_consts)
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=8, num_stages=3, num_ctas=ctas))


KERNELS = {
    "logits GEMM + statistics": (logits_triton._logits_stats_kernel,
                                 {"bias_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "M": "i32", "N": "i32",
                                  "K": "i32", "inv_temp": "fp32", "softcap": "fp32"},
                                 dict(HAS_BIAS=False, HAS_SOFTCAP=False, HAS_SUM=True, OUTPUT=0, GROUP=8)),
    "plain persistent TMA GEMM": (_plain_gemm, {"M": "i32", "N": "i32", "K": "i32"}, {}),
}


def main():
    print("triton", triton.__version__, flush=True)
    for name, (fn, sig, consts) in KERNELS.items():
        for bm, ctas in ((128, 1), (256, 2)):  # a cluster of two 128-row halves shares each W tile
            try:
                ptx = _compile(fn, bm, 256, 64, ctas, sig, consts).asm["ptx"]
                print(f"{name}, {bm} x 256 tile, num_ctas={ctas}: compiled; cluster launch "
                      f"{'.reqnctapercluster' in ptx}, multicast loads {ptx.count('multicast::cluster')}", flush=True)
            except Exception as e:  # noqa: BLE001 - the compiler's own failure is the answer
                msg = [line for line in str(e).splitlines() if line.strip()]
                print(f"{name}, {bm} x 256 tile, num_ctas={ctas}: failed ({msg[-1][:90] if msg else type(e).__name__})",
                      flush=True)


if __name__ == "__main__":
    main()
