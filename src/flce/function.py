"""The autograd Function and its chunk loop.

Forward, per chunk of rows: logits = x_c @ W^T (+ b) into one reused buffer (a single chunk: the
GEMM's own output); the CE kernel writes the loss and overwrites the logits with their gradient; then
grad_input rows = dlogits @ W and grad_weight += dlogits^T @ x_c. Backward only multiplies by
grad_output. On Hopper the logits GEMM is flce's own (``kernels.logits_triton``): its epilogue hands
the CE kernel each row's softmax statistics, so the CE kernel reads the logits once, and each row's logit at
its target comes from a float32 dot. A single chunk below 256 rows, which cuBLAS multiplies, keeps its
logits in float32 (``wide_logits``); the CE kernel then writes the 16-bit dlogits beside them.

Two exceptions. With a single chunk (small batches) the two gradient GEMMs wait for backward, where
grad_output and the reduction's scale are applied where each gradient is rounded once: to the small
operand x_c for grad_weight, to grad_input's float32 product (dlogits stay unscaled); for a plain mean the
CE kernel also counts the targets and finishes the mean itself (``LoopSpec.counts``). With several
chunks dlogits stay unscaled too, the scale joining float32 products and sums (``unit_dlogits``); where a
16-bit operand takes part of it they take its power of two (``split_scale``). With reduction="none" the
per-row grad_output is only known in backward, so there the loop runs again.
A single chunk on Hopper in bf16 (1024 rows or more, the common options) goes further: its logits GEMM
stores exp(logits), a row kernel takes the loss and row coefficients from the GEMM's statistics, and
backward's GEMMs run on the exponentials with the rows scaled: no CE pass at all (``exp_logits.py``).
Several chunks (and the low-memory mode's forward chunks) take that path chunk by chunk where the plan
budgets their float32 grad_input product (``ChunkPlan.input_product_cols``), their weight gradient summed
from the exponentials; their window check goes back with the gradients (``ChunkGrads.window``) for
backward to read, and a miss there runs the loop again on the standard path.
A loss without gradients on Hopper stores no logits: the GEMM keeps its statistics alone
(``loss_only.py``).

Autograd's contracts: what backward reads of the caller's tensors (a single chunk's GEMM operands, or
every input for reduction="none") goes through ``save_for_backward``, so an in-place change between
forward and backward raises as in eager PyTorch; so does one of the weight (see ``finish_forward``).
Gradients computed in forward are those of the forward's values. The loss is differentiable once:
under ``create_graph=True`` the gradients come back wired to raise if they are differentiated again
(``first_order_only``), never a partial second derivative.
The arithmetic of the loss is float32 (float64 for float64 logits: ``kernels.math_dtype``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import exp_logits, loss_only
from .exp_logits import PendingExp
from .gemm import (bmm_into, column_sums_into, first_cols, linear_into, mm_into, mm_new, padded_rows,
                   supports_out_dtype)
from .kernels import ce_chunk, math_dtype
from .kernels.scale import scale_into
from .options import LossOptions
from .planner import ChunkPlan


@dataclass
class ChunkGrads:
    """Gradients produced by the chunk loop, unscaled by grad_output; None where not needed."""

    input: torch.Tensor | None
    weight: torch.Tensor | None  # in the plan's accumulator dtype
    bias: torch.Tensor | None  # in the math dtype (float32, or float64 for float64 logits)
    # Chunks that took the exp-logits path (``plan.input_product_cols``): if its check misses in backward,
    # grad_input must be recomputed with the path off (the low-memory Function does).
    window: exp_logits.WindowCheck | None = None
    # The reduction's scale not in the dlogits (``unit_dlogits``, ``split_scale``): in grad_input already, not yet
    # in weight and bias, whose float32 sums take it with grad_output in backward (``scale_grads``).
    scale: torch.Tensor | None = None


@dataclass
class LossParts:
    """Per-row outputs of the chunk loop: (n,) each, in the math dtype; ``correct`` only when asked for."""

    loss: torch.Tensor
    lse: torch.Tensor
    correct: torch.Tensor | None
    total: torch.Tensor | None = None  # the reduced loss, when the CE kernel finished the mean itself
    # Every chunk's lse came from its logits unrounded (the exp-logits path, the statistics-only GEMM of
    # ``loss_only``) or stored less their tile max (``logits_triton``): a kernel that recomputes the logits
    # should not round them (the low-memory blocks).
    exact_lse: bool = False


@dataclass
class PendingGrads:
    """A single chunk's d loss / d logits (n, V) and GEMM operands, kept for backward's two GEMMs.
    The Function keeps x and w through ``save_for_backward`` (version-checked), not here."""

    dlogits: torch.Tensor
    x: torch.Tensor | None  # (n, H) in the compute dtype
    w: torch.Tensor | None  # (V, H) in the compute dtype
    scale: torch.Tensor | None = None  # the reduction's 0-d scale, not in dlogits: backward applies it

    def finish(self, x_c: torch.Tensor, w: torch.Tensor, g: torch.Tensor, needs, dtypes, backend: str) -> ChunkGrads:
        """Backward's GEMMs (``finish_pending``); x_c, w: the forward's operands, from ``ctx.saved_tensors``."""
        return finish_pending(self, x_c, w, g, needs, dtypes, backend)


class LoopSpec(NamedTuple):
    """A chunk loop's settings: the loss, the chunk plan, the GEMMs' dtype, the CE backend, whether to
    compute per-row accuracy (``correct``), and ``counts``: None, or (3,) int64 zeros for a mean over a
    single deferred chunk, which the CE kernel then finishes itself (``kernels.ce_chunk``): it counts
    the targets into them and writes grad_scale (an output then) and the mean. ``entry``: the public
    function, named in errors. ``exp_path``: False keeps every chunk on the standard path (the exp-logits
    path's form depends on a device count, which a custom op's fixed outputs cannot follow). ``wide_logits``:
    False keeps a small single chunk's logits in the compute dtype (``wide_logits``): the low-memory mode's
    backward recomputes them so below the fused GEMM's rows, and its dz must see the logits its lse saw."""

    opts: LossOptions
    plan: ChunkPlan
    compute_dtype: torch.dtype
    backend: str
    want_correct: bool = False
    counts: torch.Tensor | None = None
    entry: str = "flce.linear_cross_entropy"
    exp_path: bool = True
    wide_logits: bool = True


class LoopMemory(NamedTuple):
    """Memory a caller lays out for the loop (the low-memory mode's forward, ``low_memory_plan``):
    ``buffer`` (plan.rows, V) for the chunks' logits, ``weight_sum`` (k, H) float32 (float64 for float64
    math) for the first k rows of grad_weight, summed over the chunks, ``weight`` (V, H) for the
    weight's copy in the compute dtype (autocast), or None, and ``bias_sum`` (k,) zeros in the math dtype
    for the first k entries of grad_bias, or None (no bias gradient)."""

    buffer: torch.Tensor
    weight_sum: torch.Tensor
    weight: torch.Tensor | None = None
    bias_sum: torch.Tensor | None = None


def gradient_gemms(dl, x_c, w, grads: ChunkGrads, rows: slice, accumulate: bool, backend: str = "torch",
                   row_scale: torch.Tensor | None = None, single: bool = False) -> None:
    """grad_input[rows] = dl @ w (times ``grads.scale``, if any, before its one rounding); grad_weight (+)=
    dl^T @ x_c; grad_bias += dl summed over rows (of the gradients' first rows only, where they have fewer
    than V: ``LoopMemory``). ``row_scale`` (c,): per-row factors not in dl (no bias then), applied to
    grad_input's float32 product and to x_c, the weight GEMM's operand. ``single``: a single chunk's rows."""
    if grads.input is not None:
        scale = grads.scale if row_scale is None else row_scale
        if scale is None:
            mm_into(_take(grads.input, rows), dl, w, accumulate=False)
        else:
            scaled_product_into(_take(grads.input, rows), dl, w, scale, backend, pieces=single)
    if grads.weight is not None:
        if row_scale is not None:
            x_c = scaled_operand(x_c, row_scale[:, None], backend)
        mm_into(grads.weight, first_cols(dl, grads.weight.shape[0]).t(), x_c, accumulate=accumulate)
    if grads.bias is not None:
        column_sums_into(grads.bias, first_cols(dl, grads.bias.shape[0]), accumulate=True)


def chunk_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    spec: LoopSpec,
    defer: bool = False,
    memory: LoopMemory | None = None,
) -> tuple[LossParts, ChunkGrads | PendingGrads]:
    """Run every chunk; gradients for ``needs`` = (input, weight, bias) when ``grad_scale`` is given.

    x: (n, H); weight: (V, H); bias: (V,) or None; target: (n,) int64. ``defer`` (single chunk only)
    returns the chunk's dlogits instead of running the gradient GEMMs. ``memory``: the logits buffer, and
    the sum that the weight gradient's first rows go in (then only those rows are computed).
    """
    opts, plan, compute_dtype, backend, want_correct, counts = spec[:6]
    n, hidden = x.shape
    vocab = weight.shape[0]
    dev = x.device
    if memory is not None and memory.weight is not None:  # autocast's copy, laid out by the caller
        w = memory.weight.copy_(weight)
    else:
        w = _as_dtype(weight, compute_dtype)  # no copy unless autocast asks for a narrower dtype
    grad = grad_scale is not None
    need_x, need_w, need_b = (grad and k for k in needs)
    defer = defer and grad and plan.num_chunks == 1

    acc = math_dtype(compute_dtype)
    parts = LossParts(
        loss=torch.empty(n, dtype=acc, device=dev),
        lse=torch.empty(n, dtype=acc, device=dev),
        correct=torch.empty(n, dtype=acc, device=dev) if want_correct else None,
        total=torch.empty((), dtype=acc, device=dev) if counts is not None else None,
    )
    assert counts is None or (defer and n), "the CE kernel finishes the mean only of a single deferred chunk"
    if defer:
        grads = None
    else:
        grads = ChunkGrads(
            input=torch.empty_like(x, memory_format=torch.contiguous_format, dtype=input_grad_dtype(
                x.dtype, compute_dtype)) if need_x else None,
            weight=None if not need_w else memory.weight_sum if memory is not None else torch.empty(
                vocab, hidden, dtype=plan.accum_dtype, device=dev),
            bias=None if not need_b else memory.bias_sum if memory is not None else torch.zeros(
                vocab, dtype=acc, device=dev),
        )
    if n == 0:
        if grads is None:
            grads = ChunkGrads(None, None, None)
        elif grads.weight is not None:
            grads.weight.zero_()
        return parts, grads

    if not grad and not want_correct and loss_only.try_run(x, w, bias, target, class_weight, opts, parts.loss,
                                                           parts.lse, compute_dtype=compute_dtype, backend=backend,
                                                           chunk_rows=plan.rows):
        parts.exact_lse = True  # statistics of the unrounded logits
        return parts, grads
    # One chunk: its GEMM allocates the logits (small batches are launch-bound: one host call fewer).
    buffer = memory.buffer if memory is not None else padded_rows(
        plan.rows, vocab, compute_dtype, dev) if plan.num_chunks > 1 else None
    row_scale = grad and grad_scale.dim() == 1
    # Chunks may store exp(logits) where the plan budgets their grad_input product: several chunks without a
    # bias gradient (as a single chunk), or the low-memory mode's forward (its share of grad_weight and
    # grad_bias in the caller's memory).
    exp_input = (spec.exp_path and plan.input_product_cols > 0 and (need_x or need_w)
                 and (memory is not None or not need_b) and hopper_gemms(backend, dev))
    ce_scale, pending_scale, row_residual = grad_scale, grad_scale, None
    if defer and counts is None:  # unscaled dlogits: backward applies the scale with grad_output
        ce_scale, pending_scale = unit_dlogits(grad_scale, opts.temperature)
    elif (grads is not None and not row_scale and not (exp_input and memory is not None)
          and _sums_take_scale(compute_dtype, grads)):
        # exp-logits chunks too: their sums take the same scale, so that any chunk may take either path
        ce_scale, grads.scale = unit_dlogits(grad_scale, opts.temperature)
    elif grads is not None and row_scale and grads.bias is None and compute_dtype.itemsize == 2:
        # reduction="none": a per-row grad_output (a masked mean's 1 / count on every row) splits per row
        ce_scale, row_residual = split_scale(grad_scale, opts.temperature)
    misses = window = None
    parts.exact_lse = True
    # The last chunk that the exp-logits path can take copies its window count out before its GEMMs: backward's
    # wait then leaves them and its own kernels queued (a copy after the loop would drain the device between steps).
    last_exp = max((i for i, (a, b) in enumerate(plan.bounds()) if b - a >= exp_logits.MIN_ROWS),
                   default=-1) if exp_input else -1
    for i, (start, end) in enumerate(plan.bounds()):
        # A chunk of all rows takes the tensors themselves: each slice is a dispatcher call.
        rows = slice(start, end) if end - start < n else slice(None)
        x_c = _as_dtype(_take(x, rows), compute_dtype)
        if defer and spec.exp_path and exp_logits.applies(x_c, w, bias, needs, grad_scale, opts, want_correct, backend):
            return parts, exp_logits.forward_chunk(x_c, w, bias, target, parts.loss, parts.lse, parts.total,
                                                   class_weight, weight_sum, grad_scale, opts, counts)
        out = _take(buffer, slice(None, end - start))
        if exp_input and exp_logits.eligible(x_c, w, bias, grad_scale, opts, want_correct, backend, out):
            if misses is None and not exp_logits.take_turn(dev):
                exp_input = False  # the device cools down after a miss: this call keeps the standard path
            else:
                misses = torch.zeros(1, dtype=torch.int32, device=dev) if misses is None else misses
                e = padded_rows(end - start, vocab, compute_dtype, dev) if out is None else out
                window = exp_logits.grads_chunk(x_c, w, bias, _take(target, rows), _take(parts.loss, rows),
                                                _take(parts.lse, rows), class_weight, grad_scale, opts, e, misses,
                                                _take(grads.input, rows), plan.input_product_cols, grads.weight,
                                                i > 0, grads.bias, sums_scale=ce_scale, check=i == last_exp)
                continue
        logits, tile_stats = chunk_logits(x_c, w, bias, out, opts, backend, wide=spec.wide_logits)
        parts.exact_lse &= tile_stats is not None
        dl = dlogits_buffer(logits, compute_dtype, backend) if grad else logits
        ce_chunk(backend, logits, _take(target, rows), _take(parts.loss, rows), _take(parts.lse, rows),
                 _take(parts.correct, rows), class_weight, weight_sum,
                 _take(ce_scale, rows) if row_scale else ce_scale, opts, counts, parts.total, tile_stats,
                 grad_out=dl, operands=None if tile_stats is None else (x_c, w, bias))
        if defer:
            return parts, PendingGrads(dlogits=dl, x=x_c, w=w, scale=pending_scale)
        gradient_gemms(dl, x_c, w, grads, rows, accumulate=i > 0, backend=backend,
                       row_scale=_take(row_residual, rows), single=plan.num_chunks == 1)
    if misses is not None:  # a count copied before a later chunk of the path added to it would be stale
        grads.window = window or exp_logits.WindowCheck(misses)
    return parts, grads


def hopper_gemms(backend: str, device: torch.device) -> bool:
    """Whether flce's Hopper GEMMs (and so the exp-logits path) can run on this device at all."""
    if backend != "triton":
        return False
    from .kernels import logits_triton

    return logits_triton.hopper(device)


# A single chunk's float32 product behind a scaled grad_input is made in pieces of rows of at most this size
# (it holds every row: 128 MiB at 8192 x 4096, +129 MiB on the peak in one piece). The chunk plan sizes
# other chunks with room for theirs (one piece: two cost +0.75% at 16384 x 4096 x 128256 on an H200).
PRODUCT_BYTES = 64 << 20


def scaled_product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                        backend: str, pieces: bool = False) -> torch.Tensor:
    """out = (a @ b) * scale, from float32 products rounded once into out's dtype (``pieces``: at most
    ``PRODUCT_BYTES`` at a time). 2-D operands with a 0-d scale or one per row (m,), or batched
    (G, m, k) @ (G, k, n) with a (G,) scale, one per product (out may be strided)."""
    rows = out.shape[-2]
    piece = max(1, min(rows, PRODUCT_BYTES // max(1, out[..., :1, :].numel() * 4)) if pieces else rows)
    for k in range(0, rows, piece):
        part = slice(k, k + piece)
        if a.dim() == 3:
            _scaled_piece(out[:, part], a[:, part], b, scale[:, None, None], backend)
        else:
            _scaled_piece(out[part], a[part], b, scale if scale.dim() == 0 else scale[part, None], backend)
    return out


def scaled_operand(x_c: torch.Tensor, scale: torch.Tensor, backend: str) -> torch.Tensor:
    """x_c * scale (0-d, or broadcast along one dim) as a new tensor in x_c's dtype and layout, rounded once:
    the small operand of a weight GEMM, where a scale that the 16-bit dlogits leave out meets it."""
    return scale_into(x_c, scale, x_c.dtype, backend, out=torch.empty_like(x_c))


def weight_grad_new(dl: torch.Tensor, x_c: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
                    backend: str) -> torch.Tensor:
    """dl.t() @ (x_c * g) as a new (V, H) tensor of ``dtype``, x_c * g rounded once to x_c's dtype. dl (n, V), x_c
    (n, H), g 0-d. At few rows one write-bound Triton launch (``thin_wgrad_triton``), else cuBLAS."""
    if backend == "triton" and g.dim() == 0 and dl.dtype == x_c.dtype and dl.dtype in _thin_dtypes(dl.device):
        from .kernels.thin_wgrad_triton import THIN_K, thin_wgrad_triton

        if dl.shape[0] <= THIN_K:
            out = torch.empty(dl.shape[1], x_c.shape[1], dtype=dtype, device=dl.device)
            return thin_wgrad_triton(dl, x_c, g, out)
    return mm_new(dl.t(), scaled_operand(x_c, g, backend), dtype)


def _thin_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
    return (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float16,)


def _scaled_piece(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, backend: str) -> None:
    wide = math_dtype(a.dtype)
    product = out if out.dtype == wide else torch.empty_like(out, dtype=wide)  # a dense out's layout
    (bmm_into if a.dim() == 3 else mm_into)(product, a, b, accumulate=False)
    if product.stride() == out.stride():
        scale_into(product, scale, out.dtype, backend, out=out)
    else:  # out is a strided piece: scaled in place, then one cast copy
        out.copy_(scale_into(product, scale, wide, backend))


def _sums_take_scale(compute_dtype: torch.dtype, grads: ChunkGrads) -> bool:
    """Whether 16-bit dlogits are left unscaled (``unit_dlogits``), the reduction's scale joining every gradient
    they feed in float32 (grad_input's product, a float32 weight sum, the bias sums). Folded into fp16 dlogits a
    mean's 1 / count (even only its power of two) sinks a softmax's tail below fp16's smallest normal (6.1e-5)
    before backward's grad_output (a GradScaler's) could lift it: 90-110x the fp16 rounding in both gradients
    at 8192 x 32 x 32000 in four chunks, where one chunk reads 1.0x (benchmark/NOTES.md)."""
    wanted = grads.input is not None or grads.weight is not None or grads.bias is not None
    return wanted and compute_dtype.itemsize == 2 and (grads.weight is None or grads.weight.dtype.itemsize > 2)


def input_grad_dtype(x_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a grad_input that forward computes, until backward applies grad_output: float32 beside fp16
    GEMMs, whose range the reduction's scale (a mean's 1 / count) would take before grad_output (a GradScaler's)
    could lift it back (3.8x the fp16 rounding at 8192 x 32 x 32000 in four chunks with grad_output 1024, 1.0x in
    float32); else x's (bf16 keeps float32's range)."""
    return torch.float32 if compute_dtype == torch.float16 else x_dtype


def split_scale(scale: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel scale, residual) for a loss ``scale`` (any shape, elementwise): the CE kernel's dlogits, which
    it scales by kernel scale / temperature, take a power of two; residual, in [1/2, 1) (1 for a zero scale),
    times that power is scale / temperature.

    For dlogits rounded before grad_output is known whose residual must meet a 16-bit operand (x_c, per row,
    or beside a 16-bit weight gradient); where only float32 products and sums take it, ``unit_dlogits``.
    Scaled there by a mean's 1 / count, every target entry (-scale, for the likely rows) would carry the
    same rounding of that scale: 2.2-2.4x the bf16 rounding in both gradients at counts that round badly
    (benchmark/NOTES.md); 1 / temperature likewise. A power of two scales exactly; the residual, near 1,
    meets the operand or the float32 products and sums instead."""
    mantissa, _ = torch.frexp(scale if temperature == 1.0 else scale / temperature)
    residual = torch.where(mantissa == 0, 1.0, mantissa)
    return scale / residual, residual  # exact at temperature 1: the quotient is a power of two


def unit_dlogits(scale: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel scale, pending scale) for dlogits left unscaled, the loss's ``scale`` and 1 / temperature
    (which the CE kernel would fold in) both applied later, in float32, with grad_output."""
    if temperature == 1.0:
        return torch.ones((), dtype=scale.dtype, device=scale.device), scale
    return torch.full((), temperature, dtype=scale.dtype, device=scale.device), scale / temperature


def settle_residual(grads: ChunkGrads, residual: torch.Tensor | None) -> None:
    """After the chunks of a loop whose dlogits left out part of the scale (``unit_dlogits``, ``split_scale``;
    grad_input has that residual): a float32 weight sum and the bias sums take it in backward, with grad_output
    (``grads.scale``); beside a 16-bit weight gradient (a single chunk's, whose x_c took it) the bias sums take
    it now."""
    if residual is None:
        return
    if grads.weight is None or grads.weight.dtype.itemsize > 2:
        grads.scale = residual
    elif grads.bias is not None:
        grads.bias *= _per_leading(residual, grads.bias)


# Chunks of fewer rows than this, alone in their call, that cuBLAS multiplies (the fused Triton GEMM takes
# 256 rows and more on Hopper) keep their logits in float32 where the GEMM writes them so (``wide_logits``).
# Rounded to 16 bits a logit is off by up to |z| / 256, which every gradient carries: at logit std 6, 6-9x the
# bf16 rounding of the exact gradients, as eager PyTorch's, against 1.3-1.7x in float32 (16-200 rows x 4096 x
# 128256; benchmark/NOTES.md, Float32 logits at small batches). The 16-bit dlogits then go to a buffer of their own.
WIDE_LOGITS_ROWS = 256


def wide_logits(x_c: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether a chunk's logits from 16-bit operands are kept in float32 (``WIDE_LOGITS_ROWS``): a chunk with no
    buffer given (a single one), where cuBLAS writes float32 from 16-bit operands (``gemm.supports_out_dtype``:
    CUDA; a CPU build would upcast the whole weight)."""
    return (out is None and x_c.shape[0] < WIDE_LOGITS_ROWS and x_c.dtype in (torch.bfloat16, torch.float16)
            and supports_out_dtype(x_c.device))


def dlogits_buffer(logits: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """Where a chunk's ``dtype`` dlogits go: over its logits, or beside float32 logits (``wide_logits``) into a new
    (n, V) buffer laid out as a single chunk's logits (rows 128-byte aligned for the row kernels)."""
    if logits.dtype == dtype:
        return logits
    if backend == "triton":
        return padded_rows(*logits.shape, dtype, logits.device)
    return torch.empty(logits.shape, dtype=dtype, device=logits.device)


def chunk_logits(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
                 opts: LossOptions, backend: str, sums: bool = True, wide: bool = False,
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """A chunk's logits x_c @ w^T (+ bias), (n, V), into ``out`` or a new tensor, and the CE kernel's
    (n, T) tile statistics when the fused Triton GEMM could compute them (``kernels.logits_triton``): the
    logits then hold r = logits / T less a shift per tile, which the tile maxima give; the tile sums only
    with ``sums``. ``wide``: new float32 logits where ``wide_logits`` says so."""
    if backend == "triton":
        from .kernels import logits_triton

        if logits_triton.supported(x_c, w, bias, out):
            n, vocab = x_c.shape[0], w.shape[0]
            logits = padded_rows(n, vocab, x_c.dtype, x_c.device) if out is None else out
            stats = torch.empty(1 + sums, n, logits_triton.num_tiles(vocab), dtype=torch.float32, device=x_c.device)
            tile_sum = stats[1] if sums else None
            logits_triton.logits_with_tile_stats(x_c, w, bias, logits, stats[0], tile_sum, opts)
            return logits, (stats[0], tile_sum)
    padded = backend == "triton"  # the row kernels' layout
    if out is None:
        dtype = torch.float32 if wide and wide_logits(x_c, out) else x_c.dtype
        if bias is None:
            return mm_new(x_c, w.t(), dtype, padded=padded), None
        n, vocab = x_c.shape[0], w.shape[0]
        out = padded_rows(n, vocab, dtype, x_c.device) if padded else x_c.new_empty(n, vocab, dtype=dtype)
    linear_into(out, x_c, w.t(), bias)
    return out, None


def _take(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """t[rows], without a dispatcher call when rows is everything (or t is None)."""
    if t is None or (rows.start is None and (rows.stop is None or rows.stop >= t.shape[0])):
        return t
    return t[rows]


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def finish_pending(p: PendingGrads, x_c: torch.Tensor, w: torch.Tensor, g: torch.Tensor, needs, dtypes,
                   backend) -> ChunkGrads:
    """Backward of a single-chunk forward: the two GEMMs, with grad_output g (times the mean's scale where
    the CE kernel left it out) applied where each gradient is rounded once: to the small operand x_c for
    grad_weight (at a large vocabulary one row dominates each target's gradient row: rounding it there is
    that row's one rounding), to grad_input's float32 product, to grad_bias's float32 sums. Scaling a
    rounded gradient, or the rounded dlogits, would round twice. x_c (n, H), w (V, H): the forward's GEMM
    operands, from ``ctx.saved_tensors``."""
    x_dtype, w_dtype, b_dtype = dtypes
    dl = p.dlogits
    if p.scale is not None:
        g = g * p.scale
    acc = math_dtype(dl.dtype)
    grads = ChunkGrads(None, None, None)
    if needs[0]:
        grads.input = scaled_product_into(torch.empty(x_c.shape, dtype=x_dtype, device=dl.device), dl, w, g, backend,
                                          pieces=True)
    if needs[1]:
        grads.weight = weight_grad_new(dl, x_c, g, w_dtype, backend)
    if needs[2]:
        b = column_sums_into(torch.empty(dl.shape[1], dtype=acc, device=dl.device), dl, accumulate=False)
        grads.bias = scale_into(b, g, b_dtype, backend)
    return grads


_CONSUMED = (
    "flce: backward ran twice through the same graph. The fused loss computes its gradients in forward "
    "and hands them over once; run the forward again (or use reduction='none', which recomputes)."
)


def finish_forward(ctx, parts: LossParts, grads, grad_scale: torch.Tensor | None, saved: tuple,
                   weight_as_used: torch.Tensor | None):
    """The forward's tail every fused Function shares: hand the gradients to backward (mean/sum), or
    keep ``saved`` to recompute with the per-row grad_output (reduction='none'); package the outputs.

    What eager F.linear would save goes through ``save_for_backward`` (version-checked): a single
    chunk's pending GEMM operands, which backward reads; else ``weight_as_used`` (the caller's weight
    when the GEMMs used it without a cast, else None), whose gradient forward computed already, so
    that an in-place change of it before backward raises as in eager (keeping it alive costs nothing)."""
    if grad_scale is None:
        ctx.save_for_backward(*saved)
        loss = parts.loss
    else:
        if isinstance(grads, (PendingGrads, PendingExp)):
            ctx.save_for_backward(grads.x, grads.w)
            grads.x = grads.w = None  # backward reads them from saved_tensors only
        elif grads.window is not None:  # exp-logits chunks: what the loop needs again if the window check misses
            ctx.save_for_backward(*saved)
            ctx.redo_scale = grad_scale
        else:
            ctx.save_for_backward(weight_as_used)
        ctx.grads = grads
        loss = parts.total if parts.total is not None else parts.loss.sum() * grad_scale
    # With stats and a reduction, the per-row losses too (the grouped loss reports each group's loss).
    rows = parts.loss if grad_scale is not None and parts.correct is not None else None
    ctx.mark_non_differentiable(*(t for t in (parts.lse, parts.correct, rows) if t is not None))
    return loss, parts.lse, parts.correct, rows


def take_grads(ctx):
    """The gradients forward handed over, once; None when backward must recompute (reduction='none')."""
    if not hasattr(ctx, "grads"):
        return None
    grads, ctx.grads = ctx.grads, None
    if grads is None:
        raise RuntimeError(_CONSUMED)
    return grads


def release(ctx) -> None:
    """Drop the gradients forward handed over (backward got no gradient to pass on)."""
    if hasattr(ctx, "grads"):
        ctx.grads = None


def not_twice_differentiable(backward):
    """Decorates a fused Function's backward ``(ctx, *grad_outputs)``. Under create_graph=True its
    gradients are computed outside autograd and returned through ``_FirstOrderOnly``: using them is
    fine, differentiating them again raises (``ctx.entry`` names the function in the error)."""

    @functools.wraps(backward)
    def run(ctx, *grad_outputs):
        if not torch.is_grad_enabled():
            return backward(ctx, *grad_outputs)
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        return first_order_only(grads, ctx.entry)

    return run


def first_order_only(grads, entry: str) -> tuple:
    """``grads`` (tensors and Nones) as outputs of a node whose backward raises a clear error."""
    present = [g for g in grads if isinstance(g, torch.Tensor)]
    if not present:
        return tuple(grads)
    # A fresh leaf that requires grad makes the outputs require grad, so a second derivative reaches the node.
    wired = iter(_FirstOrderOnly.apply(entry, torch.empty(0, requires_grad=True), *present))
    return tuple(next(wired) if isinstance(g, torch.Tensor) else g for g in grads)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes gradients through (as views); its backward is reached only by a second derivative."""

    @staticmethod
    def forward(ctx, entry, _anchor, *grads):
        ctx.entry = entry
        return grads

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.entry} is not twice differentiable: its gradients come from fused kernels that autograd "
            "cannot differentiate again (create_graph=True for a gradient penalty, a Hessian-vector product, "
            "...). Compute that loss with torch ops (F.linear and F.cross_entropy) instead.")


def scale_grads(grads: ChunkGrads, g: torch.Tensor | None, dtypes, backend: str = "torch",
                fresh: bool = False) -> list:
    """(input, weight, bias) gradients times grad_output ``g`` (None: already scaled), in ``dtypes``; weight
    and bias also times ``grads.scale`` (already in grad_input). A gradient already in its dtype is scaled in
    place unless ``fresh`` (a custom op's outputs must not alias its inputs)."""
    assert g is not None or grads.scale is None, "the residual scale comes with grad_output"
    g_sums = g if g is None or grads.scale is None else g * grads.scale
    return [None if t is None else (_as_dtype(t, dt) if s is None else scale_into(
        t, _per_leading(s, t), dt, backend, out=torch.empty(t.shape, dtype=dt, device=t.device) if fresh else None))
        for t, dt, s in zip((grads.input, grads.weight, grads.bias), dtypes, (g, g_sums, g_sums))]


def _per_leading(scale: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A 0-d scale as is; a (G,) one (the grouped loss's per-head residual) shaped to scale t's leading dim."""
    return scale if scale.dim() == 0 else scale.view(-1, *(1,) * (t.dim() - 1))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: loop (``chunk_loop``, or a loop with its contract such as the grouped one), spec (its
    ``LoopSpec``), x (n, H), weight (V, H), bias, target (n,), class_weight, weight_sum, grad_scale (0-d
    reduction scale, or None for reduction='none'), target_check (an object whose ``raise_if_bad()``
    backward calls once its kernels are queued, or None).
    Outputs: loss (0-d, or per row for 'none'), lse, correct (None unless ``spec.want_correct``), and the
    per-row losses when ``spec.want_correct`` and a reduction (else None); all but the loss
    non-differentiable."""

    @staticmethod
    def forward(ctx, loop, spec, x, weight, bias, target, class_weight, weight_sum, grad_scale, target_check):
        ctx.set_materialize_grads(False)  # lse and correct get no gradient: skip their zero tensors
        needs = tuple(ctx.needs_input_grad[2:5])
        parts, grads = loop(x, weight, bias, target, class_weight, weight_sum, grad_scale, needs, spec, defer=True)
        ctx.meta = (loop, spec, needs, (x.dtype, weight.dtype, bias.dtype if bias is not None else None))
        ctx.target_check = target_check
        ctx.entry = spec.entry
        return finish_forward(ctx, parts, grads, grad_scale, (x, weight, bias, target, class_weight, weight_sum),
                              weight if weight.dtype == spec.compute_dtype else None)

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_loss, _grad_lse, _grad_correct, _grad_rows):
        loop, spec, needs, dtypes = ctx.meta
        if grad_loss is None:  # an undefined gradient is a zero one: nothing to pass on
            release(ctx)
            out = [None, None, None]
        else:
            out = _input_grads(ctx, loop, spec, needs, dtypes, _as_dtype(grad_loss, math_dtype(spec.compute_dtype)))
        if ctx.target_check is not None:  # waits only now, with this backward's kernels already queued
            ctx.target_check.raise_if_bad()
        return None, None, *out, None, None, None, None, None


def redo_standard(p: PendingExp, x_c: torch.Tensor, w: torch.Tensor, spec: LoopSpec) -> PendingGrads:
    """The single chunk's dlogits as the standard path makes them (rows left the exp-logits window),
    unscaled (``finish_pending`` applies the reduction's scale); forward's loss and lse stand."""
    bias, class_weight, weight_sum = p.redo
    logits, tile_stats = chunk_logits(x_c, w, bias, p.e, spec.opts, spec.backend)
    rows = torch.empty(2, x_c.shape[0], dtype=torch.float32, device=x_c.device)  # loss and lse, not used
    unscaled, scale = unit_dlogits(p.scale, spec.opts.temperature)
    ce_chunk(spec.backend, logits, p.target, rows[0], rows[1], None, class_weight, weight_sum, unscaled, spec.opts,
             tile_stats=tile_stats)
    return PendingGrads(dlogits=logits, x=None, w=None, scale=scale)


def _input_grads(ctx, loop, spec: LoopSpec, needs, dtypes, g: torch.Tensor) -> list:
    """(input, weight, bias) gradients for grad_output g (0-d, or per row for reduction='none')."""
    grads = take_grads(ctx)
    saved = ctx.saved_tensors  # raises if the caller changed one in place since forward
    if isinstance(grads, PendingExp):
        done = exp_logits.finish(grads, *saved, g, needs, dtypes)
        grads = ChunkGrads(*done, None) if done is not None else finish_pending(
            redo_standard(grads, *saved, spec), *saved, g, needs, dtypes, spec.backend)
        g = None
    elif isinstance(grads, PendingGrads):
        grads = grads.finish(*saved, g, needs, dtypes, spec.backend)
        g = None
    elif grads is None:  # reduction="none": run the loop again with the per-row grad_output
        _, grads = loop(*saved, g.contiguous(), needs, spec)
        g = None
    elif grads.window is not None:  # exp-logits chunks: the check waits with backward's kernels queued
        window, out = grads.window, scale_grads(grads, g, dtypes, spec.backend)
        del grads  # the accumulator goes before a second loop allocates its own
        if not window.missed():
            return out
        out = None
        _, grads = loop(*saved, ctx.redo_scale, needs, spec)  # the device now cools down: the standard path
    return scale_grads(grads, g, dtypes, spec.backend)
