"""The softcap z = c * tanh(r / c) and its derivative sech^2(r / c), for every Triton kernel.

Portable jit functions (libdevice is CUDA-only; the interpreter has none), accurate to a few float32 ulps
over all arguments on CUDA as well as under ``TRITON_INTERPRET=1``. Two traps they avoid:

- ``1 - tanh^2`` cancels where tanh -> 1 (|u| > ~4): its error is ~ulp(1) absolute, up to 100% of sech^2,
  and CUDA's exp moved it by more than float32 rounding (softcap 1e-3: 7e-6 relative gradient difference
  between the Triton and torch backends). sech^2 = 4q / (1 + q)^2 with q = exp(-2|u|) has no cancellation.
- ``tl.exp`` on CUDA is 2^(x * log2 e) with a float32 product: its relative error grows as |x| * 2^-24,
  dozens of ulps for the q of |u| ~ 40. ``_exp_neg`` reduces the argument first (Cody-Waite).

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

LOG2E = tl.constexpr(1.4426950408889634)
LN2_HI = tl.constexpr(0.693145751953125)  # ln 2 to 15 bits: k * LN2_HI is exact for |k| < 512
LN2_LO = tl.constexpr(1.4286068202862268e-06)  # ln 2 - LN2_HI
EXP_MIN = tl.constexpr(-104.0)  # exp(-104) < 2^-150 rounds to 0 in float32
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _pow2(k):
    """2^k as float32 for integer k in [-126, 0], exactly (from its bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exp_neg(x):
    """exp(x) for x <= 0 (or NaN) within ~2 float32 ulps, subnormal results included: exp(x) = 2^k exp(f)
    with f = x - k ln 2 in [-ln2 / 2, ln2 / 2] (exact for float32 x), the scale applied in two exact halves."""
    x = tl.where(x < EXP_MIN, EXP_MIN, x)  # NaN stays NaN
    k = tl.floor(x * LOG2E + 0.5)
    f = (x - k * LN2_HI) - k * LN2_LO
    k = tl.where(k >= -150.0, k, -150.0).to(tl.int32)  # in [-150, 0]; NaN gives -150 (f keeps the NaN)
    half = k >> 1
    return tl.exp(f) * _pow2(half) * _pow2(k - half)


@triton.jit
def tanh_sech2(x):
    """(tanh(x), sech^2(x)) from one q = exp(-2|x|): tanh = 1 - 2q / (1 + q) with the sign restored (an odd
    polynomial for |x| <= 0.625, where that cancels; softcap * tanh(r / softcap) must give back r for a
    large softcap) and sech^2 = 4q / (1 + q)^2. +-inf gives (+-1, 0), NaN (NaN, NaN)."""
    a = tl.abs(x)
    q = _exp_neg(-2.0 * a)
    d = tl.fdiv(1.0, 1.0 + q, ieee_rounding=True)
    s = x * x
    p = TANH_P3 + s * TANH_P4
    p = TANH_P2 + s * p
    p = TANH_P1 + s * p
    p = TANH_P0 + s * p
    big = 1.0 - 2.0 * q * d
    t = tl.where(a <= TANH_SMALL, x + x * s * p, tl.where(x < 0.0, -big, big))
    return t, 4.0 * q * d * d


@triton.jit
def tanh(x):
    """tanh(x) to float32 rounding (a few ulps) over all x."""
    t, _ = tanh_sech2(x)
    return t


@triton.jit
def sech2(x):
    """sech^2(x) = 1 - tanh^2(x) = d tanh / dx to a few float32 ulps over all x (no cancellation)."""
    _, s = tanh_sech2(x)
    return s


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
