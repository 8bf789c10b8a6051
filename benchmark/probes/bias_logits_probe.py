"""Logits with a bias, x @ w^T + b in bf16: how many values each way of computing them rounds once, and the time of
flce's way (``gemm.linear_into``) against the GEMM followed by an in-place add (flce before 7c0a1ac). GPU only.

    PYTHONPATH=src python benchmark/probes/bias_logits_probe.py            # A/B: time and max error per shape
    PYTHONPATH=src python benchmark/probes/bias_logits_probe.py --forms    # F.linear, addmm, linear_into, mm + add_
    PYTHONPATH=src python benchmark/probes/bias_logits_probe.py --paths    # addmm into strided rows, batched forms

Results: benchmark/results/2026-11-28-h200-968fa0b/bias_rounding_*.txt, bias_in_the_gemm_ab_*.txt.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from flce.gemm import linear_into, mm_into, mm_new, padded_rows


def share_rounded_once(out, exact):
    return f"{(out == exact.bfloat16()).double().mean().item():.4f}"


def forms():
    torch.manual_seed(0)
    for red in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = red
        for (m, k, n) in ((64, 100, 1000), (48, 32, 1000), (2048, 4096, 8192)):
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * 0.8 * k**-0.5 * 4).bfloat16()
            b = (torch.randn(n, device="cuda") * 4).bfloat16()
            exact = x.double() @ w.double().t() + b.double()
            outs = {"F.linear": F.linear(x, w, b), "addmm(b)": torch.addmm(b, x, w.t()),
                    "addmm(b expanded contiguous)": torch.addmm(b.expand(m, n).contiguous(), x, w.t())}
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            linear_into(o, x, w.t(), b)
            outs["linear_into"] = o
            o2 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            mm_into(o2, x, w.t(), accumulate=False)
            outs["mm then add_"] = o2.add_(b)
            outs["float32 mm + b, rounded"] = torch.mm(x, w.t(), out_dtype=torch.float32).add_(b).bfloat16()
            print(f"reduced={red} {m}x{k}x{n}: "
                  + ", ".join(f"{name}: {share_rounded_once(v, exact)}" for name, v in outs.items()))


def events_ms(fn, *args, reps=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*args)
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def paths():
    torch.manual_seed(0)
    for (m, k, n) in ((48, 32, 1000), (255, 4096, 32003), (2048, 4096, 8192), (300, 256, 50257)):
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * 3.2 * k**-0.5).bfloat16()
        b = (torch.randn(n, device="cuda") * 4).bfloat16()
        exact = x.double() @ w.double().t() + b.double()
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        torch.addmm(b, x, w.t(), out=c)
        p = padded_rows(m, n, torch.bfloat16, x.device)
        torch.addmm(b, x, w.t(), out=p)
        print(f"{m}x{k}x{n}: addmm(b, out=contiguous) {share_rounded_once(c, exact)}, addmm(b, out=padded rows, "
              f"contiguous={p.is_contiguous()}) {share_rounded_once(p, exact)}")
    G, m, k, n = 3, 64, 128, 1003
    x = torch.randn(G, m, k, device="cuda").bfloat16()
    w = (torch.randn(G, n, k, device="cuda") * 3 * k**-0.5).bfloat16()
    b = (torch.randn(G, n, device="cuda") * 4).bfloat16()
    exact = x.double() @ w.double().transpose(1, 2) + b.double()[:, None]
    o = torch.empty(G, m, n, device="cuda", dtype=torch.bfloat16)
    torch.baddbmm(b[:, None], x, w.transpose(1, 2), out=o)
    print("baddbmm(b[:, None]) batched", share_rounded_once(o, exact))
    buf = torch.empty(m, G, n, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    for g in range(G):
        torch.addmm(b[g], x[g], w[g].t(), out=buf[g])
    print("per-group addmm into strided rows", share_rounded_once(buf, exact))
    x = torch.randn(2048, 4096, device="cuda").bfloat16()
    w = (torch.randn(128256, 4096, device="cuda") * 64**-1).bfloat16()
    b = torch.randn(128256, device="cuda").bfloat16()
    out = torch.empty(2048, 128256, device="cuda", dtype=torch.bfloat16)

    def lt():
        torch.addmm(b, x, w.t(), out=out)

    def two():
        torch.mm(x, w.t(), out=out)
        out.add_(b)

    def fill():
        out.copy_(b)
        out.addmm_(x, w.t())

    times = {f.__name__: statistics.median([events_ms(f) for _ in range(5)]) for f in (lt, two, fill, lt, two, fill)}
    print("2048 x 4096 x 128256 ms:", times)


def before(x, w, b, wide):
    out = mm_new(x, w.t(), torch.float32 if wide else x.dtype, padded=True)
    return out.add_(b)


def after(x, w, b, wide):
    out = padded_rows(x.shape[0], w.shape[0], torch.float32 if wide else x.dtype, x.device)
    linear_into(out, x, w.t(), b)
    return out


def ab():
    for n, h, v, wide in ((16, 4096, 128256, True), (255, 4096, 128256, True), (255, 4096, 128256, False),
                          (2048, 4096, 128256, False), (8192, 4096, 32000, False), (4096, 1000, 50257, False)):
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
        b = torch.randn(v, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ w.double().t() + b.double()
        errs = [(f(x, w, b, wide).double() - exact).abs().max().item() for f in (before, after)]
        rounds = {"before": [], "after": []}
        for _ in range(7):  # interleaved rounds
            rounds["before"].append(events_ms(before, x, w, b, wide, reps=20))
            rounds["after"].append(events_ms(after, x, w, b, wide, reps=20))
        med = {k: statistics.median(v) for k, v in rounds.items()}
        print(f"{n} x {h} x {v} {'float32' if wide else 'bf16'} logits: before {med['before']:.4f} ms, after "
              f"{med['after']:.4f} ms ({med['after'] / med['before']:.3f}x); max error before {errs[0]:.3g}, "
              f"after {errs[1]:.3g}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forms", action="store_true")
    parser.add_argument("--paths", action="store_true")
    args = parser.parse_args()
    forms() if args.forms else paths() if args.paths else ab()
