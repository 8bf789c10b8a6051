"""The two per-chunk stages of a cross-entropy whose vocabulary is split over ranks.

Stage 1 (``shard_stats``): each rank's partial softmax statistics over its own columns — row max, sum
of exp(z - max), the target's logit if the target lives here (exact, and as stored), the (class-weighted)
sum of logits for label smoothing. The ranks combine them with two all-reduces (see ``flce.distributed``).
Stage 2 (``shard_grad``): given the global lse and per-row coefficients, the gradient over this
rank's columns, written over the logits in place.

Each stage has a Triton kernel (one program per row, blocks over the shard's columns, float32
arithmetic) and a torch twin with the same contract (CPU, float64 logits, and the kernels' test
reference); the twin computes in float32, or in float64 for float64 logits.
"""

from __future__ import annotations

import torch

from ..options import LossOptions
from .softcap_torch import capped_logits

# Rows of the statistics that shard_stats writes, (STATS, n) float32. TARGET_STORED: the target's logit as the
# logits hold it, which the hit test compares with the row max (the GEMM stores a tile's max exactly); TARGET_LOGIT
# may come from a float32 dot instead, for the loss.
ROW_MAX, SUM_EXP, TARGET_LOGIT, SUM_LOGITS, TARGET_STORED = range(5)
STATS = 5


def shard_stats(
    backend: str,
    logits: torch.Tensor,
    target_local: torch.Tensor,
    class_weight: torch.Tensor | None,
    opts: LossOptions,
    out: torch.Tensor,
    tile_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    operands: tuple | None = None,
) -> None:
    """Partial softmax statistics of this rank's columns.

    Args:
        logits: (n, V_local) raw logits (before temperature and softcap), rows contiguous; with
            ``tile_stats`` (triton only) what ``logits_triton.logits_with_tile_stats`` wrote with them:
            r = logits / T less its tile's shift, and the (n, T) tile maxima and sums.
        target_local: (n,) int64 column of the target in this shard, -1 where it is not here.
        class_weight: (V_local,) slice of the class weights (in the math dtype), or None.
        out: (STATS, n) float32 (float64 for float64 logits), written: row max of z, sum of exp(z - max),
            z at the target (0 where target_local is -1), sum_j w_j z_j (only when label smoothing is
            on, else left unwritten), z at the target as the logits hold it (0 where target_local is -1).
        operands: None, or with ``tile_stats`` the GEMM's (x (n, H), W_local (V_local, H), bias (V_local,) or
            None), unit-stride rows: z at the target then comes from a float32 dot of them, not from the stored
            value (which a tile max can leave off by |z_y - tile max| / 256 in 16 bits).
    """
    if logits.shape[1] == 0:  # an empty shard: neutral elements of max and sum
        out[ROW_MAX].fill_(float("-inf"))
        out[SUM_EXP:].zero_()
        return
    if logits.shape[0] == 0:
        return
    if backend == "triton":
        from .ce_vocab_parallel_triton import shard_stats_triton

        shard_stats_triton(logits, target_local, class_weight, opts, out, tile_stats, operands)
    else:
        assert tile_stats is None and operands is None, "tile statistics come with the triton backend only"
        _shard_stats_torch(logits, target_local, class_weight, opts, out)


def shard_grad(
    backend: str,
    logits: torch.Tensor,
    target_local: torch.Tensor,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    extra_coef: torch.Tensor,
    target_coef: torch.Tensor,
    scale: torch.Tensor,
    smoothing_per_class: float,
    opts: LossOptions,
    tile_max: torch.Tensor | None = None,
) -> None:
    """Overwrite this rank's logits with the gradient of the loss with respect to them.

    Per element, with p_j = exp(z_j - lse)::

        dz_j = target_coef * (p_j - [j == target_local]) + extra_coef * p_j - smoothing_per_class * w_j

    chained through softcap, times ``scale``. Rows whose scale is 0 get exact zeros.

    Args:
        logits: (n, V_local) raw logits (or, with ``tile_max``, as in ``shard_stats``), overwritten.
            target_local: (n,) int64, -1 if not here.
        class_weight: (V_local,) or None (w_j = 1). lse, extra_coef, target_coef, scale: (n,), all in the
            math dtype (float32, float64 for float64 logits); ``scale`` already holds grad_output /
            temperature (0 on ignored rows, NaN on rows whose unchecked target is outside [0, V)).
    """
    if logits.numel() == 0:
        return
    if backend == "triton":
        from .ce_vocab_parallel_triton import shard_grad_triton

        shard_grad_triton(logits, target_local, class_weight, lse, extra_coef, target_coef, scale,
                          smoothing_per_class, opts, tile_max)
    else:
        assert tile_max is None, "tile statistics come with the triton backend only"
        _shard_grad_torch(logits, target_local, class_weight, lse, extra_coef, target_coef, scale,
                          smoothing_per_class, opts)


def _shard_stats_torch(logits, target_local, class_weight, opts, out) -> None:
    z, _ = capped_logits(logits, 1.0 / opts.temperature, opts.softcap)
    row_max = z.amax(1)
    out[ROW_MAX] = row_max
    out[SUM_EXP] = torch.exp(z - row_max[:, None]).sum(1)
    here = target_local >= 0
    z_y = z.gather(1, target_local.clamp(min=0)[:, None])[:, 0]
    out[TARGET_LOGIT] = out[TARGET_STORED] = torch.where(here, z_y, 0.0)
    if opts.label_smoothing > 0.0:
        out[SUM_LOGITS] = (z * class_weight).sum(1) if class_weight is not None else z.sum(1)


def _shard_grad_torch(logits, target_local, class_weight, lse, extra_coef, target_coef, scale,
                      smoothing_per_class, opts) -> None:
    z, slope = capped_logits(logits, 1.0 / opts.temperature, opts.softcap, slope=True)
    p = torch.exp(z - lse[:, None])
    g = (target_coef + extra_coef)[:, None] * p
    here = target_local >= 0
    y = target_local.clamp(min=0)[:, None]
    p_y = p.gather(1, y)[:, 0]
    g_y = target_coef * (p_y - 1.0) + extra_coef * p_y  # p_y - 1 first, as the kernel
    g.scatter_(1, y, torch.where(here, g_y, g.gather(1, y)[:, 0])[:, None])
    if opts.label_smoothing > 0.0:
        g -= smoothing_per_class * (class_weight if class_weight is not None else 1.0)
    if slope is not None:
        g *= slope
    logits.copy_(torch.where(scale[:, None] != 0, g * scale[:, None], 0.0))
