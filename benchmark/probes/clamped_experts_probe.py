"""Probe: an experts layer with a clamped SwiGLU (DeepSeek-V4's ``DeepseekV4Experts``, ``swiglu_limit``) on
transformers' grouped_mm backend and on flce's, forward + backward, bf16; and flce's layer without the clamp, for
what the clamp costs in its SwiGLU kernels. Timed in interleaved rounds (median of CUDA-event times), peak memory
above the inputs. Needs a transformers with DeepSeek-V4 (5.24 has it). GPU only:

    PYTHONPATH=src python benchmark/probes/clamped_experts_probe.py [TxHxIxExK ...]   # default: V4's layer, 8192
"""
from __future__ import annotations

import statistics
import sys
import warnings

import torch
import transformers

import flce.experts as fx


def layer(shape: str):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    tokens, hidden, inter, experts, top_k = map(int, shape.split("x"))
    config = transformers.DeepseekV4Config(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                                           num_local_experts=experts, n_routed_experts=experts,
                                           num_experts_per_tok=top_k)
    torch.manual_seed(0)
    module = DeepseekV4Experts(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=hidden**-0.5 * 4)  # projections of std ~4: the clamp at 10 bites now and then
        module.down_proj.normal_(std=inter**-0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda", requires_grad=True)
    return module, config, x, ids, weights


def main(shapes: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__)
    for shape in shapes:
        measure(shape)
        torch.cuda.empty_cache()


def measure(shape: str) -> None:
    module, config, x, ids, weights = layer(shape)
    grad = torch.randn_like(x)
    leaves = (x, weights, module.gate_up_proj, module.down_proj)

    def on(impl):
        def step():
            config._experts_implementation = impl
            return torch.autograd.grad(module(x, ids, weights), leaves, grad)
        return step

    def unclamped():
        out = fx.experts_forward(x, ids, weights, module.gate_up_proj, module.down_proj)
        return torch.autograd.grad(out, leaves, grad)

    methods = {"grouped_mm": on("grouped_mm"), "flce": on("flce"), "flce, no clamp": unclamped}
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
        print(f"{shape} {name:15s} {ms:8.3f} ms (x grouped_mm {base_ms / ms:.2f}), peak +{peaks[name]:.0f} MiB",
              flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(sys.argv[1:] or ["8192x4096x2048x256x6", "8192x2048x768x128x8"])
