"""Probe: flce.linear_cross_entropy under torch.compile (the custom ops of ``flce/loss_op.py``). A training step
(loss, then torch.autograd.grad of input and weight), bf16: flce eagerly; compiled (inductor, fullgraph), and with
CUDA graphs (``mode="reduce-overhead"``); compiled behind a graph break at the loss (``loss_op.TRACED = False``:
the eager call), with and without CUDA graphs; torch's F.linear + F.cross_entropy compiled both ways; the three
cuBLAS GEMMs (the floor). Per variant: milliseconds per step in a running loop (one sync at the end: the bench's
loop reading, where a host-bound step shows its host's time), x the floor's, the median of rounds in which the
variants take turns; and each compiled flce variant's gradients against eager flce's (relative error). GPU only:

    PYTHONPATH=src:benchmark python benchmark/probes/compiled_loss_probe.py [--only A,B] [--profile] [BTxHxV ...]

``--only``: these variants alone (names as printed, e.g. "flce eager,flce graphs"). ``--profile``: instead,
torch.profiler over three steps of "flce compiled" and "flce break": GPU kernels, host ops and their times, to find
where the two differ.
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
from common import parse_shape, running_loop_ms

import flce
from flce import loss_op

SHAPES = ["16x4096x128256", "256x4096x128256", "8192x4096x128256", "16x2048x32000"]


def flce_loss(x, w, t):
    return flce.linear_cross_entropy(x, w, t)


def torch_loss(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def floor_step(x, w, t):
    z = x @ w.t()
    return z @ w, z.t() @ x


def variants() -> dict:
    """name -> (loss function, loss_op.TRACED while it runs); the CUDA-graph variants last (see ``main``)."""
    def compiled(fn, mode=None, fullgraph=True):
        return torch.compile(fn, mode=mode, fullgraph=fullgraph, dynamic=False)

    return {"flce eager": (flce_loss, True), "flce compiled": (compiled(flce_loss), True),
            "flce break": (compiled(flce_loss, fullgraph=False), False), "torch compiled": (compiled(torch_loss), True),
            "flce graphs": (compiled(flce_loss, "reduce-overhead"), True),
            "flce break graphs": (compiled(flce_loss, "reduce-overhead", fullgraph=False), False),
            "torch graphs": (compiled(torch_loss, "reduce-overhead"), True)}


def step_of(loss_fn, x, w, t):
    def step():
        torch.compiler.cudagraph_mark_step_begin()
        return torch.autograd.grad(loss_fn(x, w, t), (x, w))
    return step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(shapes: list[str], rounds: int = 5, only: list[str] | None = None) -> None:
    """Variants without CUDA graphs take turns in ``rounds`` rounds with the floor (the GPU's clock drifts
    between them); each CUDA-graph variant then runs its rounds alone, beside the floor, as a training loop
    with one compiled model would (CUDA-graph trees taking turns with other graphed functions re-record)."""
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for spec in shapes:
        bt, hidden, vocab = parse_shape(spec, "BTxHxV")
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(bt, hidden, device=device, generator=g).bfloat16().requires_grad_()
        # a Parameter, as a model's head: CUDA graphs keep its address instead of copying it in at every replay
        w = torch.nn.Parameter((torch.randn(vocab, hidden, device=device, generator=g) * hidden**-0.5).bfloat16())
        t = torch.randint(0, vocab, (bt,), device=device, generator=g)
        eager = [g.clone() for g in step_of(flce_loss, x, w, t)()]
        floor = ("floor", lambda: floor_step(x, w, t))
        print(f"\n== {spec}, median of {rounds} rounds")
        torch._dynamo.reset()
        made = {k: v for k, v in variants().items() if only is None or k in only}
        alone = [name for name in made if "graphs" in name]
        turns = [floor] + [(n, with_traced(made[n][1], step_of(made[n][0], x, w, t))) for n in made if n not in alone]
        results = _timed_rounds(turns, eager, bt, device, rounds)
        for name in alone:
            torch._dynamo.reset()
            fn, traced = variants()[name]
            results.update(_timed_rounds([floor, (name, with_traced(traced, step_of(fn, x, w, t)))], eager, bt,
                                         device, rounds, floor_name=f"floor beside {name}"))
        floor_ms = results["floor"][0]
        for name, (ms, host_ms, note) in results.items():
            print(f"{name:28s} {ms:8.3f} ms ({ms / floor_ms:.3f}x floor), host {host_ms:.3f} ms inside a call{note}")
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _timed_rounds(steps: list, eager: list, bt: int, device, rounds: int, floor_name: str = "floor") -> dict:
    """name -> (median ms per step, median host ms inside a call, note) over ``rounds`` rounds of ``steps``
    ((name, step) pairs, first the floor) taking turns; the note compares flce's gradients with eager flce's."""
    samples, notes, kept = {}, {}, []
    for name, step in steps:
        try:
            got = [g.clone() for g in step()]
        except Exception as exc:  # a variant that cannot run here: say so and go on
            print(f"{name:28s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        kept.append((name, step))
        samples[name] = []
        if name.startswith("flce") and name != "flce eager":
            notes[name] = "  first call's grads vs eager flce: " + " / ".join(
                f"{rel_err(a, b):.2e}" for a, b in zip(got, eager))
    for _ in range(rounds):
        for name, step in kept:
            samples[name].append(running_loop_ms(step, device, steps=10 if bt >= 4096 else 100, warmup=3))
    return {(floor_name if name == "floor" else name): (statistics.median(r[0] for r in runs),
                                                         statistics.median(r[1] for r in runs), notes.get(name, ""))
            for name, runs in samples.items()}


def with_traced(traced: bool, step):
    """step with ``loss_op.TRACED`` set as given while it runs (False: the loss behind a graph break)."""
    def run():
        loss_op.TRACED = traced
        try:
            return step()
        finally:
            loss_op.TRACED = True
    return run


def profile(shapes: list[str]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    device = torch.device("cuda")
    for spec in shapes:
        bt, hidden, vocab = parse_shape(spec, "BTxHxV")
        x = torch.randn(bt, hidden, device=device).bfloat16().requires_grad_()
        w = torch.nn.Parameter((torch.randn(vocab, hidden, device=device) * hidden**-0.5).bfloat16())
        t = torch.randint(0, vocab, (bt,), device=device)
        for name in ("flce compiled", "flce break"):
            torch._dynamo.reset()
            loss_op.TRACED = name == "flce compiled"
            step = step_of(torch.compile(flce_loss, fullgraph=loss_op.TRACED, dynamic=False), x, w, t)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(f"\n== {spec} {name}")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        loss_op.TRACED = True


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = None
    if args[:1] == ["--only"]:
        chosen, args = args[1].split(","), args[2:]
    if args[:1] == ["--profile"]:
        profile(args[1:] or ["8192x4096x128256"])
    else:
        main(args or SHAPES, only=chosen)
