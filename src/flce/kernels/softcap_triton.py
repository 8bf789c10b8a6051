"""The softcap z = c * tanh(r / c) and its derivative sech^2(r / c), for every Triton kernel.

Portable jit functions (libdevice is CUDA-only; the interpreter has none), accurate to a few float32 ulps
over all arguments on CUDA as well as under ``TRITON_INTERPRET=1``. Two traps they avoid:

- ``1 - tanh^2`` cancels where tanh -> 1 (|u| > ~4): its error is ~ulp(1) absolute, up to 100% of sech^2,
  and CUDA's exp moved it by more than float32 rounding (softcap 1e-3: 7e-6 relative gradient difference
  between the Triton and torch backends). sech^2 = 4q / (1 + q)^2 with q = exp(-2|u|) has no cancellation.
- Speed: the logits GEMM's epilogue computes tanh for every logit, so one plain ``tl.exp`` and one plain
  division per element, no more (a range-reduced exp and IEEE divisions there made the GEMM 2.3x slower
  with softcap 30 on an H100: ``benchmark/probes/softcap_cost_probe.py``). CUDA's exp is 2^(x log2 e) with
  a float32 product, relative error ~|x| 2^-24: for sech^2 that is a few ulps while |u| < ~20, and beyond
  sech^2(u) < 1e-17 of the largest term, where no error shows in the gradient.

u is r times the correctly rounded float32 1 / c (``inverse``): the torch twin (``softcap_torch``) multiplies
by the same number, so both backends take tanh and sech^2 of the very same u.
"""

from __future__ import annotations

import triton
import triton.language as tl

# tanh(x) = x + x^3 * P(x^2) for |x| <= TANH_SMALL: P fitted (iteratively reweighted least squares) for
# tanh's relative error, under one float32 ulp in float32 Horner arithmetic. Beyond, 1 - 2q / (1 + q).
TANH_SMALL = tl.constexpr(0.625)
TANH_P0 = tl.constexpr(-0.3333328068256378)
TANH_P1 = tl.constexpr(0.13331441581249237)
TANH_P2 = tl.constexpr(-0.05373971164226532)
TANH_P3 = tl.constexpr(0.020639073103666306)
TANH_P4 = tl.constexpr(-0.005704972892999649)

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def tanh_sech2(x):
    """(tanh(x), sech^2(x)) from one q = exp(-2|x|): tanh = 1 - 2q / (1 + q) with the sign restored (an odd
    polynomial for |x| <= 0.625, where that cancels; softcap * tanh(r / softcap) must give back r for a
    large softcap) and sech^2 = 4q / (1 + q)^2. +-inf gives (+-1, 0), NaN (NaN, NaN)."""
    a = tl.abs(x)
    q = tl.exp(-2.0 * a)  # CUDA's ex2.approx: plenty for sech^2's relative error (module docstring)
    d = 1.0 / (1.0 + q)
    s = x * x
    p = TANH_P3 + s * TANH_P4
    p = TANH_P2 + s * p
    p = TANH_P1 + s * p
    p = TANH_P0 + s * p
    big = 1.0 - 2.0 * q * d
    t = tl.where(a <= TANH_SMALL, x + x * s * p, tl.where(x < 0.0, -big, big))
    return t, 4.0 * q * d * d


@triton.jit
def inverse(softcap, dtype: tl.constexpr):
    """1 / softcap correctly rounded in ``dtype`` (as ``softcap_torch.inverse``), at most the largest float32:
    a tiny softcap then still maps r = 0 to u = 0."""
    return tl.minimum(tl.fdiv(1.0, tl.cast(softcap, dtype), ieee_rounding=True), FLOAT32_MAX)


@triton.jit
def capped(raw, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr):
    """z = softcap * tanh(r / softcap) with r = raw / T (z = r without softcap)."""
    z, _ = capped_slope(raw, inv_temp, softcap, HAS_SOFTCAP)
    return z


@triton.jit
def capped_slope(raw, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, dz / dr): the softcapped logits and the softcap's derivative sech^2(u), both from u = r / softcap
    itself (never from z / softcap). Without softcap the slope is r, a placeholder the caller never reads."""
    r = raw * inv_temp
    slope = r
    if HAS_SOFTCAP:
        t, slope = tanh_sech2(r * inverse(softcap, r.dtype))
        r = softcap * t
    return r, slope


@triton.jit
def tile_shift(tile_max, softcap, HAS_SOFTCAP: tl.constexpr):
    """What the logits GEMM takes off a tile's values r before storing them, from the tile's max of r: that
    max, which keeps the logits that carry probability nearly exact; with a softcap c at most r* = c u*,
    sinh(2 u*) = c / 2. An error e in r_j reaches d loss / d r_j as p_j sech^4(u_j) e (u_j = r_j / c), whose
    square peaks at u* over the r_j for any spread of the logits; beyond, softcap saturates and the logits
    that still carry gradient lie below (c = 30: r* = 51; c = 1: r* = 0.24)."""
    shift = tile_max
    if HAS_SOFTCAP:
        half = 0.5 * softcap
        shift = tl.minimum(tile_max, softcap * 0.5 * tl.log(half + tl.sqrt(half * half + 1.0)))  # c asinh(c/2)/2
    return shift
