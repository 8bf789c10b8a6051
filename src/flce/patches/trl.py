"""TRL's trainers on flce's kernels.

TRL (from 1.16) computes per-token log-probabilities through a fused LM head: its SFT, DPO, GRPO, KTO
and RLOO trainers call ``trl.trainer.utils.add_fused_lm_head(model, ...)``, which replaces
``model.forward``; a call with ``fused_lm_head=True`` runs the backbone and hands the hidden states to
the name ``_ChunkedLogProbFunction`` of that module (imported from ``trl.kernels``). Routing makes that
name :class:`TrlHeadOnFlce`, which serves every such call with :func:`flce.linear_log_probs`: same
arguments, same five outputs, gradients of log-probs and entropy. TRL itself stays in charge of
everything around the kernel (label shift, masking, DTensor gathering, PEFT, ZeRO-3), so its behaviour
is unchanged.

``flce.apply_flce_patch`` routes TRL (when it is installed), so the order of patching and trainer
construction does not matter: a fused-head call reaches flce's kernels whether TRL's forward wraps
flce's or the other way round (flce's patched forward hands ``fused_lm_head=True`` calls to the forward
it wraps, see :func:`passes_through`). Without ``apply_flce_patch``::

    from flce.patches.trl import route_trl_to_flce
    route_trl_to_flce()  # before or after building the trainer

TRL before its fused head (1.14 and older): ``SFTTrainer.compute_loss`` either reads ``outputs.logits``
in training (``loss_type="nll"``) or runs TRL's own chunked head (``"chunked_nll"``), which returns
fields flce's loss does not. flce's patched forward then passes every call made inside it through
unfused (warning once): the run works as it would unpatched. Upgrade TRL to get its trainers on flce.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import inspect
import math
import sys
import warnings

import torch

from ..kernels import resolve_backend
from ..kernels.token_stats import FIELDS, Transform
from ..log_probs import LogProbsSpec, token_stats

_KERNEL_MODULE = "trl.kernels.chunked_logprob"
_CALLER_MODULE = "trl.trainer.utils"  # add_fused_lm_head's forward calls _ChunkedLogProbFunction.apply
_NAME = "_ChunkedLogProbFunction"
_routed: dict[str, object] = {}  # "kernel": TRL's own function while routed
_in_old_trl_loss = contextvars.ContextVar("flce_in_old_trl_loss", default=False)
_old_trl_guarded: list[type] = []  # the old SFTTrainer classes whose compute_loss sets _in_old_trl_loss


class TrlHeadOnFlce:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction``: the same ``apply`` call, served by
    :func:`flce.linear_log_probs`.

    TRL's logits are ``z = softcap(logit_scale * raw) / temperature`` with ``softcap(y) = c * tanh(y / c)``;
    flce's are ``c' * tanh(raw / (T' c'))``: the same for ``T' = temperature / logit_scale`` and
    ``c' = c / temperature`` (``logit_scale > 0``; other scales stay on TRL's kernel).
    """

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: float | None = None,
              logit_scale: float = 1.0, outputs: tuple[str, ...] = FIELDS[1:]):
        """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> (log_probs, entropy,
        log_sum_sq_probs, mean_logits, is_top1), each (N,) or None when not in ``outputs``."""
        scale = float(logit_scale)
        if not (scale > 0.0 and math.isfinite(scale)):
            own = sys.modules[_KERNEL_MODULE].ChunkedLogProbFunction  # routing replaces other names only
            return own.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                             logit_scale, outputs)
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            compute_dtype = torch.get_autocast_dtype(device)
        else:  # as TRL: the head computes in the hidden states' dtype
            compute_dtype = hidden.dtype
            weight = weight.to(compute_dtype)
            bias = None if bias is None else bias.to(compute_dtype)
        cap = None if final_logit_softcapping is None else final_logit_softcapping / temperature
        spec = LogProbsSpec(Transform(-100, scale / temperature, cap), frozenset(outputs) | {"log_probs"},
                            compute_dtype, resolve_backend("auto", hidden.device), gather=_zero3_gather(),
                            speculate=True)  # SFT's loss: three GEMMs instead of four
        # TRL's labels are valid: it drops or clamps ignored ones, so no target check (and no host sync).
        return tuple(token_stats(hidden, weight, bias, targets, spec, validate_target=False))


def route_trl_to_flce() -> bool:
    """Serve TRL's fused LM head with flce's kernels, from now on and for trainers built before. Idempotent.

    Returns True when TRL's fused head is routed; False when TRL is not installed, or has no fused head
    (before 1.16), in which case its ``SFTTrainer`` loss calls are left unfused (see the module's notes).
    """
    if importlib.util.find_spec("trl") is None:
        return False
    try:
        import trl.kernels
        from trl.kernels import chunked_logprob
    except ImportError:
        return _guard_old_sft_trainer()
    except Exception:  # a TRL that does not import here: nothing can call it, and patching must not fail
        return False
    own = getattr(chunked_logprob, "ChunkedLogProbFunction", None)
    if own is None or not _takes_outputs(own):
        return _guard_old_sft_trainer()
    _routed.setdefault("kernel", own)
    trl.kernels.ChunkedLogProbFunction = TrlHeadOnFlce  # what trl.trainer.utils binds when imported later
    caller = sys.modules.get(_CALLER_MODULE)
    if caller is not None:
        setattr(caller, _NAME, TrlHeadOnFlce)
    return True


def _takes_outputs(kernel) -> bool:
    """Whether TRL's fused head has the signature flce's adapter serves (``..., outputs``: TRL >= 1.16),
    read through wrappers; a wrapper that hides it (``*args``) is judged by TRL's version."""
    params = inspect.signature(inspect.unwrap(kernel.forward)).parameters
    if "outputs" in params:
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        from packaging.version import InvalidVersion, Version

        try:
            return Version(_trl_version()) >= Version("1.16")
        except InvalidVersion:
            return False
    return False


def unroute_trl() -> None:
    """Give TRL its own fused-head kernel back (a no-op if it was not routed)."""
    own = _routed.pop("kernel", None)
    if own is None:
        return
    sys.modules["trl.kernels"].ChunkedLogProbFunction = own
    caller = sys.modules.get(_CALLER_MODULE)
    if caller is not None and getattr(caller, _NAME, None) is TrlHeadOnFlce:
        setattr(caller, _NAME, own)


def is_routed() -> bool:
    """Whether TRL's fused-head calls run on flce's kernels now."""
    caller = sys.modules.get(_CALLER_MODULE)
    return "kernel" in _routed and (caller is None or getattr(caller, _NAME, None) is TrlHeadOnFlce)


def passes_through(kwargs: dict) -> bool:
    """Whether flce's patched forward must hand this call, untouched, to the forward it wraps: TRL's
    fused-head calls (``fused_lm_head=True``: TRL's forward serves them, on flce's kernels once routed),
    and with TRL before 1.16 every call inside ``SFTTrainer.compute_loss``."""
    # The context variable is read only once an old TRL was guarded: dynamo cannot trace ContextVar.get, and a
    # graph break at the top of every patched forward would cost torch.compile users a resume per call.
    return bool(kwargs.get("fused_lm_head")) or (bool(_old_trl_guarded) and _in_old_trl_loss.get())


def _zero3_gather():
    """TRL's ZeRO-3 gather of the head's parameters (backward recomputes from them, as TRL's does)."""
    caller = sys.modules.get(_CALLER_MODULE)
    return getattr(caller, "maybe_gather_lm_head_ctx", None)


def _guard_old_sft_trainer() -> bool:
    """Make flce's patched forward pass calls inside an old ``SFTTrainer.compute_loss`` through."""
    try:
        from trl.trainer import sft_trainer
    except Exception:  # a TRL that does not import with this transformers: nothing can call it
        return False
    _guard(sft_trainer.SFTTrainer)
    return False


def _guard(cls: type) -> None:
    """Wrap ``cls.compute_loss`` so that flce's patched forward passes the calls made inside it through
    (warning once). Idempotent."""
    if getattr(cls.compute_loss, "__flce_guard__", False):
        return
    original = cls.compute_loss
    warned = []

    @functools.wraps(original)
    def compute_loss(self, *args, **kwargs):
        if not warned:
            warned.append(True)
            warnings.warn(f"flce: {cls.__name__} (TRL {_trl_version()}) computes its loss from the logits or "
                          "with its own chunked head, so flce leaves its model calls unfused (the run is as "
                          "unpatched). TRL >= 1.16 runs its trainers' fused LM head on flce's kernels.",
                          stacklevel=2)
        token = _in_old_trl_loss.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _in_old_trl_loss.reset(token)

    compute_loss.__flce_guard__ = True
    cls.compute_loss = compute_loss
    _old_trl_guarded.append(cls)


def _trl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return "?"
