"""A loss without gradients (evaluation, ``torch.no_grad()``): no logits written at all.

On Hopper the logits GEMM keeps only its per-row tile statistics (``logits_triton.tile_stats``: max and
sum of exp(z - max) of each 256-column tile, from the unrounded float32 logits) and one row kernel
(``exp_rows_triton.loss_rows``) finishes each row: lse from the statistics, z at the target as a float32 dot
of x with the target's weight row, loss = w_y (lse - z_y) (+ z_loss lse^2; softcap and temperature on
both as the GEMM's epilogue applies them). Against the chunked path (each chunk's logits
stored, then read back by the CE kernel) this saves a write and a read of every logit (2 x 2.1 GB at
8192 x 128256 in bf16) and runs one GEMM over all rows instead of one per 2048-row chunk; the loss is that
of the unrounded logits. Options that need more of each row than its lse and target logit (label
smoothing, the statistics' accuracy) keep the chunked path.
"""

from __future__ import annotations

import torch

from .options import LossOptions


def try_run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
            class_weight: torch.Tensor | None, opts: LossOptions, loss: torch.Tensor, lse: torch.Tensor, *,
            compute_dtype: torch.dtype, backend: str, chunk_rows: int) -> bool:
    """``run`` where this path applies, and whether it did: the Triton backend on Hopper, no label smoothing
    (it needs every logit's sum), and the Hopper GEMM's conditions (``logits_triton.supported``: 16-bit
    floats, TMA-able layouts, enough rows) for x and w cast to ``compute_dtype`` (cast only then). A
    launch's statistics take no more memory than ``chunk_rows`` rows of logits (the caller's chunk plan).
    Shapes as in ``run``."""
    n, vocab = x.shape[0], w.shape[0]
    if backend != "triton" or opts.label_smoothing > 0.0 or n == 0 or vocab == 0:
        return False
    from .kernels import logits_triton

    if not logits_triton.hopper(x.device):
        return False
    x, w = (t if t.dtype == compute_dtype else t.to(compute_dtype) for t in (x, w))
    if not logits_triton.supported(x, w, bias):
        return False
    run(x, w, bias, target, class_weight, opts, loss, lse, budget=chunk_rows * vocab * compute_dtype.itemsize)
    return True


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        class_weight: torch.Tensor | None, opts: LossOptions, loss: torch.Tensor, lse: torch.Tensor,
        budget: int) -> None:
    """loss and lse (n,) float32 of every row (0 on ignored rows, NaN loss on an unchecked target outside
    [0, V)). x (n, H) and w (V, H) in the compute dtype, bias (V,) or None, target (n,) int64, class_weight
    (V,) float32 or None; ``budget``: bytes the tile statistics of one launch may take (the chunk plan's
    logits buffer: at 128256 columns a 512 MiB buffer holds 134k rows' statistics, so one launch in
    practice; the low-memory mode's 64 MiB, 16k rows). ``try_run`` checks that it applies."""
    from .kernels import logits_triton
    from .kernels.exp_rows_triton import loss_rows

    n, vocab = x.shape[0], w.shape[0]
    tiles = logits_triton.num_tiles(vocab)
    rows = max(budget // (2 * 4 * tiles), logits_triton.MIN_ROWS)
    stats = torch.empty(2, min(rows, n), tiles, dtype=torch.float32, device=x.device)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        part = slice(start, end) if end - start < n else slice(None)
        tile_max, tile_sum = stats[0, : end - start], stats[1, : end - start]
        logits_triton.tile_stats(x[part], w, bias, tile_max, tile_sum, opts)
        loss_rows(x[part], w, bias, target[part], class_weight, (tile_max, tile_sum), loss[part], lse[part], opts)
