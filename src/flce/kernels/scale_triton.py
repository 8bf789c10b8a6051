"""Triton kernel behind kernels.scale.scale_into: a streaming multiply-and-cast in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _scale_kernel(src_ptr, out_ptr, scale_ptr, n, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr).to(tl.float32)
    if IN_PLACE and scale == 1.0:  # nothing to write: skip the read as well
        return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


def scale_into_triton(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    assert src.is_contiguous() and out.is_contiguous()
    n = src.numel()
    in_place = src.data_ptr() == out.data_ptr() and src.dtype == out.dtype
    _scale_kernel[(triton.cdiv(n, BLOCK),)](src, out, scale, n, IN_PLACE=in_place, BLOCK=BLOCK, num_warps=8)
