"""Probe: the host's time in each stage of flce's experts layer at Qwen3-30B-A3B's layer size (H 2048, I 768, E 128,
top-8), bf16: the layer eagerly (``experts_forward``: the autograd Function) and through the custom op torch.compile
traces (``experts_op``, run eagerly), forward and backward. Each stage is wrapped in a host timer; the calls are
queued behind a long GPU sleep, so nothing waits for the GPU: median microseconds per call. Keep the timed calls few:
CUDA queues ~1024 kernels, past that a launch waits (a call then reads as the whole sleep). Then ``route_pairs`` with
int64 sort keys (before b0b980f) against the int16 keys it sorts now, host and GPU time per call. GPU only:

    PYTHONPATH=src python benchmark/probes/experts_stages_host_probe.py [tokens]      (default 1024)
"""
from __future__ import annotations

import collections
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

import flce
import flce.experts as fx
import flce.experts_function as ef
from flce.kernels import experts_dispatch as dispatch
from flce.kernels import experts_triton, experts_torch

HOST: dict[str, list[float]] = collections.defaultdict(list)
ON = [False]


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if ON[0]:
            HOST[name].append(time.perf_counter() - start)
        return out
    return wrapper


def wrap_stages() -> None:
    fx.route_pairs, fx.plan_for = timed("route_pairs", fx.route_pairs), timed("plan_for", fx.plan_for)
    for name in ("rows_mm", "wgrad_mm", "forward_rows", "backward_rows", "_in_dtypes"):
        setattr(ef, name, timed(name, getattr(ef, name)))
    for name in ("_candidates", "_key", "_pick"):
        setattr(dispatch, name, timed("  dispatch " + name, getattr(dispatch, name)))
    for table, role in ((dispatch._ROWS, "rows"), (dispatch._WGRAD, "wgrad")):
        for path, fn in list(table.items()):
            if isinstance(fn, str):
                setattr(experts_triton, fn, timed(f"  {role} GEMM {path}", getattr(experts_triton, fn)))
            else:
                table[path] = timed(f"  {role} GEMM {path}", fn)
    ops = dispatch.elementwise_ops("triton")
    for name in list(ops):
        ops[name] = timed("elementwise " + name, ops[name])
    ef.ExpertsFunction.forward = staticmethod(timed("Function.forward body", ef.ExpertsFunction.forward))
    ef.ExpertsFunction.backward = staticmethod(timed("Function.backward body", ef.ExpertsFunction.backward))


@triton.jit
def _nothing(a, b, c, d, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, BLOCK: tl.constexpr):
    pass


def route_int64_keys(top_k_index: torch.Tensor, num_experts: int) -> ef.Routes:
    """route_pairs as it was before b0b980f: int64 sort keys."""
    ids = top_k_index.reshape(-1)
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    sorted_keys, perm = torch.sort(keys, stable=True)
    offsets = torch.searchsorted(sorted_keys, torch.arange(num_experts + 1, device=ids.device), out_int32=True)
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=ids.device))
    return ef.Routes(perm=perm, pos=pos.view(top_k_index.shape), offsets=offsets, experts=sorted_keys)


def host_us(fn, *args, calls: int = 20) -> float:
    torch.cuda._sleep(int(1e9))
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds * 1e6


def gpu_us(fn, *args, calls: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*args)
    torch.cuda._sleep(int(5e8))  # the calls queue up behind it: their GPU time alone, no host gaps
    start.record()
    for _ in range(calls):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    experts, hidden, inter, top_k, device = 128, 2048, 768, 8, "cuda"
    torch.manual_seed(0)
    x = (torch.randn(tokens, hidden, device=device) * 0.5).bfloat16().requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) / 45).bfloat16().requires_grad_()
    down = (torch.randn(experts, hidden, inter, device=device) / 28).bfloat16().requires_grad_()
    weights, index = torch.topk(torch.randn(tokens, experts, device=device).softmax(-1), top_k, dim=-1)
    weights.requires_grad_()
    grad = torch.randn(tokens, hidden, device=device).bfloat16()
    wrap_stages()

    def step(kind: str) -> None:
        start = time.perf_counter()
        if kind == "eager":
            out = flce.experts_forward(x, index, weights, gate_up, down)
        else:
            out = ef.experts_op(x, index, weights, gate_up, down, None, None, torch.bfloat16, None, "auto",
                                experts_torch.SWIGLU)
        middle = time.perf_counter()
        out.backward(grad)
        if ON[0]:
            HOST[f"{kind}: forward"].append(middle - start)
            HOST[f"{kind}: backward"].append(time.perf_counter() - middle)

    for kind in ("eager", "op"):
        for _ in range(3):
            step(kind)
    torch.cuda.synchronize()
    for kind in ("eager", "op"):
        torch.cuda._sleep(int(3e9))
        ON[0] = True
        for _ in range(10):
            step(kind)
        ON[0] = False
        torch.cuda.synchronize()
    a = torch.empty(16, device=device)
    _nothing[(1,)](a, a, a, a, *range(11), BLOCK=16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; {tokens} tokens; "
          f"an empty Triton launch (15 arguments) {host_us(_nothing[(1,)], a, a, a, a, *range(11), 16):.1f} us")
    print(f"{'stage':34s} {'calls a step':>12s} {'us a call':>10s}")
    for name, times in HOST.items():
        per_step = len(times) / (10 if ":" in name else 20)
        print(f"{name:34s} {per_step:12.1f} {statistics.median(times) * 1e6:10.1f}")
    for n_experts, k in ((128, 8), (8, 2), (256, 8)):
        ids = torch.topk(torch.randn(tokens, n_experts, device=device), k, dim=-1).indices
        for name, fn in (("int64 keys", route_int64_keys), ("int16 keys", ef.route_pairs)):
            hosts = [host_us(fn, ids, n_experts) for _ in range(3)]
            print(f"route_pairs, E {n_experts} top-{k}, {name}: host {min(hosts):.1f} us, "
                  f"GPU {gpu_us(fn, ids, n_experts):.1f} us a call")


if __name__ == "__main__":
    main()
