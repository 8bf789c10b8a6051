"""Probe: the experts layer's elementwise kernels alone (SwiGLU forward / backward, combine and its backward, the
biases' per-expert sums), plain SwiGLU against GPT-OSS's form (clamp, alpha, up + 1, interleaved, biases),
Inkling-2's softcaps and the ungated relu2, at GPT-OSS-20B's layer size. Median of 10 interleaved rounds of each
kernel's median of 5 calls (CUDA events). To compare two trees, run it on each (the kernels' signatures are those
of 44e5730 on). GPU only:

    PYTHONPATH=src python benchmark/probes/experts_elementwise_probe.py [SxIxHxE]   # default 32768x2880x2880x32
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from flce.kernels import experts_triton as k
from flce.kernels.experts_torch import RELU2, Activation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: common's timing
from common import median_of_rounds  # noqa: E402


def cases(rows: int, inter: int, hidden: int, experts: int) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    h = torch.randn(rows, 2 * inter, device=dev, dtype=bf16)
    da = torch.randn(rows, inter, device=dev, dtype=bf16)
    bias, bias_down = (torch.randn(experts, n, device=dev, dtype=bf16) for n in (2 * inter, hidden))
    row_experts = torch.arange(rows, device=dev) * experts // rows
    offsets = torch.searchsorted(row_experts, torch.arange(experts + 1, device=dev), out_int32=True)
    n_valid = offsets[-1:]
    y = torch.randn(rows, hidden, device=dev, dtype=bf16)
    tokens = rows // 4
    perm = torch.randperm(rows, device=dev)
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(rows, device=dev)).view(tokens, 4)
    weights = torch.rand(tokens, 4, device=dev)
    grad = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    plain, gpt_oss = Activation(), Activation(7.0, 1.702, 1.0, True)
    softcaps = Activation(gate_softcap=4.0, up_softcap=25.0)  # Inkling-2's
    return {
        "swiglu plain": lambda: k.activation_triton(h, n_valid, plain),
        "swiglu gpt_oss": lambda: k.activation_triton(h, n_valid, gpt_oss, bias, row_experts),
        "swiglu_backward plain": lambda: k.activation_backward_triton(h, da, n_valid, plain),
        "swiglu_backward gpt_oss": lambda: k.activation_backward_triton(h, da, n_valid, gpt_oss, bias, row_experts),
        "swiglu softcaps": lambda: k.activation_triton(h, n_valid, softcaps),
        "swiglu_backward softcaps": lambda: k.activation_backward_triton(h, da, n_valid, softcaps),
        "relu2": lambda: k.activation_triton(h[:, :inter], n_valid, RELU2),
        "relu2_backward": lambda: k.activation_backward_triton(h[:, :inter], da, n_valid, RELU2),
        "combine": lambda: k.combine_triton(y, pos, weights, n_valid, bf16),
        "combine, bias": lambda: k.combine_triton(y, pos, weights, n_valid, bf16, bias_down, row_experts),
        "combine_backward": lambda: k.combine_backward_triton(grad, y, perm, weights, n_valid, bf16),
        "combine_backward, bias": lambda: k.combine_backward_triton(grad, y, perm, weights, n_valid, bf16, bias_down,
                                                                    row_experts),
        "expert_sums (S, 2I)": lambda: k.expert_sums_triton(h, offsets),
        "expert_sums (S, H)": lambda: k.expert_sums_triton(y, offsets),
    }


def main(shape: str) -> None:
    rows, inter, hidden, experts = map(int, shape.split("x"))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"S {rows} I {inter} H {hidden} E {experts}")
    fns = cases(rows, inter, hidden, experts)
    for name, ms in median_of_rounds(fns, torch.device("cuda"), reps=5, rounds=10).items():
        print(f"{name:26s} {ms * 1e3:8.1f} us")

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "32768x2880x2880x32")
