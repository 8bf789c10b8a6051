#!/usr/bin/env python
"""The precise low-memory mode (``low_memory=True``) against flce's default, the lean setting, the
three-GEMM floor (and Cut Cross-Entropy when installed): time, memory above the gradients, precision.

    python benchmark/low_memory.py --out DIR          # ~3 min on an H100
    python benchmark/low_memory.py --parts            # also where one backward block's time goes

Per cell (bf16, mean over random targets, fresh random data): forward+backward through
``torch.autograd.grad`` (fresh gradients each call), CUDA events, warm-up, median over interleaved rounds;
``x floor`` = time / the three cuBLAS GEMMs of the same cell; ``above grads MiB`` = peak allocated during
the call minus what was allocated before it minus the returned gradients (grad_input + grad_weight).
Precision cells: grad_weight (and grad_input) error against a float64 reference computed on the GPU in
vocabulary blocks, in units of the error of rounding the exact gradient once to bf16.
Writes ``low_memory.json`` and ``low_memory.md`` under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import torch  # noqa: E402

import flce  # noqa: E402
from common import _failure  # noqa: E402 - "OOM" or "error: ..." for a failed method
from common import environment, free_memory, markdown_table, peak_extra_mb, timed_calls, write_json  # noqa: E402

MB = 2**20
TIME_SHAPES = "8192x4096x128256,32768x4096x128256,8192x2048x32000"
PRECISION_SHAPES = "8192x4096x128256,32768x1024x32000"


def _flce(x, w, t):
    return flce.linear_cross_entropy(x, w, t)


def _low_memory(x, w, t):
    return flce.linear_cross_entropy(x, w, t, low_memory=True)


def _lean(x, w, t):
    return flce.linear_cross_entropy(x, w, t, chunk_size=512, accum_dtype=torch.bfloat16)


def _cce(x, w, t):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(x, w, t)


METHODS = {"flce": _flce, "flce-low-memory": _low_memory, "flce-lean": _lean, "cce": _cce}


def _floor(x, w, _t):
    """The three GEMMs any exact method does: logits, grad_input and grad_weight (logits stand in for
    dlogits: same shape and dtype)."""
    logits = x.detach() @ w.detach().t()
    return logits @ w.detach(), logits.t() @ x.detach()


def step_fn(method: str, x, w, t):
    if method == "floor":
        return lambda: _floor(x, w, t)
    loss = METHODS[method]
    return lambda: torch.autograd.grad(loss(x, w, t), (x, w))


def available(method: str) -> str | None:
    """None, or why the method cannot run here."""
    if method == "cce":
        import importlib.util

        if importlib.util.find_spec("cut_cross_entropy") is None:
            return "cut_cross_entropy is not installed"
    return None


def make_inputs(bt: int, hidden: int, vocab: int, seed: int, device: torch.device):
    """Fresh random bf16 inputs: unit-variance logits, uniform random targets (never zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(bt, hidden, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * hidden**-0.5).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (bt,), device=device, generator=gen)
    return x, w, t


def time_cell(shape: tuple[int, int, int], methods: list[str], args) -> list[dict]:
    bt, hidden, vocab = shape
    x, w, t = make_inputs(bt, hidden, vocab, seed=bt + vocab, device=args.device)
    rows = {m: {"shape": "x".join(map(str, shape)), "method": m, "status": "ok"} for m in methods}
    fns = {m: step_fn(m, x, w, t) for m in methods}
    grads_mib = (x.numel() * x.element_size() + w.numel() * w.element_size()) / MB  # what each call returns
    for m, fn in fns.items():  # first call (compile, autotune), then the memory measurement
        try:
            fn()
            rows[m]["above_grads_mib"] = peak_extra_mb(fn, args.device) - grads_mib
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run
            rows[m]["status"] = _failure(exc)
        free_memory(args.device)
    live = [m for m in methods if rows[m]["status"] == "ok"]
    times: dict[str, list[float]] = {m: [] for m in live}
    for r in range(args.rounds):  # interleaved: every method sees the same clocks
        reps = args.reps // args.rounds + (r < args.reps % args.rounds)
        for m in [m for m in live if rows[m]["status"] == "ok"]:
            try:
                times[m] += timed_calls(fns[m], args.warmup, reps, args.device)
            except Exception as exc:  # noqa: BLE001
                rows[m]["status"] = _failure(exc)
            free_memory(args.device)
    live = [m for m in live if rows[m]["status"] == "ok"]
    floor = statistics.median(times["floor"]) if "floor" in live else float("nan")
    for m in live:
        rows[m]["median_ms"] = statistics.median(times[m])
        rows[m]["x_floor"] = rows[m]["median_ms"] / floor
    del x, w, t, fns
    free_memory(args.device)
    return list(rows.values())


# ---------------------------------------------------------------- precision

def reference_grads(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, block_bytes: int = 1 << 30):
    """d mean CE / d (x, W) in float64 on x's device, by blocks of vocabulary columns (two passes: the
    rows' lse, then each block's dlogits): grad_weight blocks written once, grad_input summed in float64."""
    x64, w64 = x.detach().double(), w.detach().double()
    n, vocab = x.shape[0], w.shape[0]
    cols = max(block_bytes // (n * 8), 1)
    lse = torch.full((n,), float("-inf"), dtype=torch.float64, device=x.device)
    for v0 in range(0, vocab, cols):
        lse = torch.logaddexp(lse, torch.logsumexp(x64 @ w64[v0:v0 + cols].t(), 1))
    grad_w = torch.empty_like(w64)
    grad_x = torch.zeros_like(x64)
    rows = torch.arange(n, device=x.device)
    for v0 in range(0, vocab, cols):
        dz = (x64 @ w64[v0:v0 + cols].t()).sub_(lse[:, None]).exp_()
        here = (t >= v0) & (t < v0 + dz.shape[1])
        dz[rows[here], t[here] - v0] -= 1.0
        dz /= n
        grad_w[v0:v0 + cols] = dz.t() @ x64
        grad_x.addmm_(dz, w64[v0:v0 + cols])
        del dz
    return grad_x, grad_w


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def precision_cell(shape: tuple[int, int, int], methods: list[str], args) -> list[dict]:
    bt, hidden, vocab = shape
    x, w, t = make_inputs(bt, hidden, vocab, seed=3 * bt + vocab, device=args.device)
    ref_x, ref_w = reference_grads(x, w, t)
    unit_w = relative_error(ref_w.bfloat16(), ref_w)
    unit_x = relative_error(ref_x.bfloat16(), ref_x)
    out = []
    for m in [m for m in methods if m != "floor"]:
        row = {"shape": "x".join(map(str, shape)), "method": m, "bf16_rounding_w": unit_w}
        try:
            gx, gw = step_fn(m, x, w, t)()
            row["grad_w_err"] = relative_error(gw, ref_w)
            row["grad_w_x_rounding"] = row["grad_w_err"] / unit_w
            row["grad_x_x_rounding"] = relative_error(gx, ref_x) / unit_x
            del gx, gw
        except Exception as exc:  # noqa: BLE001
            row["status"] = _failure(exc)
        free_memory(args.device)
        out.append(row)
    del x, w, t, ref_x, ref_w
    free_memory(args.device)
    return out


# ---------------------------------------------------------------- one backward block, in parts

def parts_cell(bt: int, hidden: int, cols: int, args) -> list[dict]:
    """One vocabulary block of the low-memory backward: the logits GEMM alone (cuBLAS), that GEMM plus the
    block kernel, the fused Hopper GEMM at two tile shapes, and the block's grad_weight GEMM."""
    from flce.kernels import block_gemm_triton as bg
    from flce.kernels import logits_triton as lt
    from flce.kernels.ce_block_torch import RowTerms
    from flce.kernels.ce_block_triton import ce_block_triton
    from flce.options import LossOptions

    dev = args.device
    x = torch.randn(bt, hidden, device=dev).bfloat16()
    w = (torch.randn(cols, hidden, device=dev) * hidden**-0.5).bfloat16()
    vocab = cols * 32
    t = torch.randint(0, vocab, (bt,), device=dev)
    terms = RowTerms(t, torch.full((bt,), 11.0, device=dev), None, None, torch.tensor(1.0 / bt, device=dev))
    out = torch.empty(bt, cols, dtype=torch.bfloat16, device=dev)
    gw = torch.empty(cols, hidden, dtype=torch.bfloat16, device=dev)
    opts = LossOptions()

    def fused(tile):
        def run():
            bg.TILE = tile
            bg.block_logits_grad_triton(x, w, None, out, 0, vocab, terms, opts)
        return run

    variants = {
        "logits GEMM (cuBLAS)": lambda: torch.mm(x, w.t(), out=out),
        "cuBLAS + block kernel": lambda: (torch.mm(x, w.t(), out=out),
                                          ce_block_triton(out, 0, vocab, terms, opts)),
        "block kernel alone": lambda: ce_block_triton(out, 0, vocab, terms, opts),
        "grad_weight GEMM (cuBLAS)": lambda: torch.mm(out.t(), x, out=gw),
    }
    if bg.supported(x, w, None, out):
        default = bg.TILE
        variants["fused, 128x256 tiles"] = fused(lt.TileConfig())
        variants["fused, 128x128 tiles"] = fused(lt.TileConfig(128, 128, 64, 4, 8, 8))
    rows = []
    for name, fn in variants.items():
        ms = statistics.median(timed_calls(fn, args.warmup, max(args.reps, 20), dev))
        rows.append({"block": f"{bt}x{hidden}, {cols} columns", "part": name, "median_ms": ms})
    if bg.supported(x, w, None, out):
        bg.TILE = default
    return rows


# ---------------------------------------------------------------- CLI

def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", default=TIME_SHAPES, help="timed cells BTxHxV,...")
    parser.add_argument("--precision-shapes", default=PRECISION_SHAPES, help="precision cells ('' for none)")
    parser.add_argument("--methods", default=",".join([*METHODS, "floor"]), help="comma-separated methods")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="timed calls per method and cell")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timed calls are split into")
    parser.add_argument("--parts", action="store_true", help="also time one backward block's parts")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE / "results" / "low_memory")))
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of small --shapes")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print("low_memory.py needs a CUDA GPU (or --device cpu with small --shapes for a smoke run)")
        return 1
    args.rounds = max(1, min(args.rounds, args.reps))
    wanted = args.methods.split(",")
    notes = [f"{m}: {why}" for m in wanted if (why := available(m))]
    methods = [m for m in wanted if available(m) is None]

    timing = [r for s in parse_shapes(args.shapes) for r in time_cell(s, methods, args)]
    precision = [r for s in parse_shapes(args.precision_shapes) for r in precision_cell(s, methods, args)]
    parts = []
    if args.parts and args.device.type == "cuda":
        parts = parts_cell(8192, 4096, 4096, args) + parts_cell(32768, 4096, 1024, args)

    tables = [("Forward+backward, bf16", timing, ["shape", "method", "median_ms", "x_floor", "above_grads_mib",
                                                  "status"]),
              ("grad_weight / grad_input error, x the bf16 rounding of the exact gradient", precision,
               ["shape", "method", "grad_w_x_rounding", "grad_x_x_rounding", "grad_w_err", "bf16_rounding_w",
                "status"]),
              ("One backward block in parts", parts, ["block", "part", "median_ms"])]
    text = [f"# Low-memory mode ({environment(args.device)['device']}, torch {torch.__version__})\n"]
    text += [f"- {n}\n" for n in notes]
    for title, rows, columns in tables:
        if rows:
            text.append(f"\n## {title}\n\n" + markdown_table(rows, columns))
    markdown = "".join(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "low_memory.md").write_text(markdown)
    meta = {**environment(args.device), "args": {k: str(v) for k, v in vars(args).items()}, "notes": notes}
    write_json(args.out / "low_memory.json", meta, timing + precision + parts)
    print(markdown)
    print(f"written: {args.out / 'low_memory.md'}, {args.out / 'low_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
