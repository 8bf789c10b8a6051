"""The autograd Function and its chunk loop.

Forward, per chunk of rows: logits = x_c @ W^T (+ b) into one reused buffer; the CE kernel writes the
loss and overwrites the logits with their gradient; then grad_input rows = dlogits @ W and
grad_weight += dlogits^T @ x_c. Backward only multiplies by grad_output. For reduction="none" the
per-row grad_output is only known in backward, so there the loop runs again (logits recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import mm_into
from .kernels import ce_chunk
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
) -> tuple[LossParts, ChunkGrads]:
    """Run every chunk; gradients for ``needs`` = (input, weight, bias) when ``grad_scale`` is given.

    x: (n, H); weight: (V, H); bias: (V,) or None; target: (n,) int64.
    """
    n, hidden = x.shape
    vocab = weight.shape[0]
    dev = x.device
    w = weight.to(compute_dtype)  # no copy unless autocast asks for a narrower dtype
    grad = grad_scale is not None
    need_x, need_w, need_b = (grad and k for k in needs)

    parts = LossParts(
        loss=torch.empty(n, dtype=torch.float32, device=dev),
        lse=torch.empty(n, dtype=torch.float32, device=dev),
        correct=torch.empty(n, dtype=torch.float32, device=dev) if want_correct else None,
    )
    grads = ChunkGrads(
        input=torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None,
        weight=torch.empty(vocab, hidden, dtype=plan.accum_dtype, device=dev) if need_w else None,
        bias=torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None,
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
        scale = grad_scale[start:end] if grad and grad_scale.dim() == 1 else grad_scale
        ce_chunk(
            backend,
            logits,
            target[start:end],
            parts.loss[start:end],
            parts.lse[start:end],
            parts.correct[start:end] if want_correct else None,
            class_weight,
            weight_sum,
            scale if grad else None,
            opts,
        )
        if need_x:
            mm_into(grads.input[start:end], logits, w, accumulate=False)
        if need_w:
            mm_into(grads.weight, logits.t(), x_c, accumulate=i > 0)
        if need_b:
            grads.bias += logits.sum(0, dtype=torch.float32)
    return parts, grads


def scale_grad(g: torch.Tensor | None, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """g * grad_output in ``dtype``: in place when the dtypes agree, else fused with the cast."""
    if g is None:
        return None
    if g.dtype == dtype:
        return g.mul_(grad_output)
    return torch.mul(g, grad_output, out=torch.empty(g.shape, dtype=dtype, device=g.device))


_CONSUMED = (
    "flce: backward ran twice through the same graph. The fused loss computes its gradients in forward "
    "and hands them over once; run the forward again (or use reduction='none', which recomputes)."
)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: x (n, H), weight (V, H), bias, target (n,), class_weight, weight_sum, grad_scale
    (0-d reduction scale, or None for reduction='none'), opts, plan, compute_dtype, backend,
    want_correct. Outputs: loss (0-d, or (n,) for 'none'), lse (n,), correct (n,) or empty."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, class_weight, weight_sum, grad_scale, opts, plan,
                compute_dtype, backend, want_correct):
        needs = tuple(ctx.needs_input_grad[:3])
        per_row = grad_scale is None
        parts, grads = chunk_loop(
            x, weight, bias, target, class_weight, weight_sum,
            None if per_row else grad_scale, needs, opts, plan, compute_dtype, backend, want_correct,
        )
        ctx.meta = (opts, plan, compute_dtype, backend, x.dtype, weight.dtype,
                    bias.dtype if bias is not None else None)
        if per_row:  # reduction="none": keep the inputs, recompute in backward
            ctx.save_for_backward(x, weight, bias, target, class_weight, weight_sum)
            loss = parts.loss
        else:
            ctx.grads = grads
            loss = parts.loss.sum() * grad_scale
        correct = parts.correct if parts.correct is not None else parts.loss.new_empty(0)
        ctx.mark_non_differentiable(parts.lse, correct)
        return loss, parts.lse, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_correct):
        opts, plan, compute_dtype, backend, x_dtype, w_dtype, b_dtype = ctx.meta
        if hasattr(ctx, "grads"):
            grads = ctx.grads
            if grads is None:
                raise RuntimeError(_CONSUMED)
            ctx.grads = None
            g = grad_loss.float()
        else:
            x, weight, bias, target, class_weight, weight_sum = ctx.saved_tensors
            _, grads = chunk_loop(
                x, weight, bias, target, class_weight, weight_sum, grad_loss.float().contiguous(),
                tuple(ctx.needs_input_grad[:3]), opts, plan, compute_dtype, backend,
            )
            g = torch.ones((), dtype=torch.float32, device=grad_loss.device)
        return (
            scale_grad(grads.input, g, x_dtype),
            scale_grad(grads.weight, g, w_dtype),
            scale_grad(grads.bias, g, b_dtype) if b_dtype is not None else None,
            None, None, None, None, None, None, None, None, None,
        )
