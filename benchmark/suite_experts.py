"""Experts suite: flce's Mixtral experts backend against transformers' eager and grouped_mm backends.

One experts layer (transformers' ``MixtralExperts``: SwiGLU, E experts, top-k), routed by a softmax
router over random logits (Mixtral-like, about balanced) or ``skewed`` (every token's first choice is
expert 0, as an unbalanced router does). Methods:

- ``eager``, ``grouped_mm``: transformers' backends (the per-expert loop and its grouped-GEMM default).
- ``flce``: the registered backend, ``auto``: the GEMM path measured fastest per shape, or the per-expert
  loop for GEMMs of ``LOOP_MIN_FLOP`` per expert and ``LOOP_MIN_WIDTH`` wide.
- ``flce:triton``, ``flce:triton_tma``, ``flce:grouped_mm``: the same with the GEMM path forced (CUDA
  only; see ``flce.kernels.experts_dispatch``); ``flce:loop``: one cuBLAS ``mm`` per expert after reading the
  offsets on the host (a sync per layer call: not graph-safe).

"fwd" runs under no_grad; "fwd+bwd" returns the gradients of the hidden states, the routing weights and
both expert weights (``torch.autograd.grad``). FLOPs: ``6 S H I`` forward with S = T k token-expert
pairs, three times that for fwd+bwd. ``x_grouped_mm`` is grouped_mm's time over the method's.

GEMM breakdown (rows ``gemm:<path>``, mode = the GEMM's role): each of the layer's six GEMMs alone on
flce's Triton kernels (with and without TMA loads), torch's grouped_mm, and ``cublas``, a loop of one
``mm`` per expert with the bounds known on the host (not graph-safe; the dense-GEMM reference of seed 003).

    PYTHONPATH=src python benchmark/bench.py --suite experts      # or: python benchmark/suite_experts.py
    PYTHONPATH=src python benchmark/suite_experts.py --quick      # GPU: Mixtral at T=4096 only
    PYTHONPATH=src python benchmark/bench.py --suite experts --shapes 512x4096x14336,4096x2048x1408x60x4
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from common import add_speedup, make_row, measure, parse_shape, plot_lines, progress, wanted

NAME = "experts"
COLUMNS = ["method", "mode", "shape", "routing", "median_ms", "tflops", "x_grouped_mm", "peak_mb", "paths",
           "status"]
LAYER_METHODS = ("eager", "grouped_mm", "flce", "flce:triton", "flce:triton_tma", "flce:grouped_mm", "flce:loop")
GEMM_PATHS = ("triton", "triton_tma", "grouped_mm", "cublas")
ROLES = ("up", "down", "down_dgrad", "down_wgrad", "up_wgrad", "up_dgrad")
_ROLE_PATHS = {role: set(GEMM_PATHS) - ({"triton_tma"} if role.endswith("wgrad") else set()) for role in ROLES}
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Cell:
    """T tokens, hidden H, expert width I, E experts, top-k."""

    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    dtype: torch.dtype
    routing: str = "router"
    breakdown: bool = False  # also time the six GEMMs alone

    @property
    def shape(self) -> str:
        return f"T{self.tokens} H{self.hidden} I{self.inter} E{self.experts} k{self.top_k}"

    def flops(self, mode: str) -> float:
        return (3 if mode == "fwd+bwd" else 1) * 6 * self.tokens * self.top_k * self.hidden * self.inter


MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2, dtype=torch.bfloat16)


def cells(args) -> list[Cell]:
    if getattr(args, "shapes", None):  # TxHxI[xE[xk]]: Mixtral's 8 experts, top-2 unless given
        dims = [parse_shape(spec, "TxHxI[xE[xk]]", (3, 4, 5)) for spec in args.shapes.split(",")]
        dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
        return [Cell(*d, *(8, 2)[len(d) - 3:], dtype, breakdown=True) for d in dims]
    if args.device.type != "cuda":
        return [Cell(64, 64, 96, 4, 2, torch.float32, breakdown=True),
                Cell(64, 64, 96, 4, 2, torch.float32, routing="skewed")]
    if args.quick:
        return [Cell(4096, **MIXTRAL, breakdown=True)]
    return [Cell(1024, **MIXTRAL, breakdown=True), Cell(4096, **MIXTRAL, breakdown=True),
            Cell(16384, **MIXTRAL, breakdown=True), Cell(4096, **MIXTRAL, routing="skewed"),
            Cell(4096, 1024, 3584, 8, 2, torch.bfloat16)]


# ---------------------------------------------------------------- problem

@dataclass
class Problem:
    """transformers' experts module (gate_up (E, 2I, H), down (E, H, I)) and one routed batch."""

    module: torch.nn.Module
    hidden: torch.Tensor  # (T, H)
    ids: torch.Tensor  # (T, k) int64
    weights: torch.Tensor  # (T, k) float32, as Mixtral's router gives
    grad_out: torch.Tensor  # (T, H)


def make_problem(cell: Cell, device: torch.device, seed: int = 0) -> Problem:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    gen = torch.Generator(device=device).manual_seed(seed)
    cfg = MixtralConfig(hidden_size=cell.hidden, intermediate_size=cell.inter, num_local_experts=cell.experts,
                        num_experts_per_tok=cell.top_k, num_attention_heads=8, num_key_value_heads=8)
    with torch.device("meta"):
        module = MixtralExperts(cfg)

    def randn(*shape, scale=1.0, dtype=cell.dtype):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    module.gate_up_proj = torch.nn.Parameter(randn(cell.experts, 2 * cell.inter, cell.hidden, scale=cell.hidden**-0.5))
    module.down_proj = torch.nn.Parameter(randn(cell.experts, cell.hidden, cell.inter, scale=cell.inter**-0.5))
    logits = randn(cell.tokens, cell.experts, dtype=torch.float32)
    if cell.routing == "skewed":
        logits[:, 0] += 100.0
    weights, ids = torch.softmax(logits, dim=-1).topk(cell.top_k, dim=-1)
    return Problem(module, randn(cell.tokens, cell.hidden), ids, weights / weights.sum(-1, keepdim=True),
                   randn(cell.tokens, cell.hidden))


def layer_fn(method: str, problem: Problem, mode: str):
    from flce import experts as fx

    module, hidden, ids, weights, grad_out = (problem.module, problem.hidden, problem.ids, problem.weights,
                                              problem.grad_out)
    if method.startswith("flce:"):
        gemm = method.split(":", 1)[1]

        def forward(x, w):
            return fx.experts_forward(x, ids, w, module.gate_up_proj, module.down_proj, gemm=gemm)
    else:
        module.config._experts_implementation = method

        def forward(x, w):
            return module(x, ids, w)

    if mode == "fwd":
        def run():
            with torch.no_grad():
                return forward(hidden, weights)
        return run
    x, w = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    leaves = (x, w, module.gate_up_proj, module.down_proj)
    return lambda: torch.autograd.grad(forward(x, w), leaves, grad_out)


# ---------------------------------------------------------------- GEMM breakdown

def gemm_fns(cell: Cell, problem: Problem) -> dict[str, tuple[float, dict]]:
    """Per role: (flops, {path: fn}) for the six GEMMs of one fwd+bwd, on this cell's routing."""
    from flce.experts import route_pairs
    from flce.kernels import experts_dispatch as dispatch

    gate_up, down = problem.module.gate_up_proj.detach(), problem.module.down_proj.detach()
    device = gate_up.device
    offsets = route_pairs(problem.ids, cell.experts).offsets
    bounds = offsets.tolist()
    rows, h, i = bounds[-1], cell.hidden, cell.inter

    def act(n):
        return torch.randn(rows, n, device=device, dtype=cell.dtype)

    xs, a, dy, dh = act(h), act(i), act(h), act(2 * i)
    problems = {  # role: (kind, operand a, operand b)
        "up": ("rows", xs, gate_up.transpose(1, 2)), "down": ("rows", a, down.transpose(1, 2)),
        "down_dgrad": ("rows", dy, down), "down_wgrad": ("wgrad", dy, a),
        "up_wgrad": ("wgrad", dh, xs), "up_dgrad": ("rows", dh, gate_up),
    }
    segments = [(e, s, t) for e, (s, t) in enumerate(zip(bounds[:-1], bounds[1:])) if t > s]

    def cublas(kind, p, q):
        if kind == "rows":
            return lambda: [torch.mm(p[s:t], q[e]) for e, s, t in segments]
        return lambda: [torch.mm(p[s:t].t(), q[s:t]) for _, s, t in segments]

    fns = {}
    for role, (kind, p, q) in problems.items():
        mm = dispatch.rows_mm if kind == "rows" else dispatch.wgrad_mm
        flops = 2.0 * rows * p.shape[1] * (q.shape[-1])
        paths = {"cublas": cublas(kind, p, q)}
        for path in ("triton", "triton_tma", "grouped_mm") if kind == "rows" else ("triton", "grouped_mm"):
            paths[path] = lambda mm=mm, p=p, q=q, path=path: mm(p, q, offsets, path)
        fns[role] = (flops, paths)
    return fns


# ---------------------------------------------------------------- the suite

def _extras(cell: Cell) -> dict:
    return dict(routing=cell.routing, dtype=DTYPES[cell.dtype], T=cell.tokens, H=cell.hidden, I=cell.inter,
                E=cell.experts, k=cell.top_k)


def run(args) -> list[dict]:
    from flce.kernels import experts_dispatch as dispatch

    gpu = args.device.type == "cuda"
    methods = [m for m in wanted(args, LAYER_METHODS, "methods") if gpu or not m.startswith("flce:")]
    modes = wanted(args, ("fwd", "fwd+bwd"), "modes")
    paths = GEMM_PATHS if gpu else ("grouped_mm", "cublas")
    breakdown = not getattr(args, "methods", None)
    gemms = sum(path in _ROLE_PATHS[role] for role in ROLES for path in paths)
    todo = [(c, len(methods) * len(modes) + (gemms if breakdown and c.breakdown else 0)) for c in cells(args)]
    rows = []
    with progress(sum(n for _, n in todo), NAME) as step:
        for cell, _ in todo:
            problem = make_problem(cell, args.device)
            for mode in modes:
                for method in methods:
                    measured = measure(layer_fn(method, problem, mode), args, cell.flops(mode))
                    picked = _chosen(dispatch.chosen_paths(), cell) if method == "flce" else None
                    rows.append(make_row(NAME, method, mode, cell.shape, measured, **_extras(cell), paths=picked))
                    step(f"{cell.shape} {method} {mode}")
            if breakdown and cell.breakdown:
                for role, (flops, fns) in gemm_fns(cell, problem).items():
                    for path in (p for p in paths if p in fns):
                        measured = measure(fns[path], args, flops)
                        rows.append(make_row(NAME, f"gemm:{path}", role, cell.shape, measured, **_extras(cell)))
                        step(f"{cell.shape} {role} {path}")
            del problem
    # x_grouped_mm: transformers' grouped_mm (or the grouped_mm GEMM path) time over this row's
    return add_speedup(rows, "x_grouped_mm", ("grouped_mm", "gemm:grouped_mm"), ("shape", "routing", "mode"))


def _chosen(choices: dict, cell: Cell) -> str | None:
    """The GEMM paths flce's auto dispatch measured fastest for this cell, as 'role:path' (rows in K x N)."""
    rows = cell.tokens * cell.top_k
    bucket = 1 << max(0, (rows - 1).bit_length())
    picked = sorted(f"{key[0]}{'x'.join(map(str, key[4][1][1]))}:{path}" for key, path in choices.items()
                    if key[2] == cell.experts and key[3] == bucket)
    return " ".join(picked) or None


def plot(rows: list[dict], out_dir) -> list:
    """Time and memory against T, one line per method, for the widest layer under the router's routing."""
    layer = [r for r in rows if not r["method"].startswith("gemm:") and r["routing"] == "router"]
    if not layer:
        return []
    widest = max(r["H"] for r in layer)
    figures = []
    for mode in ("fwd", "fwd+bwd"):
        chosen = [r for r in layer if r["mode"] == mode and r["H"] == widest]
        if chosen:
            r = chosen[0]
            title = f"experts layer {mode}: H{r['H']} I{r['I']} E{r['E']} top-{r['k']}, {r['dtype']}"
            figures.append(plot_lines(chosen, "T", out_dir / f"experts_{mode.replace('+', '')}.png", title))
    return [f for f in figures if f is not None]


if __name__ == "__main__":
    import bench

    sys.exit(bench.main(["--suite", NAME, *sys.argv[1:]]))
