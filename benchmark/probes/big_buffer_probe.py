"""Probe: logits buffers of more than 2**31 elements (one chunk of 17000 x 128256 / 128257). Each public entry point
and option that takes its own kernels or GEMM path, on an aligned and an odd vocabulary, against eager PyTorch in
float32 on the same bf16 (fp16) data: relative error of the loss (or log-probs) and of each gradient, or the error
that stopped it. One subprocess per case (a CUDA fault poisons its process). GPU only, ~40 GB of GPU memory:

    PYTHONPATH=src python benchmark/probes/big_buffer_probe.py [CASE,...]
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from unittest.mock import patch

import torch
import torch.nn.functional as F

ROWS, HIDDEN = 17000, 512
CASES = ("default", "cublas-logits", "fp16", "options", "none", "low-memory", "log-probs", "grouped")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(("nan" if not torch.isfinite(a).all() else (a - b).norm() / b.norm().clamp_min(1e-30)))


def eager_loss(x, w, t, case: str) -> torch.Tensor:
    logits = x.float() @ w.float().t()
    if case == "options":
        logits = 30.0 * torch.tanh(logits / 30.0)
        loss = F.cross_entropy(logits, t, reduction="sum", label_smoothing=0.1)
        return loss + 1e-4 * (torch.logsumexp(logits, -1) ** 2).sum()
    if case == "log-probs":
        return torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]
    return F.cross_entropy(logits, t, reduction="none" if case == "none" else "mean")


def flce_loss(x, w, t, case: str) -> torch.Tensor:
    import flce

    kw = {"chunk_size": ROWS}
    if case == "options":
        kw.update(reduction="sum", label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    if case == "none":
        kw["reduction"] = "none"
    if case == "low-memory":
        kw["low_memory"] = True
    if case == "log-probs":
        return flce.linear_log_probs(x, w, t, outputs=("log_probs",), **kw).log_probs
    if case == "grouped":  # two heads of one weight, G * chunk rows in one flat buffer; mean of means = mean
        xg, wg, tg = x.view(ROWS // 2, 2, -1), torch.stack([w, w]), t.view(ROWS // 2, 2)
        return flce.grouped_linear_cross_entropy(xg, wg, tg, group_reduction="mean", chunk_size=ROWS // 2)
    return flce.linear_cross_entropy(x, w, t, **kw)


def run(case: str) -> None:
    from flce.kernels import logits_triton

    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    for vocab in (128256, 128257):
        g = torch.Generator("cuda").manual_seed(vocab)
        x = torch.randn(ROWS, HIDDEN, device="cuda", generator=g).to(dtype).requires_grad_()
        w = (torch.randn(vocab, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(dtype).requires_grad_()
        t = torch.randint(0, vocab, (ROWS,), device="cuda", generator=g)
        want = eager_loss(x, w, t, case)
        probe = torch.randn(want.shape, device="cuda", generator=g) if want.dim() else torch.ones(())
        want_grads = torch.autograd.grad((want * probe).sum(), (x, w))
        want = want.detach()
        try:
            cublas = case == "cublas-logits"  # the logits GEMM of GPUs other than Hopper
            with patch.object(logits_triton, "supported", lambda *a, **k: False) if cublas else contextlib.nullcontext():
                got = flce_loss(x, w, t, case)
                grads = torch.autograd.grad((got * probe).sum(), (x, w))
            torch.cuda.synchronize()
            print(f"{case} V {vocab}: loss {rel(got.detach(), want):.2e}, grad_input {rel(grads[0], want_grads[0]):.2e}, "
                  f"grad_weight {rel(grads[1], want_grads[1]):.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, then the process ends
            print(f"{case} V {vocab}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            return
        x = w = got = grads = want = want_grads = None
        torch.cuda.empty_cache()


def main(cases: str) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for case in cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True,
                             env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        lines = [line for line in out.stdout.splitlines() if line.startswith(case)]
        print("\n".join(lines) or f"{case}: rc {out.returncode} {out.stderr.strip().splitlines()[-1:]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        run(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ",".join(CASES))
