"""A small end-to-end run: fused loss vs materialized logits on random data, on whatever device is here."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .api import linear_cross_entropy


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bt, hidden, vocab = (8192, 4096, 128256) if device.type == "cuda" else (512, 256, 8000)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(bt, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (bt,), device=device)

    results = {}
    for name, fn in (("flce", lambda: linear_cross_entropy(x, w, t)),
                     ("materialized", lambda: F.cross_entropy((x @ w.T).float(), t))):
        x.grad = w.grad = None
        start = time.perf_counter()
        loss = fn()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        results[name] = (loss.item(), time.perf_counter() - start, w.grad.float().clone())
    (l1, t1, g1), (l2, t2, g2) = results["flce"], results["materialized"]
    print(f"device {device}, BT={bt} H={hidden} V={vocab} {dtype}")
    print(f"flce          loss {l1:.6f}  {t1 * 1e3:8.1f} ms (first call, includes compilation)")
    print(f"materialized  loss {l2:.6f}  {t2 * 1e3:8.1f} ms")
    print(f"grad_weight relative difference {((g1 - g2).norm() / g2.norm()).item():.2e}")
    print("For timings and memory against the peers and the GEMM floor, see benchmark/.")


if __name__ == "__main__":
    main()
