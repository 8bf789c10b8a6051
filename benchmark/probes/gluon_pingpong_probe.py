"""Probe: the logits GEMM with its epilogue as a hand-written warp-specialized ping-pong kernel (Gluon).

flce's Triton logits GEMM (``kernels/logits_triton.py``) runs its epilogue (max, exp and sums of each tile)
between two tiles' MMAs: 3-7% above cuBLAS under sustained load, the gap NOTES names as the remaining lever
of the loss without gradients, the exp-logits path and the low-memory block GEMM. Triton 3.6's automatic
warp specialization did not close it (``ws_gemm_probe.py``). Here the schedule is written out in Gluon, as
CUTLASS's sm90 ping-pong kernels arrange it:

- one loader warp issues the TMA loads of every tile of the program into a ring of ``STAGES`` shared
  buffers (x rows and W rows, 64 columns of K each);
- two consumer warpgroups take the program's tiles in turn (even and odd): each runs its tile's wgmmas
  from the ring, then its epilogue, which overlaps the other consumer's MMAs; a pair of barriers makes
  their mainloops alternate (without it a consumer waits on a stage two fills ahead, which an mbarrier's
  parity cannot tell from the fill before: the first version hung or faulted);
- 128 x 128 or 64 x 256 tiles (a warpgroup's accumulator: 128 registers a thread); registers moved from the
  loader to the consumers (``worker_num_regs``).

The epilogue writes each row's max and sum of exp(z - max) over the tile's logits (``STORE_NOTHING`` of
``logits_triton``: a loss without gradients), or, in mode 3, the low-memory backward's dz = scale (exp(z - lse) -
onehot) through a TMA store (``block_gemm_triton``). Checked against float32 torch, then timed against
cuBLAS's plain GEMM and flce's kernel (median of interleaved rounds). ``--mode``: 0 the statistics, 1 none
(and so no MMAs: not a timing), 2 every tile to one consumer (no ping-pong), 3 dz. GPU only (Hopper), but
for ``--model``, which runs the barrier protocol as coroutines under random schedules on the CPU:

    PYTHONPATH=src:benchmark python benchmark/probes/gluon_pingpong_probe.py [--mode 0|1|2|3] [--tile 64x256]
    PYTHONPATH=src:benchmark python benchmark/probes/gluon_pingpong_probe.py --model

Status: the first two-consumer form hung or faulted on an H100
(``results/2026-11-25-h100-c954f85/gluon_pingpong_7fd07f1.txt``); ``--model`` reproduces that on the CPU (the
unordered protocol reads a stage before its load in 598 of 900 schedules, the ordered one in none). With the order
barriers the kernel is correct on an H200 (``results/2026-11-25-h200-a8b06f6/gluon_pingpong_*.txt``) and
slower than flce's 128 x 256 kernels except at 1024 rows and H 2048 with the statistics epilogue
(benchmark/NOTES.md, The ceiling).
"""
from __future__ import annotations

import random

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BK = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)
SHAPES = [(8192, 4096, 128256), (1024, 4096, 128256), (8192, 2048, 32000)]


@gluon.jit
def _tile_coords(tile, grid_m, grid_n, GROUP: gl.constexpr):
    """Grouped order (as ``logits_triton._tile_coords``): GROUP row tiles use each W tile while in L2."""
    width = GROUP * grid_n
    first_m = (tile // width) * GROUP
    size_m = gl.minimum(grid_m - first_m, GROUP)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _loader(x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr, target_ptr,
            lse_ptr, M, N, K, inv_temp, scale, STAGES: gl.constexpr, GROUP: gl.constexpr, PROGRAMS: gl.constexpr,
            MODE: gl.constexpr):
    """One warp: every tile's k-steps in order into the ring; a stage is refilled once a consumer frees it."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid = gl.program_id(0)
    grid_m, grid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    for tile in range(pid, grid_m * grid_n, PROGRAMS):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        base = (tile - pid) // PROGRAMS * k_steps
        for k in range(k_steps):
            c = base + k
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [pid_m * BM, k * BK], ready.index(s), x_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [pid_n * BN, k * BK], ready.index(s), w_bufs.index(s))


@gluon.jit
def _consumer(x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr, target_ptr,
              lse_ptr, M, N, K, inv_temp, scale, STAGES: gl.constexpr, GROUP: gl.constexpr, PROGRAMS: gl.constexpr,
              MODE: gl.constexpr, PARITY: gl.constexpr):
    """One warpgroup: the program's tiles of this parity, wgmmas from the ring, then the epilogue."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    grid_m, grid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    # MODE: 0 ping-pong with statistics, 1 without them (the compiler then drops the MMAs: not a timing),
    # 2 one consumer takes every tile, 3 ping-pong storing the low-memory backward's dz of every logit.
    first = pid + PARITY * PROGRAMS if MODE != 2 else (pid if PARITY == 0 else grid_m * grid_n)
    j = 0  # this consumer's tiles so far
    for tile in range(first, grid_m * grid_n, (2 if MODE != 2 else 1) * PROGRAMS):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
        base = (tile - pid) // PROGRAMS * k_steps
        if MODE == 3:  # the rows' terms before the mainloop, as block_gemm_triton loads them
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            y = gl.load(target_ptr + rows, mask=rows < M, other=-1).to(gl.int32)
            lse2 = gl.load(lse_ptr + rows, mask=rows < M, other=0.0) * LOG2E
        # The other consumer's mainloop of the tile before first: a ready barrier's parity names only the
        # phase in progress or the one before, so no consumer may wait two fills of a stage ahead.
        mbarrier.wait(done.index(1 - PARITY), (j + PARITY - 1) & 1, pred=(MODE != 2) & (j + PARITY > 0))
        acc = gl.zeros([BM, BN], gl.float32, mma)
        for k in range(k_steps):
            c = base + k
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=k > 0)  # the previous stage
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((base + k_steps - 1) % STAGES), count=1)
        mbarrier.arrive(done.index(PARITY), count=1, pred=MODE != 2)
        j += 1
        if MODE == 3:
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            p = gl.exp2(acc * (inv_temp * LOG2E) - lse2[:, None])
            g = (p - (cols[None, :] == y[:, None]).to(gl.float32)) * scale
            out_buf = out_bufs.index(PARITY)
            tma.store_wait(0)  # this consumer's previous tile has left its buffer
            out_buf.store(g.to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [pid_m * BM, pid_n * BN], out_buf)
        elif MODE != 1:
            _statistics(acc, mma, max_ptr, sum_ptr, pid_m * BM, pid_n, M, N, grid_n, inv_temp, BM, BN)
    tma.store_wait(0)


@gluon.jit
def _statistics(acc, mma: gl.constexpr, max_ptr, sum_ptr, m0, pid_n, M, N, grid_n, inv_temp, BM: gl.constexpr,
                BN: gl.constexpr):
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    z = gl.where(cols[None, :] < N, acc * (inv_temp * LOG2E), float("-inf"))  # in log2 units
    row_max = gl.max(z, 1)
    row_sum = gl.sum(gl.exp2(z - row_max[:, None]), 1)
    at = rows.to(gl.int64) * grid_n + pid_n
    gl.store(max_ptr + at, row_max * (1.0 / LOG2E), mask=rows < M)
    gl.store(sum_ptr + at, row_sum, mask=rows < M)


@gluon.jit
def _consumer_odd(x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr, target_ptr,
                  lse_ptr, M, N, K, inv_temp, scale, STAGES: gl.constexpr, GROUP: gl.constexpr,
                  PROGRAMS: gl.constexpr, MODE: gl.constexpr):
    _consumer(x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr, target_ptr,
              lse_ptr, M, N, K, inv_temp, scale, STAGES, GROUP, PROGRAMS, MODE, 1)


@gluon.jit
def _pingpong_kernel(x_desc, w_desc, out_desc, max_ptr, sum_ptr, target_ptr, lse_ptr, M, N, K, inv_temp, scale,
                     STAGES: gl.constexpr, GROUP: gl.constexpr, PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr, MODE: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # A store buffer per consumer for dz (mode 3); the other modes keep a token 8 rows.
    OUT_ROWS: gl.constexpr = out_desc.block_type.shape[0] if MODE == 3 else 8
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, OUT_ROWS, out_desc.block_type.shape[1]], out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(done.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr,
                     target_ptr, lse_ptr, M, N, K, inv_temp, scale, STAGES, GROUP, PROGRAMS, MODE, 0)),
        (_consumer_odd, (x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr,
                         target_ptr, lse_ptr, M, N, K, inv_temp, scale, STAGES, GROUP, PROGRAMS, MODE)),
        (_loader, (x_desc, w_desc, out_desc, x_bufs, w_bufs, out_bufs, ready, empty, done, max_ptr, sum_ptr, target_ptr,
                   lse_ptr, M, N, K, inv_temp, scale, STAGES, GROUP, PROGRAMS, MODE)),
    ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def pingpong(x, w, tile_max=None, tile_sum=None, out=None, target=None, lse=None, scale=1.0, inv_temp=1.0,
             tile=(128, 128), stages=6, group=8, consumer_regs=232, loader_regs=40, loader_warps=1, mode=0):
    """x (n, H) @ w (V, H)^T, bf16 or fp16, and an epilogue by ``mode``: tile_max / tile_sum (n, cdiv(V,
    tile[1])) float32 (0), or out (n, V) = scale (exp(z - lse) - onehot(target)) in x's dtype (3). A
    consumer's tile (BM, BN) is 128 x 128 or 64 x 256 (one warpgroup's accumulator either way)."""
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    (bm, bn), bk = tile, BK.value
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dtype))
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dtype))
    if out is None:
        out = torch.empty(bm, bn, device=x.device, dtype=x.dtype)  # never written
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], dtype))
    absent = x  # pointers the mode does not read
    n, vocab = x.shape[0], w.shape[0]
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                   triton.cdiv(n, bm) * triton.cdiv(vocab, bn))
    # 12 warps (default 4, consumer 4, loader 1 rounded to a warpgroup) share 64k registers: 168 each at launch.
    return _pingpong_kernel[(programs, )](
        x_desc, w_desc, out_desc, absent if tile_max is None else tile_max, absent if tile_sum is None else tile_sum,
        absent if target is None else target, absent if lse is None else lse, n, vocab, x.shape[1], inv_temp, scale,
        stages, group, programs, consumer_regs, loader_regs, loader_warps, mode, num_warps=4, maxnreg=168)


# ------------------------------------------------------------------ the barrier protocol, modelled on the CPU

class _Barrier:
    """An mbarrier of arrival count 1: a wait on parity p passes once the phase of that parity completed,
    which a fresh barrier reports for p = 1 (the phase before its first)."""

    def __init__(self):
        self.completed = 0

    def arrive(self):
        self.completed += 1

    def passed(self, parity):
        return (self.completed & 1) != parity


def protocol_model(ordered, stages=3, k_steps=4, tiles=7, seed=0):
    """The kernel's loader and two consumers as coroutines under a random schedule, the barriers as above.
    Returns (reads of a stage that did not hold the k-step asked for, whether the run hung)."""
    rnd = random.Random(seed)
    ready, empty = [_Barrier() for _ in range(stages)], [_Barrier() for _ in range(stages)]
    done = [_Barrier(), _Barrier()]
    holds, wrong = [None] * stages, []

    def loader():
        for c in range(tiles * k_steps):
            s = c % stages
            while not empty[s].passed(((c // stages) & 1) ^ 1):
                yield
            yield  # the TMA load in flight
            holds[s] = c
            ready[s].arrive()

    def consumer(parity):
        for j, i in enumerate(range(parity, tiles, 2)):
            while ordered and j + parity > 0 and not done[1 - parity].passed((j + parity - 1) & 1):
                yield
            for c in range(i * k_steps, (i + 1) * k_steps):
                while not ready[c % stages].passed((c // stages) & 1):
                    yield
                if holds[c % stages] != c:
                    wrong.append(c)
                yield
                if c > i * k_steps:
                    empty[(c - 1) % stages].arrive()
            empty[((i + 1) * k_steps - 1) % stages].arrive()
            if ordered:
                done[parity].arrive()
            for _ in range(rnd.randint(0, 6)):  # the epilogue
                yield

    live = [loader(), consumer(0), consumer(1)]
    for _ in range(100_000):
        if not live:
            break
        step = rnd.choice(live)
        try:
            next(step)
        except StopIteration:
            live.remove(step)
    return len(wrong), bool(live)


def check_protocol():
    """The unordered and the ordered protocol over 900 random schedules (3 stages, 2 / 4 / 7 k-steps)."""
    for ordered in (False, True):
        runs = [protocol_model(ordered, k_steps=k, seed=seed) for seed in range(300) for k in (2, 4, 7)]
        print(f"{'ordered' if ordered else 'unordered'}: {sum(w > 0 for w, _ in runs)} of {len(runs)} schedules "
              f"read a stage before its load, {sum(h for _, h in runs)} hung", flush=True)


def main():
    import argparse

    from common import median_of_rounds

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    p.add_argument("--consumer-regs", type=int, default=232)
    p.add_argument("--loader-regs", type=int, default=40)
    p.add_argument("--loader-warps", type=int, default=1)
    p.add_argument("--tile", default="128x128", help="a consumer's tile: 128x128 or 64x256")
    p.add_argument("--group", type=int, default=8, help="row tiles sharing a W tile in L2")
    p.add_argument("--stages", type=int, default=6, help="ring depth (64x256 fits 5)")
    p.add_argument("--mode", type=int, default=0,
                   help="0 ping-pong, 1 without statistics, 2 one consumer, 3 ping-pong storing dz")
    p.add_argument("--model", action="store_true", help="check the barrier protocol on the CPU, then stop")
    args = p.parse_args()
    if args.model:
        return check_protocol()
    tile = tuple(int(v) for v in args.tile.split("x"))
    kw = dict(tile=tile, group=args.group, stages=args.stages, consumer_regs=args.consumer_regs,
              loader_regs=args.loader_regs, loader_warps=args.loader_warps, mode=args.mode)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, kw, flush=True)
    for rows, hidden, vocab in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5 * 2).bfloat16()
        out = torch.empty(rows, vocab, device=device, dtype=torch.bfloat16)
        logits = x.float() @ w.float().t()
        lse = logits.logsumexp(1)
        target = torch.randint(0, vocab, (rows, ), device=device)
        if args.mode == 3:
            cases = _gradient_cases(x, w, out, logits, lse, target, kw)
        else:
            cases = _statistics_cases(x, w, out, lse, kw, args)
        del logits
        if cases is None:
            continue
        times = median_of_rounds(cases, device, reps=10)
        for name, ms in times.items():
            print(f"  {name:40s} {ms:8.4f} ms  {ms / times['cuBLAS mm']:6.3f}x cuBLAS", flush=True)
        del x, w, out, cases
        torch.cuda.empty_cache()


def _report(rows, hidden, vocab, what, err, kernel):
    print(f"{rows} x {hidden} x {vocab}: {what} {err:.2e}; registers {kernel.n_regs}, spills {kernel.n_spills}, "
          f"shared {kernel.metadata.shared} B", flush=True)


def _statistics_cases(x, w, out, lse, kw, args):
    """Modes 0-2 checked (lse from the tile statistics), then the callables to time."""
    from flce.kernels import logits_triton
    from flce.options import LossOptions

    (rows, hidden), vocab = x.shape, w.shape[0]
    mx, se = torch.full((2, rows, triton.cdiv(vocab, kw["tile"][1])), float("nan"), device=x.device)
    fmx, fse = torch.empty(2, rows, logits_triton.num_tiles(vocab), device=x.device)
    kernel = pingpong(x, w, mx, se, **kw)
    top = mx.max(1, keepdim=True).values
    err = ((top[:, 0] + (se * (mx - top).exp()).sum(1).log()) - lse).abs().max().item()
    _report(rows, hidden, vocab, "lse max error", err, kernel)
    if args.mode != 1 and not err < 1e-3:
        print("  wrong result: not timed", flush=True)  # mode 1 writes nothing
        return None
    return {
        "cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
        "flce tile_stats (128 x 256, pipelined)": lambda: logits_triton.tile_stats(x, w, None, fmx, fse, LossOptions()),
        f"Gluon ping-pong ({args.tile}, mode {args.mode})": lambda: pingpong(x, w, mx, se, **kw),
    }


def _gradient_cases(x, w, out, logits, lse, target, kw):
    """Mode 3 checked against float32 (dz of the low-memory backward's block, the block being all of V),
    then timed beside flce's block GEMM (``block_gemm_triton``) writing the same dz."""
    from flce.kernels.block_gemm_triton import block_logits_grad_triton
    from flce.kernels.ce_block_torch import RowTerms
    from flce.options import LossOptions

    (rows, hidden), vocab = x.shape, w.shape[0]
    scale = 1.0 / rows
    want = ((logits - lse[:, None]).exp() - torch.nn.functional.one_hot(target, vocab)) * scale
    kernel = pingpong(x, w, out=out, target=target, lse=lse, scale=scale, **kw)
    rounding = (want.bfloat16().float() - want).abs().max().item()
    err = (out.float() - want).abs().max().item()
    _report(rows, hidden, vocab, f"dz max error (bf16 rounding {rounding:.2e})", err, kernel)
    terms = RowTerms(target, lse, None, None, torch.tensor(scale, device=x.device), exact_lse=True)
    flce_out = torch.empty_like(out)
    block_logits_grad_triton(x, w, None, flce_out, 0, vocab, terms, LossOptions())
    print(f"  flce block GEMM dz max error {(flce_out.float() - want).abs().max().item():.2e}", flush=True)
    del want
    if not err < 4 * rounding + 1e-6:
        print("  wrong result: not timed", flush=True)
        return None
    return {
        "cuBLAS mm": lambda: torch.mm(x, w.t(), out=out),
        "flce block GEMM (128 x 256, pipelined)": lambda: block_logits_grad_triton(
            x, w, None, flce_out, 0, vocab, terms, LossOptions()),
        f"Gluon ping-pong ({'x'.join(map(str, kw['tile']))}, dz)": lambda: pingpong(
            x, w, out=out, target=target, lse=lse, scale=scale, **kw),
    }


if __name__ == "__main__":
    main()
