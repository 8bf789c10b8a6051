"""out = src * scale (a 0-d device tensor), cast to out's dtype: the only work backward does.

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
    src: contiguous, any shape; out: contiguous, src's shape."""
    if out is None:
        out = src if src.dtype == dtype else torch.empty(src.shape, dtype=dtype, device=src.device)
    if backend != "triton" or src.numel() < TORCH_BELOW or not (src.is_contiguous() and out.is_contiguous()):
        # On CUDA a 16-bit tensor times a 0-d float32 one computes in the 16-bit dtype: the scale would be
        # rounded first, the same error on every element (2x the bf16 rounding of a gradient at 1 / 172).
        return torch.mul(src if src.dtype.itemsize >= scale.dtype.itemsize else src.to(scale.dtype), scale, out=out)
    from .scale_triton import scale_into_triton

    scale_into_triton(src, scale, out)
    return out
