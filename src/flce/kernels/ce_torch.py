"""Torch twin of the Triton cross-entropy kernel: same contract, plain tensor ops.

Used on the CPU, for float64 data, and as the reference the kernel is tested against. Arithmetic is
float32 (float64 when the logits are float64) whatever the storage dtype. The chunk is walked in blocks
of rows of about ``BLOCK_ELEMENTS`` logits, so that a block's passes (max, exp, sum, scale) run in the
CPU's cache and at most one block-sized temporary exists: in place on float32/float64 logits when a
gradient is written, one working copy of the block otherwise (half-precision logits, or the loss alone,
which leaves the logits untouched).
"""

from __future__ import annotations

import torch

from ..options import LossOptions
from .softcap_torch import cap_
from .targets import count_targets

# Logits per block: 2 MiB of float32, small enough to stay in a core's L2/L3 across a block's passes and
# large enough that the ~15 torch calls per block cost little beside them.
BLOCK_ELEMENTS = 1 << 21


def ce_chunk_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    correct: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    opts: LossOptions,
    counts: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
) -> None:
    """See ``kernels.ce_chunk`` for the contract. Outputs are written with ``copy_``, so they may be float64."""
    n, vocab = logits.shape
    if n == 0:
        return
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    w = class_weight.to(acc) if class_weight is not None else None
    w_sum = weight_sum.to(acc) if w is not None else None
    # The gradient's per-row factor: grad_scale, or 1 when the kernel finishes the mean (then it is an output).
    scale = None
    if grad_scale is not None:
        scale = grad_scale.to(acc) if counts is None else torch.ones((), dtype=acc, device=logits.device)
        scale = scale.expand(n) if scale.dim() == 0 else scale
    rows = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, n, rows):
        end = min(start + rows, n)
        _block(logits[start:end], target[start:end], loss[start:end], lse[start:end],
               None if correct is None else correct[start:end], w, w_sum,
               None if scale is None else scale[start:end], opts, acc,
               None if grad_out is None else grad_out[start:end])
    if counts is not None:  # the batch's mean, as the kernel finishes it
        counted, mean_scale = count_targets(target, opts.ignore_index, vocab, "torch")
        counts[:2] = counted
        grad_scale.copy_(mean_scale)
        total.copy_(loss.sum(dtype=acc) * mean_scale)


def _softmax(z: torch.Tensor, in_place: bool) -> torch.Tensor:
    """softmax(z, 1), over z itself when allowed on the CPU (its kernel reads each element of a row before it
    writes it; contiguous z only: the out= form gave wrong rows on padded rows, ``gemm.padded_rows``);
    a new tensor elsewhere."""
    if in_place and z.device.type == "cpu" and z.is_contiguous():
        return torch.ops.aten._softmax.out(z, 1, False, out=z)
    return torch.softmax(z, 1)


def _block(logits, target, loss, lse, correct, w, w_sum, scale, opts: LossOptions, acc: torch.dtype,
           grad_out: torch.Tensor | None = None) -> None:
    """One block of rows: loss, lse, correct and (``scale`` given) the gradient over ``logits``, or into
    ``grad_out`` (then ``logits`` may be overwritten too)."""
    n, vocab = logits.shape
    eps, cap, inv_temp = opts.label_smoothing, opts.softcap, 1.0 / opts.temperature
    eps_v = eps / max(vocab, 1)  # V = 0: every valid row is NaN anyway (its target is out of range)
    grad = scale is not None
    valid = target != opts.ignore_index
    # As the kernel does: an unchecked target outside [0, V) gives its row a NaN loss and gradient.
    bad = valid & ((target < 0) | (target >= vocab))
    poison = torch.zeros(n, dtype=acc, device=logits.device).masked_fill_(bad, float("nan"))
    y = target.clamp(0, max(vocab - 1, 0))[:, None]

    # z: the transformed logits, in the block itself when it is ours to overwrite, else in one copy.
    if grad and logits.dtype == acc:
        z = logits
    elif logits.dtype != acc or inv_temp != 1.0 or cap is not None:
        z = logits.to(acc, copy=True)
    else:
        z = logits  # loss alone, float32: read here, the exponentials go to a copy below
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    # With a gradient, the softcap's derivative sech^2(r / c): the block's one temporary.
    slope = cap_(z, cap, slope=grad) if cap is not None else None

    if vocab == 0:  # every valid target is out of range: NaN rows, as the kernel; nothing to write back
        m = torch.full((n,), float("-inf"), dtype=acc, device=logits.device)
        z_y = sum_z = torch.zeros(n, dtype=acc, device=logits.device)
        arg = torch.zeros(n, dtype=torch.int64, device=logits.device)
        p = z
    else:
        m = z.amax(1)
        z_y = z.gather(1, y)[:, 0]
        sum_z = (z @ w if w is not None else z.sum(1)) if eps > 0.0 else None
        arg = z.argmax(1) if correct is not None else None
        p = _softmax(z, in_place=z is not logits or grad)
    # lse = m + log(sum exp(z - m)), and the largest p is exp(0) / that sum: one fused softmax pass
    # instead of a subtraction, an exponential and a sum (torch.logsumexp takes as long as all three).
    # As the kernel: a +inf logit gives NaN (never a finite or inf loss); all -inf gives -inf.
    p_max = p.amax(1) if vocab else torch.zeros(n, dtype=acc, device=logits.device)
    row_lse = torch.where(m == float("-inf"), m, m - p_max.log())

    w_y = w[y[:, 0]] if w is not None and vocab else None
    target_coef = (1.0 - eps) * (w_y if w_y is not None else 1.0)
    row_loss = target_coef * (row_lse - z_y)
    w_total = w_sum if w is not None else float(vocab)
    if eps > 0.0:
        row_loss = row_loss + eps_v * (w_total * row_lse - sum_z)
    if opts.z_loss > 0.0:
        row_loss = row_loss + opts.z_loss * row_lse.square()
    loss.copy_(torch.where(valid, row_loss + poison, 0.0))
    lse.copy_(torch.where(valid, row_lse, 0.0))
    if correct is not None:
        correct.copy_(((arg == y[:, 0]) & valid) if vocab else torch.zeros_like(valid))
    if not grad or vocab == 0:
        return

    # As the kernel: target_coef * (p - onehot) + extra * p, with p_y - 1 formed before any product.
    extra = (eps_v * w_total if eps > 0.0 else 0.0) + 2.0 * opts.z_loss * row_lse
    row_scale = scale * inv_temp + poison
    p_y = torch.exp(z_y - row_lse)
    e = p
    e.mul_(((target_coef + extra) * row_scale)[:, None])
    e.scatter_(1, y, ((target_coef * (p_y - 1.0) + extra * p_y) * row_scale)[:, None])
    if eps > 0.0:
        if w is not None:
            e.addr_(row_scale, w, alpha=-eps_v)
        else:
            e.sub_((eps_v * row_scale)[:, None])
    if slope is not None:
        e.mul_(slope)
    if e.is_cuda:  # no host sync
        e.masked_fill_(~valid[:, None], 0.0)
    else:  # the ignored rows only: a broadcast mask costs a pass as slow as exp over the whole block
        e.index_fill_(0, (~valid).nonzero().squeeze(1), 0.0)
    out = logits if grad_out is None else grad_out
    if e is not out:
        out.copy_(e)
