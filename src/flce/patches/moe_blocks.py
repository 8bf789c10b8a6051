"""MoE modules that transformers computes without its experts decorator, computed through flce's experts: Llama 4's
dense blocks and LongCat-Flash's experts.

Llama 4's block (``Llama4TextMoe``). Its router gives each token the sigmoid of its top-k logits (0 for the other
experts); the block scales the token's input by each expert's score and runs every expert on every token (two batched
GEMMs over all E experts), so the unselected experts compute zeros: E / k times the routed tokens' GEMMs (16x for
Llama-4-Scout, 128x for Maverick). flce computes the same sum over the selected experts only,

    out = shared_expert(x) + sum_j experts[e_j](x * s_j),

with flce's experts (``flce.experts.experts_forward``) on the k scaled copies of each token at routing weight 1.
The router, the experts and the shared expert are still called as modules, so their hooks fire as before
(transformers records the router logits through one; FSDP2, DeepSpeed ZeRO-3 and accelerate's offload gather a
module's weights in one): the experts module is handed the routed copies (``RoutedTokens``), which a wrapper of its
class's forward computes through flce's.

LongCat-Flash's experts (``LongcatFlashExperts``), called as a decorated experts module is, (T, H) hidden states and
(T, k) ids and weights, run a Python loop over the experts a batch hits (a host sync each). Ids at or above its
routed experts' count are identity experts (zero computation): out = sum_j w_j * (experts[e_j](x) if e_j is routed,
else x). flce computes the routed ones (ids beyond them are dropped) and adds x times the identity experts' weights.

``FORMS`` lists the classes by name, with what differs between them. Before a class's first use flce builds a tiny
one on the CPU and checks that the class's own forward and flce's agree (``_agrees``), so a class that changes under
the same name keeps its forward. The switch is a flag on the module, which a wrapper of its class's forward reads;
every unflagged module runs the class's own forward (``enable`` / ``disable``). A model saved whole keeps the flags
and wraps the classes again where it is loaded (``WrappedClasses``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from .. import experts
from ..import_hooks import compile_disabled
from ..kernels.experts_torch import SWIGLU

_FLAG = "_flce_sparse_experts"  # on a switched module (and False on its class, once wrapped)
_CLASSES = "_flce_wrapped_classes"  # on a switched module: its WrappedClasses


@dataclass(frozen=True)
class BlockForm:
    """A dense MoE block: its router's attribute (called on (T, H), returns the (T, E) scores, 0 outside the top
    k, and the (T, E) logits it chose them from; its ``top_k`` says k), its experts' (``gate_up_proj`` (E, H, 2I),
    ``down_proj`` (E, I, H), SwiGLU) and its shared expert's, and the config fields that size a tiny one."""

    router: str = "router"
    experts: str = "experts"
    shared: str = "shared_expert"
    tiny_config: tuple[tuple[str, int], ...] = (("hidden_size", 16), ("intermediate_size", 8),
                                                ("num_local_experts", 4), ("num_experts_per_tok", 2))


@dataclass(frozen=True)
class IdentityExpertsForm:
    """Experts with identity experts: the attribute holding the routed experts' count R (``gate_up_proj`` (E, 2I, H)
    of which the first R rows serve, E >= R, ``down_proj`` (R, H, I), SwiGLU; ids >= R are identity experts), and the
    config fields that size a tiny one."""

    routed: str = "num_routed_experts"
    tiny_config: tuple[tuple[str, int], ...] = (("hidden_size", 16), ("expert_ffn_hidden_size", 8),
                                                ("n_routed_experts", 4), ("zero_expert_num", 2))


FORMS: dict[str, BlockForm | IdentityExpertsForm] = {"Llama4TextMoe": BlockForm(),
                                                      "LongcatFlashExperts": IdentityExpertsForm()}
_CHECKED: dict[type, bool] = {}  # class -> whether its forward agrees with flce's (``_agrees``)


def computed_modules(model: nn.Module) -> list[nn.Module]:
    """The model's modules of ``FORMS``, if flce computes every one of them (else none)."""
    modules = [m for m in model.modules() if type(m).__name__ in FORMS]
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    return modules if modules and all(_computes(m, config) for m in modules) else []


@dataclass(frozen=True)
class RoutedTokens:
    """What a switched block hands its experts module: the scaled token copies (S, H) and each one's expert (S, 1)."""

    hidden: torch.Tensor
    index: torch.Tensor


class WrappedClasses:
    """Kept on a switched module beside its flag, the classes whose forwards it needs wrapped: unpickled (a model saved
    whole, loaded in another process) or deep-copied, it wraps them (``_wrap``)."""

    def __init__(self, classes: tuple[type, type | None]) -> None:
        self.classes = classes

    def __reduce__(self):
        return _rewrapped, (self.classes,)


def _rewrapped(classes: tuple[type, type | None]) -> WrappedClasses:
    _wrap(*classes)
    return WrappedClasses(classes)


def enable(module: nn.Module) -> None:
    """Compute ``module`` through flce's experts (its class's forward, and a block's experts', wrapped once)."""
    classes = _install(module)
    setattr(module, _FLAG, True)
    module.__dict__[_CLASSES] = WrappedClasses(classes)


def disable(module: nn.Module) -> None:
    """Give ``module`` its class's own forward back."""
    module.__dict__.pop(_FLAG, None)
    module.__dict__.pop(_CLASSES, None)


def enabled(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_FLAG))


def sparse_forward(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (out (T, H), router logits (T, E)) from hidden_states (..., H), through flce's experts."""
    form = FORMS[type(block).__name__]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    router = getattr(block, form.router)
    scores, logits = router(x)
    index = torch.topk(logits, router.top_k, dim=1).indices  # the router's own choice, from the same logits
    tokens, k = index.shape
    routed_in = (x[:, None, :] * scores.gather(1, index)[:, :, None]).reshape(tokens * k, -1)  # as the block rounds it
    routed = getattr(block, form.experts)(RoutedTokens(routed_in, index.reshape(-1, 1)))
    out = getattr(block, form.shared)(x)
    out.add_(routed if k == 1 else routed.view(tokens, k, -1).sum(1))
    return out, logits


def identity_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts with identity experts: (T, H) from (T, H) hidden states and (T, k) ids and weights.

    Eagerly, a call whose tokens all go to identity experts leaves the routed experts' weights out of the graph (one
    host read), as the class's loop does: their gradients stay None, not zeros, which an optimizer treats apart."""
    routed = getattr(module, FORMS[type(module).__name__].routed)
    identity = top_k_index >= routed
    out = (hidden_states * (top_k_weights * identity).sum(1, keepdim=True)).to(hidden_states.dtype)
    if _traced(hidden_states) or not bool(identity.all()):
        out = out + experts.experts_forward(hidden_states, top_k_index, top_k_weights, module.gate_up_proj[:routed],
                                            module.down_proj)  # ids >= routed: dropped
    return out


def _traced(t: torch.Tensor) -> bool:
    """Under torch.compile or CUDA-graph capture, where a host read cannot decide what runs."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def wrapped_here(cls: type) -> bool:
    """Whether this class's forward is one of this module's wrappers (a form's class, or a block's experts' class,
    which then takes ``RoutedTokens``)."""
    return getattr(cls.forward, "__flce_moe_blocks__", False)


def routed_experts(module: nn.Module, routed: RoutedTokens) -> torch.Tensor:
    """An experts module's output (S, H) for routed token copies, at routing weight 1: flce's experts on its
    weights, gate_up_proj (E, H, 2I) and down_proj (E, I, H)."""
    ops = experts.expert_operands(module, transposed=True)
    return experts.experts_forward(routed.hidden, routed.index, routed.hidden.new_ones(routed.index.shape),
                                   ops.gate_up, ops.down)


def _experts_module(block: nn.Module) -> nn.Module | None:
    """The block's experts module below PEFT's wrappers (LoRA on its parameters, ``target_parameters``: each wrapper
    calls its ``base_layer`` with the adapted weights in place), the one whose class takes ``RoutedTokens``."""
    module = getattr(block, FORMS[type(block).__name__].experts, None)
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def _install(module: nn.Module) -> tuple[type, type | None]:
    """``_wrap`` the module's class and (a block) its experts' class; returns the two (None: no experts class)."""
    cls = type(module)
    experts_cls = type(_experts_module(module)) if isinstance(FORMS[cls.__name__], BlockForm) else None
    _wrap(cls, experts_cls)
    return cls, experts_cls


def _wrap(cls: type, experts_cls: type | None) -> None:
    """Wrap the two classes' forwards, once each: a flagged module and an experts module handed ``RoutedTokens`` take
    flce's path, every other call the class's own forward."""
    if not wrapped_here(cls):
        ours = sparse_forward if isinstance(FORMS[cls.__name__], BlockForm) else identity_experts_forward
        cls.forward = _dispatching(cls.forward, ours, lambda self, args: getattr(self, _FLAG))
        setattr(cls, _FLAG, False)
    if experts_cls is not None and not wrapped_here(experts_cls):
        experts_cls.forward = _dispatching(experts_cls.forward, routed_experts,
                                           lambda self, args: len(args) > 0 and isinstance(args[0], RoutedTokens))


def _dispatching(forward, sparse, takes):
    @functools.wraps(forward)
    def dispatch(self, *args, **kwargs):
        if takes(self, args):
            return sparse(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    dispatch.__flce_moe_blocks__ = True
    return dispatch


def _computes(module: nn.Module, config) -> bool:
    """Whether flce computes this module: its weights in the form's layout with a SiLU gate, its class checked."""
    form = FORMS[type(module).__name__]
    return _in_layout(module, form) and _agrees(type(module), form, config)


def _in_layout(module: nn.Module, form) -> bool:
    if isinstance(form, BlockForm):
        ops = experts.expert_operands(_experts_module(module), transposed=True)
        return (ops is not None and ops.act == SWIGLU and ops.gate_up_bias is None and ops.down_bias is None
                and callable(getattr(module, form.shared, None)) and isinstance(getattr(module, form.router, None),
                                                                                 nn.Module))
    gate_up, down, routed = (getattr(module, a, None) for a in ("gate_up_proj", "down_proj", form.routed))
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and isinstance(routed, int)
            and 0 < routed <= gate_up.shape[0] and gate_up.dim() == down.dim() == 3 and down.shape[0] == routed
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and experts.is_silu(getattr(module, "act_fn", None)))


@compile_disabled  # once per class, on CPU tensors: never part of a compiled graph
def _agrees(cls: type, form, config) -> bool:
    """Whether a tiny ``cls`` built from ``config`` (resized by the form) gives, through its own forward, flce's
    outputs (float32, CPU; a block at k = 2, experts with two of their four ids identity experts)."""
    if cls not in _CHECKED:
        _CHECKED[cls] = _tiny_agrees(cls, form, config)
    return _CHECKED[cls]


def _tiny_agrees(cls: type, form, config) -> bool:
    if config is None:
        return False
    tiny_config = copy.deepcopy(config)
    generator = torch.Generator().manual_seed(0)
    try:
        for name, value in form.tiny_config:
            setattr(tiny_config, name, value)
        with torch.device("cpu"), torch.no_grad():  # whatever the caller's default device
            module = cls(tiny_config).float()
            _install(module)
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
            inputs = _tiny_inputs(module, form, generator)
            theirs = cls.forward(module, *inputs)  # unflagged: the class's own forward
            ours = (sparse_forward if isinstance(form, BlockForm) else identity_experts_forward)(module, *inputs)
    except Exception:  # noqa: BLE001 - a class that cannot be built or run this way is not one flce knows
        return False
    theirs, ours = (t if isinstance(t, tuple) else (t,) for t in (theirs, ours))
    return len(theirs) == len(ours) and all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(theirs, ours))


def _tiny_inputs(module: nn.Module, form, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A tiny module's inputs: 7 tokens; for experts, top-2 ids over every expert, routed and identity."""
    x = torch.randn(7, dict(form.tiny_config)["hidden_size"], generator=generator)
    if isinstance(form, BlockForm):
        return (x,)
    ids = torch.rand(7, module.gate_up_proj.shape[0], generator=generator).argsort(1)[:, :2]
    return x, ids, torch.rand(7, 2, generator=generator)
