"""Per-token statistics of one chunk of logits, and their gradient, behind one entry point each.

Logit model (as the loss's): ``r = logits / T``, ``z = c * tanh(r / c)`` (or ``z = r``), ``p = softmax(z)``.
Per row with target ``y``:

    log_probs = z_y - lse                         entropy = lse - sum_j p_j z_j
    log_sum_sq_probs = log(sum_j p_j^2)           mean_logits = mean_j z_j
    is_top1 = argmax_j z_j == y  (first index on ties)

Ignored rows (``target == ignore_index``) get zeros (False); an unchecked target outside [0, V) gets
NaN (True never), never a plausible number. All arithmetic is float32 whatever the logits' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class RowStats(NamedTuple):
    """Per-row outputs, (n,) each: float32, ``is_top1`` bool; None where not wanted. ``lse`` (the
    log-sum-exp of z) is always written: backward needs it."""

    lse: torch.Tensor
    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None

    def rows(self, start: int, end: int) -> "RowStats":
        return RowStats(*(None if t is None else t[start:end] for t in self))


class Transform(NamedTuple):
    """What turns a logit into z: ``ignore_index``, 1 / temperature and softcap (None: no cap)."""

    ignore_index: int
    inv_temp: float
    softcap: float | None


def row_stats(backend: str, logits: torch.Tensor, target: torch.Tensor, out: RowStats, tf: Transform,
              tile_max: torch.Tensor | None = None, operands: tuple | None = None) -> None:
    """Write ``out``'s fields for each row of ``logits`` (n, V) (rows contiguous, V >= 1), reading it once.
    target: (n,) int64. ``tile_max``: None, or (n, T) float32 (triton only) when ``logits`` hold what the
    Hopper logits GEMM stores: the logits / T less the max of its tile (``logits_triton.logits_with_tile_stats``).
    ``operands``: None, or the GEMM's (x (n, H), W (V, H), bias (V,) or None), unit-stride rows (triton only):
    then each row's logit at its target comes from a float32 dot of them, not from its 16-bit stored value."""
    if backend == "triton":
        from .token_stats_triton import row_stats_triton

        row_stats_triton(logits, target, out, tf, tile_max, operands)
    else:
        assert tile_max is None and operands is None, "shifted logits come with the triton backend only"
        from .token_stats_torch import row_stats_torch

        row_stats_torch(logits, target, out, tf)


def row_grad(backend: str, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
             entropy: torch.Tensor | None, grad_log_probs: torch.Tensor | None,
             grad_entropy: torch.Tensor | None, tf: Transform, tile_max: torch.Tensor | None = None,
             grad_out: torch.Tensor | None = None) -> None:
    """Overwrite ``logits`` (n, V) with d(sum_rows g_lp * log_probs + g_ent * entropy) / d logits, or write that
    into ``grad_out`` (n, V), rows contiguous, e.g. 16-bit beside float32 logits (``kernels.ce_chunk``'s).

    lse, entropy: forward's (n,) float32 (entropy only with ``grad_entropy``); grad_log_probs,
    grad_entropy: (n,) float32 per-row grad_outputs, or None (no gradient from that output). In z:
    ``g_lp * ([j == y] - p_j) - g_ent * p_j * (z_j - lse + entropy)``, then through softcap and 1/T.
    ``tile_max``: as in ``row_stats``.
    """
    if backend == "triton":
        from .token_stats_triton import row_grad_triton

        row_grad_triton(logits, target, lse, entropy, grad_log_probs, grad_entropy, tf, tile_max, grad_out)
    else:
        assert tile_max is None, "shifted logits come with the triton backend only"
        from .token_stats_torch import row_grad_torch

        row_grad_torch(logits, target, lse, entropy, grad_log_probs, grad_entropy, tf, grad_out)
