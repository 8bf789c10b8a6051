"""An experts backend for transformers (Mixtral, Qwen-MoE, DeepSeek, GPT-OSS, Nemotron-H, most MoE families),
registered as ``"flce"``.

transformers 5 keeps a layer's experts as two 3-D parameters, ``gate_up_proj (E, 2I, H)`` (gate rows
first) and ``down_proj (E, H, I)``, and calls the backend named by ``config._experts_implementation``
from ``ExpertsInterface`` as ``fn(experts, hidden_states (T, H), top_k_index (T, k), top_k_weights
(T, k))``. Importing flce registers this one, before or after transformers:
``model.set_experts_implementation("flce")``.

One autograd Function, every step on the device (every shape fixed by T and k, so the layer can be
captured in a CUDA graph; outside capture ``auto`` may take a per-expert cuBLAS loop for large GEMMs,
at one host sync per layer call, see ``flce.kernels.experts_dispatch``):

1. sort the S = T * k token-expert pairs by expert; ``offsets`` by ``searchsorted``. Pairs whose expert
   id is outside [0, E) (expert-parallel sentinels) sort last and are dropped.
2. gather the tokens once in that order: ``xs`` (S, H).
3. ``h = xs @ gate_up[e]^T`` (grouped GEMM), ``a = silu(h_gate) * h_up`` (one kernel, the
   :class:`~flce.kernels.experts_torch.Activation`: optionally a clamp (DeepSeek-V4's ``swiglu_limit``), GPT-OSS's
   gate (alpha, up + 1, gate and up interleaved), each row's expert's bias; or Nemotron-H's ungated relu2).
4. ``y = a @ down[e]^T`` (grouped GEMM).
5. ``out[t] = sum_j w[t, j] * (y[pos[t, j]] + down_bias[e])`` in float32: the routing-weight multiply, the
   un-permute and the recombine in one kernel.

Backward reverses it: ``dy = w * g[token]`` and ``dw = <g[token], y>`` (one kernel), ``da = dy @
down[e]``, ``dh`` and the recomputed ``a`` (one kernel, ``a`` written over ``da``), the two weight
gradients as expert-grouped GEMMs (the biases': per-expert sums of dh and dy), ``dxs = dh @ gate_up[e]`` and
its float32 sum back onto the tokens. Saved for backward: ``xs``, ``h`` and (only when the routing weights need a
gradient) ``y``.

Each GEMM runs on the path measured fastest for its shape (flce's Triton grouped GEMMs, with or
without TMA loads, torch's grouped_mm, or for large GEMMs outside capture one cuBLAS GEMM per expert;
see ``flce.kernels.experts_dispatch``); set ``FLCE_EXPERTS_GEMM`` to force one. Under torch.compile the layer is the
custom op ``flce::experts`` (with its backward, ``flce::experts_backward``): no graph break, so a compiled model keeps
one graph through its MoE layers and CUDA graphs (``mode="reduce-overhead"``) capture them (see
:mod:`flce.experts_function`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .experts_function import ExpertsFunction, experts_op, plan_for, route_pairs
from .import_hooks import compile_disabled, when_imported
from .kernels.experts_dispatch import ELEMENTWISE_BACKENDS, GEMM_PATHS, check_choice, gemm_path
from .kernels.experts_torch import RELU2, SWIGLU, Activation, activation_torch

BACKEND_NAME = "flce"


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    gemm: str | None = None,
    elementwise: str = "auto",
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
    swiglu_up_offset: float = 0.0,
    interleaved: bool = False,
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
    swiglu_gate_softcap: float | None = None,
    swiglu_up_softcap: float | None = None,
) -> torch.Tensor:
    """SwiGLU mixture of experts: ``sum_j w[t, j] * down[e] @ (silu(gate[e] @ x_t) * (up[e] @ x_t))``, and the
    variants transformers' MoE families use (a clamp, GPT-OSS's gate, biases, softcaps, Nemotron-H's ungated relu2).

    Args:
        hidden_states: (T, H).
        top_k_index: (T, k) integer expert ids; ids outside [0, E) are dropped (they contribute 0).
        top_k_weights: (T, k) floating routing weights.
        gate_up_proj: (E, 2I, H), gate rows first. down_proj: (E, H, I), same dtype. The GEMMs run in
            this dtype, or in autocast's when autocast is on (as ``F.linear`` would); hidden states are
            cast to it; the recombine runs in float32.
        gemm: "auto" (default; ``FLCE_EXPERTS_GEMM`` overrides), "triton", "triton_tma", "grouped_mm"
            or "loop", see :mod:`flce.kernels.experts_dispatch`.
        elementwise: "auto", "triton" or "torch" for the SwiGLU and combine kernels.
        swiglu_limit: clamp the gate projection to at most this and the up projection to [-limit, limit]
            before the SwiGLU (DeepSeek-V4's, Hunyuan-V4's and GPT-OSS's ``swiglu_limit``); None: no clamp.
        swiglu_alpha, swiglu_up_offset: the gate computes ``g * sigmoid(alpha * g) * (up + up_offset)``
            (GPT-OSS: 1.702 and 1; the defaults are SwiGLU's).
        interleaved: gate and up rows of gate_up_proj alternate (GPT-OSS's layout) instead of gate rows first.
        gate_up_proj_bias: (E, 2I), down_proj_bias: (E, H): per-expert biases of the two projections, or None.
        activation: "swiglu" (the gated forms above) or "relu2": no gate, ``relu(up[e] @ x_t) ** 2``, gate_up_proj
            being the up projection alone, (E, I, H), and its bias (E, I) (Nemotron-H's experts).
        swiglu_gate_softcap, swiglu_up_softcap: c: the gate factor becomes ``c * tanh(g / c)`` (the sigmoid still
            sees g), the up projection ``c * tanh(up / c)`` (Inkling-2's softcapped SwiGLU); None: no cap.
    Returns:
        (T, H) in hidden_states' dtype.
    """
    act = _activation(activation, swiglu_limit, swiglu_alpha, swiglu_up_offset, interleaved, swiglu_gate_softcap,
                      swiglu_up_softcap)
    _check(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, 2 if act.gated else 1)
    biases = [_checked_bias(name, bias, rows, gate_up_proj) for name, bias, rows in (
        ("gate_up_proj_bias", gate_up_proj_bias, gate_up_proj.shape[1]),
        ("down_proj_bias", down_proj_bias, down_proj.shape[1]))]
    device = hidden_states.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else gate_up_proj.dtype
    weights = top_k_weights.contiguous()
    if torch.compiler.is_compiling():  # traced: one custom op, no graph break; the paths resolved when it runs
        if gemm is not None:
            check_choice("gemm", gemm, GEMM_PATHS)
        check_choice("elementwise", elementwise, ELEMENTWISE_BACKENDS)
        return experts_op(hidden_states, top_k_index, weights, gate_up_proj, down_proj, *biases, dtype, gemm,
                          elementwise, act)
    plan = plan_for(device, dtype, gemm_path(gemm), elementwise, act)
    routes = route_pairs(top_k_index, gate_up_proj.shape[0])
    return ExpertsFunction.apply(hidden_states, gate_up_proj, down_proj, weights, *biases, routes, plan)


def _activation(kind, limit, alpha, up_offset, interleaved, gate_softcap, up_softcap) -> Activation:
    if kind not in ("swiglu", "relu2"):
        raise ValueError(f"activation must be 'swiglu' or 'relu2', got {kind!r}")
    if kind == "relu2" and (limit, alpha, up_offset, interleaved, gate_softcap, up_softcap) != (
            None, 1.0, 0.0, False, None, None):
        raise ValueError("activation='relu2' has no gate: the swiglu_* arguments and interleaved keep their defaults")
    for name, value in (("swiglu_limit", limit), ("swiglu_gate_softcap", gate_softcap),
                        ("swiglu_up_softcap", up_softcap)):
        if not _valid_limit(value):
            raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    for name, value in (("swiglu_alpha", alpha), ("swiglu_up_offset", up_offset)):
        if not _finite_number(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    return Activation(_float(limit), float(alpha), float(up_offset), interleaved, kind, _float(gate_softcap),
                      _float(up_softcap))


def _float(value) -> float | None:
    return None if value is None else float(value)


def _checked_bias(name: str, bias: torch.Tensor | None, width: int, gate_up: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor or None, got {getattr(bias, 'dtype', type(bias))}")
    if tuple(bias.shape) != (gate_up.shape[0], width):
        raise ValueError(f"{name} must be (E, {width}) = {(gate_up.shape[0], width)}, got {tuple(bias.shape)}")
    if bias.device != gate_up.device:
        raise ValueError(f"{name} is on {bias.device}, the weights on {gate_up.device}")
    return bias.contiguous()  # the kernels read rows with unit column stride


def _check(hidden, index, weights, gate_up, down, halves: int) -> None:
    """halves: 2 where gate_up_proj holds gate and up (E, 2I, H), 1 where it is the up projection alone (E, I, H)."""
    for name, t in (("hidden_states", hidden), ("top_k_weights", weights), ("gate_up_proj", gate_up),
                    ("down_proj", down)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(f"top_k_index must be an integer tensor, got {index.dtype}")
    if down.dtype != gate_up.dtype:
        raise TypeError(f"down_proj ({down.dtype}) and gate_up_proj ({gate_up.dtype}) must share a dtype")
    if hidden.dim() != 2 or index.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise _layout_error(hidden, index, gate_up, down, halves)
    experts, rows, hid = gate_up.shape
    if (hid != hidden.shape[1] or rows % halves or tuple(down.shape) != (experts, hid, rows // halves)
            or index.shape[0] != hidden.shape[0]):
        raise _layout_error(hidden, index, gate_up, down, halves)
    if weights.shape != index.shape:
        raise ValueError(f"top_k_weights {tuple(weights.shape)} must match top_k_index {tuple(index.shape)}")
    devices = {t.device for t in (hidden, index, weights, gate_up, down)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid_limit(limit) -> bool:
    return limit is None or (_finite_number(limit) and limit > 0)


def _layout_error(hidden, index, gate_up, down, halves: int) -> ValueError:
    shapes = ", ".join(str(tuple(t.shape)) for t in (hidden, index, gate_up, down))
    rows = "2I" if halves == 2 else "I"
    return ValueError(f"expected hidden_states (T, H), top_k_index (T, k), gate_up_proj (E, {rows}, H) and down_proj "
                      f"(E, H, I); got {shapes}")


# ------------------------------------------------------------------------------ transformers backend

@dataclass(frozen=True)
class GateForm:
    """An experts class whose own ``_apply_gate`` flce computes: the attributes (dotted paths from the module) holding
    its clamp limit, its alpha and its two softcaps (None: no clamp, alpha 1, no caps), the offset added to the up
    projection, and whether the activation is written in its code (else its ``act_fn`` must be SiLU). Gate and up
    alternate where the class is not ``is_concatenated``."""

    limit_attr: str | None = None
    alpha_attr: str | None = None
    up_offset: float = 0.0
    activation_in_code: bool = False
    gate_softcap_attr: str | None = None
    up_softcap_attr: str | None = None


_GPT_OSS = GateForm(limit_attr="limit", alpha_attr="alpha", up_offset=1.0, activation_in_code=True)
_INKLING2 = GateForm(activation_in_code=True, gate_softcap_attr="act_fn.gate_softcap.softcap",
                     up_softcap_attr="act_fn.up_softcap.softcap")

# The ``_apply_gate`` overrides flce computes, by class name (a new one is an entry; each is checked numerically at
# first use, and the zoo's verdicts compare each family's training step on flce's experts with its own):
GATE_FORMS = {
    "DeepseekV4Experts": GateForm(limit_attr="limit"),  # gate.clamp(max=L), up.clamp(-L, L), act_fn(gate) * up
    "HYV4Experts": GateForm(limit_attr="swiglu_limit", activation_in_code=True),  # the same with F.silu
    "BeamExperts": GateForm(),  # act_fn(gate) * up in float32, rounded once: as flce's kernels compute it
    "GptOssExperts": _GPT_OSS,  # clamped, g * sigmoid(alpha * g) * (up + 1), interleaved, biases
    "OpenAIPrivacyFilterExperts": _GPT_OSS,  # the same, concatenated
    "MiniMaxM3VLExperts": GateForm(limit_attr="swiglu_limit", alpha_attr="swiglu_alpha", up_offset=1.0,
                                   activation_in_code=True),  # the same, concatenated, no bias
    "Inkling2Experts": _INKLING2,  # softcap(gate) * sigmoid(gate) * softcap(up) in float32
    "Inkling2LoopExperts": _INKLING2,
}


@dataclass(frozen=True)
class Operands:
    """What :func:`experts_forward` takes for a transformers experts module: gate_up (E, 2I, H) (ungated experts: the
    up projection, (E, I, H)), down (E, H, I), their biases ((E, 2I or I), (E, H) or None) and the activation."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: Activation


def computes_experts(experts: torch.nn.Module) -> bool:
    """Whether :func:`flce_experts_forward` computes this experts module itself (else it hands it to transformers'
    grouped_mm): gate/up (E, 2I, H) and down (E, H, I) (or both stored transposed), optional biases, a SiLU gate
    applied by transformers' default gate or a :data:`GATE_FORMS` class's own gate; or ungated experts (``up_proj``
    (E, I, H)) with a relu2 ``act_fn``."""
    return expert_operands(experts) is not None


def expert_operands(experts: torch.nn.Module, transposed: bool | None = None) -> Operands | None:
    """The :class:`Operands` of this module, or None where flce does not compute it; every check made once (a
    layer call's host path). transposed: whether the weights are stored (E, H, 2I) and (E, I, H) (None: as the
    module's ``is_transposed`` says)."""
    gated = getattr(experts, "has_gate", True)
    first, down = getattr(experts, "gate_up_proj" if gated else "up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(first, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if getattr(experts, "experts_are_transposed", False) or getattr(experts, "has_post_expert_norm", False):
        return None
    biases = _biases(experts, "gate_up_proj_bias" if gated else "up_proj_bias")
    act = _module_activation(experts) if gated else (RELU2 if _is_relu2(getattr(experts, "act_fn", None)) else None)
    if biases is None or act is None:
        return None
    if getattr(experts, "is_transposed", False) if transposed is None else transposed:  # their transposed views
        first, down = first.transpose(-1, -2), down.transpose(-1, -2)
    halves = 2 if gated else 1
    num_experts, rows, hidden = first.shape if first.dim() == 3 else (0, 1, 0)
    if not (rows % halves == 0 and down.dim() == 3 and tuple(down.shape) == (num_experts, hidden, rows // halves)
            and all(b is None or tuple(b.shape) == (num_experts, n) for b, n in zip(biases, (rows, hidden)))):
        return None
    return Operands(first, down, *biases, act)


def _biases(experts: torch.nn.Module, first: str) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """(the first projection's bias (attribute ``first``), down_proj_bias) where the class has biases (both tensors),
    (None, None) where it has none; None for anything else."""
    biases = getattr(experts, first, None), getattr(experts, "down_proj_bias", None)
    if not getattr(experts, "has_bias", False):
        return biases if all(b is None for b in biases) else None
    return biases if all(isinstance(b, torch.Tensor) and b.dim() == 2 for b in biases) else None


def _module_activation(experts: torch.nn.Module) -> Activation | None:
    """The :class:`Activation` the module's gate computes (checked on a probe for a class's own gate), or None."""
    if not _own_gate(experts):  # transformers' default: act_fn(gate) * up of the two halves
        return SWIGLU if is_silu(getattr(experts, "act_fn", None)) else None
    owner = next(c for c in type(experts).__mro__ if "_apply_gate" in c.__dict__)  # the class that defines it
    form = GATE_FORMS.get(owner.__name__)
    if form is None or not (form.activation_in_code or is_silu(getattr(experts, "act_fn", None))):
        return None
    limit, gate_cap, up_cap = (_attr(experts, path) for path in (form.limit_attr, form.gate_softcap_attr,
                                                                 form.up_softcap_attr))
    alpha = _attr(experts, form.alpha_attr) if form.alpha_attr else 1.0
    if not (all(map(_valid_limit, (limit, gate_cap, up_cap))) and _finite_number(alpha)):
        return None
    alpha = float(alpha)
    key = (owner, limit, alpha, form.up_offset, not getattr(experts, "is_concatenated", True), gate_cap, up_cap)
    if key not in _GATES_CHECKED:  # once per class and form
        act = Activation(*key[1:5], gate_softcap=gate_cap, up_softcap=up_cap)
        _GATES_CHECKED[key] = act if _gate_agrees(experts, act) else None
    return _GATES_CHECKED[key]


def _attr(obj, path: str | None):
    """The attribute at a dotted path (None for no path or a missing attribute)."""
    for name in path.split(".") if path else ():
        obj = getattr(obj, name, None)
    return obj if path else None


def _own_gate(experts: torch.nn.Module) -> bool:
    """Whether the class applies its gate by its own ``_apply_gate`` rather than transformers' default."""
    gate = getattr(type(experts), "_apply_gate", None)
    return gate is not None and gate.__name__ != "_default_apply_gate"


# (class that defines the gate, the form's values) -> the Activation it computes, or None where its gate is another.
# Kept by that class, not the module's type: a parametrization (PEFT's LoRA on the weights) gives the module a new
# type at every registration.
_GATES_CHECKED: dict[tuple, Activation | None] = {}


@compile_disabled  # a check on CPU tensors, once per class and form: never part of a compiled graph
def _gate_agrees(experts: torch.nn.Module, act: Activation) -> bool:
    """Whether a class's own ``_apply_gate`` gives ``act`` on values on both sides of its limit: a class whose gate
    changes under the same name (another transformers) then falls back to its own implementation instead of being
    computed as something else."""
    scale = 2.0 * (act.limit if act.limit is not None else 4.0)
    probe = (torch.rand(4, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1) * scale  # (S, 2I)
    with torch.no_grad():
        try:
            theirs = experts._apply_gate(probe)
        except Exception:  # noqa: BLE001 - a gate that cannot run on a CPU float32 probe is not one flce knows
            theirs = None
        ours = activation_torch(probe, probe.new_zeros(1), act)
    return (isinstance(theirs, torch.Tensor) and theirs.shape == ours.shape
            and torch.allclose(theirs.float(), ours, rtol=1e-5, atol=1e-6))


def is_silu(act) -> bool:
    return act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation")


def _is_relu2(act) -> bool:
    return type(act).__name__ == "ReLUSquaredActivation"  # transformers' "relu2": relu(x) ** 2


def flce_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``ExpertsInterface`` entry: (T, H) hidden states, (T, k) ids and weights -> (T, H).

    Experts of another layout (another activation or gate, a post-expert norm) run transformers' ``grouped_mm``
    backend (or the module's eager forward where that is missing).
    """
    ops = expert_operands(self)
    if ops is not None and ops.gate_up.shape[2] == hidden_states.shape[-1]:
        act = ops.act
        return experts_forward(hidden_states, top_k_index, top_k_weights, ops.gate_up, ops.down,
                               swiglu_limit=act.limit, swiglu_alpha=act.alpha, swiglu_up_offset=act.up_offset,
                               interleaved=act.interleaved, gate_up_proj_bias=ops.gate_up_bias,
                               down_proj_bias=ops.down_bias, activation=act.kind,
                               swiglu_gate_softcap=act.gate_softcap, swiglu_up_softcap=act.up_softcap)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fallback = ALL_EXPERTS_FUNCTIONS.get("grouped_mm") or type(self).forward.__wrapped__
    return fallback(self, hidden_states, top_k_index, top_k_weights)


def register_experts_backend(name: str = BACKEND_NAME) -> bool:
    """Register :func:`flce_experts_forward` with transformers; False (quietly) without ExpertsInterface."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except Exception:  # noqa: BLE001 - no transformers, an old one, or a broken install: nothing to register
        return False
    ExpertsInterface.register(name, flce_experts_forward)
    return True


# transformers' models import this module before any experts backend is chosen; flce stays light until then
when_imported("transformers.integrations.moe", lambda _moe: register_experts_backend())
