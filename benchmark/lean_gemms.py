"""Where the lean setting's time goes: its three GEMMs at chunk granularity, against the floor.

GPU only. Usage: PYTHONPATH=src:benchmark python benchmark/lean_gemms.py [--shape 8192x4096x128256]
[--rows 512,576,1024]. For each chunk height c it times, interleaved with the floor (the three GEMMs
over all rows at once):
  gemms          per chunk: logits = x_c W^T; grad_x[c] = dl W; grad_W += dl^T x_c (bf16, in place)
  gemms+streams  the same, with grad_x on a second stream beside grad_W (both only read dl)
  flce           flce.linear_cross_entropy(chunk_size=c, accum_dtype=bf16), forward+backward
and each GEMM of one chunk alone, so the loss of a short chunk is split by GEMM.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flce
from common import timed_calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x4096x128256")
    p.add_argument("--rows", default="512,576,1024")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    bt, hidden, vocab = map(int, args.shape.split("x"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(bt, hidden, device=dev, dtype=dt)
    w = (torch.randn(vocab, hidden, device=dev) * hidden**-0.5).to(dt)
    t = torch.randint(0, vocab, (bt,), device=dev)
    gx = torch.empty_like(x)
    gw = torch.empty_like(w)
    side = torch.cuda.Stream()

    def floor():
        big = torch.mm(x, w.t())
        torch.mm(big, w, out=gx)
        torch.mm(big.t(), x, out=gw)

    def gemms(c: int, streams: bool):
        buf = torch.empty(c, vocab, device=dev, dtype=dt)

        def run():
            main_s = torch.cuda.current_stream()
            for i, s in enumerate(range(0, bt, c)):
                x_c = x[s:s + c]
                dl = buf[: x_c.shape[0]]
                if streams:
                    main_s.wait_stream(side)  # the buffer is free again
                torch.mm(x_c, w.t(), out=dl)
                if streams:
                    side.wait_stream(main_s)
                    with torch.cuda.stream(side):
                        torch.mm(dl, w, out=gx[s:s + c])
                else:
                    torch.mm(dl, w, out=gx[s:s + c])
                if i:
                    gw.addmm_(dl.t(), x_c)
                else:
                    torch.mm(dl.t(), x_c, out=gw)
            if streams:
                main_s.wait_stream(side)
        return run

    def lean(c: int):
        xg = x.clone().requires_grad_()
        wg = w.clone().requires_grad_()

        def run():
            xg.grad = wg.grad = None
            flce.linear_cross_entropy(xg, wg, t, chunk_size=c, accum_dtype=torch.bfloat16).backward()
        return run

    def one_chunk(c: int, which: str):
        x_c, dl = x[:c], torch.randn(c, vocab, device=dev, dtype=dt)
        ops = {"logits": lambda: torch.mm(x_c, w.t(), out=dl),
               "grad_x": lambda: torch.mm(dl, w, out=gx[:c]),
               "grad_W": lambda: gw.addmm_(dl.t(), x_c)}
        return ops[which]

    methods = {"floor": floor}
    for c in map(int, args.rows.split(",")):
        methods[f"gemms c={c}"] = gemms(c, False)
        methods[f"gemms+streams c={c}"] = gemms(c, True)
        methods[f"flce lean c={c}"] = lean(c)
        for which in ("logits", "grad_x", "grad_W"):
            methods[f"{which} of one chunk c={c} (x{-(-bt // c)})"] = one_chunk(c, which)
    times = {k: [] for k in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            times[name] += timed_calls(fn, 2, args.reps, dev)
    floor_ms = statistics.median(times["floor"])
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape {args.shape}")
    for name, ts in times.items():
        ms = statistics.median(ts)
        note = ""
        if "one chunk" in name:
            chunks = int(name.split("(x")[1].rstrip(")"))
            note = f"  x chunks = {ms * chunks:8.3f} ms = {ms * chunks / (floor_ms / 3):.3f} of a third of the floor"
        print(f"{name:40s} {ms:8.3f} ms  {ms / floor_ms:6.3f}x floor{note}")


if __name__ == "__main__":
    main()
