"""Probe: Llama 4's MoE block (``Llama4TextMoe``: router, experts, shared expert) as transformers computes it (every
expert on every token, the unselected ones on zeros) and as flce computes it after ``apply_flce_patch``
(``patches/moe_blocks.py``: the selected experts only, through flce's experts). Forward + backward, bf16, timed in
interleaved rounds (``common.median_of_rounds``), peak memory above the inputs and weights (gradients included), and
the two outputs' difference. GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/llama4_moe_probe.py [TxHxIxExK ...]

Default shapes: Llama-4-Scout's layer (H 5120, I 8192, 16 experts, top-1) at 4096 and 16384 tokens, Maverick's (128
experts) at 2048 tokens, where the dense block may not fit (reported as out of memory).
"""
from __future__ import annotations

import sys
import warnings

import torch
import transformers
from common import is_oom, median_of_rounds, peak_extra_mb
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

from flce.patches import moe_blocks

SHAPES = ["4096x5120x8192x16x1", "16384x5120x8192x16x1", "2048x5120x8192x128x1"]


def block_for(shape: str):
    tokens, hidden, inter, experts, top_k = map(int, shape.split("x"))
    config = transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                           num_experts_per_tok=top_k)
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = Llama4TextMoe(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():  # fan-in scaling; the experts' gate_up_proj is (E, H, 2I), down_proj (E, I, H)
            p.normal_(std=(p.shape[-2] if p.dim() == 3 else p.shape[-1]) ** -0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return block, x


def measure(shape: str) -> None:
    block, x = block_for(shape)
    grad = torch.randn_like(x)
    leaves = [x, *block.parameters()]

    def on(sparse: bool):
        def step():
            (moe_blocks.enable if sparse else moe_blocks.disable)(block)
            out, _ = block(x)
            return out, torch.autograd.grad(out, leaves, grad)
        return step

    methods = {"transformers (dense)": on(False), "flce": on(True)}
    peaks, outs = {}, {}
    for name, fn in list(methods.items()):  # warm (autotune, the dispatch's timing), peak memory, output
        try:
            fn()
            peaks[name] = peak_extra_mb(fn, x.device)
            outs[name] = fn()[0].float()
        except Exception as e:  # noqa: BLE001 - out of memory is a result; anything else is raised
            if not is_oom(e):
                raise
            print(f"{shape} {name:22s} out of memory", flush=True)
            del methods[name]
            torch.cuda.empty_cache()
    times = median_of_rounds(methods, x.device, reps=3)
    dense_ms = times.get("transformers (dense)")
    for name, ms in times.items():
        speed = f"(x dense {dense_ms / ms:.2f})" if dense_ms else ""
        print(f"{shape} {name:22s} {ms:9.3f} ms {speed:16s} peak +{peaks[name]:.0f} MiB", flush=True)
    if len(outs) == 2:
        a, b = outs.values()
        print(f"{shape} outputs differ by {((a - b).norm() / b.norm()).item():.2e} (relative L2)", flush=True)


def main(shapes: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__)
    for shape in shapes or SHAPES:
        measure(shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(sys.argv[1:])
