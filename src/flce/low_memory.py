"""The precise low-memory mode (``linear_cross_entropy(..., low_memory=True)``): its autograd Function and
backward's vocabulary-block loop.

Forward runs the chunk loop without the weight gradient: per chunk of rows the logits GEMM, the CE kernel
(loss, lse, dlogits) and grad_input rows = dlogits @ W (K = V: one GEMM, rounded once). On Hopper in bf16
a chunk stores exp(logits) instead and needs no CE pass (``exp_logits.grads_chunk``, its float32 product
in the memory the plan leaves beside the buffer); if rows left that path's window, backward runs forward's
loop again on the standard path, and its blocks with that loop's lse. Backward recomputes the logits one
block of vocabulary columns at a time for all rows, overwrites them with their gradient from the saved lse
(``kernels/ce_block_*``), and writes grad_weight[block] = dz^T @ x: one GEMM over every row, float32
inside, rounded once into the weight's dtype; an unconfident target's one-hot term stays out of the 16-bit
dz and is subtracted from its row in float32 after that GEMM (``target_rows_apart``: in dz it would carry
the rounding of the mean's scale on every target). Four GEMMs in all, two exact gradients, and at most a
small buffer plus the per-row lse above the gradients (``low_memory_plan.py``): the first, widest blocks
keep their dz in grad_weight's rows not yet written. With reduction="none", grad_input's rows scale
linearly with the per-row grad_output, and the block kernel takes it per row: nothing is recomputed twice.

Where the plan finds room (``LowMemoryPlan.forward_cols``; a mean or sum), forward allocates
grad_weight's storage itself: its chunks' logits go at its start (after the weight's cast copy under
autocast), and the first k rows of grad_weight, summed over the chunks in float32, at its end (a trainable
bias's first k entries in a (k,) sum beside it). Backward rounds that sum times grad_output into those rows
and recomputes the logits of the other columns only (a quarter of a GEMM less at 8192 x 4096 x 128256). The
peak stays the same: forward's buffer already took grad_weight's size.
"""

from __future__ import annotations

import torch

from .function import LoopMemory, LoopSpec
from .gemm import column_sums_into, linear_into, mm_into, padded_width
from .kernels import math_dtype
from .kernels.ce_block_torch import RowTerms, ce_block_torch
from .kernels.scale import scale_into
from .kernels.target_rows_torch import subtract_target_rows_torch
from .low_memory_plan import LowMemoryPlan, plan_low_memory
from .options import LossOptions


def low_memory_plan(n_rows: int, input: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype,
                    chunk_size: int | None, reduction: str) -> LowMemoryPlan:
    """``plan_low_memory`` for these tensors (whether backward allocates grad_weight, whether autocast casts
    them, whether forward may take a share of grad_weight)."""
    grad = torch.is_grad_enabled()
    return plan_low_memory(n_rows, weight.shape[0], weight.shape[1], compute_dtype, weight.dtype,
                           weight_grad=grad and weight.requires_grad,
                           weight_cast=weight.dtype != compute_dtype, input_cast=input.dtype != compute_dtype,
                           chunk_size=chunk_size,
                           forward_share=reduction != "none")


def check_low_memory(low_memory: object, accum_dtype: torch.dtype | None) -> None:
    """The mode's switch is a bool, and it has no accumulator to choose."""
    if not isinstance(low_memory, bool):
        raise TypeError(f"low_memory must be a bool, got {low_memory!r}")
    if low_memory and accum_dtype is not None:
        raise ValueError("accum_dtype cannot be combined with low_memory=True: its grad_weight needs no "
                         "accumulator (one GEMM per vocabulary block over all rows, rounded once)")


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def block_logits_grad(x: torch.Tensor, w_block: torch.Tensor, b_block: torch.Tensor | None, out: torch.Tensor,
                      col_start: int, vocab: int, terms: RowTerms, opts: LossOptions, backend: str) -> None:
    """out (n, C) = the gradient of the loss w.r.t. the logits x @ w_block^T (+ b_block) of vocabulary
    columns [col_start, col_start + C), times the rows' grad_scale (``terms``). On Hopper one GEMM with
    the gradient in its epilogue; elsewhere the GEMM, then the block kernel over its output."""
    if backend == "triton":
        from .kernels import block_gemm_triton

        if block_gemm_triton.supported(x, w_block, b_block, out):
            block_gemm_triton.block_logits_grad_triton(x, w_block, b_block, out, col_start, vocab, terms, opts)
            return
    linear_into(out, x, w_block.t(), b_block)  # rounded as forward's logits (``function.chunk_logits``)
    if backend == "triton":
        from .kernels.ce_block_triton import ce_block_triton

        ce_block_triton(out, col_start, vocab, terms, opts)
    else:
        ce_block_torch(out, col_start, vocab, terms, opts)


def target_rows_apart(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, terms: RowTerms,
                      opts: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' one-hot term stays out of the blocks' 16-bit dz: (target_col (n,) int32, the target where
    dz keeps it and -1 where not; coef (n,) float32, that term's coefficient where not, else 0).

    In dz, -scale * target_coef at every likely target carries the same rounding of the scale (1 / count
    times grad_output): up to 1.7x the bf16 rounding of grad_weight where it rounds badly. Kept apart, it is
    subtracted from the block's rows of grad_weight in float32 (``subtract_target_rows``). A confident target
    (p_y >= 1/2) keeps it in dz, where p_y - 1 is exact and nothing cancels. p_y from a 16-bit dot of x_r with
    W[y_r] (in row pieces within the mode's budget): only the choice depends on it. No softcap (its slope at the
    target would be needed). x: (n, H) in the compute dtype; weight (V, H); bias (V,) or None."""
    target, lse, class_weight, _, grad_scale = terms[:5]
    n, hidden = x.shape
    valid = (target != opts.ignore_index) & (target >= 0) & (target < weight.shape[0])
    y = torch.where(valid, target, 0)
    z_y = torch.empty(n, dtype=torch.float32, device=x.device)  # written piece by piece
    piece = max(1, (1 << 22) // max(hidden, 1))  # 8 MiB of gathered bf16 rows at a time
    for start in range(0, n, piece):
        rows = slice(start, start + piece)
        z_y[rows] = torch.linalg.vecdot(x[rows], _as_dtype(weight[y[rows]], x.dtype))
    if bias is not None:
        z_y += bias[y].float()
    confident = (z_y / opts.temperature - lse.float()) >= -0.6931471805599453  # p_y >= 1/2
    keep = confident | ~valid
    target_col = torch.where(keep, target, -1).to(torch.int32)
    w_y = class_weight[y].float() if class_weight is not None else 1.0
    coef = torch.where(keep, 0.0, (1.0 - opts.label_smoothing) * w_y * grad_scale.float() / opts.temperature)
    return target_col, coef


def weight_grad_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, terms: RowTerms,
                       need_w: bool, need_b: bool, spec: LoopSpec, grad_w: torch.Tensor | None = None,
                       first: int = 0, grad_b: torch.Tensor | None = None, coef: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_weight (V, H) in the weight's dtype and grad_bias (V,) in the math dtype, block by block of
    vocabulary columns (``spec.plan.blocks``) from column ``first`` (entries before it are written already, into
    the given ``grad_w`` and ``grad_b``), each from all n rows at once. x: (n, H), weight: (V, H). A block's
    dlogits (and its weight rows cast under autocast) go in grad_weight's rows that later blocks write, where
    the plan found room, else in the budget's buffer. With ``terms.target_col``, the one-hot terms that dz
    leaves out (coefficients ``coef``, ``target_rows_apart``) are subtracted after each block's GEMM."""
    opts, plan, compute_dtype, backend = spec.opts, spec.plan, spec.compute_dtype, spec.backend
    n, hidden = x.shape
    vocab = weight.shape[0]
    if grad_w is None and need_w:
        grad_w = torch.empty(vocab, hidden, dtype=weight.dtype, device=x.device)
    if grad_b is None and need_b:
        grad_b = torch.empty(vocab, dtype=math_dtype(compute_dtype), device=x.device)
    if n == 0:
        return tuple(None if g is None else g.zero_() for g in (grad_w, grad_b))
    x_c = _as_dtype(x, compute_dtype)
    apart = None if terms.target_col is None else _sorted_apart_targets(terms, vocab)
    if apart is not None:
        sorted_keys, order = apart
        unit = torch.ones((), dtype=torch.float32, device=x.device)  # coef holds the whole scale
        bias_x = x_c.new_ones(n, 1) if grad_b is not None else None  # a bias is a weight on 1
    storage = None if grad_w is None else grad_w.view(-1).view(torch.uint8)
    buffer = None
    for start, end, scratch in plan.blocks(vocab, borrow=grad_w is not None, start=first):
        cols = end - start
        if scratch is None:
            width = padded_width(cols, compute_dtype.itemsize)  # padded rows (the last block may be odd)
            if buffer is None:  # allocated only for the blocks the borrowed room could not take
                buffer = torch.empty(n * width, dtype=compute_dtype, device=x.device)
            dz = buffer[: n * width].view(n, width)[:, :cols]
            w_block = _as_dtype(weight[start:end], compute_dtype)
        else:
            dz = _borrow(storage, scratch, (n, cols), compute_dtype)
            w_block = weight[start:end]
            if w_block.dtype != compute_dtype:
                w_block = _borrow(storage, scratch + dz.nbytes, (cols, hidden), compute_dtype).copy_(w_block)
        block_logits_grad(x_c, w_block, None if bias is None else bias[start:end], dz, start, vocab, terms, opts,
                          backend)
        if grad_w is not None:
            mm_into(grad_w[start:end], dz.t(), x_c, accumulate=False)
        if grad_b is not None:
            column_sums_into(grad_b[start:end], dz, accumulate=False)
        if apart is not None:
            # In sorted order each block's targets are one stretch; the others are marked past its end.
            keys = torch.where((sorted_keys >= start) & (sorted_keys < end), sorted_keys - start, cols)
            if grad_w is not None:
                _subtract_target_rows(grad_w[start:end], x_c, keys, order, coef, unit, backend)
            if grad_b is not None:
                _subtract_target_rows(grad_b[start:end, None], bias_x, keys, order, coef, unit, backend)
    return grad_w, grad_b


def _sorted_apart_targets(terms: RowTerms, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets whose one-hot term stays out of dz, sorted (int32; V for the other rows), and their order."""
    keys = torch.where(terms.target_col < 0, terms.target, vocab).to(torch.int32)
    return torch.sort(keys, stable=True)


def _subtract_target_rows(grad: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, order: torch.Tensor,
                          coef: torch.Tensor, scale: torch.Tensor, backend: str) -> None:
    if backend == "triton":
        from .kernels.exp_rows_triton import subtract_target_rows

        subtract_target_rows(grad, x, keys, coef, scale, order)
    else:
        subtract_target_rows_torch(grad, x, keys, coef, scale, order)


def _borrow(storage: torch.Tensor, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``dtype`` over the bytes of ``storage`` (uint8) from ``offset``."""
    size = shape[0] * shape[1] * dtype.itemsize
    return storage[offset: offset + size].view(dtype).view(shape)


_CONSUMED = (
    "flce low_memory: backward ran twice through the same graph. grad_input is computed in forward and "
    "handed over once; run the forward again."
)
_NOT_TWICE = (
    "flce low_memory: the fused loss is not twice differentiable; call backward without create_graph=True "
    "(or use a materialized-logits loss for higher-order gradients)."
)


class LowMemoryFunction(torch.autograd.Function):
    """``LinearCrossEntropyFunction``'s inputs and outputs (loop, spec with a ``LowMemoryPlan``, x, weight,
    bias, target, class_weight, weight_sum, grad_scale, target_check), with grad_weight and grad_bias
    computed in backward by the vocabulary-block loop."""

    @staticmethod
    def forward(ctx, loop, spec, x, weight, bias, target, class_weight, weight_sum, grad_scale, target_check):
        ctx.set_materialize_grads(False)
        needs = tuple(ctx.needs_input_grad[2:5])
        memory = _forward_memory(spec, weight, needs[2]) if needs[1] and grad_scale is not None else None
        # grad_input (and a share of grad_weight and grad_bias) in forward, times the reduction's scale (1 for
        # 'none': backward scales grad_input's rows).
        fwd_scale = _forward_scale(grad_scale, spec, x.device) if needs[0] or memory else None
        share = memory is not None
        parts, grads = loop(x, weight, bias, target, class_weight, weight_sum, fwd_scale,
                            (needs[0], share, share and needs[2]), spec, memory=memory[1] if memory else None)
        ctx.grad_input, ctx.window, ctx.exact_lse = grads.input, grads.window, parts.exact_lse
        # grad_weight's storage, the share's sums
        ctx.share = (memory[0], grads.weight, grads.bias, grads.scale) if memory else None
        ctx.consumed = False
        ctx.meta = (loop, spec, needs, (x.dtype, weight.dtype, bias.dtype if bias is not None else None))
        ctx.target_check = target_check
        ctx.save_for_backward(x, weight, bias, target, class_weight, weight_sum, grad_scale, parts.lse)
        loss = parts.loss if grad_scale is None else parts.loss.sum() * grad_scale
        ctx.mark_non_differentiable(*(t for t in (parts.lse, parts.correct) if t is not None))
        return loss, parts.lse, parts.correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_correct):
        if grad_loss is None:  # only lse / correct were used: they carry no gradient
            ctx.share = None
            return (None,) * 10
        if torch.is_grad_enabled():
            raise RuntimeError(_NOT_TWICE)
        if ctx.consumed:
            raise RuntimeError(_CONSUMED)
        ctx.consumed = True
        loop, spec, needs, dtypes = ctx.meta
        x, weight, bias, target, class_weight, weight_sum, grad_scale, lse = ctx.saved_tensors
        grad_x, ctx.grad_input = ctx.grad_input, None
        (grad_w, share_sum, bias_share, share_scale), ctx.share = ctx.share or (None,) * 4, None
        g = _as_dtype(grad_loss, math_dtype(spec.compute_dtype))  # float64 stays float64
        if grad_scale is None:  # reduction='none': grad_output per row
            g = g.reshape(-1).contiguous()
            block_scale = g
        else:
            block_scale = grad_scale * g
        if grad_x is not None:
            grad_x = _scale_input_grad(grad_x, g, dtypes[0], spec)
        first, grad_b = 0, None
        if share_sum is not None:  # forward's share: its float32 sums times grad_output, rounded once
            first = share_sum.shape[0]
            g_share = g if share_scale is None else g * share_scale  # the scale's part not in forward's dz
            scale_into(share_sum, g_share, dtypes[1], spec.backend, out=grad_w[:first])
            share_sum = None  # the first blocks borrow its bytes (queued after this read)
            if bias_share is not None:
                grad_b = torch.empty(weight.shape[0], dtype=bias_share.dtype, device=x.device)
                torch.mul(bias_share, g_share, out=grad_b[:first])
        # After the exp-logits forward (a window check exists), or the logits stored less their tile max, the lse
        # is that of the unrounded logits; else of the logits rounded as stored.
        grad_w, grad_b = _weight_grads(x, weight, bias, target, class_weight, weight_sum, lse, block_scale, needs, spec,
                                       exact_lse=ctx.window is not None or ctx.exact_lse, grad_w=grad_w, first=first,
                                       grad_b=grad_b)
        if ctx.window is not None and ctx.window.missed():
            # Rows left the exp-logits window: forward again on the standard path, and the blocks again with its
            # lse (rare: the device then cools down). The first results go before forward's buffer comes back:
            # the mode's peak.
            grad_x = grad_w = grad_b = None  # forward's share too: grad_weight's storage goes
            parts, grads = loop(x, weight, bias, target, class_weight, weight_sum,
                                _forward_scale(grad_scale, spec, x.device), (True, False, False), spec)
            grad_x = _scale_input_grad(grads.input, g, dtypes[0], spec)
            grad_w, grad_b = _weight_grads(x, weight, bias, target, class_weight, weight_sum, parts.lse, block_scale,
                                           needs, spec, exact_lse=parts.exact_lse)
        if grad_b is not None:
            grad_b = _as_dtype(grad_b, dtypes[2])
        if ctx.target_check is not None:  # waits only now, with this backward's kernels already queued
            ctx.target_check.raise_if_bad()
        return None, None, grad_x, grad_w, grad_b, None, None, None, None, None


def _weight_grads(x, weight, bias, target, class_weight, weight_sum, lse, block_scale, needs, spec: LoopSpec,
                  exact_lse: bool = False, grad_w: torch.Tensor | None = None, first: int = 0,
                  grad_b: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward's vocabulary-block loop, where grad_weight or grad_bias is wanted."""
    if not (needs[1] or needs[2]):
        return None, None
    terms = RowTerms(target, lse, class_weight, weight_sum, block_scale, exact_lse)
    coef = None
    if spec.compute_dtype.itemsize == 2 and spec.opts.softcap is None and x.shape[0]:
        target_col, coef = target_rows_apart(_as_dtype(x, spec.compute_dtype), weight, bias, terms, spec.opts)
        terms = terms._replace(target_col=target_col)
    return weight_grad_blocks(x, weight, bias, terms, needs[1], needs[2], spec, grad_w, first, grad_b, coef)


def _forward_memory(spec: LoopSpec, weight: torch.Tensor, bias_grad: bool) -> tuple[torch.Tensor, LoopMemory] | None:
    """grad_weight (V, H), allocated now, and the loop's memory laid out in its bytes (``LowMemoryPlan``: the
    weight's cast copy under autocast from byte 0, the logits buffer from ``forward_buffer``, the share's sum
    from ``forward_offset``), with ``bias_grad`` the share's grad_bias sum (k,) beside it; None without a
    share."""
    plan = spec.plan
    if not plan.forward_cols:
        return None
    vocab, hidden = weight.shape
    grad_w = torch.empty(vocab, hidden, dtype=weight.dtype, device=weight.device)
    storage = grad_w.view(-1).view(torch.uint8)
    cast = _borrow(storage, 0, (vocab, hidden), spec.compute_dtype) if weight.dtype != spec.compute_dtype else None
    width = padded_width(vocab, spec.compute_dtype.itemsize)  # padded rows for the GEMM's stores
    buffer = _borrow(storage, plan.forward_buffer, (plan.rows, width), spec.compute_dtype)[:, :vocab]
    weight_sum = _borrow(storage, plan.forward_offset, (plan.forward_cols, hidden), math_dtype(spec.compute_dtype))
    bias_sum = torch.zeros(plan.forward_cols, dtype=weight_sum.dtype, device=weight.device) if bias_grad else None
    return grad_w, LoopMemory(buffer, weight_sum, cast, bias_sum)


def _forward_scale(grad_scale: torch.Tensor | None, spec: LoopSpec, device: torch.device) -> torch.Tensor:
    """The scale forward's grad_input carries: the reduction's, or 1 for reduction='none'."""
    return grad_scale if grad_scale is not None else torch.ones((), dtype=math_dtype(spec.compute_dtype),
                                                                device=device)


def _scale_input_grad(grad_x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, spec: LoopSpec) -> torch.Tensor:
    """grad_x times grad_output, in ``dtype`` (in place where grad_x has it): per row (n,) for reduction='none',
    else 0-d."""
    return scale_into(grad_x, g[:, None] if g.dim() == 1 else g, dtype, spec.backend)
