"""Probe: what flce's experts give a torch.compile'd MoE training step. A Qwen3-MoE model of a few layers at
Qwen3-30B-A3B's layer size, its loss fused by apply_flce_patch; the step (forward with labels, backward) eager and
compiled, its experts on transformers' grouped_mm, on flce (under compile the custom op ``flce::experts``, traced
into the graph) or on ``flce_break`` (flce's layer behind a graph break, run eagerly: how it ran before the custom
op). The variants take turns in rounds. ``--trace``: what stays allocated between eager steps and what is alive at a
step's peak, per experts backend (found the patch's reference cycle that kept a deleted model's weights and
gradients, fixed in apply.py). ``--profile``: per variant, the wall time and the GPU's kernel time per step, kernels
per step and the host's busiest ops (torch.profiler). Each step zeroes the gradients first, as a training loop does;
``--accumulate`` keeps them instead (as this probe did before 2026-11-27: under ``mode="reduce-overhead"`` with the
first step compiled, every backend then fails at its second step, the accumulated ``.grad`` being a CUDA graph's
output that the next replay overwrites). GPU only:

    PYTHONPATH=src python benchmark/probes/moe_compile_probe.py [--layers 4] [--tokens 8192] [--mode reduce-overhead]
        [--modes eager,compiled] [--trace] [--profile] [--accumulate]
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


BACKENDS = ("grouped_mm", "flce", "flce_break")  # flce_break: flce's layer behind a graph break, run eagerly


def build(layers: int, experts: str) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).train()
    flce.apply_flce_patch(model, use_flce_experts=experts != "grouped_mm")
    if experts == "flce_break":  # how flce's layer ran under torch.compile before the custom op
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(experts, torch.compiler.disable(flce.experts.flce_experts_forward))
    model.set_experts_implementation(flce.experts.BACKEND_NAME if experts == "flce" else experts)
    return model


def first_step(model, ids, compiled: bool, mode: str | None = None, accumulate: bool = False):
    """The step function (gradients zeroed unless ``accumulate``, forward with labels, backward) and its first call's
    seconds, peak memory (MiB: compiling, autotuning, the experts' path timing) and graph count (compiled: how many
    graphs dynamo made)."""
    forward = torch.compile(model, mode=mode) if compiled else model

    def step():
        if not accumulate:
            model.zero_grad(set_to_none=True)
        if mode == "reduce-overhead":  # a new step: the CUDA graphs may reuse the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        forward(input_ids=ids, labels=ids).loss.backward()

    torch._dynamo.utils.counters.clear()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return step, {"first_s": time.perf_counter() - start, "first_peak": torch.cuda.max_memory_allocated() / 2**20,
                  "graphs": graphs}


def steady_peak(step) -> float:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


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


def profile_steps(step, steps: int = 5) -> None:
    """Wall and GPU kernel time per step, kernels per step, and the ops with the most host time (self)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    gpu = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    print(f"   wall {wall:.2f} ms a step, GPU kernels {gpu:.2f} ms, {sum(e.count for e in kernels) / steps:.0f} "
          "kernels a step; most host time (self):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"   {e.self_cpu_time_total / steps / 1e3:7.2f} ms a step in {e.count // steps:4d} calls  {e.key[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mode", default=None, help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--trace", action="store_true", help="what is alive at an eager step's peak, per backend")
    parser.add_argument("--profile", action="store_true", help="wall, GPU kernel time and host ops per variant")
    parser.add_argument("--accumulate", action="store_true", help="keep the gradients across steps (no zero_grad)")
    args = parser.parse_args()
    seq = min(args.seq, args.tokens)  # fewer tokens than --seq: one sequence of them all
    ids = torch.randint(0, 32000, (args.tokens // seq, seq), device="cuda")
    print(f"Qwen3-MoE, {args.layers} layers (H 2048, I 768, E 128, top-8), {args.tokens} tokens, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"compile mode {args.mode}")
    if args.trace:
        for experts in ("grouped_mm", "flce"):
            print(experts)
            trace_peak(build(args.layers, experts), ids)
            gc.collect()
            torch.cuda.empty_cache()
        return
    variants = [(mode, experts) for mode in ("eager", "compiled") for experts in BACKENDS
                if (mode, experts) != ("eager", "flce_break")]  # eagerly flce_break is flce
    variants = [v for v in variants if v[0] in args.modes.split(",")]
    models = {experts: build(args.layers, experts) for experts in {e for _, e in variants}}
    steps, times = {}, {v: [] for v in variants}
    for mode, experts in list(variants):
        try:
            steps[mode, experts], info = first_step(models[experts], ids, mode == "compiled", args.mode,
                                                    args.accumulate)
            info["peak"] = steady_peak(steps[mode, experts])
        except RuntimeError as error:  # e.g. CUDA graphs across graph breaks: reported, left out of the rounds
            print(f"{mode:8s} {experts:10s} failed: {str(error).splitlines()[0][:300]}", flush=True)
            variants.remove((mode, experts))
            times.pop((mode, experts))
            continue
        print(f"{mode:8s} {experts:10s} first call {info['first_s']:.1f} s, peak {info['first_peak']:.0f} MiB; "
              f"steady peak {info['peak']:.0f} MiB" + (f"; {info['graphs']} graphs" if mode == "compiled" else ""),
              flush=True)
        if args.profile:
            profile_steps(steps[mode, experts])
    for r in range(args.rounds if variants else 0):  # the variants take turns, starting one later each round
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times[v] += event_times(steps[v], reps=args.reps, warmup=1)
    print(f"step (forward with labels + backward), median of {args.rounds} rounds x {args.reps} steps, "
          "each step between two CUDA events:")
    for (mode, experts), ts in times.items():
        ts = sorted(ts)
        print(f"{mode:8s} {experts:10s} {statistics.median(ts):8.2f} ms  (p10 {ts[len(ts) // 10]:.2f}, "
              f"p90 {ts[len(ts) * 9 // 10]:.2f})", flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main()
