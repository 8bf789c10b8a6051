"""Wall time per step at small BT (flce, flce without the target check, eager) and a host-side
profile of flce vs eager: where a launch-bound step spends its CPU time.

    PYTHONPATH=src python benchmark/small_bt_host.py 64
    PYTHONPATH=src python benchmark/small_bt_host.py 16 --host   (host cost per part, GPU held busy)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import flce

HIDDEN, VOCAB = 4096, 128256


def main(bt: int) -> None:
    dev = torch.device("cuda")
    x = torch.randn(bt, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, device=dev) * HIDDEN**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, VOCAB, (bt,), device=dev)
    steps = {
        "flce": lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w)),
        "flce_nocheck": lambda: torch.autograd.grad(flce.linear_cross_entropy(x, w, t, validate_target=False),
                                                    (x, w)),
        "eager": lambda: torch.autograd.grad(F.cross_entropy((x @ w.t()).float(), t), (x, w)),
    }
    for rnd in range(3):
        for name, fn in steps.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            calls = 0.0
            for _ in range(50):
                t0 = time.perf_counter()
                fn()
                calls += time.perf_counter() - t0
            torch.cuda.synchronize()
            print(f"BT={bt} round {rnd} {name}: wall/step {(time.perf_counter() - start) / 50 * 1e3:.3f} ms, "
                  f"host/step {calls / 50 * 1e3:.3f} ms", flush=True)
    for name in ("flce", "eager"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                steps[name]()
            torch.cuda.synchronize()
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))


def host_costs(bt: int, steps: int = 50) -> None:
    """Host time per step with the GPU held busy by a sleep kernel, so that nothing waits for it: what
    each part of a sync-free flce step (validate_target=False) costs the CPU, next to eager."""
    import flce.api
    import flce.function

    dev = torch.device("cuda")
    x = torch.randn(bt, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, device=dev) * HIDDEN**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, VOCAB, (bt,), device=dev)
    counts = flce.api.count_targets(t, -100, VOCAB, "triton")

    def unchecked():
        return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, validate_target=False), (x, w))

    def three_mm():
        lg = x.detach() @ w.detach().t()
        return lg @ w.detach(), lg.t() @ x.detach()

    variants = {
        "eager": lambda: torch.autograd.grad(F.cross_entropy((x @ w.t()).float(), t), (x, w)),
        "three mm alone": three_mm,
        "flce unchecked": unchecked,
        "  without the count launch": ("count_targets", lambda *a, **k: counts, flce.api),
        "  without the CE launch": ("ce_chunk", lambda *a, **k: None, flce.function),
    }
    for rnd in range(2):
        for name, fn in variants.items():
            saved = None
            if isinstance(fn, tuple):
                attr, stub, module = fn
                saved = (module, attr, getattr(module, attr))
                setattr(module, attr, stub)
                fn = unchecked
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the host never waits below
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            host = (time.perf_counter() - start) / steps * 1e6
            torch.cuda.synchronize()
            if saved is not None:
                setattr(*saved)
            print(f"BT={bt} round {rnd} {name}: host {host:.0f} us/step", flush=True)


if __name__ == "__main__":
    if "--host" in sys.argv:
        host_costs(int(sys.argv[1]) if sys.argv[1].isdigit() else 16)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
