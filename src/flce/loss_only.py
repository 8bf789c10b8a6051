"""A loss without gradients (evaluation, ``torch.no_grad()``): no logits written at all.

On Hopper the logits GEMM keeps only its per-row tile statistics (``logits_triton.tile_stats``: max and
sum of exp(z - max) of each 256-column tile, from the unrounded float32 logits) and one row kernel
(``exp_rows_triton.loss_rows``) finishes each row: lse from the statistics, z at the target as a float32 dot
of x with the target's weight row, loss = w_y (lse - z_y) (+ z_loss lse^2; softcap and temperature on
both as the GEMM's epilogue applies them; label smoothing's sum_j c_j z_j from two thin GEMMs, see
``smoothing_sums``). Against the chunked path (each chunk's logits
stored, then read back by the CE kernel) this saves a write and a read of every logit (2 x 2.1 GB at
8192 x 128256 in bf16) and runs one GEMM over all rows instead of one per 2048-row chunk; the loss is that
of the unrounded logits. The accuracy statistics, and label smoothing where its sums do not pay
(``_smoothing_pays``), keep the chunked path.
"""

from __future__ import annotations

import torch

from .gemm import bmm_into, mm_new
from .options import LossOptions


def try_run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
            class_weight: torch.Tensor | None, opts: LossOptions, loss: torch.Tensor, lse: torch.Tensor, *,
            compute_dtype: torch.dtype, backend: str, chunk_rows: int) -> bool:
    """``run`` where this path applies, and whether it did: the Triton backend on Hopper, label smoothing
    only where ``_smoothing_pays``, and the Hopper GEMM's conditions (``logits_triton.supported``: 16-bit
    floats, TMA-able layouts, enough rows) for x and w cast to ``compute_dtype`` (cast only then). A
    launch's statistics take no more memory than ``chunk_rows`` rows of logits (the caller's chunk plan).
    Shapes as in ``run``."""
    n, vocab = x.shape[0], w.shape[0]
    if backend != "triton" or n == 0 or vocab == 0 or not _smoothing_pays(opts, n, x.shape[1]):
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
    sums = None
    for start in range(0, n, rows):
        end = min(start + rows, n)
        part = slice(start, end) if end - start < n else slice(None)
        tile_max, tile_sum = stats[0, : end - start], stats[1, : end - start]
        logits_triton.tile_stats(x[part], w, bias, tile_max, tile_sum, opts)
        if opts.label_smoothing > 0.0 and sums is None:  # launched behind the GEMM, which hides their latency
            sums = smoothing_sums(x, w, bias, class_weight, opts)
        loss_rows(x[part], w, bias, target[part], class_weight, (tile_max, tile_sum), loss[part], lse[part], opts,
                  None if sums is None else (sums[0][part], sums[1]))


def _smoothing_pays(opts: LossOptions, rows: int, hidden: int) -> bool:
    """Whether this path serves ``opts``'s label smoothing (trivially true without it): not with a softcap
    (a capped row's sum is not linear in x), and where the chunked path's logits round trip (4 n V bytes in
    16 bits) outweighs ``smoothing_sums``' pass over W (2 V H): n >= H / 2. Measured on an H100 at
    1024 x 4096 x 128256: 2.1 ms against the chunked path's 1.7, at 8192 rows 12.2 against 13.1."""
    if opts.label_smoothing == 0.0:
        return True
    return opts.softcap is None and 2 * rows >= hidden


def smoothing_sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, class_weight: torch.Tensor | None,
                   opts: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """What label smoothing needs of each row without its logits: sum_j c_j z_j (n,) and sum_j c_j (0-d),
    float32, c the class weights (ones without). Without a softcap z = (x W^T + b) / T is linear in x, so
    sum_j c_j z_j = (x . u + b . c) / T with u = W^T c (H,): two thin GEMMs with float32 results that read W
    and x once. Their 16-bit operands c and u enter as scaled pairs hi + lo (``_split``). Shapes as ``run``."""
    c = class_weight.float() if class_weight is not None else torch.ones(w.shape[0], device=x.device)
    pair, scale = _split(c, x.dtype)
    u = _split_k_mm(pair, w).sum(0).mul_(scale)
    pair, scale = _split(u, x.dtype)
    sum_z = mm_new(x, pair.t(), torch.float32).sum(1).mul_(scale)
    if bias is not None:
        sum_z += bias.float() @ c
    return sum_z.mul_(1.0 / opts.temperature), c.sum()


# Vocabulary rows per batch of ``_split_k_mm``: one GEMM over all 128256 rows leaves cuBLAS a (2, 4096)
# output to spread over the SMs; the sums then added 0.89 ms to the 1024 x 4096 x 128256 loss on an H100,
# 0.65 split (benchmark/NOTES.md, A loss without gradients).
SPLIT_K_ROWS = 2048


def _split_k_mm(pair: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """pair (2, V) @ w (V, H) in float32, its V split into batches of about SPLIT_K_ROWS summed here."""
    vocab = w.shape[0]
    splits = max(1, vocab // SPLIT_K_ROWS)
    head = splits * (vocab // splits)
    parts = torch.empty(splits, 2, w.shape[1], dtype=torch.float32, device=w.device)
    bmm_into(parts, pair[:, :head].unflatten(1, (splits, -1)).transpose(0, 1), w[:head].unflatten(0, (splits, -1)),
             accumulate=False)
    total = parts.sum(0)
    return total if head == vocab else total.add_(mm_new(pair[:, head:], w[head:], torch.float32))


def _split(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """v (k,) float32 as scale * (hi + lo): a (2, k) ``dtype`` pair, |hi| <= 1 (no fp16 overflow), and a 0-d
    float32 scale (on the device: no host sync). hi + lo keeps 16 bits of v's 24 in bf16, 22 in fp16."""
    scale = v.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    v = v / scale
    hi = v.to(dtype)
    return torch.stack([hi, (v - hi.float()).to(dtype)]), scale
