"""exp for the GEMM epilogues: one ``MUFU.EX2`` per element.

Triton lowers ``tl.exp`` of float32 to ``ex2.approx.f32``, which ptxas wraps in a fix-up for subnormal
results (a compare and two predicated multiplies): four of the ten or so operations per element that the
logits GEMMs spend after their MMAs (``logits_triton.py``, ``block_gemm_triton.py``). ``ex2.approx.ftz``
flushes results below 2^-126 to zero instead, which nothing here can tell apart: such a term is below
e^-87 of a sum that the exp-logits window keeps above e^-40, or a probability below 1e-38 whose gradient
rounds to that zero in any case. Same error otherwise (2 ulp). Where there is no PTX (``TRITON_INTERPRET=1``,
a ROCm build of torch) it is ``tl.exp``: the CE row kernels that share ``ce_triton._grad_block`` stay portable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interpreter_ready

PTX = tl.constexpr(not _interpreter_ready() and torch.version.hip is None)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(x):
    """exp(x) of a float32 tensor, results below 2^-126 flushed to zero."""
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp(x)
