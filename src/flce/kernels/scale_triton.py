"""Triton kernel behind kernels.scale.scale_into: a streaming multiply-and-cast in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _scale_kernel(src_ptr, out_ptr, scale_ptr, n, inner, count, IN_PLACE: tl.constexpr, PER_INDEX: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if PER_INDEX:  # one scale per index of one dim: ``inner`` elements each, ``count`` indices (L1 hits)
        scale = tl.load(scale_ptr + (offs // inner) % count, mask=mask).to(tl.float32)
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
        if IN_PLACE and scale == 1.0:  # nothing to write: skip the read as well
            return
    x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


def scale_into_triton(src: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    """src, out: contiguous, one shape; scale: 0-d, or of src's dims with one of them full, the rest 1."""
    assert src.is_contiguous() and out.is_contiguous()
    n = src.numel()
    in_place = src.data_ptr() == out.data_ptr() and src.dtype == out.dtype
    inner, count = 1, 1
    if scale.dim() > 0:
        dim = max(range(scale.dim()), key=lambda d: scale.shape[d])
        count, inner = scale.shape[dim], src[(0,) * (dim + 1)].numel()
    _scale_kernel[(triton.cdiv(n, BLOCK),)](src, out, scale.reshape(-1).contiguous(), n, inner, count,
                                            IN_PLACE=in_place, PER_INDEX=scale.dim() > 0, BLOCK=BLOCK, num_warps=8)
