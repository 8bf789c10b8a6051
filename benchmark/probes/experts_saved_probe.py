"""Probe: what one transformers experts layer (Qwen3-MoE's, float32) keeps for backward under each experts
implementation (grouped_mm, flce, eager): the bytes of the tensors autograd saves in forward (saved-tensor hooks;
weights included). In a model these add up over the layers; a layer's backward transients do not. CPU or GPU:

    PYTHONPATH=src python benchmark/probes/experts_saved_probe.py [TxHxIxExK] [cpu|cuda]
"""
from __future__ import annotations

import sys
import warnings

import torch
import transformers

import flce.experts  # registers the "flce" experts backend


def saved_bytes(experts: torch.nn.Module, x, ids, weights) -> tuple[int, int]:
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, ids, weights)
    return sum(sizes), len(sizes)


def main(shape: str, device: str) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    tokens, hidden, inter, n_experts, top_k = map(int, shape.split("x"))
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=n_experts,
                                         num_experts_per_tok=top_k)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    ids = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, device=device, requires_grad=True)
    for impl in ("grouped_mm", flce.experts.BACKEND_NAME, "eager"):
        config._experts_implementation = impl
        total, count = saved_bytes(experts, x, ids, weights)
        print(f"{shape} {device} {impl}: {total / 2**20:.1f} MiB saved in {count} tensors", flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(sys.argv[1] if len(sys.argv) > 1 else "2048x512x192x32x8", sys.argv[2] if len(sys.argv) > 2 else "cpu")
