"""Fused linear + cross-entropy suite: flce against eager, torch.compile, peers and the GEMM floor.

Every method computes ``mean cross_entropy(x @ W.T, t)`` with x: (BT, H), W: (V, H), t: (BT,).
"fwd" times the loss alone (no autograd); "fwd+bwd" times a training step's loss and both gradients:
each step gets a fresh activation x (a new leaf, made outside the timing) and calls
``torch.autograd.grad``, so nothing accumulates across repetitions and the returned gradients are
alive at the memory peak. ``floor`` is the three GEMMs alone: logits, grad_input, grad_weight.
Times are the worse of two readings (``common.measure_steps``): each method in its own running loop,
and all methods of the cell taking turns call by call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from common import (MB, NAN, TIMINGS, copy_bandwidth_gbs, free_memory, is_oom, make_row, measure_steps, parse_shape,
                    plot_bars, plot_lines, progress)

NAME = "lce"
COLUMNS = ["sweep", "method", "mode", "dtype", "shape", "median_ms", "ms_loop", "ms_mixed", "tflops", "x_floor",
           "x_floor_loop", "x_floor_mixed", "peak_mb", "overhead_mb", "byte_floor_ms", "x_byte_floor", "grad_w_err",
           "x_rounding", "ignored", "x_all_valid", "status"]
FLOOR = "floor"
LEAN_BUFFER_MB = 128  # flce-lean: logits buffer of about this size (--lean-mb)
BYTE_FLOOR_MAX_BT = 256  # the byte floor column is shown up to this many rows
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Cell:
    """One problem: BT x H x V in ``dtype``; ``ignored``: share of targets = -100; ``logit_std``: the logits'
    spread (W scaled by it); above 1 the targets are drawn from the softmax, as a trained model's are."""

    sweep: str
    bt: int
    hidden: int
    vocab: int
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    ignored: float = 0.0
    precision: bool = False  # also measure grad_weight's error against float64
    dtype: torch.dtype = torch.bfloat16
    logit_std: float = 1.0
    label: str = ""  # a name shown after the shape (the model a head is from)

    @property
    def shape(self) -> str:
        return f"{self.bt}x{self.hidden}x{self.vocab}"


LLAMA3 = dict(hidden=4096, vocab=128256)
FB = ("fwd+bwd",)
# LM heads (H, V) of common model families, for the "heads" sweep at 8192 tokens: where small H or a large
# vocabulary moves the chunk plan (planner.py) and the GEMMs' rate.
MODEL_HEADS = {
    "Qwen3-0.6B": (1024, 151936), "Llama-3.2-1B": (2048, 128256), "Gemma-3-4B": (2560, 262208),
    "gpt-oss-20b": (2880, 201088), "Llama-3.2-3B": (3072, 128256), "Qwen2.5-7B": (3584, 152064),
    "Mistral-7B-v0.3": (4096, 32768), "Llama-3.1-8B": (4096, 128256), "Qwen3-8B": (4096, 151936),
    "Phi-4": (5120, 100352), "DeepSeek-V3": (7168, 129280), "Llama-3.1-70B": (8192, 128256),
}
QUICK_HEADS = ("Qwen3-0.6B", "Llama-3.2-1B", "Llama-3.1-8B")
SWEEPS: dict[str, Callable[[bool], list[Cell]]] = {
    "headline": lambda quick: [Cell("headline", bt, **LLAMA3)
                               for bt in ((16, 1024, 8192) if quick else (1, 16, 64, 256, 1024, 8192, 32768))],
    "vocab": lambda quick: [Cell("vocab", 8192, 4096, v)
                            for v in ((32000, 128256) if quick else (32000, 65536, 128256, 256000))],
    "hidden": lambda quick: [Cell("hidden", 8192, h, 128256)
                             for h in ((2048, 4096) if quick else (1024, 2048, 4096, 8192))],
    "small-vocab": lambda quick: [Cell("small-vocab", 8192, 2048, 32000)],
    "heads": lambda quick: [Cell("heads", 8192, *MODEL_HEADS[name], FB, label=name)
                            for name in (QUICK_HEADS if quick else MODEL_HEADS)],
    "precision": lambda quick: [Cell("precision", 32768, 1024, 32000, FB, precision=True),
                                Cell("precision", 16384, 2048, 65536, FB, precision=True),
                                Cell("precision", 8192, 4096, 128256, FB, precision=True),  # one chunk
                                # a trained model's logits: spread out, targets likely (bf16 logits' own error)
                                Cell("precision", 32768, 1024, 32000, FB, precision=True, logit_std=6.0),
                                Cell("precision", 8192, 4096, 128256, FB, precision=True, logit_std=6.0),
                                # a small batch: cuBLAS's logits (flce's in float32, function.wide_logits)
                                Cell("precision", 64, 4096, 128256, FB, precision=True, logit_std=6.0)],
    "ignore": lambda quick: [Cell("ignore", 8192, **LLAMA3, modes=FB, ignored=share) for share in (0.0, 0.5)],
    # The embedded default without a GPU (a training step in float32, seconds a cell): logits of 8 and
    # 32 MiB against a weight of 2 and 4 MiB, and the larger with half the targets ignored.
    "cpu": lambda quick: [Cell("cpu", bt, 128, vocab, FB, ignored=ignored, precision=True, dtype=torch.float32)
                          for bt, vocab, ignored in ((512, 4096, 0.0), (1024, 8192, 0.0), (1024, 8192, 0.5))],
}
GPU_SWEEPS = [s for s in SWEEPS if s != "cpu"]
X_AXIS = {"headline": "BT", "vocab": "V", "hidden": "H"}  # sweeps drawn as lines


# ---------------------------------------------------------------- methods

def _flce(x, w, t):
    import flce

    return flce.linear_cross_entropy(x, w, t)


def _flce_unchecked(x, w, t):
    """No target check: no host sync (what CUDA-graph capture needs), and ignored rows are not dropped."""
    import flce

    return flce.linear_cross_entropy(x, w, t, validate_target=False)


def _flce_lean(x, w, t):
    """Accumulator in the weight's dtype (bf16 in bf16 runs) and a logits buffer of at most
    LEAN_BUFFER_MB, its rows a multiple of 128 where possible (full GEMM tiles: 523 rows left the
    last 128-row tile of every chunk's logits and grad_input GEMMs almost empty)."""
    import flce

    rows = max(LEAN_BUFFER_MB * MB // (w.shape[0] * w.element_size()), 1)
    rows = rows // 128 * 128 or rows
    return flce.linear_cross_entropy(x, w, t, accum_dtype=w.dtype, chunk_size=rows)


def _flce_low_memory(x, w, t):
    """The precise low-memory mode: grad_input in forward, grad_weight per vocabulary block in backward."""
    import flce

    return flce.linear_cross_entropy(x, w, t, low_memory=True)


def _eager(x, w, t):
    """Hugging Face style: logits in the model's dtype, upcast, then cross-entropy."""
    logits = F.linear(x, w)
    return F.cross_entropy(logits.float(), t, ignore_index=-100)


_compiled: dict[str, LossFn] = {}


def _compile(x, w, t):
    if "eager" not in _compiled:
        import torch._dynamo

        for knob in ("cache_size_limit", "recompile_limit"):  # one graph per shape and mode
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        _compiled["eager"] = torch.compile(_eager, dynamic=False)
    return _compiled["eager"](x, w, t)


def _torch_native(x, w, t):
    options = torch.nn.LinearCrossEntropyOptions()  # chunked path, torch's own auto choices
    return F.linear_cross_entropy(x, w, t, options=options)


@functools.lru_cache(maxsize=None)
def _liger_module():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()  # defaults, built once: not part of the timing


def _liger(x, w, t):
    return _liger_module()(w, x, t)


def _cce(x, w, t):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(x, w, t)


def _quack(x, w, t):
    """quack-kernels' chunked linear cross-entropy, its base pipeline (logits GEMM, row kernel, two GEMMs
    per chunk; ``use_scaled_exp=False``: at H = 4096 quack 0.6.5's scaled-exp pipeline raises, see
    ``quack-default``)."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    return chunked_linear_cross_entropy(x, w, t, use_scaled_exp=False)


def _quack_default(x, w, t):
    """quack-kernels' chunked linear cross-entropy at its defaults, as a user calls it: the scaled-exp
    pipeline wherever quack finds it eligible (an sm90 GPU, bf16, V % 128 == 0, ...), else the base one."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    return chunked_linear_cross_entropy(x, w, t)


def _trl(x, w, t):
    """TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``) as its trainer calls it: the valid rows'
    per-token log-probabilities (rows picked on a GPU, masked elsewhere), loss = -their mean. Taken from
    its defining module, which ``flce.patches.trl``'s routing leaves alone: always TRL's own kernel."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    valid = t != -100
    if x.is_cuda:
        logp = ChunkedLogProbFunction.apply(x[valid], w, None, t[valid], 1.0, TRL_VOCAB_TILE, None, 1.0, ())[0]
        return -logp.sum() / valid.sum().clamp(min=1)
    logp = ChunkedLogProbFunction.apply(x, w, None, t.clamp(min=0), 1.0, TRL_VOCAB_TILE, None, 1.0, ())[0]
    return -(logp * valid).sum() / valid.sum().clamp(min=1)


TRL_VOCAB_TILE = 32768  # the vocabulary tile TRL's trainer passes (trl.trainer.utils)


def _missing(module: str, cuda_only: bool = True,
             imports: tuple[str, ...] = ()) -> Callable[[torch.device], str | None]:
    """Why a peer cannot run here: not installed, not importable (``imports``: the modules its call imports), or
    CPU."""
    def why(device: torch.device) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        if cuda_only and device.type != "cuda":
            return "needs CUDA"
        for name in imports:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a broken optional install costs only its method
                return f"cannot import {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        return None

    return why


METHODS: dict[str, LossFn | None] = {
    "flce": _flce,
    "flce-lean": _flce_lean,
    "flce-low-memory": _flce_low_memory,
    "flce-unchecked": _flce_unchecked,
    "eager": _eager,
    "compile": _compile,
    "torch-native": _torch_native,
    "liger": _liger,
    "cce": _cce,
    "quack": _quack,
    "quack-default": _quack_default,
    "trl": _trl,
    FLOOR: None,  # timed by _floor_fn
}
# Without --methods the CPU default runs these: flce-lean and flce-unchecked match flce on the CPU,
# compile's C++ build takes ~30 s a cell, and TRL's CPU path (its torch fallback, ~5x the floor) is not
# the Triton kernel its users run.
CPU_METHODS = ["flce", "eager", "torch-native", FLOOR]
UNAVAILABLE: dict[str, Callable[[torch.device], str | None]] = {
    "torch-native": lambda device: None if hasattr(F, "linear_cross_entropy")
    else f"torch {torch.__version__} has no F.linear_cross_entropy",
    "liger": _missing("liger_kernel"),
    "cce": _missing("cut_cross_entropy"),
    "quack": _missing("quack", imports=("quack.linear_cross_entropy",)),
    "quack-default": _missing("quack", imports=("quack.linear_cross_entropy",)),
    # TRL's kernel imports trl.trainer.utils (and with it TRL's dependencies, datasets among them) when called
    "trl": _missing("trl", cuda_only=False, imports=("trl.kernels.chunked_logprob", "trl.trainer.utils")),
}


def _floor_fn(x, w, mode: str) -> Callable[[], object]:
    """The GEMMs any exact method must do: logits, then (fwd+bwd) grad_input and grad_weight from them."""
    if mode == "fwd":
        return lambda: x @ w.t()

    def three_gemms():
        logits = x @ w.t()  # stands in for dlogits too: same shape, same dtype
        return logits @ w, logits.t() @ x

    return three_gemms


def _make_step(method: str, x, w, t, mode: str) -> Callable[[], Callable[[], object]]:
    """A function that prepares one step and returns the call to time (``common.timed_steps``).

    fwd+bwd: each step takes a fresh activation (a new leaf copy of x, made before the timing starts), as
    a training step gets new hidden states, and returns both gradients from ``torch.autograd.grad``.
    """
    loss = METHODS[method]
    if mode == "fwd":
        x0, w0 = x.detach(), w.detach()

        def forward():
            with torch.no_grad():
                return loss(x0, w0, t)

        return lambda: forward

    def step() -> Callable[[], object]:
        x_step = x.detach().clone().requires_grad_()
        return lambda: torch.autograd.grad(loss(x_step, w, t), (x_step, w))

    return step


# ---------------------------------------------------------------- precision

def reference_grad_weight(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
                          budget: int = 512 * MB) -> torch.Tensor:
    """d mean CE / dW in float64, chunk by chunk on x's device: (V, H) float64.

    x: (BT, H), w: (V, H), t: (BT,) with -100 for ignored rows.
    """
    w64 = w.detach().double()
    valid = t != -100
    grad = torch.zeros_like(w64)
    rows = max(budget // (w.shape[0] * 8), 1)
    for start in range(0, x.shape[0], rows):
        x_c, t_c, v_c = x[start:start + rows].detach().double(), t[start:start + rows], valid[start:start + rows]
        dlogits = torch.softmax(x_c @ w64.t(), dim=1)
        dlogits[v_c, t_c[v_c]] -= 1
        dlogits[~v_c] = 0
        grad.addmm_(dlogits.t(), x_c)
    return grad / valid.sum().clamp(min=1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


# ---------------------------------------------------------------- the run

def _make_inputs(cell: Cell, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(cell.bt * 7 + cell.vocab)
    x = torch.randn(cell.bt, cell.hidden, device=device, dtype=cell.dtype, generator=gen).requires_grad_()
    w = (torch.randn(cell.vocab, cell.hidden, device=device, dtype=cell.dtype, generator=gen)
         * (cell.logit_std * cell.hidden ** -0.5)).requires_grad_()
    t = (torch.randint(0, cell.vocab, (cell.bt,), device=device, generator=gen) if cell.logit_std == 1.0
         else _sampled_targets(x.detach(), w.detach(), gen))
    if cell.ignored:
        drop = torch.randperm(cell.bt, device=device, generator=gen)[: round(cell.ignored * cell.bt)]
        t[drop] = -100
    return x, w, t


def _sampled_targets(x: torch.Tensor, w: torch.Tensor, gen: torch.Generator, budget: int = 512 * MB) -> torch.Tensor:
    """(BT,) targets drawn from softmax(x @ w.T) (the Gumbel-max trick), in chunks of rows."""
    rows = max(budget // (w.shape[0] * 4), 1)
    parts = []
    for start in range(0, x.shape[0], rows):
        z = x[start:start + rows].float() @ w.float().t()
        u = torch.rand(z.shape, device=z.device, generator=gen).clamp_(min=1e-20)
        parts.append((z - torch.log(-torch.log(u))).argmax(1))
    return torch.cat(parts)


def _cells(args) -> list[Cell]:
    if getattr(args, "shapes", None):
        cells = [_custom_cell(spec) for spec in args.shapes.split(",")]
    else:
        names = args.sweep.split(",") if getattr(args, "sweep", None) else (
            ["headline"] if args.device.type == "cuda" else ["cpu"])
        names = GPU_SWEEPS if names == ["all"] else names
        unknown = [n for n in names if n not in SWEEPS]
        if unknown:
            raise ValueError(f"unknown lce sweep(s) {unknown}; choose from {list(SWEEPS)} or 'all'")
        cells = [c for n in names for c in SWEEPS[n](args.quick)]
    dtypes = getattr(args, "dtype", None)
    if dtypes:
        unknown = [d for d in dtypes.split(",") if d not in DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; choose from {list(DTYPES)}")
        cells = [replace(c, dtype=DTYPES[d]) for c in cells for d in dtypes.split(",")]
    modes = getattr(args, "modes", None)
    if modes:
        keep = set(modes.split(","))
        cells = [replace(c, modes=tuple(m for m in c.modes if m in keep)) for c in cells]
    return [c for c in cells if c.modes]


def _custom_cell(spec: str) -> Cell:
    return Cell("custom", *parse_shape(spec, "BTxHxV"))


def _methods(args, cells: list[Cell]) -> list[str]:
    chosen_by_user = bool(getattr(args, "methods", None))
    if chosen_by_user:
        wanted = args.methods.split(",")
    elif all(c.sweep == "cpu" for c in cells):
        wanted = CPU_METHODS
        _note(args, f"lce: CPU default methods {', '.join(CPU_METHODS)} (--methods adds "
                    f"{', '.join(m for m in METHODS if m not in CPU_METHODS)})")
    else:
        wanted = list(METHODS)
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown lce method(s) {unknown}; choose from {list(METHODS)}")
    chosen = []
    for m in wanted:
        why = UNAVAILABLE.get(m, lambda d: None)(args.device)
        if why:
            _note(args, f"lce: {m} skipped ({why})")
        else:
            chosen.append(m)
    return chosen


def _note(args, text: str) -> None:
    notes = getattr(args, "notes", None)
    if notes is not None:
        notes.append(text)
    else:
        print(text)


def run(args) -> list[dict]:
    """Run the chosen sweeps; see the module docstring and benchmark/README.md for the columns.

    ``args.time_limit`` (seconds, optional): no new cell starts after it; ``args.checkpoint(rows)``
    (optional) is called after each cell, so a run cut short keeps what it measured.
    """
    global LEAN_BUFFER_MB
    device = args.device
    started = time.monotonic()
    cells = _cells(args)
    methods = _methods(args, cells)
    timing = getattr(args, "timing", None) or TIMINGS
    unknown = [k for k in timing if k not in TIMINGS]
    if unknown:
        raise ValueError(f"unknown timing(s) {unknown}; choose from {list(TIMINGS)}")
    LEAN_BUFFER_MB = getattr(args, "lean_mb", None) or LEAN_BUFFER_MB
    if device.type != "cuda":
        what = "the small embedded CPU default" if all(c.sweep == "cpu" for c in cells) else "on the CPU"
        _note(args, f"lce: no CUDA device, running {what}; times are not comparable with GPU results")
    bandwidth = copy_bandwidth_gbs(device, 1024 if device.type == "cuda" else 64)
    _note(args, f"lce: measured device-to-device copy bandwidth {bandwidth:.0f} GB/s")
    rows: list[dict] = []
    limit = getattr(args, "time_limit", None)
    checkpoint = getattr(args, "checkpoint", None)
    with progress(sum(len(c.modes) for c in cells) * len(methods), "lce") as step:
        for i, cell in enumerate(cells):
            if limit is not None and i and time.monotonic() - started > limit:
                _note(args, f"lce: stopped at the time limit ({limit:.0f} s); cells not run: "
                            + ", ".join(f"{c.shape}" + (f" ({c.ignored:.0%} ignored)" if c.ignored else "")
                                        for c in cells[i:]))
                break
            try:
                rows += _run_cell(cell, methods, args, bandwidth, step)
            except Exception as exc:  # noqa: BLE001 - inputs or the float64 reference did not fit
                if not is_oom(exc):
                    raise
                _note(args, f"lce: cell {cell.shape} {cell.dtype} skipped: out of memory for its inputs")
                free_memory(device)
            if checkpoint:
                checkpoint(_add_ratios(rows))
    return _add_ratios(rows)


def _run_cell(cell: Cell, methods: list[str], args, bandwidth: float, step) -> list[dict]:
    device = args.device
    x, w, t = _make_inputs(cell, device)
    n_valid = int((t != -100).sum())
    ref = rounding = None
    if cell.precision:
        ref = reference_grad_weight(x, w, t)
        rounding = relative_error(ref.to(cell.dtype), ref)
    item = x.element_size()
    rows = []
    for mode in cell.modes:
        flops = (6 if mode == "fwd+bwd" else 2) * n_valid * cell.vocab * cell.hidden
        grad_mb = (x.numel() + w.numel()) * item / MB if mode == "fwd+bwd" else 0.0
        weight_passes = 3 if mode == "fwd+bwd" else 1  # read W (logits), read W (grad_input), write grad_W
        byte_floor = weight_passes * w.numel() * item / (bandwidth * 1e9) * 1e3
        steps = {}
        for method in methods:
            if method == FLOOR:  # the unavoidable work: valid rows only
                x_valid = x.detach()[t != -100] if cell.ignored else x.detach()
                floor = _floor_fn(x_valid, w.detach(), mode)
                steps[method] = lambda floor=floor: floor
            else:
                steps[method] = _make_step(method, x, w, t, mode)
        for method, measured in measure_steps(steps, args, flops, timings=getattr(args, "timing", None)).items():
            step(f"{cell.shape} {mode} {method}")
            extras = dict(sweep=cell.sweep, dtype=str(cell.dtype).removeprefix("torch."), BT=cell.bt,
                          H=cell.hidden, V=cell.vocab, ignored=cell.ignored, logit_std=cell.logit_std,
                          cell=_cell_label(cell),
                          ms_loop=measured.pop("ms_loop", None), ms_mixed=measured.pop("ms_mixed", None),
                          overhead_mb=measured["peak_mb"] - grad_mb,
                          byte_floor_ms=byte_floor if cell.bt <= BYTE_FLOOR_MAX_BT else None,
                          copy_gbs=bandwidth)
            if ref is not None and mode == "fwd+bwd" and method != FLOOR and measured["status"] == "ok":
                extras.update(_precision(steps[method], ref, rounding, args))
            rows.append(make_row(NAME, method, mode, cell.shape, measured, **extras))
    del x, w, t, ref
    free_memory(device)
    return rows


def _cell_label(cell: Cell) -> str:
    """The shape, the share of ignored targets and the logits' spread where not the default, and the cell's
    label (the compact table's cell column)."""
    return cell.shape + (f" {cell.ignored:.0%} ign" if cell.ignored else "") + (
        f" std {cell.logit_std:g}" if cell.logit_std != 1.0 else "") + (f" {cell.label}" if cell.label else "")


def _precision(make_step, ref: torch.Tensor, rounding: float, args) -> dict:
    try:
        _, grad_w = make_step()()
        err = relative_error(grad_w, ref)
        return dict(grad_w_err=err, x_rounding=err / rounding if rounding > 0 else NAN)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        _note(args, f"lce: precision check failed: {type(exc).__name__}: {str(exc)[:160]}")
        return {}
    finally:
        free_memory(args.device)


def _add_ratios(rows: list[dict]) -> list[dict]:
    """x_floor (time / floor's time, same cell: per reading, then the worse), x_byte_floor, x_all_valid
    (ignored cells vs all-valid)."""
    def key(r, **override):
        k = dict(sweep=r["sweep"], mode=r["mode"], dtype=r["dtype"], shape=r["shape"], ignored=r["ignored"],
                 logit_std=r.get("logit_std", 1.0), method=r["method"])
        k.update(override)
        return tuple(k.values())

    by_key = {key(r): r for r in rows}
    for r in rows:
        floor = by_key.get(key(r, method=FLOOR)) or {}
        ratios = []
        for reading in TIMINGS:
            ms, floor_ms = r.get(f"ms_{reading}"), floor.get(f"ms_{reading}")
            r[f"x_floor_{reading}"] = _ratio(ms, floor_ms) if ms is not None and floor_ms is not None else None
            if r[f"x_floor_{reading}"] is not None and math.isfinite(r[f"x_floor_{reading}"]):
                ratios.append(r[f"x_floor_{reading}"])
        r["x_floor"] = max(ratios) if ratios else _ratio(r["median_ms"], floor.get("median_ms", NAN))
        r["x_byte_floor"] = _ratio(r["median_ms"], r["byte_floor_ms"]) if r["byte_floor_ms"] else None
        if r["ignored"]:
            base = by_key.get(key(r, ignored=0.0))
            r["x_all_valid"] = _ratio(r["median_ms"], base["median_ms"] if base else NAN)
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else NAN


def compact_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """The default table (fits 100 columns): method, mode (when several), cell, time, x floor, peak memory,
    grad_weight's error. ``--wide`` shows COLUMNS."""
    cols = [("method", "method")]
    if len({r["mode"] for r in rows}) > 1:
        cols.append(("mode", "mode"))
    return cols + [("cell", "shape"), ("median_ms", "ms"), ("x_floor", "x floor"), ("peak_mb", "peak MB"),
                   ("grad_w_err", "grad err")]


def title(rows: list[dict]) -> str:
    """What every row of the compact table shares: modes and dtypes."""
    modes = ", ".join(dict.fromkeys(r["mode"] for r in rows))
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in rows))
    return f"lce ({modes}; {dtypes})"


# ---------------------------------------------------------------- plots

def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Latency and memory vs BT / V / H for the line sweeps, bars for the single-shape ones."""
    paths = []
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["sweep"] == sweep):
            sel = [r for r in rows if r["sweep"] == sweep and r["mode"] == mode]
            name = f"lce_{sweep}_{mode.replace('+', '')}.png"
            title = f"lce {sweep}, {mode}, {sel[0]['dtype']}"
            x = X_AXIS.get(sweep)
            if x and len({r[x] for r in sel}) > 1:
                sel = [r for r in sel if not r["ignored"]]
                path = plot_lines(sel, x, out_dir / name, title, ys=("median_ms", "x_floor", "peak_mb"))
            else:
                path = plot_bars(sel, out_dir / name, title)
            if path:
                paths.append(path)
    return paths

