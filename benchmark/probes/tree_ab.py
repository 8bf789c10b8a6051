"""Probe: whole trees of flce against each other as a training loop runs them (any two commits, e.g. one
reverted long ago against HEAD). Each revision's ``src/flce`` is unpacked as its own package (``git archive``);
every round runs one process per revision (its import hooks and Triton caches apart), in turn, and each
process times blocks of back-to-back fwd+bwd steps of that tree and of the floor (three cuBLAS GEMMs) per
shape, fresh leaves each step. Prints, per shape, each tree's median ms per step over all blocks, x the floor
timed in the same processes, and the peak memory above the inputs. Results:
`results/2026-11-27-h200-4de36ee/tree_ab_457c722.txt` (457c722, the several-chunk exp-logits path of 2026-11-24,
against its parent and the HEAD of then). GPU only:

    PYTHONPATH=benchmark python benchmark/probes/tree_ab.py --revs HEAD~1,HEAD [--shapes 32768x4096x128256,...]
        [--rounds 3] [--blocks 3] [--steps 5] [--set exp_logits.MIN_ROWS=256] [--dtype float16]

Where git is not at hand, unpack each revision first and pass the folders:
``git archive REV src/flce | tar -x -C DIR && mv DIR/src/flce DIR/REV``, then ``--revs DIR/REV1,DIR/REV2``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def unpack(rev: str, name: str, into: Path) -> None:
    """``rev``'s src/flce as the package ``name`` under ``into`` (its imports are relative). A ``rev`` that is a
    folder is taken as such a package already unpacked (a machine without the repository's history)."""
    if Path(rev).is_dir():
        shutil.copytree(rev, into / name)
        return
    archive = subprocess.run(["git", "archive", rev, "src/flce"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "src" / "flce").rename(into / name)


def worker(package: str, shapes: str, blocks: int, steps: int, settings: list[str], dtype: str = "bfloat16") -> None:
    """One process: ``package``'s blocks and the floor's, per shape, as one JSON line each; ``settings``:
    ``module.attr=expr`` of the package (``exp_logits.MIN_ROWS=256``), set after import."""
    import importlib
    import time

    import torch
    from with_setting import apply_setting

    flce = importlib.import_module(package)
    for setting in settings:
        apply_setting(setting, prefix=f"{package}.")
    for shape in shapes.split(","):
        n, hidden, vocab = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, hidden, device="cuda", generator=g).to(getattr(torch, dtype))
        w = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden**-0.5).to(getattr(torch, dtype))
        t = torch.randint(0, vocab, (n,), device="cuda", generator=g)

        def tree():
            xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(flce.linear_cross_entropy(xs, ws, t), (xs, ws))

        def floor():
            z = x @ w.t()
            return z @ w, z.t() @ x

        times, peaks = defaultdict(list), {}
        for name, fn in (("tree", tree), ("floor", floor)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        for b in range(blocks):
            for name, fn in ((("tree", tree), ("floor", floor)) if b % 2 == 0 else (("floor", floor), ("tree", tree))):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) * 1e3 / steps)
        print("JSON " + json.dumps({"shape": shape, "times": times, "peaks": peaks}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--revs", default="HEAD~1,HEAD")
    p.add_argument("--shapes", default="8192x1024x151936,16384x2048x128256,32768x4096x128256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3, help="blocks per shape in each process")
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=EXPR",
                   help="a setting of every tree's package, e.g. exp_logits.MIN_ROWS=256 (repeatable)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="of x and W")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.shapes, a.blocks, a.steps, a.set, a.dtype)
    revs = a.revs.split(",")
    times, peaks = defaultdict(lambda: defaultdict(list)), {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, rev in enumerate(revs):
            unpack(rev, f"flce_tree{i}", Path(tmp))
        for _ in range(a.rounds):
            for i, rev in enumerate(revs):
                out = subprocess.run([sys.executable, __file__, "--worker", f"flce_tree{i}", "--shapes", a.shapes,
                                      "--blocks", str(a.blocks), "--steps", str(a.steps), "--dtype", a.dtype,
                                      *(f"--set={x}" for x in a.set)], check=True,
                                     capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tmp}).stdout
                for line in out.splitlines():
                    if line.startswith("JSON "):
                        d = json.loads(line[5:])
                        times[d["shape"]][rev] += d["times"]["tree"]
                        times[d["shape"]]["floor"] += d["times"]["floor"]
                        peaks[d["shape"], rev], peaks[d["shape"], "floor"] = d["peaks"]["tree"], d["peaks"]["floor"]
    for shape, by in times.items():
        floor = statistics.median(by["floor"])
        print(f"== {shape}")
        for name, v in by.items():
            ms = statistics.median(v)
            print(f"  {name:12s} {ms:9.3f} ms  x floor {ms / floor:.4f}  blocks {min(v):.2f}-{max(v):.2f} (n={len(v)})"
                  f"  peak {peaks[shape, name]:.0f} MiB above the inputs")


if __name__ == "__main__":
    main()
