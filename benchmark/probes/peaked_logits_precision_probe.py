"""Probe: bf16 gradients against float64 when the logits are spread out as a trained model's are (std 1, 3, 6;
targets drawn from the softmax), on each path of the fused loss, beside eager PyTorch (bf16 logits, ``.float()``
cross-entropy). A bf16 logit is off by up to |z| / 256, which every method that stores bf16 logits carries into
its gradients. Prints each gradient's relative error as a multiple of the bf16 rounding of the exact gradient.
With a softcap (Gemma 2's 30) the targets are still drawn from the uncapped softmax, and eager caps the float32
logits. Beside them, the largest error of a token's log-probability (nats) from ``flce.linear_log_probs`` and from
eager's log_softmax of the bf16 logits (cases without label smoothing). GPU only; run it once per tree to compare
two (the argument picks cases by their rows or a word of their label):

    PYTHONPATH=src:benchmark python benchmark/probes/peaked_logits_precision_probe.py [rows|word,...]
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from suite_lce import _sampled_targets

import flce
from flce import exp_logits

H, V = 4096, 128256
EAGER_MAX_ROWS = 8192  # eager's float32 logits and their gradient: 13 GB at 8192 rows
# (label, rows, linear_cross_entropy keywords, whether the exp-logits path may run)
CASES = [
    ("16 rows (cuBLAS logits, thin grad_weight)", 16, {}, True),
    ("17 rows (cuBLAS logits and grad_weight)", 17, {}, True),
    ("200 rows (cuBLAS logits)", 200, {}, True),
    ("512 rows (one chunk)", 512, {}, True),
    ("8192 rows (one chunk, exp-logits)", 8192, {}, True),
    ("8192 rows (one chunk, standard path)", 8192, {}, False),
    ("8192 rows, label_smoothing 0.1 (one chunk)", 8192, {"label_smoothing": 0.1}, True),
    ("32768 rows (6 chunks, exp-logits)", 32768, {}, True),
    ("32768 rows (6 chunks, standard path)", 32768, {}, False),
    ("8192 rows, softcap 30 (one chunk)", 8192, {"softcap": 30.0}, True),
    ("32768 rows, softcap 30 (6 chunks)", 32768, {"softcap": 30.0}, True),
]


def reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, label_smoothing: float = 0.0,
              softcap: float | None = None, rows: int = 1024):
    """d mean CE / d(x, w) in float64, chunk by chunk."""
    w64 = w.double()
    gx, gw = torch.empty(x.shape, dtype=torch.float64, device=x.device), torch.zeros_like(w64)
    for s in range(0, x.shape[0], rows):
        x_c, t_c = x[s:s + rows].double(), t[s:s + rows]
        r = x_c @ w64.t()
        z = r if softcap is None else softcap * torch.tanh(r / softcap)
        dz = torch.softmax(z, 1) - label_smoothing / w.shape[0]
        dz[torch.arange(x_c.shape[0], device=x.device), t_c] -= 1 - label_smoothing
        if softcap is not None:
            dz *= torch.cosh(r / softcap).reciprocal_().square_()
        gx[s:s + rows] = dz @ w64
        gw.addmm_(dz.t(), x_c)
    return gx / x.shape[0], gw / x.shape[0]


def exact_log_probs(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, softcap: float | None = None,
                    rows: int = 1024) -> torch.Tensor:
    """log softmax(z)[t] per row in float64, z = x @ w^T (softcapped), chunk by chunk."""
    w64, out = w.double(), []
    for s in range(0, x.shape[0], rows):
        z = x[s:s + rows].double() @ w64.t()
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        out.append(z.gather(1, t[s:s + rows, None])[:, 0] - torch.logsumexp(z, 1))
    return torch.cat(out)


def log_prob_errors(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, kw: dict) -> str:
    """'flce / eager' largest log-prob errors against float64 (eager's '-' past EAGER_MAX_ROWS), or '-'."""
    if kw.get("label_smoothing"):
        return "-"
    exact = exact_log_probs(x, w, t, kw.get("softcap"))
    got = flce.linear_log_probs(x, w, t, softcap=kw.get("softcap")).log_probs
    cells = [f"{(got.double() - exact).abs().max().item():.2g}"]
    if x.shape[0] <= EAGER_MAX_ROWS:
        z = (x @ w.t()).float()
        z = z if kw.get("softcap") is None else kw["softcap"] * torch.tanh(z / kw["softcap"])
        eager_lp = torch.log_softmax(z, 1).gather(1, t[:, None])[:, 0]
        cells.append(f"{(eager_lp.double() - exact).abs().max().item():.2g}")
    return " / ".join(cells + ["-"] * (2 - len(cells)))


def eager(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, label_smoothing: float = 0.0,
          softcap: float | None = None) -> torch.Tensor:
    z = (x @ w.t()).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, t, label_smoothing=label_smoothing)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None  # rows to run
    print(torch.cuda.get_device_name(), "flce from", flce.__file__)
    print("| case | logit std | flce grad_input / grad_weight, x rounding | eager | log-prob error, flce / eager |")
    print("|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    min_rows = exp_logits.MIN_ROWS
    for label, n, kw, exp_path in CASES:
        if only and str(n) not in only and not any(o in label for o in only):
            continue
        for std in (1.0, 3.0, 6.0):
            x = torch.randn(n, H, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(V, H, device="cuda", generator=gen) * std * H**-0.5).to(torch.bfloat16)
            t = _sampled_targets(x, w, gen)
            exact = reference(x, w, t, **kw)
            rounding = [rel(e.to(torch.bfloat16), e) for e in exact]
            exp_logits.MIN_ROWS = min_rows if exp_path else 1 << 40
            cells = []
            methods = [lambda a, b, t=t: flce.linear_cross_entropy(a, b, t, **kw)]
            if n <= EAGER_MAX_ROWS:
                methods.append(lambda a, b, t=t: eager(a, b, t, **kw))
            for fn in methods:
                leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
                got = torch.autograd.grad(fn(*leaves), leaves)
                cells.append(" / ".join(f"{rel(g, e) / r:.3f}" for g, e, r in zip(got, exact, rounding)))
                del got, leaves
            exp_logits.MIN_ROWS = min_rows
            lp = log_prob_errors(x, w, t, kw)
            print(f"| {label} | {std:g} | {' | '.join(cells)}{' | -' if len(cells) == 1 else ''} | {lp} |", flush=True)
            del x, w, t, exact
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
