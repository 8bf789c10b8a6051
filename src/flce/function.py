"""The autograd Function and its chunk loop.

Forward, per chunk of rows: logits = x_c @ W^T (+ b) into one reused buffer; the CE kernel writes the
loss and overwrites the logits with their gradient; then grad_input rows = dlogits @ W and
grad_weight += dlogits^T @ x_c. Backward only multiplies by grad_output.

Two exceptions. With a single chunk (small batches) the two gradient GEMMs wait for backward, where
grad_output scales the small operand x_c instead of a whole (V, H) gradient afterwards. With
reduction="none" the per-row grad_output is only known in backward, so there the loop runs again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import mm_into
from .kernels import ce_chunk
from .kernels.scale import scale_into
from .options import LossOptions
from .planner import ChunkPlan


@dataclass
class ChunkGrads:
    """Gradients produced by the chunk loop, unscaled by grad_output; None where not needed."""

    input: torch.Tensor | None
    weight: torch.Tensor | None  # in the plan's accumulator dtype
    bias: torch.Tensor | None  # float32


@dataclass
class LossParts:
    """Per-row outputs of the chunk loop: (n,) float32 each; ``correct`` only when asked for."""

    loss: torch.Tensor
    lse: torch.Tensor
    correct: torch.Tensor | None


@dataclass
class PendingGrads:
    """A single chunk's d loss / d logits (n, V) and GEMM operands, kept for backward's two GEMMs."""

    dlogits: torch.Tensor
    x: torch.Tensor  # (n, H) in the compute dtype
    w: torch.Tensor  # (V, H) in the compute dtype


def gradient_gemms(dl, x_c, w, grads: ChunkGrads, rows: slice, accumulate: bool) -> None:
    """grad_input[rows] = dl @ w; grad_weight (+)= dl^T @ x_c; grad_bias += dl summed over rows."""
    if grads.input is not None:
        mm_into(grads.input[rows], dl, w, accumulate=False)
    if grads.weight is not None:
        mm_into(grads.weight, dl.t(), x_c, accumulate=accumulate)
    if grads.bias is not None:
        grads.bias += dl.sum(0, dtype=torch.float32)


def chunk_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    opts: LossOptions,
    plan: ChunkPlan,
    compute_dtype: torch.dtype,
    backend: str,
    want_correct: bool = False,
    defer: bool = False,
) -> tuple[LossParts, ChunkGrads | PendingGrads]:
    """Run every chunk; gradients for ``needs`` = (input, weight, bias) when ``grad_scale`` is given.

    x: (n, H); weight: (V, H); bias: (V,) or None; target: (n,) int64. ``defer`` (single chunk only)
    returns the chunk's dlogits instead of running the gradient GEMMs.
    """
    n, hidden = x.shape
    vocab = weight.shape[0]
    dev = x.device
    w = weight.to(compute_dtype)  # no copy unless autocast asks for a narrower dtype
    grad = grad_scale is not None
    need_x, need_w, need_b = (grad and k for k in needs)
    defer = defer and grad and plan.num_chunks == 1

    parts = LossParts(
        loss=torch.empty(n, dtype=torch.float32, device=dev),
        lse=torch.empty(n, dtype=torch.float32, device=dev),
        correct=torch.empty(n, dtype=torch.float32, device=dev) if want_correct else None,
    )
    grads = ChunkGrads(
        input=torch.empty_like(x, memory_format=torch.contiguous_format) if need_x and not defer else None,
        weight=torch.empty(vocab, hidden, dtype=plan.accum_dtype, device=dev) if need_w and not defer else None,
        bias=torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b and not defer else None,
    )
    if n == 0:
        if grads.weight is not None:
            grads.weight.zero_()
        return parts, grads

    buffer = torch.empty(plan.rows, vocab, dtype=compute_dtype, device=dev)
    for i, (start, end) in enumerate(plan.bounds()):
        x_c = x[start:end].to(compute_dtype)
        logits = buffer[: end - start]
        torch.mm(x_c, w.t(), out=logits)
        if bias is not None:
            logits.add_(bias)
        rows = slice(start, end)
        scale = grad_scale[rows] if grad and grad_scale.dim() == 1 else grad_scale
        ce_chunk(backend, logits, target[rows], parts.loss[rows], parts.lse[rows],
                 parts.correct[rows] if want_correct else None, class_weight, weight_sum,
                 scale if grad else None, opts)
        if defer:
            return parts, PendingGrads(dlogits=logits, x=x_c, w=w)
        gradient_gemms(logits, x_c, w, grads, rows, accumulate=i > 0)
    return parts, grads


# Below this many bytes of dlogits, grad_output scales dlogits in place: one launch instead of two
# (small batches are launch-bound); above it, scaling the smaller x_c moves fewer bytes.
FOLD_INTO_DLOGITS_BYTES = 32 << 20


def finish_pending(p: PendingGrads, g: torch.Tensor, needs, dtypes, backend) -> ChunkGrads:
    """Backward of a single-chunk forward: the two GEMMs, with grad_output folded into an operand."""
    x_dtype, w_dtype, b_dtype = dtypes
    dl, x, g_left = p.dlogits, p.x, g
    if dl.numel() * dl.element_size() <= FOLD_INTO_DLOGITS_BYTES:
        dl, g_left = dl.mul_(g), None
    elif needs[1]:
        x = scale_into(p.x, g, p.x.dtype, backend, out=torch.empty_like(p.x))
    grads = ChunkGrads(None, None, None)
    if needs[0]:
        grads.input = torch.empty(p.x.shape, dtype=x_dtype, device=p.x.device)
        mm_into(grads.input, dl, p.w, accumulate=False)
        if g_left is not None:
            scale_into(grads.input, g_left, x_dtype, backend)
    if needs[1]:
        grads.weight = torch.empty(p.w.shape, dtype=w_dtype, device=p.w.device)
        mm_into(grads.weight, dl.t(), x, accumulate=False)
    if needs[2]:
        b = dl.sum(0, dtype=torch.float32)
        grads.bias = (b if g_left is None else b * g_left).to(b_dtype)
    return grads


_CONSUMED = (
    "flce: backward ran twice through the same graph. The fused loss computes its gradients in forward "
    "and hands them over once; run the forward again (or use reduction='none', which recomputes)."
)


def finish_forward(ctx, parts: LossParts, grads, grad_scale: torch.Tensor | None, saved: tuple):
    """The forward's tail every fused Function shares: hand the gradients to backward (mean/sum), or
    keep ``saved`` to recompute with the per-row grad_output (reduction='none'); package the outputs."""
    if grad_scale is None:
        ctx.save_for_backward(*saved)
        loss = parts.loss
    else:
        ctx.grads = grads
        loss = parts.loss.sum() * grad_scale
    correct = parts.correct if parts.correct is not None else parts.loss.new_empty(0)
    ctx.mark_non_differentiable(parts.lse, correct)
    return loss, parts.lse, correct


def take_grads(ctx):
    """The gradients forward handed over, once; None when backward must recompute (reduction='none')."""
    if not hasattr(ctx, "grads"):
        return None
    grads, ctx.grads = ctx.grads, None
    if grads is None:
        raise RuntimeError(_CONSUMED)
    return grads


def scale_grads(grads: ChunkGrads, g: torch.Tensor | None, dtypes, backend: str = "torch") -> list:
    """(input, weight, bias) gradients times grad_output ``g`` (None: already scaled), in ``dtypes``."""
    return [None if t is None else (t.to(dt) if g is None else scale_into(t, g, dt, backend))
            for t, dt in zip((grads.input, grads.weight, grads.bias), dtypes)]


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: loop (``chunk_loop``, or a loop with its contract such as the grouped one), x (n, H),
    weight (V, H), bias, target (n,), class_weight, weight_sum, grad_scale (0-d reduction scale, or
    None for reduction='none'), opts, plan, compute_dtype, backend, want_correct, target_check (an
    object whose ``raise_if_bad()`` backward calls once its kernels are queued, or None).
    Outputs: loss (0-d, or per row for 'none'), lse, correct (or empty)."""

    @staticmethod
    def forward(ctx, loop, x, weight, bias, target, class_weight, weight_sum, grad_scale, opts, plan,
                compute_dtype, backend, want_correct, target_check):
        ctx.set_materialize_grads(False)  # lse and correct get no gradient: skip their zero tensors
        needs = tuple(ctx.needs_input_grad[1:4])
        parts, grads = loop(x, weight, bias, target, class_weight, weight_sum, grad_scale, needs, opts, plan,
                            compute_dtype, backend, want_correct, defer=True)
        ctx.meta = (loop, opts, plan, compute_dtype, backend, needs,
                    (x.dtype, weight.dtype, bias.dtype if bias is not None else None))
        ctx.target_check = target_check
        return finish_forward(ctx, parts, grads, grad_scale, (x, weight, bias, target, class_weight, weight_sum))

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_correct):
        loop, opts, plan, compute_dtype, backend, needs, dtypes = ctx.meta
        g = grad_loss.float()
        grads = take_grads(ctx)
        if isinstance(grads, PendingGrads):
            grads = finish_pending(grads, g, needs, dtypes, backend)
            g = None
        elif grads is None:  # reduction="none": run the loop again with the per-row grad_output
            _, grads = loop(*ctx.saved_tensors, g.contiguous(), needs, opts, plan, compute_dtype, backend)
            g = None
        out = scale_grads(grads, g, dtypes, backend)
        if ctx.target_check is not None:  # waits only now, with this backward's kernels already queued
            ctx.target_check.raise_if_bad()
        return None, *out, *([None] * 10)
