"""Probe: the CE kernel alone on one chunk per logits layout, to tell what of its cost at a vocabulary that is no
multiple of 8 comes from V, from the row stride, and from the kernel's padded form. Per case (V, row stride in
values, padded form as ``ce_triton.whole_groups`` decides or forced on): the chunk's logits from the Hopper GEMM
(with tile statistics) in a buffer of that stride, then the CE kernel's one-read pass and, on the same buffer,
its two-pass form (no statistics); median CUDA-event time of 20 calls per round, cases taking turns (every other
round in reverse), the median over rounds, ms. GPU only (Hopper):

    PYTHONPATH=src:benchmark python benchmark/probes/ce_layout_probe.py [ROWS] [HIDDEN] [ROUNDS]
"""
from __future__ import annotations

import contextlib
import statistics
import sys
from unittest import mock

import torch
from breakdown import event_times, head_inputs

from flce.kernels import ce_triton, logits_triton
from flce.options import LossOptions

# (V, row stride, padded form forced on): the defaults of aligned and odd V (rows on 128-byte lines), then each
# varied alone: 16-byte rows, the form forced on aligned rows, V % 16 == 8.
CASES = [(128256, 128256, False), (128257, 128320, False), (128257, 128264, True), (128256, 128264, True),
         (128256, 128256, True), (128256, 128320, True), (128264, 128264, False)]


def chunk(rows: int, hidden: int, vocab: int, stride: int):
    """(logits (rows, vocab) at row stride ``stride``, tile maxima, tile sums, target)."""
    x, w, t = head_inputs(rows, hidden, vocab)
    storage = torch.empty(rows * stride, dtype=torch.bfloat16, device="cuda")
    logits = storage.as_strided((rows, vocab), (stride, 1))
    n_tiles = logits_triton.num_tiles(vocab)
    tile_max, tile_sum = (torch.empty(rows, n_tiles, device="cuda") for _ in range(2))
    logits_triton.logits_with_tile_stats(x.detach(), w.detach(), None, logits, tile_max, tile_sum, LossOptions())
    return logits, tile_max, tile_sum, t


def main(rows: int, hidden: int, rounds: int) -> None:
    opts = LossOptions()
    calls = {}
    for vocab, stride, forced in CASES:
        logits, tile_max, tile_sum, target = chunk(rows, hidden, vocab, stride)
        loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
        scale = torch.ones((), device="cuda")
        padded = forced or ce_triton.whole_groups(logits, 8)
        for form, stats in (("one-read", (tile_max, tile_sum)), ("two-pass", None)):
            def call(logits=logits, target=target, loss=loss, lse=lse, scale=scale, stats=stats):
                ce_triton.ce_chunk_triton(logits, target, loss, lse, None, None, None, scale, opts, tile_stats=stats)
            calls[(vocab, stride, padded, forced, form)] = call
    times = {key: [] for key in calls}
    for r in range(rounds):
        for key in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            forced = key[3]
            with mock.patch.object(ce_triton, "whole_groups", lambda *a: True) if forced else contextlib.nullcontext():
                times[key].append(statistics.median(event_times(calls[key], 20, 3)))
    print(f"{rows} rows x H {hidden}, {rounds} rounds, {torch.cuda.get_device_name()}")
    for (vocab, stride, padded, forced, form), ts in times.items():
        how = "forced" if forced else "as decided"
        print(f"V {vocab} stride {stride} padded form {padded} ({how}) {form}: {statistics.median(ts):.3f} ms "
              f"(rounds {' '.join(f'{t:.3f}' for t in ts)})", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 6144, int(args[1]) if len(args) > 1 else 4096, int(args[2]) if len(args) > 2 else 3)
