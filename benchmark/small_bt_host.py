"""Wall time per step at small BT (flce, flce without the target check, eager) and a host-side
profile of flce vs eager: where a launch-bound step spends its CPU time.

    PYTHONPATH=src python benchmark/small_bt_host.py 64
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
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            print(f"BT={bt} round {rnd} {name}: wall/step {(time.perf_counter() - start) / 50 * 1e3:.3f} ms",
                  flush=True)
    for name in ("flce", "eager"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                steps[name]()
            torch.cuda.synchronize()
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
