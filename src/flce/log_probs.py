"""Per-token log-probabilities, entropy and friends of a linear head, without materializing the logits.

What policy-gradient losses (PPO, GRPO, DPO, ...) and TRL's fused LM head (``flce.patches.trl``) need:
for each token, the log-probability of its target and, on request, the entropy of its distribution and
three diagnostics. Same logit model as :func:`flce.linear_cross_entropy`.

Forward, chunk by chunk: logits = x_c @ W^T (+ b) into one reused buffer, then one read of them by the
statistics kernel (``kernels.token_stats``). Backward gets any per-token grad_output of the log-probs
and of the entropy, so it recomputes each chunk's logits, overwrites them with their gradient and runs
the two gradient GEMMs (grad_weight accumulated in float32 across chunks, see ``planner``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .api import _check_tensors, _compute_dtype, _is_dtensor, _raise_bad_targets
from .function import ChunkGrads, gradient_gemms
from .kernels import resolve_backend
from .kernels import token_stats as kernels
from .kernels.targets import count_targets
from .kernels.token_stats import FIELDS, RowStats, Transform
from .options import LossOptions, check_run_options
from .planner import plan_chunks, weight_grad_hidden


class TokenStats(NamedTuple):
    """Per-token results of :func:`linear_log_probs`, each shaped like ``target``; 0 (False) at ignored
    tokens; None for a field not asked for in ``outputs``.

    log_probs: float32, log p(target) = z_target - logsumexp(z); differentiable.
    entropy: float32, -sum_j p_j log p_j of the token's distribution; differentiable.
    log_sum_sq_probs: float32, log(sum_j p_j^2) (collision entropy, negated); no gradient.
    mean_logits: float32, mean over the vocabulary of z (after temperature and softcap); no gradient.
    is_top1: bool, whether the target is the argmax of z (the first index wins ties).
    """

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


class LogProbsSpec(NamedTuple):
    """A call's settings: the logit transform, the fields wanted, the GEMMs' dtype, the kernels' backend,
    rows per chunk (None: planner), and ``gather``: None, or ``gather(weight, bias)`` -> a context manager
    that backward enters before reading the weight (DeepSpeed ZeRO-3 frees it after forward)."""

    tf: Transform
    want: frozenset
    compute_dtype: torch.dtype
    backend: str
    chunk_size: int | None = None
    gather: Callable | None = None


@torch.compiler.disable  # data-dependent control flow and Triton launches: one graph break, exact result
def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    outputs: Iterable[str] = ("log_probs", "entropy"),
    chunk_size: int | None = None,
    backend: str = "auto",
    validate_target: bool = True,
) -> TokenStats:
    """Per-token statistics of ``z = softcap(input @ linear_weight.T + linear_bias) / temperature)`` at
    ``target``, without materializing the [tokens, vocab] logits.

    ``r = logits / temperature``, ``z = softcap * tanh(r / softcap)`` (``z = r`` without softcap),
    ``p = softmax(z)``: the logit model of :func:`flce.linear_cross_entropy`, whose per-token loss is
    ``-log_probs``.

    Args:
        input: (..., H) hidden states. linear_weight: (V, H). target: (...) class indices.
        linear_bias: (V,) or None.
        ignore_index: tokens with this target get 0 in every field and no gradient.
        outputs: names among ``flce.TokenStats``' fields ("log_probs", "entropy", "log_sum_sq_probs",
            "mean_logits", "is_top1") to compute; the others come back as None.
        chunk_size: rows per chunk (None: from a memory budget, see planner).
        backend: "auto" (triton on CUDA, torch elsewhere), "triton" or "torch".
        validate_target: raise a ValueError for targets outside [0, V) (one host sync, which also drops
            ignored tokens before the GEMMs). False makes the call sync-free: targets are trusted, and
            one outside [0, V) gives NaN in its row.

    Returns:
        :class:`TokenStats` of tensors shaped like ``target``. ``log_probs`` and ``entropy`` take any
        grad_output: backward recomputes the logits chunk by chunk (four GEMMs in all) and returns
        gradients for input, linear_weight and linear_bias in their own dtypes.
    """
    tf, want = _check(input, linear_weight, target, linear_bias, ignore_index, temperature, softcap, outputs,
                      chunk_size)
    spec = LogProbsSpec(tf, want, _compute_dtype(input, linear_weight, linear_bias),
                        resolve_backend(backend, input.device), chunk_size)
    return token_stats(input, linear_weight, linear_bias, target, spec, validate_target)


def token_stats(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                spec: LogProbsSpec, validate_target: bool) -> TokenStats:
    """:func:`linear_log_probs` on checked arguments (its settings in ``spec``)."""
    hidden, vocab = input.shape[-1], weight.shape[0]
    x = input.reshape(-1, hidden)
    t = target.reshape(-1).long().contiguous()
    n = t.numel()
    rows = None  # indices of the valid tokens, when ignored ones are dropped
    if validate_target and n:
        counts, _ = count_targets(t, spec.tf.ignore_index, vocab, spec.backend)
        n_valid, n_bad = counts.tolist()  # the one host sync
        if n_bad:
            _raise_bad_targets(t, vocab, spec.tf.ignore_index, n_bad)
        if n_valid < n:
            rows = (t != spec.tf.ignore_index).nonzero_static(size=n_valid).squeeze(1)
            x, t = x.index_select(0, rows), t.index_select(0, rows)
    fields = LinearLogProbsFunction.apply(x, weight, bias, t, spec)
    return TokenStats(*(None if f is None else _scatter(f, rows, n).reshape(target.shape) for f in fields))


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: x (n, H), weight (V, H), bias (V,) or None, target (n,) int64, spec (``LogProbsSpec``).
    Outputs: the five ``TokenStats`` fields as (n,) tensors (None where not in ``spec.want``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, spec):
        ctx.set_materialize_grads(False)  # an output without grad_output adds nothing to backward
        stats = stats_loop(x, weight, bias, target, spec)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, bias, target, stats.lse, stats.entropy)
        fields = tuple(getattr(stats, name) if name in spec.want else None for name in FIELDS)
        ctx.mark_non_differentiable(*(f for f in fields[2:] if f is not None))
        return fields

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        x, weight, bias, target, lse, entropy = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        if grad_log_probs is None and grad_entropy is None or not any(needs):
            return None, None, None, None, None
        spec = ctx.spec
        with spec.gather(weight, bias) if spec.gather is not None else nullcontext():
            grads = grad_loop(x, weight, bias, target, lse, entropy, _per_row(grad_log_probs),
                              _per_row(grad_entropy), needs, spec)
        return (grads.input, _as(grads.weight, weight), _as(grads.bias, bias), None, None)


def stats_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
               spec: LogProbsSpec) -> RowStats:
    """Every chunk's logits, read once by the statistics kernel; (n,) ``RowStats`` of ``spec.want``."""
    n, vocab = x.shape[0], weight.shape[0]
    dev = x.device
    stats = RowStats(
        torch.empty(n, dtype=torch.float32, device=dev),
        *(torch.empty(n, dtype=torch.float32, device=dev) if name in spec.want else None for name in FIELDS[:-1]),
        torch.empty(n, dtype=torch.bool, device=dev) if "is_top1" in spec.want else None)
    if vocab == 0 or n == 0:
        return _no_vocabulary(stats, target, spec.tf)
    plan = plan_chunks(n, vocab, spec.compute_dtype, weight.dtype, chunk_size=spec.chunk_size)
    w = _in_dtype(weight, spec.compute_dtype)
    buffer = torch.empty(plan.rows, vocab, dtype=spec.compute_dtype, device=dev) if plan.num_chunks > 1 else None
    for start, end in plan.bounds():
        x_c = _in_dtype(x[start:end], spec.compute_dtype)
        logits = _logits(x_c, w, bias, None if buffer is None else buffer[:end - start])
        kernels.row_stats(spec.backend, logits, target[start:end], stats.rows(start, end), spec.tf)
    return stats


def grad_loop(x, weight, bias, target, lse, entropy, grad_log_probs, grad_entropy, needs, spec) -> ChunkGrads:
    """Gradients for ``needs`` = (input, weight, bias): every chunk's logits recomputed, turned into their
    gradient by the kernel, then grad_input rows = dlogits @ W and grad_weight += dlogits^T @ x_c."""
    n, hidden = x.shape
    vocab = weight.shape[0]
    dev = x.device
    plan = plan_chunks(n, vocab, spec.compute_dtype, weight.dtype, chunk_size=spec.chunk_size,
                       weight_grad_hidden=hidden if needs[1] else 0)
    grads = ChunkGrads(
        input=torch.empty_like(x, memory_format=torch.contiguous_format) if needs[0] else None,
        weight=torch.empty(vocab, hidden, dtype=plan.accum_dtype, device=dev) if needs[1] else None,
        bias=torch.zeros(vocab, dtype=torch.float32, device=dev) if needs[2] else None,
    )
    if vocab == 0 or n == 0:  # nothing depends on the inputs
        for g in (grads.input, grads.weight):
            if g is not None:
                g.zero_()
        return grads
    w = _in_dtype(weight, spec.compute_dtype)
    buffer = torch.empty(plan.rows, vocab, dtype=spec.compute_dtype, device=dev) if plan.num_chunks > 1 else None
    for i, (start, end) in enumerate(plan.bounds()):
        rows = slice(start, end)
        x_c = _in_dtype(x[rows], spec.compute_dtype)
        logits = _logits(x_c, w, bias, None if buffer is None else buffer[:end - start])
        kernels.row_grad(spec.backend, logits, target[rows], lse[rows], _take(entropy, rows),
                         _take(grad_log_probs, rows), _take(grad_entropy, rows), spec.tf)
        gradient_gemms(logits, x_c, w, grads, rows, accumulate=i > 0)
    return grads


def _check(input, weight, target, bias, ignore_index, temperature, softcap, outputs, chunk_size):
    """Argument checks; returns (Transform, the wanted fields)."""
    if _is_dtensor(weight):
        raise TypeError("linear_weight is a DTensor: pass a regular tensor (e.g. linear_weight.full_tensor())")
    opts = LossOptions(ignore_index=ignore_index, softcap=softcap, temperature=temperature, reduction="none")
    _check_tensors(input, weight, target, bias, None)
    check_run_options("none", None, chunk_size, None)
    if isinstance(outputs, str) or not isinstance(outputs, Iterable):
        raise TypeError(f"outputs must be a tuple of field names among {FIELDS}, got {outputs!r}")
    want = frozenset(outputs)
    unknown = sorted(str(name) for name in want - set(FIELDS))
    if unknown:
        raise ValueError(f"outputs holds unknown field(s) {unknown}; the fields are {FIELDS}")
    return Transform(opts.ignore_index, 1.0 / opts.temperature, opts.softcap), want


def _no_vocabulary(stats: RowStats, target: torch.Tensor, tf: Transform) -> RowStats:
    """Stats of rows with no logits (V = 0) or of no rows: 0 where ignored, NaN for an unchecked target."""
    nan_or_zero = torch.where(target != tf.ignore_index, float("nan"), 0.0)
    for field in stats:
        if field is not None:
            field.copy_(nan_or_zero if field.is_floating_point() else torch.zeros_like(field))
    return stats


def _logits(x_c: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    logits = torch.mm(x_c, w.t()) if out is None else torch.mm(x_c, w.t(), out=out)
    return logits if bias is None else logits.add_(bias)


def _per_row(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.float().contiguous()


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Per-valid-row values placed back at their rows (zeros, False, elsewhere)."""
    return values if rows is None else values.new_zeros(n).index_copy(0, rows, values)


def _take(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else _in_dtype(grad, like.dtype)
