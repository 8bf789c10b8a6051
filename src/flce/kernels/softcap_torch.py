"""Torch twin of ``softcap_triton``: z = c * tanh(u) and its derivative sech^2(u) with u = r * (1 / c), the
same u as the Triton kernels (the same correctly rounded 1 / c), in place where the caller allows it."""

from __future__ import annotations

import torch


def inverse(softcap: float, dtype: torch.dtype) -> float:
    """1 / softcap as the kernels multiply by it: float32(1 / float32(c)) for float32 math (the Triton kernels'
    IEEE division; rounding 1 / float32(c) from float64 once more gives the same number), 1 / c for float64;
    at most the dtype's largest finite number."""
    if dtype == torch.float64:
        return min(1.0 / softcap, torch.finfo(torch.float64).max)
    c32 = torch.tensor(softcap, dtype=torch.float32).item()
    return min(torch.tensor(1.0 / c32, dtype=torch.float32).item(), torch.finfo(torch.float32).max)


def sech2_(u: torch.Tensor) -> torch.Tensor:
    """sech^2(u) = 1 - tanh^2(u), over u in place: (1 / cosh u)^2 has no cancellation where tanh -> 1, and
    cosh overflows only where sech^2 is far below the smallest float32 (gives 0)."""
    return u.cosh_().reciprocal_().square_()


def cap_(r: torch.Tensor, softcap: float, slope: bool = False) -> torch.Tensor | None:
    """Overwrite r (float32 or float64, logits after temperature) with z = softcap * tanh(r / softcap); with
    ``slope``, return dz / dr = sech^2(r / softcap) as one new tensor of r's shape (else None)."""
    inv = inverse(softcap, r.dtype)
    if not slope:
        r.mul_(inv).tanh_().mul_(softcap)
        return None
    u = r * inv
    torch.tanh(u, out=r).mul_(softcap)
    return sech2_(u)


def capped_logits(logits: torch.Tensor, inv_temp: float, softcap: float | None, slope: bool = False,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z, dz/dr or None) for logits (n, V): z = softcap * tanh(r / softcap) (z = r without softcap) with
    r = logits * inv_temp, a new tensor in ``dtype`` (default: the math dtype, float64 for float64 logits,
    else float32); the slope sech^2(r / softcap) only with ``slope`` and a softcap."""
    if dtype is None:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype, copy=True)
    if inv_temp != 1.0:
        z.mul_(inv_temp)  # as the kernels: times 1 / T
    return z, (cap_(z, softcap, slope) if softcap is not None else None)
