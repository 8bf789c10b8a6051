"""MoE blocks that transformers computes densely and flce's experts sparsely: Llama 4's.

Llama 4's block (``Llama4TextMoe``) has no experts decorator. Its router gives each token the sigmoid of its top-k
logits (0 for the other experts); the block scales the token's input by each expert's score and runs every expert
on every token (two batched GEMMs over all E experts), so the unselected experts compute zeros: E / k times the
routed tokens' GEMMs (16x for Llama-4-Scout, 128x for Maverick). flce computes the same sum over the selected
experts only,

    out = shared_expert(x) + sum_j experts[e_j](x * s_j),

with flce's experts (``flce.experts.experts_forward``) on the k scaled copies of each token at routing weight 1.
The router, the experts and the shared expert are still called as modules, so their hooks fire as before
(transformers records the router logits through one; FSDP2, DeepSpeed ZeRO-3 and accelerate's offload gather a
module's weights in one): the experts module is handed the routed copies (``RoutedTokens``), which a wrapper of its
class's forward computes through flce's.

``BLOCK_FORMS`` lists the block classes by name, with what differs between them. Before a class's first use flce
builds a tiny one on the CPU and checks that the class's own forward and flce's agree (``_block_agrees``), so a
class that changes under the same name keeps its forward. The switch is a flag on the block, which a wrapper of
the block class's forward reads; every unflagged block runs the class's own forward (``enable`` / ``disable``).
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

_FLAG = "_flce_sparse_experts"  # on a switched block (and False on its class, once wrapped)


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


BLOCK_FORMS = {"Llama4TextMoe": BlockForm()}
_CHECKED: dict[type, bool] = {}  # block class -> whether its forward agrees with flce's (``_block_agrees``)


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's dense MoE blocks, if flce computes every one of them (else none)."""
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_FORMS]
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    return blocks if blocks and all(_computes(b, config) for b in blocks) else []


@dataclass(frozen=True)
class RoutedTokens:
    """What a switched block hands its experts module: the scaled token copies (S, H) and each one's expert (S, 1)."""

    hidden: torch.Tensor
    index: torch.Tensor


def enable(block: nn.Module) -> None:
    """Compute ``block`` through flce's experts (its and its experts' classes' forwards wrapped once)."""
    _install(type(block), type(_experts_module(block)))
    setattr(block, _FLAG, True)


def disable(block: nn.Module) -> None:
    """Give ``block`` its class's own forward back."""
    block.__dict__.pop(_FLAG, None)


def enabled(block: nn.Module) -> bool:
    return bool(block.__dict__.get(_FLAG))


def sparse_forward(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (out (T, H), router logits (T, E)) from hidden_states (..., H), through flce's experts."""
    form = BLOCK_FORMS[type(block).__name__]
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


def routed(experts_cls: type) -> bool:
    """Whether this experts class's forward is wrapped here (it then takes ``RoutedTokens``)."""
    return getattr(experts_cls.forward, "__flce_routed__", False)


def routed_experts(module: nn.Module, routed: RoutedTokens) -> torch.Tensor:
    """An experts module's output (S, H) for routed token copies, at routing weight 1: flce's experts on its
    weights, gate_up_proj (E, H, 2I) and down_proj (E, I, H)."""
    ops = experts.expert_operands(module, transposed=True)
    return experts.experts_forward(routed.hidden, routed.index, routed.hidden.new_ones(routed.index.shape),
                                   ops.gate_up, ops.down)


def _experts_module(block: nn.Module) -> nn.Module | None:
    """The block's experts module below PEFT's wrappers (LoRA on its parameters, ``target_parameters``: each wrapper
    calls its ``base_layer`` with the adapted weights in place), the one whose class takes ``RoutedTokens``."""
    module = getattr(block, BLOCK_FORMS[type(block).__name__].experts, None)
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def _install(block_cls: type, experts_cls: type) -> None:
    """Wrap the two classes' forwards (once each): a flagged block and an experts module handed ``RoutedTokens``
    take flce's path, every other call the class's own forward."""
    if _FLAG not in block_cls.__dict__:
        block_cls.forward = _dispatching(block_cls.forward, sparse_forward, lambda module, args: getattr(module, _FLAG))
        setattr(block_cls, _FLAG, False)
    if not routed(experts_cls):
        experts_cls.forward = _dispatching(experts_cls.forward, routed_experts,
                                           lambda module, args: len(args) > 0 and isinstance(args[0], RoutedTokens))
        experts_cls.forward.__flce_routed__ = True


def _dispatching(forward, sparse, takes):
    @functools.wraps(forward)
    def dispatch(self, *args, **kwargs):
        if takes(self, args):
            return sparse(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return dispatch


def _computes(block: nn.Module, config) -> bool:
    """Whether flce computes this block: its experts in the form's layout with a SiLU gate, its class checked."""
    form = BLOCK_FORMS[type(block).__name__]
    ops = experts.expert_operands(_experts_module(block), transposed=True)
    return (ops is not None and ops.act == SWIGLU and ops.gate_up_bias is None and ops.down_bias is None
            and callable(getattr(block, form.shared, None)) and isinstance(getattr(block, form.router, None), nn.Module)
            and _block_agrees(type(block), form, config))


@compile_disabled  # once per class, on CPU tensors: never part of a compiled graph
def _block_agrees(cls: type, form: BlockForm, config) -> bool:
    """Whether a tiny ``cls`` built from ``config`` (resized by the form) gives, through its own forward, flce's
    output and router logits (float32, CPU, k = 2)."""
    if cls not in _CHECKED:
        _CHECKED[cls] = _agrees(cls, form, config)
    return _CHECKED[cls]


def _agrees(cls: type, form: BlockForm, config) -> bool:
    if config is None:
        return False
    tiny_config = copy.deepcopy(config)
    generator = torch.Generator().manual_seed(0)
    try:
        for name, value in form.tiny_config:
            setattr(tiny_config, name, value)
        with torch.device("cpu"):
            block = cls(tiny_config).float()
        _install(cls, type(_experts_module(block)))
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
            x = torch.randn(7, dict(form.tiny_config)["hidden_size"], generator=generator)
            theirs = cls.forward(block, x)  # unflagged: the class's own forward
            ours = sparse_forward(block, x)
    except Exception:  # noqa: BLE001 - a class that cannot be built or run this way is not one flce knows
        return False
    return (isinstance(theirs, tuple) and len(theirs) == 2 and all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(theirs, ours)))
