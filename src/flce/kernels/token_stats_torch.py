"""Torch twin of the Triton token-statistics kernels: same contract (``kernels.token_stats``), plain
tensor ops in float32. Used on the CPU and as the reference the kernels are tested against."""

from __future__ import annotations

import torch

from .softcap_torch import capped_logits
from .token_stats import RowStats, Transform


def _targets(target: torch.Tensor, vocab: int, tf: Transform):
    """(valid rows, NaN for an unchecked target outside [0, V) else 0, a safe column index)."""
    valid = target != tf.ignore_index
    poison = torch.where(valid & ((target < 0) | (target >= vocab)), float("nan"), 0.0)
    return valid, poison, target.clamp(0, vocab - 1)


def row_stats_torch(logits: torch.Tensor, target: torch.Tensor, out: RowStats, tf: Transform) -> None:
    """See ``kernels.token_stats.row_stats``."""
    n, vocab = logits.shape
    if n == 0:
        return
    z, _ = capped_logits(logits, tf.inv_temp, tf.softcap, dtype=torch.float32)
    valid, poison, y = _targets(target, vocab, tf)
    m = z.amax(1)
    m = torch.where(m == float("-inf"), 0.0, m)[:, None]  # as the kernel: a row of -inf logits gives NaN
    e = torch.exp(z - m)
    s = e.sum(1)
    lse = m[:, 0] + s.log()

    def put(dst: torch.Tensor | None, value: torch.Tensor) -> None:
        if dst is not None:
            dst.copy_(torch.where(valid, value + poison, 0.0))

    put(out.lse, lse)
    put(out.log_probs, z.gather(1, y[:, None])[:, 0] - lse)
    put(out.entropy, s.log() - (e * (z - m)).sum(1) / s)  # both terms >= 0: no cancellation
    put(out.log_sum_sq_probs, e.square().sum(1).log() - 2.0 * s.log())
    put(out.mean_logits, z.mean(1))
    if out.is_top1 is not None:
        out.is_top1.copy_(valid & (poison == 0) & (z.argmax(1) == y))


def row_grad_torch(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                   grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, tf: Transform,
                   grad_out: torch.Tensor | None = None) -> None:
    """See ``kernels.token_stats.row_grad``."""
    n, vocab = logits.shape
    if n == 0:
        return
    z, dz_dr = capped_logits(logits, tf.inv_temp, tf.softcap, slope=True, dtype=torch.float32)
    valid, poison, y = _targets(target, vocab, tf)
    log_p = z - lse[:, None]
    p = torch.exp(log_p)
    g = torch.zeros_like(z)
    if grad_log_probs is not None:
        onehot_minus_p = (-p).scatter_add_(1, y[:, None], torch.ones_like(p[:, :1]))  # 1 - p_y formed first
        g += grad_log_probs.float()[:, None] * onehot_minus_p
    if grad_entropy is not None:
        g -= grad_entropy.float()[:, None] * p * (log_p + entropy[:, None])
    if dz_dr is not None:
        g *= dz_dr
    g = g * tf.inv_temp + poison[:, None]
    (logits if grad_out is None else grad_out).copy_(torch.where(valid[:, None], g, 0.0))
