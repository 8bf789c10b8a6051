"""Torch twins of the experts kernels (same contracts as ``experts_triton``), plus torch's grouped_mm.

``grouped_*_loop`` run one ``mm`` per expert after reading the offsets on the host: exact for every
dtype and device, the CPU default, but a host sync on CUDA (not for graph capture). ``grouped_*_mm``
call torch's own grouped GEMM (``F.grouped_mm`` / ``torch._grouped_mm``), which keeps the offsets on
the device. Elementwise twins compute in float32 (float64 for float64 data).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .softcap_torch import cap_


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segments(offsets: torch.Tensor):
    """(expert, start, end) of every expert with rows. The host copy of ``offsets`` is kept on the tensor, checked
    against its version counter: a layer's six GEMMs share one offsets tensor (backward gets it back from
    ``save_for_backward``), so the loop syncs once per layer call instead of once per GEMM."""
    cached = getattr(offsets, "_flce_host_bounds", None)
    if cached is None or cached[0] != offsets._version:
        cached = (offsets._version, offsets.tolist())
        offsets._flce_host_bounds = cached
    bounds = cached[1]
    return [(e, start, end) for e, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])) if end > start]


def grouped_rows_loop(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ w[e] for the rows of each expert e; a (S, K), w (E, K, N) -> (S, N)."""
    out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype, device=a.device)
    for e, start, end in _segments(offsets):
        torch.mm(a[start:end], w[e], out=out[start:end])
    return out


def grouped_wgrad_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e]; a (S, M), b (S, N) -> (E, M, N), zero for empty experts."""
    out = torch.empty(offsets.numel() - 1, a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
    written = set()
    for e, start, end in _segments(offsets):
        torch.mm(a[start:end].t(), b[start:end], out=out[e])
        written.add(e)
    for e in set(range(out.shape[0])) - written:  # zeroing only these: at Mixtral's size out is 1.9 GB
        out[e].zero_()
    return out


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def has_grouped_mm() -> bool:
    return _grouped_mm() is not None


def grouped_rows_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_rows_loop` through torch's grouped GEMM (rows past offsets[-1] are left unwritten)."""
    return _grouped_mm()(a, w, offs=offsets[1:])


def grouped_wgrad_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_wgrad_loop` through torch's grouped GEMM (K-grouped: both operands ragged)."""
    return _grouped_mm()(a.t(), b, offs=offsets[1:])


@dataclass(frozen=True)
class Activation:
    """What the experts compute between their two projections, from the first one's output h.

    kind "swiglu": ``act(gate) * (up + up_offset)``, ``act(g) = g * sigmoid(alpha * g)`` (SiLU at alpha 1), of the two
    halves of h (S, 2I): gate columns first (``interleaved``: gate and up alternating, GPT-OSS's layout). With
    ``limit`` the gate is first clamped to at most limit and the up projection to [-limit, limit] (DeepSeek-V4's
    ``swiglu_limit``; GPT-OSS's with alpha 1.702 and up_offset 1). With ``gate_softcap`` / ``up_softcap`` c the gate
    factor is ``c * tanh(g / c)`` while the sigmoid sees g itself, and up is ``c * tanh(up / c)`` (Inkling-2's).
    kind "relu2": ``relu(h) ** 2`` of h (S, I), no gate (Nemotron-H's experts); the other fields keep their defaults.
    """

    limit: float | None = None
    alpha: float = 1.0
    up_offset: float = 0.0
    interleaved: bool = False
    kind: str = "swiglu"
    gate_softcap: float | None = None
    up_softcap: float | None = None

    @property
    def gated(self) -> bool:
        return self.kind == "swiglu"


SWIGLU = Activation()
RELU2 = Activation(kind="relu2")


def _gate_up(h: torch.Tensor, act: Activation, bias: torch.Tensor | None,
             row_experts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (gate, up) halves of h in float32 (float64 for float64), plus each row's expert's bias."""
    h = _biased(h.to(_acc_dtype(h.dtype)), bias, row_experts, None)
    return (h[:, 0::2], h[:, 1::2]) if act.interleaved else h.chunk(2, dim=-1)


def _clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)


def _softcapped(x: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(c * tanh(x / c), its derivative sech^2(x / c)) as the Triton kernels compute them (x and 1 without a cap)."""
    if cap is None:
        return x, 1.0
    capped = x.clone()
    return capped, cap_(capped, cap, slope=True)


def activation_torch(h: torch.Tensor, n_valid: torch.Tensor, act: Activation = SWIGLU,
                     bias: torch.Tensor | None = None, row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`Activation` of h (S, 2I) (relu2: (S, I)) -> (S, I) in h's dtype. bias: (E, 2I) (relu2: (E, I)) added to
    each row's expert's projection (``row_experts`` (S,) int64, the expert of each row). (``n_valid`` is the Triton
    twin's row limit; here every row is computed, rows past it being don't-cares.)"""
    if not act.gated:
        return torch.relu(_biased(h.to(_acc_dtype(h.dtype)), bias, row_experts, None)).square().to(h.dtype)
    gate, up = _clamped(*_gate_up(h, act, bias, row_experts), act.limit)
    if act.alpha == 1.0 and act.gate_softcap is None:
        gated = F.silu(gate)  # SiLU as torch rounds it
    else:
        gated = _softcapped(gate, act.gate_softcap)[0] * torch.sigmoid(act.alpha * gate)
    up = _softcapped(up, act.up_softcap)[0]
    return (gated * (up + act.up_offset if act.up_offset else up)).to(h.dtype)


def activation_backward_torch(h: torch.Tensor, da: torch.Tensor, n_valid: torch.Tensor, act: Activation = SWIGLU,
                              bias: torch.Tensor | None = None,
                              row_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, a (S, I)) from h and da (S, I), dh shaped as h; ``a`` is written over ``da``."""
    if not act.gated:
        positive = torch.relu(_biased(h.to(_acc_dtype(h.dtype)), bias, row_experts, None))
        dh = (da.to(positive.dtype) * 2 * positive).to(h.dtype)
        da.copy_(positive.square())
        return dh, da
    gate_in, up_in = _gate_up(h, act, bias, row_experts)
    gate, up = _clamped(gate_in, up_in, act.limit)
    grad = da.to(gate.dtype)
    sig = torch.sigmoid(act.alpha * gate)
    factor, factor_slope = _softcapped(gate, act.gate_softcap)
    up, up_slope = _softcapped(up, act.up_softcap)
    gated, up = factor * sig, up + act.up_offset
    d_gate = grad * up * (factor_slope * sig + act.alpha * factor * sig * (1 - sig))
    d_up = grad * gated * up_slope
    if act.limit is not None:  # a clamped input gets no gradient (torch's clamp passes it where min <= x <= max)
        d_gate = torch.where(gate_in <= act.limit, d_gate, 0.0)
        d_up = torch.where((up_in >= -act.limit) & (up_in <= act.limit), d_up, 0.0)
    pair = torch.stack([d_gate, d_up], dim=-1).flatten(1) if act.interleaved else torch.cat([d_gate, d_up], dim=-1)
    da.copy_(gated * up)
    return pair.to(h.dtype), da


def expert_sums_torch(d: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
    """(E, N) float32 (float64 for float64): the sum of d's (S, N) rows per expert (a bias's gradient), by
    ``row_experts`` (S,) int64; rows of dropped pairs (expert id E) are left out. (``offsets`` is the Triton twin's
    way to the rows.)"""
    num_experts, acc = offsets.numel() - 1, _acc_dtype(d.dtype)
    sums = torch.zeros(num_experts + 1, d.shape[1], dtype=acc, device=d.device)
    return sums.index_add_(0, row_experts, d.to(acc))[:num_experts]


def combine_torch(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, n_valid: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                  row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * (y[p] + bias[row_experts[p]]), p = pos[t, j]; float32 sum, rows at or past
    n_valid count as 0."""
    tokens, top_k = pos.shape
    acc = _acc_dtype(y.dtype)
    rows = _biased(y.index_select(0, pos.reshape(-1)).to(acc), bias, row_experts, pos.reshape(-1))
    rows = rows.view(tokens, top_k, y.shape[1])
    keep = (pos < n_valid).unsqueeze(-1)
    if weights is not None:
        rows = rows * weights.to(acc).unsqueeze(-1)
    return torch.where(keep, rows, 0.0).sum(1).to(out_dtype)


def combine_backward_torch(grad: torch.Tensor, y: torch.Tensor | None, perm: torch.Tensor, weights: torch.Tensor,
                           n_valid: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                           row_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy (S, H) = weight * grad[token] per sorted row (0 past n_valid); d weights (T, k) = <grad[token], y + bias>
    when y is given."""
    top_k = weights.shape[1]
    acc = _acc_dtype(grad.dtype)
    valid = (torch.arange(perm.numel(), device=perm.device) < n_valid).unsqueeze(-1)
    g = grad.index_select(0, perm // top_k).to(acc)
    w = weights.reshape(-1).index_select(0, perm).to(acc).unsqueeze(-1)
    dy = torch.where(valid, g * w, 0.0).to(dtype)
    if y is None:
        return dy, None
    rows = _biased(y.to(acc), bias, row_experts, None)
    dots = torch.where(valid, g * rows, 0.0).sum(1)
    dw = torch.empty(perm.numel(), dtype=weights.dtype, device=weights.device)
    dw[perm] = dots.to(weights.dtype)
    return dy, dw.view_as(weights)


def _biased(rows: torch.Tensor, bias: torch.Tensor | None, row_experts: torch.Tensor | None,
            picked: torch.Tensor | None) -> torch.Tensor:
    """rows + the bias of each row's expert (the rows ``picked`` from the sorted ones, or all of them; a dropped
    pair's row, expert id E, takes the last expert's bias: a don't-care)."""
    if bias is None:
        return rows
    experts = row_experts if picked is None else row_experts.index_select(0, picked)
    return rows + bias.to(rows.dtype).index_select(0, experts.clamp(max=bias.shape[0] - 1))
