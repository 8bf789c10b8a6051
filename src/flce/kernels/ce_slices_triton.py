"""The cross-entropy kernel that reads each logit once: a row is split into slices held in registers.

The row kernel (``ce_triton``) reads a row twice, once for its logsumexp and once for the gradient:
2 reads + 1 write per logit. Here each program loads one slice of SLICE_V logits of a row into
registers, publishes the slice's (max, sum of exp, sum of z, argmax) and, on a GPU, waits at a per-row
counter until every slice of its row has done so; it then combines the partials into the row's
logsumexp and writes the gradient from the registers: 1 read + 1 write per logit.

The wait needs the slices of a row to be resident together. Programs are numbered row-major, so the
GPU dispatches a row's slices next to each other and only the row at the dispatch front can wait on a
program not yet started: any GPU that holds ``slices`` programs at once makes progress. The Triton
interpreter runs programs one after the other, so there (``two_launches=True``) the same kernel runs
twice: once to publish the partials, once to read them and write the gradient, reloading the slice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import LossOptions
from .ce_triton import _checked_target, _logit_grad, _logits, _row_loss, _row_scale

# A partial per (row, slice): max, sum of exp(z - max), (weighted) sum of z, and the argmax as a
# float (exact below 2**24 columns).
_FIELDS = 4
MAX_VOCAB = 2**24
FUSED, PUBLISH, FINISH = 0, 1, 2  # PHASE: one launch (GPU), or the interpreter's two


@triton.jit
def _publish(part_ptr, z, cols, mask, class_weight_ptr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
             COMPUTE_ACC: tl.constexpr):
    """Write this slice's partial: max, sum of exp(z - max), (weighted) sum of z, argmax."""
    zm = tl.where(mask, z, float("-inf"))
    m = tl.max(zm, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # a slice of -inf logits adds exp(-inf) = 0
    tl.store(part_ptr, m)
    tl.store(part_ptr + 1, tl.sum(tl.exp(zm - m_ref), 0))
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(part_ptr + 2, tl.sum(tl.where(mask, w * z, 0.0), 0))
        else:
            tl.store(part_ptr + 2, tl.sum(tl.where(mask, z, 0.0), 0))
    if COMPUTE_ACC:
        tl.store(part_ptr + 3, tl.min(tl.where(zm == m, cols, 2**30), 0).to(tl.float32))


@triton.jit
def _combine(row_part_ptr, SLICES: tl.constexpr, SLICES_POW2: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
             COMPUTE_ACC: tl.constexpr):
    """The row's logsumexp, sum of z and argmax from its slices' partials (the first maximum wins)."""
    k = tl.arange(0, SLICES_POW2)
    mask = k < SLICES
    ptrs = row_part_ptr + k * 4
    m = tl.load(ptrs, mask=mask, other=float("-inf"), cache_modifier=".cg")
    s = tl.load(ptrs + 1, mask=mask, other=0.0, cache_modifier=".cg")
    m_row = tl.max(m, 0)
    m_ref = tl.where(m_row == float("-inf"), 0.0, m_row)
    lse = m_ref + tl.log(tl.sum(s * tl.exp(m - m_ref), 0))
    sum_z = 0.0
    if HAS_SMOOTHING:
        sum_z = tl.sum(tl.load(ptrs + 2, mask=mask, other=0.0, cache_modifier=".cg"), 0)
    best_idx = 0
    if COMPUTE_ACC:
        arg = tl.load(ptrs + 3, mask=mask, other=0.0, cache_modifier=".cg")
        best_idx = tl.min(tl.where(mask & (m == m_row), arg, 2.0**30), 0).to(tl.int64)
    return lse, sum_z, best_idx


@triton.jit
def _ce_slices_kernel(
    logits_ptr, stride_row, target_ptr, class_weight_ptr, weight_sum_ptr, scale_ptr, loss_ptr, lse_ptr,
    correct_ptr, part_ptr, z_y_ptr, arrived_ptr, V, ignore_index, smoothing, z_loss, softcap, inv_temp,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr, COMPUTE_ACC: tl.constexpr,
    SLICES: tl.constexpr, SLICES_POW2: tl.constexpr, SLICE_V: tl.constexpr, PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.cast(pid // SLICES, tl.int64)
    first = (pid % SLICES) * SLICE_V
    row_ptr = logits_ptr + row * stride_row
    cols = first + tl.arange(0, SLICE_V)
    mask = cols < V
    y, valid, poison = _checked_target(target_ptr, row, V, ignore_index)
    z = _logits(tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32), inv_temp, softcap, HAS_SOFTCAP)
    row_part_ptr = part_ptr + row * (SLICES * 4)
    if PHASE != 2:
        _publish(row_part_ptr + (pid % SLICES) * 4, z, cols, mask, class_weight_ptr, HAS_WEIGHT, HAS_SMOOTHING,
                 COMPUTE_ACC)
        if (y >= first) & (y < first + SLICE_V):  # the target's slice keeps z_y before anyone writes over it
            tl.store(z_y_ptr + row, tl.sum(tl.where(cols == y, z, 0.0), 0))
    if PHASE == 0:
        if SLICES > 1:  # release our partial, then wait until the row's every slice has released its own
            tl.debug_barrier()  # every thread's stores, before one thread's release
            tl.atomic_add(arrived_ptr + row, 1, sem="release", scope="gpu")
            while tl.atomic_add(arrived_ptr + row, 0, sem="acquire", scope="gpu") < SLICES:
                pass
            tl.debug_barrier()
    if PHASE != 1:
        lse, sum_z, best_idx = _combine(row_part_ptr, SLICES, SLICES_POW2, HAS_SMOOTHING, COMPUTE_ACC)
        z_y = tl.load(z_y_ptr + row, cache_modifier=".cg")
        loss, target_coef, extra_coef = _row_loss(lse, z_y, sum_z, y, class_weight_ptr, weight_sum_ptr, V, smoothing,
                                                  z_loss, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS)
        if pid % SLICES == 0:
            tl.store(loss_ptr + row, tl.where(valid, loss + poison, 0.0))
            tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
            if COMPUTE_ACC:
                tl.store(correct_ptr + row, (valid & (best_idx == y)).to(tl.float32))
        if COMPUTE_GRAD:
            scale = _row_scale(scale_ptr, row, inv_temp, poison, SCALE_PER_ROW)
            g = _logit_grad(z, cols, mask, class_weight_ptr, y, lse, extra_coef, target_coef, smoothing / V, scale,
                            valid, softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP)
            tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_chunk_slices(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
                    correct: torch.Tensor | None, class_weight: torch.Tensor | None,
                    weight_sum: torch.Tensor | None, grad_scale: torch.Tensor | None, opts: LossOptions,
                    slice_v: int, num_warps: int, two_launches: bool) -> None:
    """Launch the slice kernel on one chunk (contract: ``kernels.ce_chunk``); ``slice_v``: columns per
    program, a power of two; ``two_launches``: publish, then finish (the interpreter's way)."""
    n, vocab = logits.shape
    assert vocab < MAX_VOCAB, "argmax partials are stored as float32"
    slices = triton.cdiv(vocab, slice_v)
    two_launches = two_launches and slices > 1
    dev = logits.device
    part = torch.empty(n * slices * _FIELDS, dtype=torch.float32, device=dev)
    z_y = torch.empty(n, dtype=torch.float32, device=dev)
    arrived = torch.zeros(n, dtype=torch.int32, device=dev) if slices > 1 and not two_launches else z_y
    dummy = loss  # placeholder pointer for disabled features (never read)
    args = (logits, logits.stride(0), target, class_weight if class_weight is not None else dummy,
            weight_sum if weight_sum is not None else dummy, grad_scale if grad_scale is not None else dummy,
            loss, lse, correct if correct is not None else dummy, part, z_y, arrived, vocab, opts.ignore_index,
            float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 1.0), 1.0 / opts.temperature)
    flags = dict(HAS_WEIGHT=class_weight is not None, HAS_SMOOTHING=opts.label_smoothing > 0.0,
                 HAS_Z_LOSS=opts.z_loss > 0.0, HAS_SOFTCAP=opts.softcap is not None,
                 COMPUTE_GRAD=grad_scale is not None,
                 SCALE_PER_ROW=grad_scale is not None and grad_scale.dim() == 1, COMPUTE_ACC=correct is not None,
                 SLICES=slices, SLICES_POW2=triton.next_power_of_2(slices), SLICE_V=slice_v, num_warps=num_warps)
    for phase in ((PUBLISH, FINISH) if two_launches else (FUSED,)):
        _ce_slices_kernel[(n * slices,)](*args, PHASE=phase, **flags)
