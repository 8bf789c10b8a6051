"""The global-memory accesses the row kernels compile to on Hopper (sm_90), counted from their PTX: whether
bf16 logits move in 16-byte groups (``ld.global.v4.b32``) or value by value (``ld.global.b16``). Compiling
needs no GPU (triton's own ptxas) but the jit kernels, not the interpreter's stand-ins, so the tests run this
file in a child process without TRITON_INTERPRET:

    python tests/ptx_accesses.py   # prints {case: {instruction: count}} as JSON
"""

from __future__ import annotations

import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flce.kernels import ce_triton, ce_vocab_parallel_triton, token_stats_triton

INT64_POINTERS = ("target_ptr", "counts_ptr", "total_ptr")
FLOAT_SCALARS = ("inv_temp", "softcap", "smoothing", "z_loss")


def accesses(kernel, constexprs: dict) -> dict[str, int]:
    """{PTX global load/store instruction: count} of ``kernel`` compiled for sm_90 with bf16 logits, every
    pointer 16-byte aligned and the integer arguments (V, the row stride) of unknown divisibility."""
    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*bf16" if name in ("logits_ptr", "grad_ptr") else "*i64" if name in INT64_POINTERS else "*fp32"
        return "fp32" if name in FLOAT_SCALARS else "i32"

    names = kernel.arg_names
    signature = {name: arg_type(name) for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name.endswith("_ptr")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32))
    return dict(collections.Counter(re.findall(r"(?:ld|st)\.global[.\w:]*", compiled.asm["ptx"])))


def cases() -> dict[str, dict[str, int]]:
    """Each row kernel (the CE kernel, the token statistics', the vocab-parallel stages), in whole groups or not, on
    plain or tile-shifted logits (the Hopper GEMM's)."""
    ce = dict(HAS_WEIGHT=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False, HAS_SOFTCAP=False, COMPUTE_GRAD=True,
              SCALE_PER_ROW=False, COMPUTE_ACC=False, MEAN_BY_COUNT=False, EXACT_Y=False, HAS_BIAS=False, BLOCK_H=1024,
              BLOCK_V=8192, BLOCK_T=16, VEC=8)
    stats = dict(HAS_SOFTCAP=False, HAS_LOG_PROBS=True, HAS_ENTROPY=True, HAS_SUM_SQ=True, HAS_MEAN=True,
                 HAS_TOP1=True, EXACT_Y=False, HAS_BIAS=False, BLOCK_H=1024, BLOCK_V=8192, VEC=8)  # the logits' reads
    grad = dict(HAS_SOFTCAP=False, HAS_LP_GRAD=True, HAS_ENT_GRAD=True, BLOCK_V=8192, VEC=8)
    shard = dict(HAS_WEIGHT=False, HAS_SMOOTHING=True, HAS_SOFTCAP=False, BLOCK_V=4096, VEC=8)  # smoothing: a read
    kernels = {"ce": (ce_triton._ce_kernel, ce), "stats": (token_stats_triton._stats_kernel, stats),
               "grad": (token_stats_triton._grad_kernel, grad),
               "shard-stats": (ce_vocab_parallel_triton._shard_stats_kernel,
                               dict(shard, BLOCK_T=16, EXACT_Y=False, HAS_BIAS=False, BLOCK_H=1024)),
               "shard-grad": (ce_vocab_parallel_triton._shard_grad_kernel, shard)}
    out = {}
    for label, (kernel, flags) in kernels.items():
        for shifted in (False, True):
            for padded in (False, True):
                key = f"{label} shifted={shifted} padded={padded}"
                out[key] = accesses(kernel, dict(flags, SHIFTED=shifted, TILE_N=256 if shifted else 1, GROUPED=padded))
    return out


if __name__ == "__main__":
    print(json.dumps(cases()))
