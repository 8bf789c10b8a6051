"""out = src * scale (a 0-d device tensor, or one per index of one dim), cast to out's dtype: backward's work.

torch's mixed-dtype multiply (bf16 tensor by a float32 0-d tensor) takes a generic, unvectorized
path at about a quarter of copy bandwidth; this kernel streams at copy speed, and in place it reads
nothing when the scale is 1 (the usual grad_output), which spares a pass over a (V, H) gradient.
"""

from __future__ import annotations

import torch


# Below this many elements torch's multiply takes a few microseconds of GPU time, less than the host
# time a Triton launch adds to a launch-bound step (small batches scale x and grad_input).
TORCH_BELOW = 1 << 20


def scale_into(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, backend: str,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """src * scale in ``dtype``: into ``out`` if given, else in place when src already has that dtype.
    src: any shape; out: src's shape; scale: 0-d, or src's dims with one of them full and the rest 1 (the
    grouped loss's per-head scales: (G, 1, 1) for (G, n, H)); else any shape that broadcasts (torch then)."""
    if out is None:
        out = src if src.dtype == dtype else torch.empty(src.shape, dtype=dtype, device=src.device)
    dense = _same_dense_layout(src, out, scale) if backend == "triton" and src.numel() >= TORCH_BELOW else None
    if dense is None:
        # On CUDA a 16-bit tensor times a 0-d float32 one computes in the 16-bit dtype: the scale would be
        # rounded first, the same error on every element (2x the bf16 rounding of a gradient at 1 / 172).
        return torch.mul(src if src.dtype.itemsize >= scale.dtype.itemsize else src.to(scale.dtype), scale, out=out)
    from .scale_triton import scale_into_triton

    scale_into_triton(*dense)
    return out


def _same_dense_layout(src: torch.Tensor, out: torch.Tensor, scale: torch.Tensor):
    """(src, out, scale) permuted so that src and out are contiguous (a batched GEMM's permuted output is),
    with the scale's one full dim, if any; None where they differ in layout or the scale is of another kind."""
    if scale.dim() == 0 and src.is_contiguous() and out.is_contiguous():  # the usual case, in few host calls
        return src, out, scale
    if scale.dim() == 0:
        full = None
    else:
        full = [d for d, size in enumerate(scale.shape) if size != 1]
        if scale.dim() != src.dim() or len(full) != 1 or scale.shape[full[0]] != src.shape[full[0]]:
            return None
    if src.stride() != out.stride():
        return None
    order = sorted(range(src.dim()), key=lambda d: -src.stride(d))
    src, out = src.permute(order), out.permute(order)
    if not (src.is_contiguous() and out.is_contiguous()):
        return None
    return src, out, scale if full is None else scale.permute(order)
