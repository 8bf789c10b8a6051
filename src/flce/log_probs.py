"""Per-token log-probabilities, entropy and friends of a linear head, without materializing the logits.

What policy-gradient losses (PPO, GRPO, DPO, ...) and TRL's fused LM head (``flce.patches.trl``) need:
for each token, the log-probability of its target and, on request, the entropy of its distribution and
three diagnostics. Same logit model as :func:`flce.linear_cross_entropy`.

Forward, chunk by chunk: logits = x_c @ W^T (+ b) into one reused buffer (on Hopper the loss's GEMM,
which stores them less their tile max: ``function.chunk_logits``), then one read of them by the
statistics kernel (``kernels.token_stats``); log-probs alone without gradients skip the logits on Hopper
(``loss_only``). Backward gets any per-token grad_output of the log-probs
and of the entropy, so it recomputes each chunk's logits, overwrites them with their gradient and runs
the two gradient GEMMs (grad_weight accumulated in float32 across chunks, see ``planner``). A mean
negative log-likelihood (uniform log-prob grad_output) gets its gradients from forward instead, once
backward has seen one: see ``LinearLogProbsFunction``.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Callable, Iterable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import loss_only
from .checks import check_tensors, compute_dtype, raise_bad_targets
from .distributed import is_dtensor
from .function import ChunkGrads, chunk_logits, dlogits_buffer, gradient_gemms, scale_grads, split_scale
from .gemm import padded_rows
from .import_hooks import compile_disabled
from .kernels import resolve_backend
from .kernels import token_stats as kernels
from .kernels.targets import count_targets
from .kernels.token_stats import FIELDS, RowStats, Transform
from .options import LossOptions, check_run_options
from .planner import plan_chunks


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
    rows per chunk (None: planner); ``gather``: None, or ``gather(weight, bias)`` -> a context manager
    that backward enters before reading the weight (DeepSpeed ZeRO-3 frees it after forward);
    ``speculate``: whether forward may compute the gradients of a uniform grad_output (see
    ``LinearLogProbsFunction``; costs a host sync in some backwards)."""

    tf: Transform
    want: frozenset
    compute_dtype: torch.dtype
    backend: str
    chunk_size: int | None = None
    gather: Callable | None = None
    speculate: bool = False


@compile_disabled  # data-dependent control flow and Triton launches: one graph break, exact result
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
    """Per-token statistics of ``z = softcap((input @ linear_weight.T + linear_bias) / temperature)`` at
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
        gradients for input, linear_weight and linear_bias in their own dtypes. Where the previous
        backward of the same kind of call had a uniform log-prob grad_output and no entropy one (a
        mean negative log-likelihood), forward computes the gradients itself (three GEMMs, and a
        (V, H) gradient held until backward), and backward checks that guess (a host sync) before
        using them; with ``validate_target=False`` it never guesses.
    """
    tf, want = _check(input, linear_weight, target, linear_bias, ignore_index, temperature, softcap, outputs,
                      chunk_size)
    spec = LogProbsSpec(tf, want, compute_dtype(input, linear_weight, linear_bias),
                        resolve_backend(backend, input.device), chunk_size, speculate=validate_target)
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
            raise_bad_targets(t, vocab, spec.tf.ignore_index, n_bad, target)
        if n_valid < n:
            rows = (t != spec.tf.ignore_index).nonzero_static(size=n_valid).squeeze(1)
            x, t = x.index_select(0, rows), t.index_select(0, rows)
    grad = torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in (x, weight, bias))
    fields = None if grad else _log_probs_alone(x, weight, bias, t, spec)
    if fields is None:
        fields = LinearLogProbsFunction.apply(x, weight, bias, t, spec)
    return TokenStats(*(None if f is None else _scatter(f, rows, n).reshape(target.shape) for f in fields))


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: x (n, H), weight (V, H), bias (V,) or None, target (n,) int64, spec (``LogProbsSpec``).
    Outputs: the five ``TokenStats`` fields as (n,) tensors (None where not in ``spec.want``).

    With ``spec.speculate``, a forward whose kind of call (``_Speculation``) last got a uniform log-prob
    grad_output and no entropy one (an SFT loss, -sum(log_probs) / n) also computes the gradients for a
    grad_output of ones, as the fused loss does: three GEMMs instead of four. Backward checks the guess
    and scales them, or recomputes as usual.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, spec):
        ctx.set_materialize_grads(False)  # an output without grad_output adds nothing to backward
        needs = tuple(ctx.needs_input_grad[:3])
        n, vocab = x.shape[0], weight.shape[0]
        stats = _new_stats(n, x.device, spec.want)
        ctx.guess = _Speculation.of(x, weight, spec) if spec.speculate and any(needs) and n and vocab else None
        if ctx.guess is not None and ctx.guess.predicts_uniform():
            unit = RowGrad(stats.lse, None, torch.ones(n, dtype=torch.float32, device=x.device), None)
            ctx.unit_grads = chunk_loop(x, weight, bias, target, spec, stats, unit, needs, unit=True)
            ctx.guess.hold(ctx.unit_grads)
        else:
            ctx.unit_grads = None
            chunk_loop(x, weight, bias, target, spec, stats)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, bias, target, stats.lse, stats.entropy)
        fields = tuple(getattr(stats, name) if name in spec.want else None for name in FIELDS)
        ctx.mark_non_differentiable(*(f for f in fields[2:] if f is not None))
        return fields

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        x, weight, bias, target, lse, entropy = ctx.saved_tensors  # raises if changed in place since forward
        needs = tuple(ctx.needs_input_grad[:3])
        spec, unit, ctx.unit_grads = ctx.spec, ctx.unit_grads, None  # used once: a second backward recomputes
        if grad_log_probs is None and grad_entropy is None or not any(needs):
            return None, None, None, None, None
        g_lp, g_ent = _per_row(grad_log_probs), _per_row(grad_entropy)
        if ctx.guess is not None and ctx.guess.check(g_lp, g_ent, verify=unit is not None):
            out = scale_grads(unit, g_lp[0], (x.dtype, weight.dtype, None if bias is None else bias.dtype),
                              spec.backend)
        else:
            with spec.gather(weight, bias) if spec.gather is not None else nullcontext():
                grads = chunk_loop(x, weight, bias, target, spec, None, RowGrad(lse, entropy, g_lp, g_ent), needs)
            out = (grads.input, _as(grads.weight, weight), _as(grads.bias, bias))
        return (*out, None, None)


def _log_probs_alone(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                     spec: LogProbsSpec) -> tuple | None:
    """Log-probs alone without gradients (a reference model's, in GRPO or DPO) from the loss's
    statistics-only path on Hopper (``loss_only``: the GEMM keeps its tile statistics, no logits are
    written): log_probs = -(lse - z_y), from the unrounded logits. Returns the five fields, or None where
    that path does not apply."""
    n, vocab = x.shape[0], weight.shape[0]
    if spec.want != {"log_probs"}:
        return None
    opts = _loss_options(spec.tf)
    log_probs, lse = torch.empty(2, n, dtype=torch.float32, device=x.device)
    rows = plan_chunks(n, vocab, spec.compute_dtype, weight.dtype, chunk_size=spec.chunk_size).rows
    if not loss_only.try_run(x, weight, bias, target, None, opts, log_probs, lse, compute_dtype=spec.compute_dtype,
                             backend=spec.backend, chunk_rows=rows):
        return None
    return (log_probs.neg_().add_(0.0), None, None, None, None)  # -loss, +0.0 (not -0.0) on ignored rows


class RowGrad(NamedTuple):
    """What the gradient kernel needs per row, (n,) float32 each: forward's lse and entropy (None unless
    grad_entropy), and the grad_outputs of log_probs and entropy (None: no gradient from that output)."""

    lse: torch.Tensor
    entropy: torch.Tensor | None
    grad_log_probs: torch.Tensor | None
    grad_entropy: torch.Tensor | None


def chunk_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
               spec: LogProbsSpec, stats: RowStats | None, grad: RowGrad | None = None,
               needs: tuple[bool, bool, bool] = (False, False, False), unit: bool = False) -> ChunkGrads | None:
    """Every chunk's logits x_c @ W^T (+ b), then: the statistics kernel writes ``stats`` (if given) in one
    read; with ``grad``, the gradient kernel overwrites the logits with d(sum_rows g_lp * log_probs +
    g_ent * entropy) / d logits, and grad_input rows = dlogits @ W, grad_weight += dlogits^T @ x_c (for
    ``needs`` = input, weight, bias). ``unit``: grad's grad_outputs are all 1 and backward scales the
    gradients, so nothing is split and grad_input stays in float32 until then (one rounding, not two:
    n x H x 4 bytes). Returns the gradients (None without ``grad``)."""
    n, hidden = x.shape
    vocab = weight.shape[0]
    dev = x.device
    plan = plan_chunks(n, vocab, spec.compute_dtype, weight.dtype, chunk_size=spec.chunk_size,
                       weight_grad_hidden=hidden if grad is not None and needs[1] else 0)
    grads = None if grad is None else ChunkGrads(
        input=torch.empty(x.shape, dtype=torch.promote_types(x.dtype, torch.float32) if unit else x.dtype,
                          device=dev) if needs[0] else None,
        weight=torch.empty(vocab, hidden, dtype=plan.accum_dtype, device=dev) if needs[1] else None,
        bias=torch.zeros(vocab, dtype=torch.float32, device=dev) if needs[2] else None)
    if vocab == 0 or n == 0:  # no logits: the statistics are fixed and nothing depends on the inputs
        if stats is not None:
            _no_vocabulary(stats, target, spec.tf)
        for g in (grads.input, grads.weight) if grads is not None else ():
            if g is not None:
                g.zero_()
        return grads
    w = _in_dtype(weight, spec.compute_dtype)
    buffer = padded_rows(plan.rows, vocab, spec.compute_dtype, dev) if plan.num_chunks > 1 else None
    grad, residual = (grad, None) if unit else _split_rows(grad, grads, spec)
    opts = _loss_options(spec.tf)
    for i, (start, end) in enumerate(plan.bounds()):
        rows = slice(start, end)
        x_c = _in_dtype(x[rows], spec.compute_dtype)
        # As the loss's: on Hopper the logits less their tile max (far less rounding where p is not small), and
        # float32 logits for a small single chunk (``function.wide_logits``)
        logits, tile_stats = chunk_logits(x_c, w, bias, None if buffer is None else buffer[:end - start], opts,
                                          spec.backend, sums=False, wide=True)  # the token kernels make their own sums
        tile_max = None if tile_stats is None else tile_stats[0]
        if stats is not None:  # shifted logits: each target's logit from a float32 dot, not its stored 16 bits
            kernels.row_stats(spec.backend, logits, target[rows], stats.rows(start, end), spec.tf, tile_max,
                              None if tile_max is None else (x_c, w, bias))
        if grad is not None:
            dl = dlogits_buffer(logits, spec.compute_dtype, spec.backend)
            kernels.row_grad(spec.backend, logits, target[rows], *(None if t is None else t[rows] for t in grad),
                             spec.tf, tile_max, grad_out=dl)
            gradient_gemms(dl, x_c, w, grads, rows, accumulate=i > 0, backend=spec.backend,
                           row_scale=None if residual is None else residual[rows], single=plan.num_chunks == 1)
    return grads


def _split_rows(grad: RowGrad | None, grads: ChunkGrads | None,
                spec: LogProbsSpec) -> tuple[RowGrad | None, torch.Tensor | None]:
    """(the kernel's RowGrad, per-row residual or None). A masked mean of log-probs gives every row of a
    sequence the same 1 / count: folded into 16-bit dlogits it would put that factor's rounding on every
    target entry (1.8x the bf16 rounding in both gradients; the loss's ``function.split_scale``). The
    kernel takes each row's power of two (the entropy's grad_output divided to match), and the residual
    meets grad_input's float32 product and the weight GEMM's operand x_c. Not with a bias gradient (its sums
    would need the residual) nor 32-bit GEMMs (nothing to gain)."""
    if (grad is None or grad.grad_log_probs is None or grads.bias is not None
            or spec.compute_dtype.itemsize != 2):
        return grad, None
    power, residual = split_scale(grad.grad_log_probs, 1.0 / spec.tf.inv_temp)
    g_ent = None if grad.grad_entropy is None else grad.grad_entropy / residual
    return grad._replace(grad_log_probs=power, grad_entropy=g_ent), residual


class _Speculation:
    """Whether the last backward of a kind of call (weight shape, dtypes, device, options) got a uniform
    log-prob grad_output and no entropy one; then its next forward computes the gradients itself.

    Backward records that without a host sync (the flag is read in a later forward once it has landed),
    except where it checks a guess, which needs the answer before choosing how to finish. At most one
    guess per kind is held at a time (its gradients cost a (V, H) tensor from forward to backward), and
    one whose backward never comes (no gradient through log_probs) ends with its autograd graph.
    """

    _kinds: dict = {}

    def __init__(self) -> None:
        self.flag: torch.Tensor | None = None  # host bool, valid once ``landed``
        self.landed: torch.cuda.Event | None = None
        self.held: weakref.ref | None = None

    @classmethod
    def of(cls, x: torch.Tensor, weight: torch.Tensor, spec: LogProbsSpec) -> "_Speculation":
        key = (tuple(weight.shape), weight.dtype, x.dtype, x.device, spec.tf, spec.want, spec.compute_dtype)
        return cls._kinds.setdefault(key, cls())

    def predicts_uniform(self) -> bool:
        if self.held is not None and self.held() is not None:
            return False
        if self.flag is None or (self.landed is not None and not self.landed.query()):
            return False
        return bool(self.flag)

    def hold(self, grads: ChunkGrads) -> None:
        self.held = weakref.ref(grads)

    def check(self, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, verify: bool) -> bool:
        """Record whether this backward's grad_outputs are uniform; with ``verify``, return it (a sync)."""
        if g_lp is None or g_ent is not None:
            self.flag, self.landed = torch.tensor(False), None
            return False
        uniform = (g_lp == g_lp[:1]).all()
        if verify:
            self.flag, self.landed = uniform.cpu(), None
            return bool(self.flag)
        self.flag = torch.empty((), dtype=torch.bool, device="cpu", pin_memory=uniform.is_cuda)
        self.flag.copy_(uniform, non_blocking=True)
        self.landed = torch.cuda.Event() if uniform.is_cuda else None
        if self.landed is not None:
            self.landed.record()
        return False


def _new_stats(n: int, device: torch.device, want: frozenset) -> RowStats:
    return RowStats(
        torch.empty(n, dtype=torch.float32, device=device),
        *(torch.empty(n, dtype=torch.float32, device=device) if name in want else None for name in FIELDS[:-1]),
        torch.empty(n, dtype=torch.bool, device=device) if "is_top1" in want else None)


def _check(input, weight, target, bias, ignore_index, temperature, softcap, outputs, chunk_size):
    """Argument checks; returns (Transform, the wanted fields)."""
    if is_dtensor(weight):
        raise TypeError("linear_weight is a DTensor: pass a regular tensor (e.g. linear_weight.full_tensor())")
    opts = LossOptions(ignore_index=ignore_index, softcap=softcap, temperature=temperature, reduction="none")
    check_tensors(input, weight, target, bias, None, min_vocab=0)
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


def _loss_options(tf: Transform) -> LossOptions:
    """The loss's options for the same logit transform (the GEMMs shared with the loss read them)."""
    return LossOptions(ignore_index=tf.ignore_index, softcap=tf.softcap, temperature=1.0 / tf.inv_temp,
                       reduction="none")


def _per_row(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.float().contiguous()


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Per-valid-row values placed back at their rows (zeros, False, elsewhere)."""
    return values if rows is None else values.new_zeros(n).index_copy(0, rows, values)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else _in_dtype(grad, like.dtype)
