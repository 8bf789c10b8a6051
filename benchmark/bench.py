#!/usr/bin/env python
"""Benchmark CLI: latency, throughput, memory and precision of flce against its peers and the floor.

    python benchmark/bench.py                      # GPU: lce headline sweep; CPU: small embedded default
    python benchmark/bench.py --sweep all          # every lce sweep
    python benchmark/bench.py --suite lce,grouped,experts --quick

Writes ``results.json`` and ``results.md`` under ``--out`` (after every finished cell, so a run cut
short keeps what it measured), then PNG plots (matplotlib); prints one table per suite, 100 columns
wide (``--wide``: every column). See benchmark/README.md for the columns.
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

from common import (TIMINGS, environment, has_module, markdown_table, plot_bars, print_table, slug,  # noqa: E402
                    write_json)


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
    parser.add_argument("--shapes", default=None, help="custom cells (replace --sweep): lce BTxHxV,...; experts TxHxI[xE[xk]],... (8 experts, top-2 by default)")
    parser.add_argument("--methods", default=None, help="comma-separated methods to run (default: all)")
    parser.add_argument("--dtype", default=None, help="comma-separated bf16,fp16,fp32 (default: the sweep's)")
    parser.add_argument("--modes", default=None, help="comma-separated fwd,fwd+bwd (default: the sweep's)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 gives steadier CPU times on a busy "
                             "machine)")
    parser.add_argument("--quick", action="store_true", help="fewer cells per sweep")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per cell (default 3 GPU, 1 CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per reading (default 10 GPU, 3 CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: $OUT, else benchmark/results/<date>-<device>/)")
    parser.add_argument("--lean-mb", type=int, default=None,
                        help="lce: logits buffer of the flce-lean method in MiB (default 128)")
    parser.add_argument("--timing", default=",".join(TIMINGS),
                        help="lce readings, comma-separated: loop (each method in its own running loop), mixed "
                             "(all methods of a cell taking turns call by call); the table shows the worse")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds after which no new lce cell starts (results so far are kept)")
    parser.add_argument("--wide", action="store_true", help="print every column (default: a 100-column table)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    args.timing = tuple(k.strip() for k in args.timing.split(",") if k.strip())
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    args.reps = args.reps if args.reps is not None else (10 if gpu else 3)
    args.notes, args.tracebacks = [], []
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
        args.notes.append(f"suite {name} skipped: cannot import suite_{name} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200]})")
        return None, []
    try:
        return module, module.run(args)
    except Exception as exc:  # noqa: BLE001
        args.notes.append(f"suite {name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} "
                          "(traceback in results.json)")
        args.tracebacks.append(traceback.format_exc(limit=6))
        return module, []


def write_results(out: Path, env: dict, args, results: dict[str, tuple[object | None, list[dict]]]) -> None:
    """results.json (every row) and results.md (per suite: the compact table, then every column)."""
    settings = {k: v for k, v in vars(args).items() if k not in ("notes", "tracebacks", "out", "checkpoint")}
    write_json(out / "results.json", {**env, "args": settings, "notes": args.notes, "tracebacks": args.tracebacks},
               [r for _, rows in results.values() for r in rows])
    markdown = [f"# flce benchmark: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
                f"transformers {env['transformers']}, {env['date']}\n"] + [f"- {n}" for n in args.notes]
    for name, (module, rows) in results.items():
        if rows:
            compact = getattr(module, "compact_columns", None)
            if compact:
                markdown.append(f"\n## {name}\n\n" + markdown_table(rows, compact(rows)))
                markdown.append(f"\n### {name}, every column\n\n" + markdown_table(rows, module.COLUMNS))
            else:
                markdown.append(f"\n## {name}\n\n" + markdown_table(rows, getattr(module, "COLUMNS", None)))
    (out / "results.md").write_text("\n".join(markdown) + "\n")


def draw_plots(out: Path, args, results) -> list[Path]:
    """Each suite's figures; without matplotlib, one note and none."""
    if args.no_plots:
        return []
    if not has_module("matplotlib"):
        args.notes.append("plots skipped: matplotlib is not installed (pip install -e \".[bench]\")")
        return []
    plots = []
    for name, (module, rows) in results.items():
        if not rows:
            continue
        try:
            plot = getattr(module, "plot", None)
            plots += plot(rows, out) if plot else [p for p in [plot_bars(rows, out / f"{name}.png", name)] if p]
        except Exception as exc:  # noqa: BLE001 - a figure must not cost the numbers
            args.notes.append(f"plots of {name} failed: {type(exc).__name__}: {str(exc)[:160]}")
    return plots


def print_tables(env: dict, args, results) -> None:
    for name, (module, rows) in results.items():
        if not rows:
            continue
        compact = getattr(module, "compact_columns", None)
        label = module.title(rows) if hasattr(module, "title") else name
        title = f"{label} on {env['device']}"
        if args.wide or not compact:  # every column, as wide as they need
            print_table(rows, title, getattr(module, "COLUMNS", None), width=None)
        else:
            print_table(rows, title, compact(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or default_out(args.device)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    print(f"flce benchmark on {env['device']} ({args.device}), torch {env['torch']}, triton {env['triton']}")
    if args.device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] > (os.cpu_count() or 1):
        args.notes.append(f"the CPU is busy (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): times are "
                          f"unsteady{'' if args.threads == 1 else '; --threads 1 steadies them'}")
    if not has_module("rich"):
        args.notes.append("plain tables and no progress bar: rich is not installed (pip install -e \".[bench]\")")

    results: dict[str, tuple[object | None, list[dict]]] = {}
    for name in [s.strip() for s in args.suite.split(",") if s.strip()]:
        def checkpoint(rows, name=name):
            results[name] = (sys.modules.get(f"suite_{name}"), rows)
            write_results(out, env, args, results)

        args.checkpoint = checkpoint
        results[name] = run_suite(name, args)
        write_results(out, env, args, results)

    for note in args.notes:
        print(f"note: {note}")
    print_tables(env, args, results)
    seen = len(args.notes)
    plots = draw_plots(out, args, results)
    write_results(out, env, args, results)  # again: notes from the plots
    for note in args.notes[seen:]:
        print(f"note: {note}")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f" and {len(plots)} plot(s)" if plots else ""))
    return 0 if any(rows for _, rows in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
