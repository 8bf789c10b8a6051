"""Timing, memory and output helpers shared by the benchmark suites.

A suite is a module ``benchmark/suite_<name>.py`` with ``NAME: str`` and ``run(args) -> list[dict]``
(optional: ``COLUMNS`` for its table, ``plot(rows, out_dir) -> list[Path]`` for its figures; without
``plot``, bench.py draws :func:`plot_bars`). ``args`` has ``.device`` (torch.device), ``.quick``,
``.warmup`` and ``.reps``, and the shared filters ``.sweep``, ``.methods``, ``.dtype``, ``.modes``
(comma-separated strings, None = the suite's default), ``.timing`` (the readings to take, see
:func:`measure_steps`), ``.notes`` (a list: append one-line notes to print and store, e.g. why a method
was skipped) and ``.checkpoint(rows)`` (call after each finished cell: bench.py rewrites the result files,
so a run cut short keeps what it measured). A row is a flat dict made by :func:`make_row`: ``suite,
method, mode ("fwd" | "fwd+bwd"), shape (str), median_ms, tflops, peak_mb, status`` plus extras.
Optional packages (rich, matplotlib) cost only their part when missing: plain tables, no plots.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

NAN = float("nan")
MB = 2**20
BASE_COLUMNS = ["method", "mode", "shape", "median_ms", "tflops", "peak_mb", "status"]


# ---------------------------------------------------------------- timing and memory

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return cached blocks between cells so that one method's leftovers do not count for the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def median_ms(fn: Callable[[], Any], warmup: int, reps: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` in milliseconds: CUDA events on a GPU, perf_counter elsewhere."""
    return statistics.median(timed_calls(fn, warmup, reps, device))


def timed_calls(fn: Callable[[], Any], warmup: int, reps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()`` after ``warmup`` untimed ones (see :func:`timed_steps`)."""
    return timed_steps(lambda: fn, warmup, reps, device)


def median_of_rounds(fns: dict[str, Callable[[], Any]], device: torch.device, reps: int,
                     rounds: int = 5) -> dict[str, float]:
    """Median over ``rounds`` interleaved rounds (every function once a round) of each function's median
    call time in ms, ``reps`` calls after 2 warm-up calls a round: the probes' reading of kernels alone."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(statistics.median(timed_calls(fn, 2, reps, device)))
    return {k: statistics.median(v) for k, v in samples.items()}


def timed_steps(make_call: Callable[[], Callable[[], Any]], warmup: int, reps: int,
                device: torch.device) -> list[float]:
    """Milliseconds of each of ``reps`` steps after ``warmup`` untimed ones; ``make_call()`` prepares a
    step's fresh inputs outside the timing and returns the call to time.

    On a GPU each call is bracketed by two CUDA events, and the timed calls follow the warm-up calls
    with no sync between them, as steps follow each other in training: the host is then ahead of the GPU
    by the warm-up calls' work, and a call's time is what it costs in a running loop. Right after a
    sync, a launch-bound call (a small batch) would also be timed waiting for its own launches, which a
    training step's earlier layers hide.
    """
    cuda = device.type == "cuda"
    if cuda:
        sync(device)
    for _ in range(warmup):
        make_call()()
    samples = [_timed(make_call(), cuda) for _ in range(reps)]
    if cuda:
        torch.cuda.synchronize(device)
    return [_ms(s) for s in samples]


def _timed(call: Callable[[], Any], cuda: bool) -> tuple[Any, Any] | float:
    """Run ``call``: on CUDA between two recorded events (read them after a sync), else timed in ms."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        return start, end
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def _ms(sample: tuple[Any, Any] | float) -> float:
    return sample[0].elapsed_time(sample[1]) if isinstance(sample, tuple) else sample


def neighbour_cycle(names: list[str], rng: random.Random) -> list[str]:
    """A closed walk in which every method follows every method, itself included, exactly once: an
    Eulerian circuit of the complete directed graph with loops on ``names`` (Hierholzer's algorithm, edges
    taken in ``rng``'s order). len(names)**2 + 1 entries, first and last ``names[0]``."""
    exits = {a: rng.sample(names, len(names)) for a in names}  # each method's followers not yet walked
    stack, circuit = [names[0]], []
    while stack:
        if exits[stack[-1]]:
            stack.append(exits[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def mixed_times(make_calls: dict[str, Callable[[], Callable[[], Any]]], rounds: int, device: torch.device,
                failed: Callable[[str, BaseException], None]) -> dict[str, list[float]]:
    """Milliseconds per call of each method, taking turns one call at a time (fresh inputs from its
    ``make_calls`` entry, each call between two CUDA events, no sync between calls), in an order where
    every method follows every method, itself included, equally often (:func:`neighbour_cycle`, seeded;
    whole walks, each timing every method len(make_calls) times, about ``rounds`` in all). One untimed call
    of each first. A method that
    raises is reported to ``failed`` and leaves the rotation.

    This is how a step meets its neighbours in a real program: the allocator's cache, the L2 and the
    GPU's clock are left as the previous (possibly heavy) method left them, not as its own warm-up did.
    The neighbours are the same for every method: a GPU under its power limit runs any call 2-6% faster
    after a light neighbour than after a GEMM-heavy one (benchmark/NOTES.md, Two readings), so a method
    never timed after itself, as in one shuffled call per method per round, would be favoured if it is
    the heaviest of all (the floor).
    """
    live = list(make_calls)
    samples: list[tuple[str, tuple[Any, Any] | float]] = []
    cuda = device.type == "cuda"
    rng = random.Random(0)
    order = live[1:] + live[:1]  # untimed, each once, ending where every walk starts and ends
    for _ in range(max(1, round(rounds / len(live)))):  # whole walks: each method timed len(live) times a walk
        order += neighbour_cycle(live, rng)[1:]
    for i, name in enumerate(order):
        if name not in live:
            continue
        try:
            sample = _timed(make_calls[name](), cuda)
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run
            failed(name, exc)
            live.remove(name)
            free_memory(device)
            continue
        if i >= len(make_calls):
            samples.append((name, sample))
    if cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {n: [] for n in live}
    for name, sample in samples:
        if name in times:
            times[name].append(_ms(sample))
    return times


def host_us_per_call(fns: dict[str, Callable[[], Any]], rounds: int = 15, calls: int = 20,
                     sleep_cycles: int = 100_000_000) -> dict[str, list[float]]:
    """Host microseconds per call of each ``fns`` entry, one sample per round (interleaved rounds, so all
    see the same host speed). Before each sample the GPU is put to sleep for ``sleep_cycles`` cycles, so
    the host never waits for it: what is timed is launching, not running. CUDA only."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            start = time.perf_counter()
            for _ in range(calls):  # few enough calls not to fill the launch queue
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return times


def running_loop_ms(fn: Callable[[], Any], device: torch.device, steps: int = 300,
                    warmup: int = 20) -> tuple[float, float]:
    """(wall milliseconds per call over ``steps`` calls back to back with one sync at the end, the host's median
    milliseconds inside a call): a running loop, where the GPU idles whenever the host is the slower of the two, so
    that a launch-bound call's first figure is its host's time (unlike :func:`host_us_per_call`'s held-busy GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    inside = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        inside.append(time.perf_counter() - t0)
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3, statistics.median(inside) * 1e3


def unshifted_logits(stored: torch.Tensor, tile_max: torch.Tensor, block_n: int) -> torch.Tensor:
    """The logits as float32 from what the Hopper logits GEMM stores (each less its tile's max, since 2afee14) and
    its (n, tiles) tile maxima over ``block_n`` columns: what probes check a GEMM variant against."""
    return stored.float() + tile_max.repeat_interleave(block_n, dim=1)[:, :stored.shape[1]]


def peak_extra_mb(fn: Callable[[], Any], device: torch.device) -> float:
    """Peak memory allocated during ``fn()`` above what was allocated before it, in MiB.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: torch's own allocations, replayed in time order from
    the profiler's memory events (:func:`cpu_peak_extra_bytes`). What ``fn`` returns is alive at the
    peak, so returning gradients counts their buffers.
    """
    if device.type != "cuda":
        return cpu_peak_extra_bytes(fn) / MB
    free_memory(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak / MB


def cpu_peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of CPU tensor memory allocated during ``fn()`` above what was allocated before it.

    torch's CPU allocator reports every allocation and free to the profiler when ``profile_memory`` is
    on; the running sum of those sizes, in time order, is the memory held at each moment. Unlike the
    process's resident size, this sees frees at once (glibc keeps freed pages), counts a temporary that
    lives inside one operator, and ignores memory that is not tensors (Python, oneDNN scratch). The
    result of ``fn`` is still alive when the profiler stops. A tensor allocated before the call and
    freed during it is not seen freed (the profiler knows no size for it): the reading can then only be
    higher than the truth, never lower.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when the profiler starts first: no start/stop lines
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    sizes = []
    while stack:
        event = stack.pop()
        stack += event.children
        if event.tag == _EventType.Allocation and str(event.extra_fields.device).startswith("cpu"):
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    held = peak = 0
    for _, size in sorted(sizes, key=lambda e: e[0]):
        held += size
        peak = max(peak, held)
    return peak


def is_oom(exc: BaseException) -> bool:
    """Out-of-memory errors, whatever layer raised them (torch, Triton, cuBLAS)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "outofresources" in type(exc).__name__.lower()


TIMINGS = ("loop", "mixed")  # the readings measure_steps can take (--timing)


def measure(fn: Callable[[], Any], args, flops: float) -> dict[str, Any]:
    """Time and measure ``fn``; an OOM or other error becomes a ``status`` instead of a crash.

    Returns ``median_ms, tflops, peak_mb, status`` ("ok", "OOM" or "error: ...").
    """
    return measure_interleaved({"fn": fn}, args, flops, rounds=1)["fn"]


def measure_interleaved(fns: dict[str, Callable[[], Any]], args, flops: float,
                        rounds: int = 5) -> dict[str, dict[str, Any]]:
    """:func:`measure_steps` of plain callables (the same inputs every call), "loop" reading only."""
    return measure_steps({name: (lambda fn=fn: fn) for name, fn in fns.items()}, args, flops,
                         timings=("loop",), rounds=rounds)


def measure_steps(make_calls: dict[str, Callable[[], Callable[[], Any]]], args, flops: float,
                  timings: Iterable[str] | None = None, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """Peak memory and time of each method of one cell; ``make_calls[name]()`` prepares a step's fresh
    inputs and returns the call to time (see :func:`timed_steps`).

    Readings (``timings``, default ``args.timing`` or both):
      - "loop": each method alone, in ``rounds`` interleaved rounds (one on the CPU) (every method once per round,
        ``args.warmup`` untimed calls then its share of ``args.reps`` timed calls, back to back): a
        GPU's clock follows its temperature (an H200's floor read 35.7 ms after a pause, 39.3 after a
        minute of load), so all methods see the same mix of clocks.
      - "mixed": the methods take turns call by call (:func:`mixed_times`, ``args.reps`` rounds).
    Returns per method ``median_ms`` (the worse of the readings taken), ``ms_loop`` / ``ms_mixed``,
    ``tflops``, ``peak_mb`` and ``status``.
    """
    device = args.device
    timings = tuple(timings or getattr(args, "timing", None) or TIMINGS)
    out = {}
    for name, make_call in make_calls.items():  # first call (compile, autotune) and peak memory, one at a time
        out[name] = {"median_ms": NAN, "tflops": NAN, "peak_mb": NAN, "status": "ok"}
        try:
            make_call()()
            out[name]["peak_mb"] = peak_extra_mb(make_call(), device)
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run
            out[name]["status"] = _failure(exc)
        free_memory(device)

    def failed(name: str, exc: BaseException, reading: str = "") -> None:
        out[name]["status"] = _failure(exc) + (f" ({reading} reading)" if reading else "")

    def live() -> list[str]:
        return [n for n in make_calls if out[n]["status"] == "ok"]

    readings: dict[str, dict[str, list[float]]] = {n: {} for n in make_calls}
    if "loop" in timings:
        # Rounds keep a GPU's clock the same for every method; a CPU has no such drift to average out.
        rounds = max(1, min(rounds if device.type == "cuda" else 1, args.reps))
        for r in range(rounds):
            reps = args.reps // rounds + (r < args.reps % rounds)
            for name in live():
                try:
                    readings[name].setdefault("loop", []).extend(
                        timed_steps(make_calls[name], args.warmup, reps, device))
                except Exception as exc:  # noqa: BLE001
                    failed(name, exc)
                free_memory(device)
    if "mixed" in timings and live():
        mixed = mixed_times({n: make_calls[n] for n in live()}, args.reps, device,
                            lambda name, exc: failed(name, exc, "mixed"))
        for name, times in mixed.items():
            readings[name]["mixed"] = times
        free_memory(device)
    for name in live():
        medians = {k: statistics.median(v) for k, v in readings[name].items() if v}
        for k in timings:
            out[name][f"ms_{k}"] = medians.get(k, NAN)
        if medians:
            out[name]["median_ms"] = max(medians.values())
            out[name]["tflops"] = tflops(flops, out[name]["median_ms"])
    return out


def _failure(exc: BaseException) -> str:
    return "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {str(exc)[:160]}"


def wanted(args, names: Iterable[str], key: str) -> list[str]:
    """The names the user kept with --methods/--modes (``key``), in the suite's order; all by default."""
    chosen = getattr(args, key, None)
    return list(names) if not chosen else [n for n in names if n in chosen.split(",")]


def parse_shape(spec: str, form: str, lengths: Iterable[int] = (3,)) -> tuple[int, ...]:
    """'AxBxC' -> (A, B, C), positive integers, as ``--shapes`` takes them; ``form`` (e.g. 'BTxHxV') names
    them in the error, ``lengths`` are the numbers of dimensions accepted."""
    parts = spec.strip().lower().split("x")
    if len(parts) not in tuple(lengths) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes wants {form} with positive integers, got {spec!r}")
    return tuple(map(int, parts))


def add_speedup(rows: list[dict], column: str, baselines: Iterable[str], keys: tuple[str, ...]) -> list[dict]:
    """rows[column] = the baseline method's median over this row's, matching rows on ``keys``."""
    baselines = set(baselines)
    base = {tuple(r[k] for k in keys): r["median_ms"] for r in rows if r["method"] in baselines}
    for r in rows:
        ref = base.get(tuple(r[k] for k in keys), NAN)
        ok = all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in (ref, r["median_ms"]))
        r[column] = ref / r["median_ms"] if ok else NAN
    return rows


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else NAN


def copy_bandwidth_gbs(device: torch.device, megabytes: int = 1024, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (10^9 bytes read + written per second) of a large copy."""
    n = megabytes * MB
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=2, reps=reps, device=device)
    src = dst = None  # free before measuring the rest (the lambda holds the cells)
    free_memory(device)
    return 2 * n / (ms * 1e-3) / 1e9


def make_row(suite: str, method: str, mode: str, shape: str, measured: dict[str, Any], **extras) -> dict:
    """A flat result row: the shared keys first, then the suite's extras."""
    row = {"suite": suite, "method": method, "mode": mode, "shape": shape}
    row.update({k: measured.get(k, NAN) for k in ("median_ms", "tflops", "peak_mb")})
    row["status"] = measured.get("status", "ok")
    row.update(extras)
    return row


# ---------------------------------------------------------------- environment

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device) -> dict[str, Any]:
    """What a result file needs to be read later: device, versions, date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": _installed_version("transformers"),  # the experts suite's grouped_mm is transformers'
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def slug(text: str) -> str:
    """File-name-safe form of a device name or label."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-").lower() or "x"


# ---------------------------------------------------------------- output

TABLE_WIDTH = 100  # the default (compact) tables fit a 100-column terminal
Column = str | tuple[str, str]  # a row key, or (row key, header)


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """Whether an optional package imports (a broken install counts as missing)."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - ImportError, or whatever a broken install raises
        return False
    return True


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on a terminal that disappears when done (rich; nothing without it or in a log);
    yields ``step(label)`` to call once per finished cell."""
    if not sys.stdout.isatty() or not has_module("rich"):
        yield lambda label="": None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[label]}"))
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(description, total=total, label="")

        def step(label: str = "") -> None:
            bar.update(task, advance=1, label=label)

        yield step


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


FAILED_SHOWS_STATUS = ("median_ms", "tflops", "peak_mb")


def row_cells(row: dict, columns: list[str]) -> list[str]:
    """Formatted values; a failed row (status not "ok") shows its status in place of its measurements."""
    failed = row.get("status", "ok") != "ok"
    return [row["status"].split(":")[0] if failed and c in FAILED_SHOWS_STATUS
            else format_value(row.get(c)) for c in columns]


def table_columns(rows: list[dict], preferred: Iterable[Column] | None = None) -> list[tuple[str, str]]:
    """(key, header) of the columns to show: ``preferred`` (or the base ones) that any row has a value for."""
    names = [c if isinstance(c, tuple) else (c, c) for c in (preferred if preferred is not None else BASE_COLUMNS)]
    present = {k for r in rows for k, v in r.items() if v is not None}
    return [c for c in names if c[0] in present]


def table_text(rows: list[dict], title: str, columns: Iterable[Column] | None = None,
               width: int | None = TABLE_WIDTH) -> str:
    """The table as text: boxed by rich when installed (at most ``width`` columns wide; None: as wide as
    it needs), else plain aligned columns. A row whose status is not "ok" shows that status in place
    of its numbers."""
    cols = table_columns(rows, columns)
    cells = [row_cells(r, [k for k, _ in cols]) for r in rows]
    numeric = [any(isinstance(r.get(k), (int, float)) for r in rows) for k, _ in cols]
    if not has_module("rich"):
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(cols)]

        def line(values):
            return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

        return "\n".join([title, line([h for _, h in cols])] + [line(c) for c in cells]) + "\n"
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for (_, header), num in zip(cols, numeric):
        table.add_column(header, justify="right" if num else "left")
    for c in cells:
        table.add_row(*c)
    buffer = io.StringIO()
    Console(file=buffer, width=width or 1000, force_terminal=False, color_system=None).print(table)
    text = buffer.getvalue()
    return text if width else "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def print_table(rows: list[dict], title: str, columns: Iterable[Column] | None = None,
                width: int | None = TABLE_WIDTH) -> None:
    """:func:`table_text`, printed."""
    sys.stdout.write(table_text(rows, title, columns, width))


def markdown_table(rows: list[dict], columns: Iterable[Column] | None = None) -> str:
    """The same table as :func:`print_table`, as GitHub markdown (for notes and result files)."""
    cols = table_columns(rows, columns)
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row_cells(r, [k for k, _ in cols])) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    return value


def write_json(path: Path, meta: dict[str, Any], rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe({"meta": meta, "rows": rows}), indent=1) + "\n")
    return path


def _pyplot():
    import matplotlib  # optional: bench.py turns its ImportError into a note

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lines(rows: list[dict], x: str, path: Path, title: str, ys=("median_ms", "peak_mb"),
               logx: bool = True) -> Path | None:
    """One figure, one panel per ``ys`` key, one line per method: value vs ``x`` (rows with status "ok")."""
    plt = _pyplot()
    ok = [r for r in rows if r.get("status", "ok") == "ok" and isinstance(r.get(x), (int, float))]
    if not ok:
        return None
    fig, axes = plt.subplots(1, len(ys), figsize=(5.5 * len(ys), 4), squeeze=False)
    for ax, y in zip(axes[0], ys):
        for method in dict.fromkeys(r["method"] for r in ok):
            pts = sorted((r[x], r[y]) for r in ok if r["method"] == method
                         and isinstance(r.get(y), (int, float)) and math.isfinite(r[y]))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {y} values", transform=ax.transAxes, ha="center")
            continue
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def plot_bars(rows: list[dict], path: Path, title: str, ys=("median_ms", "peak_mb")) -> Path | None:
    """Fallback figure for a suite without its own ``plot``: one bar per (shape, mode, method)."""
    plt = _pyplot()
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    if not ok:
        return None
    labels = [f"{r['method']}\n{r['mode']} {r['shape']}" for r in ok]
    fig, axes = plt.subplots(len(ys), 1, figsize=(max(6, 0.6 * len(ok)), 3.2 * len(ys)), squeeze=False)
    for ax, y in zip(axes[:, 0], ys):
        ax.bar(range(len(ok)), [r.get(y) if r.get(y) is not None else NAN for r in ok])
        ax.set_ylabel(y)
        ax.set_xticks(range(len(ok)), labels, rotation=60, ha="right", fontsize=7)
    return _save(plt, fig, path, title)
