"""Probe: a MoE family's own experts class on transformers' grouped_mm backend and on flce's, forward + backward,
bf16; and flce's plain SwiGLU layer on the same weights (no clamp, no bias), for what the family's gate form costs
in flce's kernels. Timed in interleaved rounds (median of CUDA-event times), peak memory above the inputs. GPU only:

    PYTHONPATH=src python benchmark/probes/family_experts_probe.py FAMILY [TxHxIxExK ...]

FAMILY: deepseek_v4 (a clamped SwiGLU; needs a transformers with DeepSeek-V4, 5.24 has it), gpt_oss (clamped,
alpha 1.702, up + 1, gate and up interleaved, biases, weights stored transposed) or nemotron_h (ungated relu2; its third
row is flce's relu2 layer called directly). Default shapes: the family's layers at 8192 tokens (Nemotron-H:
Nemotron-3-Nano-30B-A3B's, H 2688, I 1856, E 128, top-6).
"""
from __future__ import annotations

import statistics
import sys
import warnings

import torch
import transformers

import flce.experts as fx


def deepseek_v4(hidden, inter, experts, top_k):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    config = transformers.DeepseekV4Config(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                                           num_local_experts=experts, n_routed_experts=experts,
                                           num_experts_per_tok=top_k)
    return DeepseekV4Experts(config), config, 4.0  # projections of std ~4: the clamp at 10 bites now and then


def gpt_oss(hidden, inter, experts, top_k):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                       num_experts_per_tok=top_k)
    return GptOssExperts(config), config, 3.0  # the clamp at 7 bites now and then


def nemotron_h(hidden, inter, experts, top_k):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = transformers.NemotronHConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                                          num_experts_per_tok=top_k)
    return NemotronHExperts(config), config, 1.0


FAMILIES = {"deepseek_v4": (deepseek_v4, ["8192x4096x2048x256x6", "8192x2048x768x128x8"]),
            "gpt_oss": (gpt_oss, ["8192x2880x2880x32x4", "8192x2880x2880x128x4", "16384x2880x2880x32x4"]),
            "nemotron_h": (nemotron_h, ["8192x2688x1856x128x6", "16384x2688x1856x128x6"])}


def layer(family: str, shape: str):
    tokens, hidden, inter, experts, top_k = map(int, shape.split("x"))
    torch.manual_seed(0)
    module, config, spread = FAMILIES[family][0](hidden, inter, experts, top_k)
    module = module.to("cuda", torch.bfloat16)
    with torch.no_grad():
        first = module.gate_up_proj if hasattr(module, "gate_up_proj") else module.up_proj  # ungated: up_proj
        first.normal_(std=hidden**-0.5 * spread)
        module.down_proj.normal_(std=inter**-0.5)
        for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
            if isinstance(getattr(module, name, None), torch.Tensor):
                getattr(module, name).normal_(std=0.1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(tokens, experts, device="cuda").argsort(1)[:, :top_k]
    weights = torch.rand(tokens, top_k, device="cuda", requires_grad=True)
    return module, config, x, ids, weights


def main(family: str, shapes: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__, family)
    for shape in shapes or FAMILIES[family][1]:
        measure(family, shape)
        torch.cuda.empty_cache()


def measure(family: str, shape: str) -> None:
    module, config, x, ids, weights = layer(family, shape)
    grad = torch.randn_like(x)
    leaves = [x, weights, *(p for p in module.parameters())]
    operands = fx.expert_operands(module)
    assert operands is not None, f"flce does not compute {type(module).__name__}"

    def on(impl):
        def step():
            config._experts_implementation = impl
            return torch.autograd.grad(module(x, ids, weights), leaves, grad)
        return step

    def plain():
        out = fx.experts_forward(x, ids, weights, operands.gate_up, operands.down, activation=operands.act.kind)
        return torch.autograd.grad(out, [x, weights, operands.gate_up, operands.down], grad)

    methods = {"grouped_mm": on("grouped_mm"), "flce": on("flce"),
               "flce, plain SwiGLU" if operands.act.gated else "flce, direct call": plain}
    times: dict[str, list[float]] = {name: [] for name in methods}
    peaks = {}
    for name, fn in methods.items():  # warm: compile, autotune, the dispatch's timing
        fn(), fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for _ in range(15):
        for name, fn in methods.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    base_ms = statistics.median(times["grouped_mm"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{shape} {name:18s} {ms:8.3f} ms (x grouped_mm {base_ms / ms:.2f}), peak +{peaks[name]:.0f} MiB",
              flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    if len(sys.argv) < 2 or sys.argv[1] not in FAMILIES:
        sys.exit(f"usage: family_experts_probe.py {{{','.join(FAMILIES)}}} [TxHxIxExK ...]")
    main(sys.argv[1], sys.argv[2:])
