"""Probe: a head that scales its float32 logits per vocabulary column by a learned vector (Dory's, fused through
``patches.head.SCALED_COLUMN_HEADS``), at Dory's head size (H 2560, V 131072, bf16).

- ``step``: a training step (loss.backward()) of a DoryForCausalLM whose body is cut to one small layer per part,
  patched and unpatched: the median of 10 CUDA-event timings (3 warm-up steps first) and the peak memory above
  the step's start (weights allocated, gradients None), per BATCHxSEQ.
- ``precision``: the head and loss alone on ROWS rows, Dory's own forward (bf16 logits, then the float32 scale)
  and the fused loss (the scaled weight rounded once), each gradient's distance from a float64 reference in
  units of that gradient's own bf16 rounding.

GPU only:

    PYTHONPATH=src python benchmark/probes/scaled_head_probe.py [BATCHxSEQ,...] [ROWS]
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F
import transformers

import flce

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmark/: breakdown's helpers
from breakdown import event_times  # noqa: E402

HIDDEN, VOCAB = 2560, 131072


def tiny_body_dory() -> torch.nn.Module:
    layers = ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]
    config = transformers.DoryConfig(hidden_size=HIDDEN, vocab_size=VOCAB, intermediate_size=1024,
                                     num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                                     layer_types=layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()
    with torch.no_grad():
        model.lm_head.logit_scale.uniform_(0.5, 2.0).mul_(config.initializer_range)
    return model


def step_figures(model: torch.nn.Module, batch: int, seq: int) -> tuple[float, float]:
    ids = torch.randint(0, VOCAB, (batch, seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    times = event_times(step, 10, 3)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def steps(shapes: str) -> None:
    model = tiny_body_dory()
    for shape in shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        eager = step_figures(model, batch, seq)
        flce.apply_flce_patch(model)
        fused = step_figures(model, batch, seq)
        flce.remove_flce_patch(model)
        print(f"step {batch}x{seq} (H {HIDDEN}, V {VOCAB}): unpatched {eager[0]:.2f} ms, {eager[1]:.0f} MiB; "
              f"patched {fused[0]:.2f} ms, {fused[1]:.0f} MiB", flush=True)


def head_grads(x, w, s, t, fused: bool) -> list[torch.Tensor]:
    if fused:
        loss = flce.linear_cross_entropy(x, (w * s[:, None]).to(w.dtype), t)
    else:  # DoryLMHead.forward, then the mean cross-entropy
        loss = F.cross_entropy((x @ w.t()).to(s.dtype) * s, t)  # .float(), or float64 for the reference
    return list(torch.autograd.grad(loss, (x, w, s)))


def precision(rows: int) -> None:
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    w = (torch.randn(VOCAB, HIDDEN, device="cuda") * 2 * HIDDEN**-0.5).bfloat16()  # logits of std 2
    s = torch.empty(VOCAB, device="cuda").uniform_(0.5, 2.0)
    t = torch.randint(0, VOCAB, (rows,), device="cuda")
    ref = head_grads(*(a.double().requires_grad_() for a in (x, w, s)), t, fused=False)
    for fused in (False, True):
        got = head_grads(*(a.clone().requires_grad_() for a in (x, w, s)), t, fused=fused)
        ratios = [((g.double() - r).norm() / (r.bfloat16().double() - r).norm()).item() for g, r in zip(got, ref)]
        print(f"precision {rows}x{HIDDEN}x{VOCAB}, {'fused' if fused else 'Dory forward'}: grad_x / grad_W / "
              f"grad_scale {' / '.join(f'{v:.3f}' for v in ratios)} bf16 roundings", flush=True)
        del got


if __name__ == "__main__":
    steps(sys.argv[1] if len(sys.argv) > 1 else "1x2048,4x2048")
    torch.cuda.empty_cache()
    precision(int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
