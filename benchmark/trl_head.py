#!/usr/bin/env python
"""TRL's fused LM head against TRL on flce, same inputs, forward+backward.

    python benchmark/trl_head.py --out benchmark/results/<date>-<gpu>-trl
    python benchmark/trl_head.py --out /tmp/x --shapes 64x32x100 --reps 2   # CPU smoke run

Methods: ``trl`` is ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` (TRL's own kernel, called
as ``add_fused_lm_head``'s forward calls it, vocabulary tiles of 32768); ``flce`` is
``flce.patches.trl.TrlHeadOnFlce`` (what routed TRL calls); ``floor`` is three cuBLAS GEMMs of the same
shapes (logits, grad_input, grad_weight), timed in the same run. Losses: ``sft`` is -sum(log_probs) / n
with TRL SFT's outputs ("log_probs", "entropy", "is_top1"); ``grpo`` is a per-token-weighted policy term
plus an entropy bonus, -(a * log_probs + 0.01 * entropy).sum() / n with ("log_probs", "entropy");
``ref`` is a reference model's log-probs (GRPO, DPO): ("log_probs",) under ``torch.no_grad()``, against
a floor of the one logits GEMM, with a third method ``flce-chunked`` (flce's chunked log-prob loop, the
route before the statistics-only path) to show what that path changes.
Columns: median_ms, x_floor, peak_mb (above the inputs, with the returned gradients), and relative L2
errors: ``*_vs_other`` between trl and flce, ``*_vs_fp32`` against a float32 reference computed chunk by
chunk, next to ``rounding`` (the same error of the reference rounded to the inputs' dtype); for ``ref``
the log-probs' errors stand in the grad_x columns. Writes trl_head.json and trl_head.md under --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]  # flce from this checkout unless already importable

import torch  # noqa: E402

from common import NAN, environment, free_memory, markdown_table, measure_interleaved, write_json  # noqa: E402

SHAPES = ["8192x4096x128256", "1024x4096x128256", "8192x2048x32000"]
OUTPUTS = {"sft": ("log_probs", "entropy", "is_top1"), "grpo": ("log_probs", "entropy"), "ref": ("log_probs",)}
ENTROPY_COEF = 0.01
TRL_VOCAB_TILE = 32768  # add_fused_lm_head's chunk_size
COLUMNS = ["loss", "method", "shape", "median_ms", "x_floor", "peak_mb", "grad_x_vs_other", "grad_w_vs_other",
           "grad_x_vs_fp32", "grad_w_vs_fp32", "rounding_x", "rounding_w", "status"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for trl_head.json and trl_head.md")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated BTxHxV")
    p.add_argument("--losses", default="sft,grpo,ref")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-reference", action="store_true", help="skip the float32 reference")
    args = p.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args


def loss_of(kind: str, out, advantages: torch.Tensor) -> torch.Tensor:
    log_probs, entropy = out[0], out[1]
    n = log_probs.numel()
    if kind == "sft":
        return -log_probs.sum() / n
    return -(advantages * log_probs + ENTROPY_COEF * entropy).sum() / n


def method_fn(head, kind, x, w, t, advantages):
    """fwd+bwd of one method; returns (grad_x, grad_w) (alive at the memory peak, as in training); for
    ``ref`` the forward alone under no_grad, returning (log_probs,)."""
    if kind == "ref":
        @torch.no_grad()
        def reference_model():
            return head.apply(x, w, None, t, 1.0, TRL_VOCAB_TILE, None, 1.0, OUTPUTS[kind])[:1]
        return reference_model

    def step():
        out = head.apply(x, w, None, t, 1.0, TRL_VOCAB_TILE, None, 1.0, OUTPUTS[kind])
        return torch.autograd.grad(loss_of(kind, out, advantages), (x, w))
    return step


def floor_fn(x, w, kind):
    if kind == "ref":
        return lambda: x @ w.t()

    def three_gemms():
        logits = x @ w.t()  # stands in for dlogits too: same shape and dtype
        return logits @ w, logits.t() @ x
    return three_gemms


def reference_grads(kind, x, w, t, advantages, rows: int = 1024):
    """(grad_x, grad_w) in float32 (no TF32), chunk by chunk through autograd on materialized logits; for
    ``ref`` (log_probs,)."""
    if kind == "ref":
        return (torch.cat([torch.log_softmax(x[s:s + rows].float() @ w.float().t(), -1)
                           .gather(1, t[s:s + rows, None])[:, 0] for s in range(0, x.shape[0], rows)]),)
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    n = x.shape[0]
    try:
        for start in range(0, n, rows):
            end = min(start + rows, n)
            log_p = torch.log_softmax(x32[start:end] @ w32.t(), -1)
            log_probs = log_p.gather(1, t[start:end, None])[:, 0]
            entropy = -(log_p.exp() * log_p).sum(-1)
            part = loss_of(kind, (log_probs, entropy), advantages[start:end]) * (end - start) / n
            part.backward()
            del log_p
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    return x32.grad, w32.grad


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    e64 = e.double()
    return ((a.double() - e64).norm() / e64.norm().clamp(min=1e-30)).item()


def run_cell(args, kind: str, shape: str, methods: dict) -> list[dict]:
    n, hidden, vocab = (int(v) for v in shape.split("x"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(n, hidden, device=args.device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=args.device, generator=g) / hidden**0.5 * 2).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), device=args.device, generator=g)
    advantages = torch.randn(n, device=args.device, generator=g)
    fns = {"floor": floor_fn(x.detach(), w.detach(), kind)}
    heads = {**methods, "flce-chunked": chunked_log_probs(methods["flce"])} if kind == "ref" else methods
    fns.update({name: method_fn(head, kind, x, w, t, advantages) for name, head in heads.items()})
    measured = measure_interleaved(fns, args, flops=(2.0 if kind == "ref" else 6.0) * n * hidden * vocab)
    grads = {}
    for name in heads:
        if measured[name]["status"] == "ok":
            grads[name] = fns[name]()
            free_memory(args.device)
    reference = None if args.no_reference else reference_grads(kind, x, w, t, advantages)
    rows = []
    for name, m in measured.items():
        row = {"loss": kind, "method": name, "shape": shape, **{k: m[k] for k in ("median_ms", "peak_mb", "status")},
               "x_floor": m["median_ms"] / measured["floor"]["median_ms"]}
        if name in grads:
            other = next((o for o in grads if o != name and o in methods), None)
            for i, axis in enumerate("xw"[:len(grads[name])]):
                row[f"grad_{axis}_vs_other"] = rel_err(grads[name][i], grads[other][i]) if other else NAN
                if reference is not None:
                    row[f"grad_{axis}_vs_fp32"] = rel_err(grads[name][i], reference[i])
                    row[f"rounding_{axis}"] = rel_err(reference[i].to(dtype), reference[i])
        rows.append(row)
    del grads, reference
    free_memory(args.device)
    return rows


def chunked_log_probs(head):
    """``head`` with flce's statistics-only log-prob path turned off for its calls (the chunked loop)."""
    from flce import log_probs

    class Chunked:
        @staticmethod
        def apply(*args):
            alone = log_probs._log_probs_alone
            log_probs._log_probs_alone = lambda *a: None
            try:
                return head.apply(*args)
            finally:
                log_probs._log_probs_alone = alone
    return Chunked


def main(argv=None) -> int:
    args = parse_args(argv)
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # TRL's own kernel, whatever is routed

    from flce.patches.trl import TrlHeadOnFlce

    methods = {"trl": ChunkedLogProbFunction, "flce": TrlHeadOnFlce}
    rows = []
    for shape in args.shapes.split(","):
        for kind in args.losses.split(","):
            cell = run_cell(args, kind, shape, methods)
            rows += cell
            print(markdown_table(cell, COLUMNS), flush=True)
    import trl

    meta = {**environment(args.device), "trl": trl.__version__, "dtype": args.dtype, "reps": args.reps,
            "warmup": args.warmup}
    write_json(args.out / "trl_head.json", meta, rows)
    header = f"# TRL fused head vs TRL on flce ({meta['device']}, torch {meta['torch']}, trl {meta['trl']})\n\n"
    (args.out / "trl_head.md").write_text(header + markdown_table(rows, COLUMNS))
    print(f"wrote {args.out / 'trl_head.json'} and trl_head.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
