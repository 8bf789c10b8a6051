"""Probe: what flce's experts cost a torch.compile'd MoE training step, where each experts layer is one graph
break (the layer runs eagerly). A Qwen3-MoE model of a few layers at Qwen3-30B-A3B's layer size, its loss
fused by apply_flce_patch; the step (forward with labels, backward) eager and compiled, its experts on
transformers' grouped_mm or on flce. ``--trace``: what stays allocated between eager steps and what is alive at a
step's peak, per experts backend (found the patch's reference cycle that kept a deleted model's weights and
gradients, fixed in apply.py). GPU only:

    PYTHONPATH=src python benchmark/probes/moe_compile_probe.py [--layers 4] [--tokens 8192] [--trace]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flce  # noqa: E402
from breakdown import event_times  # noqa: E402
from probes.memory_trace_probe import _peak  # noqa: E402


def build(layers: int, experts: str) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).train()
    flce.apply_flce_patch(model, use_flce_experts=experts == "flce")
    model.set_experts_implementation(flce.experts.BACKEND_NAME if experts == "flce" else "grouped_mm")
    return model


def step_ms(model, ids, compiled: bool) -> dict[str, float]:
    """Forward with labels + backward: the median step (ms) and its spread, the first call's seconds, and the
    peak memory (MiB) of the first call (compiling, autotuning, the experts' path timing) and of later steps."""
    forward = torch.compile(model) if compiled else model

    def step():
        forward(input_ids=ids, labels=ids).loss.backward()

    mib = 2**20
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first, first_peak = time.perf_counter() - start, torch.cuda.max_memory_allocated() / mib
    step()
    torch.cuda.reset_peak_memory_stats()
    times = event_times(step, reps=20, warmup=2)
    steady_peak = torch.cuda.max_memory_allocated() / mib
    model.zero_grad(set_to_none=True)
    return {"median": statistics.median(times), "spread": times[-1] - times[0], "first_s": first,
            "first_peak": first_peak, "peak": steady_peak}


def _where(frames: list[dict]) -> str:
    frames = [f for f in frames if "flce" in f["filename"] or "transformers" in f["filename"]] or frames[:2]
    return "; ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3])


def trace_peak(model, ids) -> None:
    """What stays allocated between eager steps (beyond the weights), and the allocations alive at a step's
    peak, largest first, with the flce and transformers lines that made them."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    held = [b for seg in torch.cuda.memory._snapshot()["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated" and b.get("frames")]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    print(f"   between steps {torch.cuda.memory_allocated() / 2**20:.0f} MiB: weights {weights / 2**20:.0f}, "
          f"grads {grads / 2**20:.0f}; made by the steps, by where:")
    by_where: dict[str, list[int]] = {}
    for block in held:
        by_where.setdefault(_where(block["frames"]), []).append(block["size"])
    for where, sizes in sorted(by_where.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"   {sum(sizes) / 2**20:9.1f} MiB in {len(sizes):4d}  {where}")
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, alive = _peak(trace)
    print(f"   allocations of the recorded steps peak at {peak / 2**20:.0f} MiB:")
    for event in sorted(alive, key=lambda e: -e["size"])[:10]:
        print(f"   {event['size'] / 2**20:9.1f} MiB  {_where(event.get('frames', []))}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--trace", action="store_true", help="what is alive at an eager step's peak, per backend")
    args = parser.parse_args()
    ids = torch.randint(0, 32000, (args.tokens // args.seq, args.seq), device="cuda")
    print(f"Qwen3-MoE, {args.layers} layers (H 2048, I 768, E 128, top-8), {args.tokens} tokens, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    if args.trace:
        for experts in ("grouped_mm", "flce"):
            print(experts)
            trace_peak(build(args.layers, experts), ids)
            gc.collect()
            torch.cuda.empty_cache()
        return
    for compiled in (False, True):
        for experts in ("grouped_mm", "flce"):
            torch._dynamo.reset()
            model = build(args.layers, experts)
            r = step_ms(model, ids, compiled)
            mode = "compiled" if compiled else "eager"
            print(f"{mode:8s} {experts:10s} step {r['median']:8.2f} ms (spread {r['spread']:.2f}), peak "
                  f"{r['peak']:.0f} MiB; first call {r['first_s']:.1f} s, peak {r['first_peak']:.0f} MiB", flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main()
