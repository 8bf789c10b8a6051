#!/usr/bin/env python
"""Benchmark CLI: latency, throughput, memory and precision of flce against its peers and the floor.

    python benchmark/bench.py                      # GPU: lce headline sweep; CPU: small embedded default
    python benchmark/bench.py --sweep all          # every lce sweep
    python benchmark/bench.py --suite lce,grouped,experts --quick

Writes ``results.json``, ``results.md`` and PNG plots under ``--out``; prints one table per suite.
See benchmark/README.md for the columns.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Suites import ``common`` (or ``benchmark.common``); flce comes from this checkout unless already importable.
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]
sys.path.append(str(HERE.parent))

import torch  # noqa: E402

from common import environment, markdown_table, plot_bars, print_table, slug, write_json  # noqa: E402


def _lce_help() -> str:
    try:
        import suite_lce

        return (f"lce sweeps: {', '.join(suite_lce.SWEEPS)} (or 'all' = every GPU sweep); "
                f"lce methods: {', '.join(suite_lce.METHODS)}")
    except Exception as exc:  # noqa: BLE001 - help must print anyway
        return f"(lce suite not importable: {exc})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=_lce_help(),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--suite", default="lce", help="comma-separated suites: lce, grouped, experts")
    parser.add_argument("--sweep", default=None,
                        help="comma-separated named sweeps (default: the suite's; lce: headline on a GPU, "
                             "cpu without one)")
    parser.add_argument("--shapes", default=None, help="lce: custom cells BTxHxV,BTxHxV (replaces --sweep)")
    parser.add_argument("--methods", default=None, help="comma-separated methods to run (default: all)")
    parser.add_argument("--dtype", default=None, help="comma-separated bf16,fp16,fp32 (default: the sweep's)")
    parser.add_argument("--modes", default=None, help="comma-separated fwd,fwd+bwd (default: the sweep's)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="fewer cells per sweep")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per cell (default 3 GPU, 1 CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per cell (default 10 GPU, 3 CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: $OUT, else benchmark/results/<date>-<device>/)")
    parser.add_argument("--lean-mb", type=int, default=None,
                        help="lce: logits buffer of the flce-lean method in MiB (default 128)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = args.device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    args.reps = args.reps if args.reps is not None else (10 if gpu else 3)
    args.notes = []
    return args


def default_out(device: torch.device) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    from common import device_name

    return HERE / "results" / f"{datetime.date.today().isoformat()}-{slug(device_name(device))}"


def run_suite(name: str, args) -> tuple[object | None, list[dict]]:
    """Import and run one suite; a missing or failing suite becomes a note, not a crash."""
    try:
        module = importlib.import_module(f"suite_{name}")
    except Exception as exc:  # noqa: BLE001 - ImportError or anything the suite raises at import
        args.notes.append(f"suite {name} skipped: cannot import suite_{name} ({type(exc).__name__}: {exc})")
        return None, []
    try:
        return module, module.run(args)
    except Exception as exc:  # noqa: BLE001
        args.notes.append(f"suite {name} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        return module, []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or default_out(args.device)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    print(f"flce benchmark on {env['device']} ({args.device}), torch {env['torch']}, triton {env['triton']}")

    results: dict[str, tuple[object | None, list[dict]]] = {}
    for name in [s.strip() for s in args.suite.split(",") if s.strip()]:
        results[name] = run_suite(name, args)

    all_rows = [r for _, rows in results.values() for r in rows]
    settings = {k: v for k, v in vars(args).items() if k not in ("notes", "out")}
    write_json(out / "results.json", {**env, "args": settings, "notes": args.notes}, all_rows)
    markdown = [f"# flce benchmark: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
                f"{env['date']}\n"] + [f"- {n}" for n in args.notes]
    plots = []
    for name, (module, rows) in results.items():
        if not rows:
            continue
        markdown.append(f"\n## {name}\n\n" + markdown_table(rows, getattr(module, "COLUMNS", None)))
        if not args.no_plots:
            plot = getattr(module, "plot", None)
            plots += plot(rows, out) if plot else [p for p in [plot_bars(rows, out / f"{name}.png", name)] if p]
    (out / "results.md").write_text("\n".join(markdown) + "\n")

    for note in args.notes:
        print(f"note: {note}")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f" and {len(plots)} plot(s)" if plots else ""))
    for name, (module, rows) in results.items():
        if rows:
            print_table(rows, f"{name} on {env['device']}", getattr(module, "COLUMNS", None))
    return 0 if all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
