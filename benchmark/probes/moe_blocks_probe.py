"""Probe: MoE modules without transformers' experts decorator, as transformers computes them and as flce computes them
after ``apply_flce_patch`` (``patches/moe_blocks.py``). Forward + backward, bf16, timed in interleaved rounds
(``common.median_of_rounds``), peak memory above the inputs and weights (gradients included), and the two outputs'
difference. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/moe_blocks_probe.py {llama4,longcat} [TxHxIxExK ...]

llama4: Llama 4's MoE block (router, experts, shared expert; transformers runs every expert on every token); default
shapes Llama-4-Scout's layer (H 5120, I 8192, 16 experts, top-1) at 4096 and 16384 tokens, Maverick's (128 experts) at
2048 tokens, where the dense block may not fit (reported as out of memory). longcat: LongCat-Flash's experts (512
routed and 256 identity experts, top-12; transformers loops over the experts a batch hits, a host sync each), the
routing drawn uniformly over all 768; default shape its layer (H 6144, I 2048) at 4096 tokens. (Before 2026-11-28 this
probe was ``llama4_moe_probe.py``, llama4 only.)
"""
from __future__ import annotations

import sys
import warnings

import torch
import transformers
from common import is_oom, median_of_rounds, peak_extra_mb

from flce.patches import moe_blocks


def llama4(tokens, hidden, inter, experts, top_k):
    """The block and its call on (tokens, H) hidden states: (output, leaves to differentiate)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                           num_experts_per_tok=top_k)
    with torch.device("cuda"):
        module = Llama4TextMoe(config).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return module, lambda: module(x)[0], [x, *module.parameters()]


def longcat(tokens, hidden, inter, experts, top_k, identity=256):
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    config = transformers.LongcatFlashConfig(hidden_size=hidden, expert_ffn_hidden_size=inter, n_routed_experts=experts,
                                             zero_expert_num=identity, moe_topk=top_k)
    with torch.device("cuda"):
        module = LongcatFlashExperts(config).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(tokens, experts + identity, device="cuda").argsort(1)[:, :top_k]
    weights = torch.rand(tokens, top_k, device="cuda", requires_grad=True)
    return module, lambda: module(x, ids, weights), [x, weights, module.gate_up_proj, module.down_proj]


FAMILIES = {"llama4": (llama4, ["4096x5120x8192x16x1", "16384x5120x8192x16x1", "2048x5120x8192x128x1"]),
            "longcat": (longcat, ["4096x6144x2048x512x12"])}


def measure(family: str, shape: str) -> None:
    torch.manual_seed(0)
    module, call, leaves = FAMILIES[family][0](*map(int, shape.split("x")))
    with torch.no_grad():
        for p in module.parameters():  # fan-in scaling (3-D experts weights: the middle dimension is the input's)
            p.normal_(std=(p.shape[-2] if p.dim() == 3 and family == "llama4" else p.shape[-1]) ** -0.5)
    grad = torch.randn_like(leaves[0])

    def on(sparse: bool):
        def step():
            (moe_blocks.enable if sparse else moe_blocks.disable)(module)
            out = call()
            return out, torch.autograd.grad(out, leaves, grad)
        return step

    methods = {"transformers": on(False), "flce": on(True)}
    peaks, outs = {}, {}
    for name, fn in list(methods.items()):  # warm (autotune, the dispatch's timing), peak memory, output
        try:
            fn()
            peaks[name] = peak_extra_mb(fn, grad.device)
            outs[name] = fn()[0].float()
        except Exception as e:  # noqa: BLE001 - out of memory is a result; anything else is raised
            if not is_oom(e):
                raise
            print(f"{shape} {name:14s} out of memory", flush=True)
            del methods[name]
            torch.cuda.empty_cache()
    times = median_of_rounds(methods, grad.device, reps=3)
    base_ms = times.get("transformers")
    for name, ms in times.items():
        speed = f"(x transformers {base_ms / ms:.2f})" if base_ms else ""
        print(f"{shape} {name:14s} {ms:9.3f} ms {speed:23s} peak +{peaks[name]:.0f} MiB", flush=True)
    if len(outs) == 2:
        a, b = outs.values()
        print(f"{shape} outputs differ by {((a - b).norm() / b.norm()).item():.2e} (relative L2)", flush=True)


def main(family: str, shapes: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__, family)
    for shape in shapes or FAMILIES[family][1]:
        measure(family, shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    if len(sys.argv) < 2 or sys.argv[1] not in FAMILIES:
        sys.exit(f"usage: moe_blocks_probe.py {{{','.join(FAMILIES)}}} [TxHxIxExK ...]")
    main(sys.argv[1], sys.argv[2:])
