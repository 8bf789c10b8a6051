"""Probe: the experts layer's elementwise kernels alone (SwiGLU forward / backward, combine and its backward, the
biases' per-expert sums), plain SwiGLU against GPT-OSS's form (clamp, alpha, up + 1, interleaved, biases), at
GPT-OSS-20B's layer size. Median of interleaved rounds of CUDA-event times. To compare two trees, run it on each
(the kernels' signatures are those of 0437d29 on). GPU only:

    PYTHONPATH=src python benchmark/probes/experts_elementwise_probe.py [SxIxHxE]   # default 32768x2880x2880x32
"""
from __future__ import annotations

import statistics
import sys

import torch

from flce.kernels import experts_triton as k
from flce.kernels.experts_torch import Glu


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
    plain, gpt_oss = Glu(), Glu(7.0, 1.702, 1.0, True)
    return {
        "swiglu plain": lambda: k.swiglu_triton(h, n_valid, plain),
        "swiglu gpt_oss": lambda: k.swiglu_triton(h, n_valid, gpt_oss, bias, row_experts),
        "swiglu_backward plain": lambda: k.swiglu_backward_triton(h, da, n_valid, plain),
        "swiglu_backward gpt_oss": lambda: k.swiglu_backward_triton(h, da, n_valid, gpt_oss, bias, row_experts),
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
    for fn in fns.values():  # compile
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(20):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    for name, ts in times.items():
        print(f"{name:26s} {statistics.median(ts) * 1e3:8.1f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "32768x2880x2880x32")
