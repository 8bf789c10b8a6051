"""Torch twin of the Triton cross-entropy kernel: same contract, plain tensor ops in float32.

Used on the CPU and as the reference the kernel is tested against. Materializes a few float32
copies of the chunk, which is fine for the chunk sizes it sees.
"""

from __future__ import annotations

import torch

from ..options import LossOptions
from .targets import count_targets


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
) -> None:
    """See ``kernels.ce_chunk`` for the contract."""
    n, vocab = logits.shape
    if n == 0:
        return
    eps, cap = opts.label_smoothing, opts.softcap
    z = logits.float() / opts.temperature
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    valid = target != opts.ignore_index
    # As the kernel does: an unchecked target outside [0, V) gives its row a NaN loss and gradient.
    poison = torch.where(valid & ((target < 0) | (target >= vocab)), float("nan"), 0.0)
    y = target.clamp(0, vocab - 1)
    # As the kernel computes it (not torch.logsumexp): a +inf logit gives NaN, never a finite or inf loss.
    m = z.amax(1)
    m_ref = torch.where(m == float("-inf"), 0.0, m)
    row_lse = m + torch.exp(z - m_ref[:, None]).sum(1).log()
    z_y = z.gather(1, y[:, None])[:, 0]
    w = class_weight.float() if class_weight is not None else None
    w_y = w[y] if w is not None else torch.ones_like(z_y)
    w_sum = weight_sum.float() if w is not None else torch.tensor(float(vocab), device=z.device)

    row_loss = (1.0 - eps) * w_y * (row_lse - z_y)
    if eps > 0.0:
        sum_z = (z * w).sum(1) if w is not None else z.sum(1)
        row_loss = row_loss + eps / vocab * (w_sum * row_lse - sum_z)
    if opts.z_loss > 0.0:
        row_loss = row_loss + opts.z_loss * row_lse.square()
    loss.copy_(torch.where(valid, row_loss + poison, 0.0))
    lse.copy_(torch.where(valid, row_lse, 0.0))
    if correct is not None:
        correct.copy_(((z.argmax(1) == y) & valid).float())
    if counts is not None:  # the batch's mean, as the kernel finishes it
        counted, mean_scale = count_targets(target, opts.ignore_index, vocab, "torch")
        counts[:2] = counted
        grad_scale.copy_(mean_scale)
        total.copy_(loss.sum() * mean_scale)
    if grad_scale is None:
        return

    # As the kernel: target_coef * (p - onehot) + extra * p, with p_y - 1 formed before any product.
    target_coef = (1.0 - eps) * w_y
    extra = eps / vocab * w_sum + 2.0 * opts.z_loss * row_lse
    p = torch.exp(z - row_lse[:, None])
    g = (target_coef + extra)[:, None] * p
    p_y = p.gather(1, y[:, None])[:, 0]
    g.scatter_(1, y[:, None], (target_coef * (p_y - 1.0) + extra * p_y)[:, None])
    if eps > 0.0:
        g -= eps / vocab * (w if w is not None else 1.0)
    if cap is not None:
        g *= 1.0 - (z / cap).square()
    scale = (grad_scale.float() if counts is None else torch.ones_like(grad_scale)) / opts.temperature
    g *= (scale + poison)[:, None]
    logits.copy_(torch.where(valid[:, None], g, 0.0))
