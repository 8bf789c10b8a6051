"""flce.distributed over 2 and 3 gloo processes: vocab-parallel loss and gradients against the float64
reference (even, uneven and empty shards; every option; all-ignored rows), the DTensor entry, and a
patched tiny Llama and Mixtral trained a few steps under FSDP2 and DDP set up as accelerate does it.

The processes are started once per world size and kept for the module (a ``Cluster``); each test
sends a function to every rank and asserts on what the ranks send back.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import queue
import re
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import BACKENDS, GPU_FUZZ_EXAMPLES, ON_HOPPER
import hypothesis
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (TOL, DropGrad, assert_close, assert_loss_close, errors_in_roundings, peaked_case,
                       poisoned_padded_copy, reference_loss, rel_err)
from test_api import OPTION_SETS, make_case
from test_fuzz import (GPU_OPTIONS, GRAD_TOL, assert_grad_close, grad_floors, leaves, loss_unit, num_items_for,
                       options, rounding_scales)

import flce
from flce.distributed import ShardLayout, vocab_parallel_linear_cross_entropy
from flce.kernels import triton_available
from flce.kernels.ce_vocab_parallel import STATS, shard_grad, shard_stats
from flce.options import LossOptions

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from hf_tiny import tiny_model  # noqa: E402

CPU = torch.device("cpu")
# Float64 inputs: float64 GEMMs and float64 softmax arithmetic (the torch twins), so the vocab-parallel
# loss meets the float64 reference to float64 rounding (VP_F64_TOL). Paths through the one-device loss
# (DTensor, patched models) are held to F64_TOL: tight enough to catch any wrong term (1e-2 and above).
F64_TOL = 1e-6
VP_F64_TOL = 1e-10


# --- the process pool ---------------------------------------------------------------------------------

class Cluster:
    """``world`` processes in one process group; ``run(fn, **kw)`` calls ``fn(rank, world, **kw)`` on
    every rank and returns the ranks' results in rank order (a failure on any rank raises here).
    With backend="nccl" rank r works on GPU r."""

    def __init__(self, world: int, backend: str = "gloo"):
        self.world, self.backend = world, backend
        self._start()

    def _start(self) -> None:
        # Ranks fork from a fresh server process that imported these modules once: cheap starts, and
        # none of this process's state (a BLAS thread pool forked mid-use deadlocks the child's GEMMs).
        # Where CUDA is, ranks start by spawn: the server's imports (conftest's capability check) may have set
        # up CUDA, which a forked child cannot use (transformers' TrainingArguments asks for the capability).
        spawn = self.backend == "nccl" or torch.cuda.is_available()
        ctx = mp.get_context("spawn" if spawn else "forkserver")
        if not spawn:
            ctx.set_forkserver_preload([__name__, "transformers", "accelerate"])
        self.inboxes = [ctx.SimpleQueue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, self.world, self.backend, port, self.inboxes[r], self.outbox))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, **kwargs) -> list:
        for inbox in self.inboxes:
            inbox.put((fn, kwargs))
        replies = {}
        try:
            for _ in range(self.world):
                rank, ok, value = self.outbox.get(timeout=180)
                replies[rank] = (ok, value)
        except queue.Empty:
            replies.update({r: (False, "no answer in 180 s") for r in range(self.world) if r not in replies})
        failed = {r: v for r, (ok, v) in replies.items() if not ok}
        if failed:  # a rank may be left inside a collective: start afresh for the next test
            self.close()
            self._start()
            raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failed.items())))
        return [replies[r][1] for r in range(self.world)]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world, backend, port, inbox, outbox) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        while (job := inbox.get()) is not None:
            fn, kwargs = job
            try:
                outbox.put((rank, True, fn(rank, world, **kwargs)))
            except BaseException:  # noqa: BLE001 - the traceback goes back to the test
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cluster2():
    c = Cluster(2)
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster3():
    c = Cluster(3)
    yield c
    c.close()


# --- what the ranks run -------------------------------------------------------------------------------

def _bounds(sizes, rank: int) -> tuple[int, int]:
    """[start, end) of rank's rows when the vocabulary is split into ``sizes``, in rank order."""
    return sum(sizes[:rank]), sum(sizes[: rank + 1])


def vocab_parallel_case(rank, world, *, sizes, dtype=torch.float64, shape=(29,), hidden=12,
                        reduction="mean", backend="torch", device=CPU, autocast=False, one_device=False, **opts):
    """Relative errors of this rank's loss, grad_input and weight/bias-shard grads against float64;
    ``one_device``: also those of ``flce.linear_cross_entropy`` on the full weight (same options), the
    single-device loss the vocab-parallel one stands in for. (Also run on GPUs by benchmark/dist_check.py.)"""
    torch.manual_seed(1234)  # the same full problem on every rank
    vocab = sum(sizes)
    case_keys = {k: opts.pop(k) for k in ("bias", "weight_cls", "ignore") if k in opts}
    x, w, b, t, cw = make_case(shape, hidden, vocab, dtype, device, **case_keys,
                               ignore_index=opts.get("ignore_index", -100))
    start, end = _bounds(sizes, rank)
    w_shard = w.detach()[start:end].clone().requires_grad_()
    b_shard = b.detach()[start:end].clone().requires_grad_() if b is not None else None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = vocab_parallel_linear_cross_entropy(x, w_shard, t, linear_bias=b_shard, weight=cw,
                                                   reduction=reduction, backend=backend, **opts)
    for k in ("validate_target", "shard_sizes"):
        opts.pop(k, None)
    one_opts = dict(opts)
    for k in ("chunk_size", "accum_dtype"):
        opts.pop(k, None)
    ref, (x64, w64, b64) = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, reduction=reduction, **opts)
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.shape == ref.shape and loss.dtype == want_dtype, (loss.shape, loss.dtype)
    grad_out = torch.randn(ref.shape, dtype=torch.float64).to(device)
    loss.backward(grad_out.to(loss.dtype))
    ref.backward(grad_out)
    errs = {"loss": rel_err(loss, ref), "grad_input": rel_err(x.grad, x64.grad),
            "grad_weight": rel_err(w_shard.grad, w64.grad[start:end])}
    if b is not None:
        errs["grad_bias"] = rel_err(b_shard.grad, b64.grad[start:end])
    dtypes = {str(g.dtype) for g in (x.grad, w_shard.grad) + ((b_shard.grad,) if b is not None else ())}
    out = {"errs": errs, "dtypes": dtypes}
    if one_device:
        leaves = [None if a is None else a.detach().clone().requires_grad_() for a in (x, w, b)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            one = flce.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], weight=cw,
                                            reduction=reduction, backend=backend, **one_opts)
        one.backward(grad_out.to(one.dtype))
        out["one_errs"] = {"loss": rel_err(one, ref), "grad_input": rel_err(leaves[0].grad, x64.grad),
                           "grad_weight": rel_err(leaves[1].grad[start:end], w64.grad[start:end])}
        if b is not None:
            out["one_errs"]["grad_bias"] = rel_err(leaves[2].grad[start:end], b64.grad[start:end])
    return out


def _assert_all_close(results, dtype, tol=None):
    tol = tol or (VP_F64_TOL if dtype == torch.float64 else TOL[dtype])
    for rank, res in enumerate(results):
        assert res["dtypes"] == {str(dtype)}, f"rank {rank}: gradient dtypes {res['dtypes']}"
        for what, err in res["errs"].items():
            assert err <= tol, f"rank {rank} {what}: relative error {err:.3g}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_every_option_two_ranks(cluster2, name, reduction):
    """Float64 inputs: the split softmax is the one-device math, to float32 rounding."""
    results = cluster2.run(vocab_parallel_case, sizes=(23, 17), reduction=reduction, chunk_size=8,
                           **dict(OPTION_SETS[name]))
    _assert_all_close(results, torch.float64)


@pytest.mark.parametrize("sizes", [(13, 13, 11), (30, 1, 9), (20, 0, 17)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_uneven_and_empty_shards_three_ranks(cluster3, sizes, reduction):
    results = cluster3.run(vocab_parallel_case, sizes=sizes, reduction=reduction, chunk_size=7,
                           **dict(OPTION_SETS["all"]))
    _assert_all_close(results, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_many_chunks(cluster2, dtype):
    results = cluster2.run(vocab_parallel_case, sizes=(150, 111), dtype=dtype, shape=(3, 11), hidden=16,
                           chunk_size=5, label_smoothing=0.1, z_loss=1e-3, ignore=0.2)
    _assert_all_close(results, dtype)


@pytest.mark.parametrize("sizes", [(200, 184), (150, 111)])
def test_bf16_grad_input_as_precise_as_one_device(cluster2, sizes):
    """Each rank's partial grad_input stays float32 through the all-reduce and is rounded once. With
    reduction="none" one device's loop makes the same products, so the errors against float64 agree;
    bf16 partial sums summed in bf16 read 1.11-1.15x one device's here."""
    results = cluster2.run(vocab_parallel_case, sizes=sizes, dtype=torch.bfloat16, shape=(64,), hidden=64,
                           reduction="none", one_device=True)
    for rank, res in enumerate(results):
        err, one = res["errs"]["grad_input"], res["one_errs"]["grad_input"]
        assert err <= 1.02 * one, f"rank {rank}: grad_input error {err:.3g} against one device's {one:.3g}"


@contextlib.contextmanager
def _hopper_gemm(calls: list, device: torch.device, off: bool = False):
    """flce's Hopper logits GEMM, its calls counted into ``calls``; on the CPU let run under the interpreter
    (small tiles, fp16); ``off``: never taken (every chunk's logits from cuBLAS)."""
    import flce.kernels.logits_triton as lt

    saved = lt.ALLOW_INTERPRETER, lt.MIN_ROWS, lt.TILE, lt.logits_with_tile_stats
    if device.type == "cpu":
        lt.ALLOW_INTERPRETER, lt.MIN_ROWS, lt.TILE = True, 8, lt.TileConfig(32, 64, 16, 2, 4, 4)
    if off:
        lt.MIN_ROWS = 1 << 40
    lt.logits_with_tile_stats = lambda *a, **k: calls.append(1) or saved[3](*a, **k)
    try:
        yield
    finally:
        lt.ALLOW_INTERPRETER, lt.MIN_ROWS, lt.TILE, lt.logits_with_tile_stats = saved


def _hopper_gemm_case(rank, world, device=CPU, **kw):
    calls = []
    with _hopper_gemm(calls, device):
        out = vocab_parallel_case(rank, world, backend="triton", device=device, **kw)
    return dict(out, calls=len(calls))


needs_interpreted_triton = pytest.mark.skipif(not triton_available(CPU),
                                              reason="needs TRITON_INTERPRET=1 before triton is imported")


@needs_interpreted_triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_hopper_gemm_on_each_shard(cluster2, name, reduction):
    """Each rank's logits from flce's GEMM, stored less their tile's shift, with the tile statistics in stage 1
    (every option: softcap, smoothing's sum, class weights, a bias shard): fp16 against float64. Each chunk
    GEMM'd once in forward, and again in backward for reduction="none": 40 rows in three chunks of 16, or two
    once the ignored rows of "all" are dropped (30 left)."""
    results = cluster2.run(_hopper_gemm_case, sizes=(200, 184), dtype=torch.float16, shape=(40,), hidden=32,
                           chunk_size=16, reduction=reduction, **dict(OPTION_SETS[name]))
    _assert_all_close(results, torch.float16)
    chunks = 2 if name == "all" else 3
    assert all(res["calls"] == chunks * (2 if reduction == "none" else 1) for res in results), results


def _peaked_case(rank, world, *, sizes, hopper_gemm, device=CPU, dtype=torch.float16, rows=96, hidden=32,
                 chunk_size=32):
    """Errors (x the 16-bit rounding of the exact gradients) of this rank's grad_input and weight-shard gradient
    with logits of a trained model's spread (std 6, targets drawn from the softmax), and the GEMM's calls."""
    x, w, _, t = peaked_case(rows, hidden, sum(sizes), dtype, device)
    want, (x64, w64, _) = reference_loss(x, w, t)
    exact = torch.autograd.grad(want, (x64, w64))
    start, end = _bounds(sizes, rank)
    w_shard = w.detach()[start:end].clone().requires_grad_()
    calls = []
    with _hopper_gemm(calls, device, off=not hopper_gemm):
        loss = vocab_parallel_linear_cross_entropy(x, w_shard, t, backend="triton", chunk_size=chunk_size)
        got = torch.autograd.grad(loss, (x, w_shard))
    return errors_in_roundings(got, (exact[0], exact[1][start:end]), dtype), len(calls)


def _assert_peaked(fused, plain, chunks):
    for rank, ((errs, calls), (plain_errs, _)) in enumerate(zip(fused, plain)):
        assert calls == chunks and max(errs) <= 2.5, (rank, errs, calls)
        assert all(e <= p / 2 for e, p in zip(errs, plain_errs)), (rank, errs, plain_errs)


@needs_interpreted_triton
def test_peaked_logits_on_each_shard(cluster2):
    """The logits stored less their tile max keep the gradients near the fp16 rounding (1.3-1.5x here), where
    the shards' cuBLAS logits carry their rounding into them (~7x), as on one device."""
    fused = cluster2.run(_peaked_case, sizes=(256, 256), hopper_gemm=True)
    plain = cluster2.run(_peaked_case, sizes=(256, 256), hopper_gemm=False)
    _assert_peaked(fused, plain, chunks=3)


def _peaked_loss_case(rank, world, *, sizes, opts, device=CPU, dtype=torch.float16, rows=96, hidden=32,
                      chunk_size=32):
    """This rank's per-row losses over peaked logits (std 6, targets from the softmax), each chunk's logits from
    flce's Hopper GEMM: their sum's error against float64, each row's largest error, that of the target's stored
    value instead of the dot (stage 1 without the operands), and the accuracy less one device's."""
    import flce.distributed as fd

    opts = dict(opts)
    x, w, b, t = peaked_case(rows, hidden, sum(sizes), dtype, device, opts.pop("bias", False),
                             opts.get("temperature", 1.0), softcap=opts.get("softcap"))
    want, _ = reference_loss(x, w, t, linear_bias=b, reduction="none", **opts)
    start, end = _bounds(sizes, rank)
    shard = [None if a is None else a.detach()[start:end].clone().requires_grad_() for a in (w, b)]

    def rows_and_stats():
        calls = []
        with _hopper_gemm(calls, device):
            got, stats = vocab_parallel_linear_cross_entropy(x, shard[0], t, linear_bias=shard[1], reduction="none",
                                                             backend="triton", chunk_size=chunk_size,
                                                             return_stats=True, **opts)
        assert calls, "the shards' logits did not come from flce's GEMM"
        return got.double(), stats

    got, stats = rows_and_stats()
    stage1 = fd.shard_stats
    fd.shard_stats = lambda *args: stage1(*args[:7])  # no operands: the target's stored value
    try:
        stored, _ = rows_and_stats()
    finally:
        fd.shard_stats = stage1
    with _hopper_gemm([], device):
        one = flce.linear_cross_entropy(x, w, t, linear_bias=b, backend="triton", return_stats=True, **opts)[1]
    return dict(sum_err=(got.sum() - want.sum()).abs().item(), row_err=(got - want).abs().max().item(),
                stored_row_err=(stored - want).abs().max().item(),
                hits_off=(stats.accuracy - one.accuracy).abs().item(), accuracy=one.accuracy.item())


PEAKED_OPTIONS = [dict(), dict(temperature=0.7, label_smoothing=0.1, bias=True), dict(softcap=30.0)]


def _assert_peaked_losses(results, sum_tol=None) -> None:
    """Each row's loss 4x nearer the truth than from the stored value, hits as on one device; ``sum_tol``: the summed
    loss within it too."""
    for rank, res in enumerate(results):
        assert res["row_err"] <= res["stored_row_err"] / 4, (rank, res)
        assert res["hits_off"] == 0.0 and res["accuracy"] > 0.2, (rank, res)
        assert sum_tol is None or res["sum_err"] <= sum_tol, (rank, res)


@needs_interpreted_triton
@pytest.mark.parametrize("opts", PEAKED_OPTIONS)
def test_peaked_logits_losses_from_a_dot_at_the_target(cluster2, opts):
    """Where the shards' logits are stored less their tile max, each row's logit at its target comes from a float32
    dot of the GEMM's operands, as on one device: each row's loss 7-24x nearer the truth here than from the stored
    value, the summed loss within half an fp16 ulp of 1; the hits still from the stored values, so accuracy is one
    device's."""
    _assert_peaked_losses(cluster2.run(_peaked_loss_case, sizes=(256, 256), opts=opts),
                          sum_tol=0.5 * torch.finfo(torch.float16).eps)


def _mean_scale_case(rank, world, *, chunk_size, g=1.0, temperature=1.0, dtype=torch.bfloat16, shape=(200, 8192, 64),
                     num_items=None):
    """Errors of this rank's 16-bit gradients over the dtype's rounding of the exact ones (float64 from the
    16-bit logits both compute from), for a mean over all but 28 of the rows (or over ``num_items``)."""
    torch.manual_seed(0)
    n, vocab, hidden = shape
    x = torch.randn(n, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * hidden**-0.5 * 0.5).to(dtype)
    t = torch.randint(0, vocab, (n,))
    t[torch.randperm(n)[:28]] = -100
    start, end = _bounds((vocab // world,) * world, rank)
    w_shard = w[start:end].clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, w_shard, t, chunk_size=chunk_size, temperature=temperature,
                                               num_items_in_batch=num_items)
    grads = torch.autograd.grad(loss * g, (x, w_shard))
    z = (x @ w.t()).double().requires_grad_()
    total = torch.nn.functional.cross_entropy(z / temperature, t, reduction="sum")
    mean = total / (n - 28 if num_items is None else num_items)
    (dz,) = torch.autograd.grad(mean * g, z)
    exact = [dz @ w.double(), (dz.t() @ x.double())[start:end]]
    return [rel_err(got, e) / rel_err(e.to(dtype), e) for got, e in zip(grads, exact)]


@pytest.mark.parametrize("chunk_size,g,temperature", [(None, 1.0, 1.0), (None, 1 / 3, 1.0), (64, 1.0, 1.0),
                                                       (64, 1 / 3, 1.0), (64, 1.0, 1.3)])
def test_mean_scale_stays_out_of_the_rounded_dlogits(cluster2, chunk_size, g, temperature):
    """As on one device: a mean's 1 / 172 folded into the 16-bit dlogits read 1.8x the bf16 rounding in both
    gradients (2.0-2.2x with grad_output 1/3). The dlogits take none of it, the scale joins the float32
    grad_input and sums (1.0x); beside a single chunk's 16-bit grad_weight they take its power of two, the rest
    meeting x_c (1.3x, 1.6x with grad_output 1/3, rounded again in backward). 1 / temperature joins the scale."""
    results = cluster2.run(_mean_scale_case, chunk_size=chunk_size, g=g, temperature=temperature)
    for rank, (input_ratio, weight_ratio) in enumerate(results):
        assert input_ratio <= 1.05, f"rank {rank}: grad_input at {input_ratio:.3g}x the bf16 rounding"
        bound = 1.05 if chunk_size else 1.4 if g == 1 else 1.7
        assert weight_ratio <= bound, f"rank {rank}: grad_weight at {weight_ratio:.3g}x the bf16 rounding"


@pytest.mark.parametrize("chunk_size", [None, 256])
def test_fp16_mean_keeps_the_softmax_tail(cluster2, chunk_size):
    """fp16 dlogits that took a mean's power of two (2^-12 over 4000 items) sank the softmax's tail, p ~ 1 / V,
    below fp16's smallest normal: 3.1x the fp16 rounding in grad_input and 7.3x in grad_weight, one chunk or four.
    They stay unscaled now, the scale joining float32 alone (one chunk's weight gradient summed in float32 too):
    1.04 / 1.18x."""
    results = cluster2.run(_mean_scale_case, chunk_size=chunk_size, dtype=torch.float16, shape=(1024, 2048, 16),
                           num_items=4000.0)
    for rank, ratios in enumerate(results):
        assert max(ratios) <= 1.5, f"rank {rank}: gradients at {ratios}x the fp16 rounding"


def test_custom_ignore_index_and_autocast(cluster2):
    results = cluster2.run(vocab_parallel_case, sizes=(23, 17), ignore=0.3, ignore_index=7, chunk_size=8)
    _assert_all_close(results, torch.float64)
    results = cluster2.run(vocab_parallel_case, sizes=(23, 17), dtype=torch.float32, autocast=True, bias=True,
                           label_smoothing=0.1)  # bf16 GEMMs, float32 master weights and gradients
    _assert_all_close(results, torch.float32, tol=TOL[torch.bfloat16])


def _no_grad_case(rank, world):
    torch.manual_seed(2)
    x, w, b, t, cw = make_case((17,), 8, 30, torch.float64, CPU, bias=True, weight_cls=True, ignore=0.2)
    start, end = _bounds((12, 18), rank)
    errs = []
    for reduction in ("mean", "none"):
        kw = dict(reduction=reduction, label_smoothing=0.1)
        with torch.no_grad():
            loss = vocab_parallel_linear_cross_entropy(x, w[start:end], t, linear_bias=b[start:end], weight=cw,
                                                       **kw)
        errs.append(rel_err(loss, reference_loss(x, w, t, linear_bias=b, weight_cls=cw, **kw)[0]))
    return errs


def test_loss_alone_under_no_grad(cluster2):
    for rank, errs in enumerate(cluster2.run(_no_grad_case)):
        assert max(errs) < VP_F64_TOL, (rank, errs)


def test_num_items_in_batch_and_sync_free_path(cluster2):
    """num_items_in_batch as in HF gradient accumulation; with shard_sizes and validate_target=False
    (no host sync) ignored rows are computed and zeroed, same result."""
    for extra in ({}, {"shard_sizes": (23, 17), "validate_target": False}):
        results = cluster2.run(vocab_parallel_case, sizes=(23, 17), reduction="sum", ignore=0.3,
                               num_items_in_batch=11, **extra)
        _assert_all_close(results, torch.float64)


def _all_ignored_case(rank, world, *, reduction, validate):
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    t = torch.full((6,), -100)
    loss = vocab_parallel_linear_cross_entropy(x, w, t, reduction=reduction, validate_target=validate)
    loss.sum().backward()
    return [bool(torch.all(v == 0)) for v in (loss, x.grad, w.grad)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_rows_give_zeros(cluster2, reduction):
    for validate in (True, False):
        for rank, flags in enumerate(cluster2.run(_all_ignored_case, reduction=reduction, validate=validate)):
            assert flags == [True, True, True], (rank, validate, flags)


def _stats_case(rank, world):
    torch.manual_seed(5)
    x, w, _, t, _ = make_case((40,), 16, 30, torch.float64, CPU, ignore=0.25)
    t[:6] = (x[:6].detach() @ w.detach().T).argmax(1)  # some sure hits
    start, end = _bounds((18, 12), rank)
    loss, stats = vocab_parallel_linear_cross_entropy(x, w[start:end], t, z_loss=1e-2, return_stats=True,
                                                      chunk_size=16)
    one = flce.linear_cross_entropy(x, w, t, z_loss=1e-2, return_stats=True)[1]
    return [(getattr(stats, k) - getattr(one, k)).abs().item() for k in ("accuracy", "z_loss", "num_valid")]


def test_return_stats_match_one_device(cluster2):
    for rank, diffs in enumerate(cluster2.run(_stats_case)):
        assert max(diffs) < F64_TOL, (rank, diffs)


def _raises_case(rank, world, *, what):
    x = torch.randn(4, 8)
    w = torch.randn(5, 8)
    t = torch.randint(0, 10, (4,))
    kwargs = {}
    if what == "target_out_of_range":
        t[1] = 10
    elif what == "target_differs":
        t[0] = rank
    elif what == "shard_sizes":
        kwargs["shard_sizes"] = (5, 6)
    elif what == "class_weight_shape":
        kwargs["weight"] = torch.rand(5)
    try:
        vocab_parallel_linear_cross_entropy(x, w, t, **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what,match", [
    ("target_out_of_range", "outside"),
    ("target_differs", "target differs"),
    ("shard_sizes", "shard_sizes"),
    ("class_weight_shape", r"weight \(class weights\) must be a floating tensor of shape \(10,\)"),
])
def test_bad_input_raises_on_every_rank(cluster2, what, match):
    for rank, message in enumerate(cluster2.run(_raises_case, what=what)):
        assert message is not None and re.search(match, message), (rank, message)


def _option_edges_case(rank, world):
    """Every shared option edge (test_argument_edges.OPTION_CASES) and the vocab-parallel tensor edges:
    (type name, message) per case, or None where nothing was raised."""
    from test_argument_edges import OPTION_CASES

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    t = torch.randint(0, 10, (4,))
    big = torch.tensor([1, 2, 3, 2**64 - 100], dtype=torch.uint64)
    cases = [((x, w, t), {name: value}) for name, value, _, _ in OPTION_CASES] + [
        ((x, w, t), {"reduction": "none", "num_items_in_batch": 3}),
        ((x, w, t), {"weight": torch.rand(10, requires_grad=True)}),
        ((x, w, t), {"weight": torch.ones(10, dtype=torch.int64)}),
        ((x, w[:0], torch.full((4,), -100)), {"shard_sizes": (0, 0)}),  # an empty vocabulary on every rank
        ((x, w, big), {}),
        ((x.to("meta"), w.to("meta"), t.to("meta")), {}),
        ((x.long(), w, t), {}),
        ((x, w, t.float()), {}),
    ]
    out = []
    for args, kw in cases:
        try:
            vocab_parallel_linear_cross_entropy(*args, **kw)
        except (ValueError, TypeError) as e:
            out.append((type(e).__name__, str(e)))
        else:
            out.append(None)
    return out


def test_option_and_tensor_edges_raise_on_every_rank(cluster2):
    from test_argument_edges import OPTION_CASES

    expected = [(exc.__name__, match) for _, _, exc, match in OPTION_CASES] + [
        ("ValueError", "num_items_in_batch cannot be combined with reduction='none'"),
        ("ValueError", r"weight \(class weights\) requires grad"),
        ("TypeError", r"weight \(class weights\) must be a floating tensor of shape \(10,\), got dtype"),
        ("ValueError", r"the vocabulary is empty"),
        ("ValueError", r"\(first: 18446744073709551516\)"),
        ("ValueError", "input is on the meta device"),
        ("TypeError", "input must be a floating-point tensor"),
        ("TypeError", "integer class indices"),
    ]
    for rank, got in enumerate(cluster2.run(_option_edges_case)):
        for i, (want, message) in enumerate(zip(expected, got)):
            assert message is not None and message[0] == want[0] and re.search(want[1], message[1]), \
                (rank, i, want, message)


def _unchecked_bad_target_case(rank, world, *, reduction, backend="torch", device=CPU):
    """validate_target=False (sync-free, shard_sizes given): a target of V or -1 that is not
    ignore_index has no shard; its row must come out NaN (loss and grad_input), the others finite."""
    torch.manual_seed(3)
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(10, 8, device=device)
    start, end = _bounds((6, 4) if world == 2 else (10,), rank)
    w_shard = w[start:end].clone().requires_grad_()
    t = torch.randint(0, 10, (6,), device=device)
    t[1], t[4] = 10, -1
    loss = vocab_parallel_linear_cross_entropy(x, w_shard, t, shard_sizes=(6, 4) if world == 2 else (10,),
                                               validate_target=False, reduction=reduction, backend=backend)
    loss.sum().backward()
    loss, grad = loss.cpu(), x.grad.cpu()
    bad = torch.zeros(6, dtype=torch.bool)
    bad[[1, 4]] = True
    rows_nan = loss.isnan() if reduction == "none" else None
    return {"loss_nan": rows_nan.tolist() if rows_nan is not None else bool(loss.isnan()),
            "grad_nan_rows": grad.isnan().all(1).tolist(), "grad_finite_rows": grad[~bad].isfinite().all().item(),
            "want": bad.tolist()}


def _assert_bad_rows_nan(results, reduction):
    for rank, res in enumerate(results):
        assert res["loss_nan"] == (res["want"] if reduction == "none" else True), (rank, res)
        assert res["grad_nan_rows"] == res["want"] and res["grad_finite_rows"], (rank, res)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch", "triton"] if triton_available(CPU) else ["torch"])
def test_unchecked_bad_target_gives_nan_not_a_number(cluster2, reduction, backend):
    """On the CPU's gloo ranks; "triton" runs the stage kernels under the interpreter there."""
    _assert_bad_rows_nan(cluster2.run(_unchecked_bad_target_case, reduction=reduction, backend=backend), reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_unchecked_bad_target_gives_nan(nccl_cluster, reduction):
    _assert_bad_rows_nan(nccl_cluster.run(_unchecked_bad_target_case, reduction=reduction, backend="triton",
                                          device=torch.device("cuda")), reduction)


def _contract_case(rank, world):
    """Autograd's contracts on the vocab-parallel Function: an in-place change of the weight shard before
    backward raises, a second derivative raises clearly, an undefined grad_output is a zero gradient,
    and a one-element num_items_in_batch tensor of shape (1,) is a count."""
    torch.manual_seed(4)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8)
    start, end = _bounds((6, 4), rank)
    shard = w[start:end].clone().requires_grad_()
    t = torch.randint(0, 10, (6,))
    out = {}
    loss = vocab_parallel_linear_cross_entropy(x, shard, t)
    with torch.no_grad():
        shard.mul_(2.0)
    try:
        loss.backward()
    except RuntimeError as e:
        out["inplace"] = str(e)
    with torch.no_grad():
        shard.div_(2.0)
    gx, = torch.autograd.grad(vocab_parallel_linear_cross_entropy(x, shard, t), x, create_graph=True)
    ref, (x64, _, _) = reference_loss(x, w, t)
    out["first_derivative_err"] = rel_err(gx, torch.autograd.grad(ref, x64)[0])
    try:
        gx.square().sum().backward()
    except RuntimeError as e:
        out["twice"] = str(e)

    x.grad = None
    (DropGrad.apply(vocab_parallel_linear_cross_entropy(x, shard, t)) + x.sum() * 0).backward()
    out["undefined_zero"] = bool(torch.all(x.grad == 0))
    loss = vocab_parallel_linear_cross_entropy(x, shard, t, num_items_in_batch=torch.tensor([4.0]), reduction="sum")
    out["num_items_err"] = rel_err(loss, reference_loss(x, w, t, num_items_in_batch=4)[0])
    out["num_items_shape"] = tuple(loss.shape)
    return out


def test_autograd_contract_vocab_parallel(cluster2):
    for rank, res in enumerate(cluster2.run(_contract_case)):
        assert "modified by an inplace operation" in res.get("inplace", ""), (rank, res)
        assert "vocab_parallel_linear_cross_entropy is not twice differentiable" in res.get("twice", ""), (rank, res)
        assert res["first_derivative_err"] < 1e-5 and res["undefined_zero"], (rank, res)
        assert res["num_items_err"] < 1e-5 and res["num_items_shape"] == (), (rank, res)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        vocab_parallel_linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]))


def test_layout():
    layout = ShardLayout((5, 0, 7), rank=2)
    assert (layout.start, layout.end, layout.vocab) == (5, 12, 12)


# --- random cases: the one-device fuzz's draws and tolerances (test_fuzz) on vocabulary shards --------

def _random_case(rank, world, *, sizes, n, hidden, lead, chunk, ignore, bias, class_weight, opts, dtype, num_items,
                 sync_free, accum, frozen, stats, backend, device, seed) -> str | None:
    """What of this rank's loss, grad_input and shard gradients missed the float64 reference (None: nothing).
    Every rank draws the same full problem from ``seed``. ``dtype`` "autocast": float32 leaves, bf16 GEMMs;
    ``frozen``: what needs no gradient ("all": the loss alone); ``sync_free``: shard_sizes given and the target
    unchecked; ``bias`` "frozen" / "trained"."""
    g = torch.Generator().manual_seed(seed)
    store, gemm = (torch.float32, torch.bfloat16) if dtype == "autocast" else (dtype, dtype)
    x, w, b, t, cw = leaves(g, (*lead, n), hidden, sum(sizes), store, bias != "none", class_weight, ignore, device)
    start, end = _bounds(sizes, rank)
    cols = slice(start, end)
    x.requires_grad_(frozen not in ("input", "all"))
    w_shard = w.detach()[cols].clone().requires_grad_(frozen not in ("weight", "all"))
    b_shard = None if b is None else b.detach()[cols].clone().requires_grad_(bias == "trained" and frozen != "all")
    items = None if opts["reduction"] == "none" else num_items_for(t, num_items)
    known = dict(shard_sizes=sizes, validate_target=False) if sync_free else {}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "autocast"):
        out = vocab_parallel_linear_cross_entropy(x, w_shard, t, linear_bias=b_shard, weight=cw, chunk_size=chunk,
                                                  num_items_in_batch=items, accum_dtype=accum, backend=backend,
                                                  return_stats=stats, **known, **opts)
    loss = out[0] if stats else out

    def reference(**changed):
        return reference_loss(x, w, t, linear_bias=b, weight_cls=cw, num_items_in_batch=items, **{**opts, **changed})

    ref, ref_leaves = reference()
    try:
        assert loss.dtype == torch.float32 and loss.shape == ref.shape, (loss.dtype, loss.shape)
        tol = 1e-5 if gemm == torch.float32 else TOL[gemm]
        assert_loss_close(loss, ref, tol, loss_unit(t, opts["reduction"], items))
        if stats:
            assert out[1].num_valid.item() == int((t != -100).sum()), "num_valid"
        if not loss.requires_grad:
            return None
        grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(device)
        loss.backward(grad_out.float())
        ref.backward(grad_out)
        floors = grad_floors(reference, grad_out, opts, cols)
        scales = rounding_scales(x, w, b, t, cw, items, grad_out, opts, cols)
        for got, leaf, part, floor, scale, name in zip((x, w_shard, b_shard), ref_leaves, (slice(None), cols, cols),
                                                       floors, scales, ("input", "weight", "bias")):
            if got is not None and got.requires_grad:
                assert got.grad.dtype == store, (name, got.grad.dtype)
                assert_grad_close(got.grad, leaf.grad[part], GRAD_TOL[gemm], max(floor, scale), f"grad_{name}",
                                  atol=GRAD_TOL[gemm] / 100)
    except AssertionError as e:  # sent back as the rank's answer: a raising rank would restart the cluster
        return f"rank {rank}: {e}"
    return None


def _shard_sizes(max_size: int):
    """Two ranks' vocabulary slices, one of them possibly empty."""
    return st.tuples(st.integers(0, max_size), st.integers(0, max_size)).filter(lambda s: sum(s) > 0)


@settings(deadline=None)
@given(
    sizes=_shard_sizes(60), n=st.integers(0, 30), hidden=st.integers(1, 16), lead=st.sampled_from([(), (2,)]),
    chunk=st.one_of(st.none(), st.integers(1, 12)), ignore=st.floats(0.0, 1.0),
    bias=st.sampled_from(["none", "frozen", "trained"]), class_weight=st.booleans(), opts=options,
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16, "autocast"]),
    num_items=st.sampled_from(["none", "none", "float", "0-d"]), sync_free=st.booleans(),
    accum=st.sampled_from([None, None, torch.float32]),
    frozen=st.sampled_from(["none", "none", "input", "weight", "all"]),
    stats=st.booleans(), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**31 - 1),
)
def test_random_cases_match_reference(cluster2, **case):
    """Random shard sizes (one may be empty), shapes, options, dtypes, frozen operands and both backends, each
    rank's results against float64 (the Triton kernels under the interpreter: small shapes)."""
    failed = [m for m in cluster2.run(_random_case, device=CPU, **case) if m]
    assert not failed, "\n".join(failed)


# --- DTensor ------------------------------------------------------------------------------------------

def _dtensor_case(rank, world, *, vocab, shard, bias):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(7)
    x, w, b, t, cw = make_case((21,), 10, vocab, torch.float64, CPU, bias=bias, weight_cls=True, ignore=0.2)
    mesh = init_device_mesh("cpu", (world,))
    placement = [Shard(0)] if shard else [Replicate()]
    w_d = distribute_tensor(w.detach(), mesh, placement).requires_grad_()
    b_d = distribute_tensor(b.detach(), mesh, placement).requires_grad_() if bias else None
    loss = flce.linear_cross_entropy(x, w_d, t, linear_bias=b_d, weight=cw, label_smoothing=0.1, softcap=5.0)
    loss.backward()
    ref, (x64, w64, b64) = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, label_smoothing=0.1,
                                          softcap=5.0)
    ref.backward()
    errs = [rel_err(loss, ref), rel_err(x.grad, x64.grad), rel_err(w_d.grad.full_tensor(), w64.grad)]
    if bias:
        errs.append(rel_err(b_d.grad.full_tensor(), b64.grad))
    return {"errs": errs, "grad_placements": str(w_d.grad.placements)}


@pytest.mark.parametrize("vocab,shard,bias", [(37, True, True), (40, True, False), (37, False, True)])
def test_dtensor_weight(cluster3, vocab, shard, bias):
    """flce.linear_cross_entropy with a DTensor weight: Shard(0) (torch.chunk's uneven split over 3 ranks)
    routes to the vocab-parallel path, Replicate to the one-device path; the weight's gradient keeps the
    weight's placements."""
    for rank, res in enumerate(cluster3.run(_dtensor_case, vocab=vocab, shard=shard, bias=bias)):
        assert max(res["errs"]) < F64_TOL, (rank, res)
        assert res["grad_placements"] == ("(Shard(dim=0),)" if shard else "(Replicate(),)")


def _dtensor_bias_mismatch(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w_d = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    try:
        flce.linear_cross_entropy(torch.randn(3, 4), w_d, torch.tensor([0, 1, 2]), linear_bias=torch.randn(6))
    except ValueError as e:
        return str(e)
    return None


def test_dtensor_bias_must_be_placed_like_the_weight(cluster2):
    assert all(m and "linear_bias" in m for m in cluster2.run(_dtensor_bias_mismatch))


# --- on GPUs with NCCL (as many ranks as GPUs, up to 2; one GPU still runs the CUDA code path) -------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,reduction,name", [(torch.float32, "mean", "all"), (torch.float32, "none", "all"),
                                                  (torch.bfloat16, "sum", "plain")])
def test_vocab_parallel_on_gpus_with_nccl(nccl_cluster, dtype, reduction, name):
    vocab, world = 5003, nccl_cluster.world
    sizes = [vocab // world] * world
    sizes[-1] += vocab - sum(sizes)
    results = nccl_cluster.run(vocab_parallel_case, sizes=sizes, dtype=dtype, shape=(300,), hidden=128,
                               reduction=reduction, backend="triton", device=torch.device("cuda"),
                               chunk_size=128, **dict(OPTION_SETS[name]))
    _assert_all_close(results, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_gpu_hopper_gemm_on_each_shard(nccl_cluster, name, reduction):
    """bf16 shards of 4096 columns through flce's GEMM where a chunk has 256 rows or more (Hopper; with "all"'s
    ignored rows dropped the last chunk may have fewer: cuBLAS there), every option."""
    if not ON_HOPPER:
        pytest.skip("needs Hopper (TMA)")
    results = nccl_cluster.run(_hopper_gemm_case, sizes=(4096,) * nccl_cluster.world, dtype=torch.bfloat16,
                               shape=(1000,), hidden=256, chunk_size=512, reduction=reduction,
                               device=torch.device("cuda"), **dict(OPTION_SETS[name]))
    _assert_all_close(results, torch.bfloat16)
    least = (2 if name == "plain" else 1) * (2 if reduction == "none" else 1)
    assert all(res["calls"] >= least for res in results), results


@pytest.mark.gpu
@pytest.mark.parametrize("opts", PEAKED_OPTIONS)
def test_gpu_peaked_logits_losses_from_a_dot_at_the_target(nccl_cluster, opts):
    """bf16 at 1024 rows x 256 x 4096 columns a rank, two chunks, on the GPUs' own GEMM: each row as the CPU test.
    Not the sum: Hopper's tensor cores shrink every logit by ~4e-6 of itself (the lse with them, the dot not), a
    bias that 1024 rows add up (benchmark/NOTES.md, The target's logit from a dot in every loss)."""
    if not ON_HOPPER:
        pytest.skip("needs Hopper (TMA)")
    _assert_peaked_losses(nccl_cluster.run(_peaked_loss_case, sizes=(4096,) * nccl_cluster.world, opts=opts,
                                           device=torch.device("cuda"), dtype=torch.bfloat16, rows=1024, hidden=256,
                                           chunk_size=512))


@pytest.mark.gpu
def test_gpu_peaked_logits_on_each_shard(nccl_cluster):
    """bf16 at 1024 rows x 256 x 4096 columns a rank, two chunks: as the CPU test, on the GPUs' own GEMM."""
    if not ON_HOPPER:
        pytest.skip("needs Hopper (TMA)")
    kw = dict(sizes=(4096,) * nccl_cluster.world, device=torch.device("cuda"), dtype=torch.bfloat16, rows=1024,
              hidden=256, chunk_size=512)
    _assert_peaked(nccl_cluster.run(_peaked_case, hopper_gemm=True, **kw),
                   nccl_cluster.run(_peaked_case, hopper_gemm=False, **kw), chunks=2)


@pytest.mark.gpu
@settings(deadline=None, max_examples=GPU_FUZZ_EXAMPLES)
@given(
    sizes=_shard_sizes(40000), n=st.one_of(st.sampled_from([1, 255, 256, 1024, 2048]), st.integers(0, 3000)),
    hidden=st.sampled_from([8, 64, 100, 256, 512]), lead=st.sampled_from([(), (), (2,)]),
    chunk=st.sampled_from([None, None, 100, 256, 1000]), ignore=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    bias=st.sampled_from(["none", "none", "frozen", "trained"]), class_weight=st.sampled_from([False, False, True]),
    opts=GPU_OPTIONS,
    dtype=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32, "autocast"]),
    num_items=st.sampled_from(["none", "none", "float", "0-d"]), sync_free=st.booleans(),
    accum=st.sampled_from([None, None, torch.float32]),
    frozen=st.sampled_from(["none", "none", "input", "weight", "all"]),
    stats=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31 - 1),
)
def test_gpu_random_cases_match_reference(nccl_cluster, **case):
    """GPU-sized shards over NCCL: flce's Hopper GEMM on each shard from 256 rows a chunk, the CE kernels at large
    shards, every option (logits of std 1: the dtype's tolerance holds without eager's rounding allowance)."""
    rows = case["n"] * (2 if case["lead"] else 1)
    hypothesis.assume(rows * sum(case["sizes"]) <= 6e7)
    if nccl_cluster.world == 1:  # one GPU: its rank holds the whole vocabulary
        case["sizes"] = (sum(case["sizes"]),)
    failed = [m for m in nccl_cluster.run(_random_case, device=torch.device("cuda"), backend="auto", **case) if m]
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def nccl_cluster():
    c = Cluster(min(torch.cuda.device_count(), 2), backend="nccl")
    yield c
    c.close()


# --- the stage kernels: Triton against the torch twin (once, tiny: the interpreter is slow) ----------

@pytest.mark.parametrize("n,v_local", [pytest.param(5, 37, id="tiny"), pytest.param(3, 296, id="v%16=8"),
                                        pytest.param(64, 50_000, id="large", marks=pytest.mark.gpu)])
def test_stage_kernels_triton_matches_torch(device, n, v_local):
    if not triton_available(device):
        pytest.skip("needs triton (CUDA, or TRITON_INTERPRET=1)")
    opts = LossOptions(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, temperature=1.3)
    for dtype in (torch.float32, torch.bfloat16):
        _check_stage_kernels(device, n, v_local, dtype, opts)


def _check_stage_kernels(dev, n, v_local, dtype, opts):
    """Both stages' Triton kernels against the torch twin; 16-bit logits also in a ``gemm.padded_rows`` buffer whose
    padding holds NaN (the kernels' whole-group form where V % 16 != 0, ``ce_triton.whole_groups``)."""
    logits = (torch.randn(n, v_local, device=dev) * 3).to(dtype)
    target_local = torch.randint(-1, v_local, (n,), device=dev)  # -1: the target is on another rank
    class_w = torch.rand(v_local, device=dev) + 0.2
    layouts = ("contiguous", "padded") if dtype.itemsize == 2 else ("contiguous",)
    copies = {b: logits.clone() for b in ("torch", *layouts)}
    if "padded" in copies:
        copies["padded"] = poisoned_padded_copy(logits)
    stats = {b: torch.zeros(STATS, n, device=dev) for b in copies}
    for b, buf in copies.items():
        shard_stats("torch" if b == "torch" else "triton", buf, target_local, class_w, opts, stats[b])
    for b, row in itertools.product(layouts, range(STATS)):
        assert_close(stats[b][row], stats["torch"][row], 1e-5, f"{b}: stat {row}")

    lse = stats["torch"][0] + torch.log(stats["torch"][1]) + 0.3  # as if other ranks added mass
    coef, target_coef = torch.rand(n, device=dev) + 0.5, torch.rand(n, device=dev)
    scale = torch.randn(n, device=dev)
    scale[1] = 0.0  # an ignored row
    for b, buf in copies.items():
        shard_grad("torch" if b == "torch" else "triton", buf, target_local, class_w, lse, coef, target_coef, scale,
                   0.1 / 1000, opts)
    for b in layouts:
        assert_close(copies[b].float(), copies["torch"].float(), 1e-5 if dtype == torch.float32 else 1e-2, b)
        assert torch.all(copies[b][1] == 0)


# --- patched models trained under DDP and FSDP2, as accelerate sets them up -------------------------

# SGD with momentum, not Adam: a gradient off by a constant factor (a rank count, a token count) moves the
# weights by that factor, where Adam's normalization would hide it.
LR, MOMENTUM = 0.1, 0.9


def _batches(world: int, vocab: int, device):
    """One (input_ids, labels) batch per rank, with a different number of ignored labels on each."""
    out = []
    for r in range(world):
        ids = torch.randint(0, vocab, (2, 11))
        labels = ids.clone()
        labels[:, : r + 1] = -100
        out.append((ids.to(device), labels.to(device)))
    return out


@contextlib.contextmanager
def fsdp_on_cpu():
    """Within the block, an Accelerator given an FSDP plugin on CPU ranks sets up FSDP as it does on GPUs
    (accelerate alone picks DDP on CPUs whatever the plugin says), with a CPU device mesh: FSDP2's
    default mesh would be on the machine's accelerator while the group and tensors are on the CPU."""
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.utils import DistributedType

    init = Accelerator.__init__

    @functools.wraps(init)
    def init_fsdp_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        state, plugin = self.state, kwargs.get("fsdp_plugin")
        if plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
            return
        state.distributed_type = DistributedType.FSDP
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)  # what accelerate does for an FSDP state
        state.fsdp_plugin = plugin
        state.parallelism_config = ParallelismConfig(dp_shard_size=dist.get_world_size())
        state.device_mesh = state.parallelism_config.get_device_mesh("cpu")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Accelerator, "__init__", init_fsdp_on_cpu)
        yield


@contextlib.contextmanager
def fresh_accelerate_state():
    """A fresh accelerate state on entry and exit, and the environment put back: an Accelerator given an
    FSDP plugin sets ACCELERATE_USE_FSDP for the whole process, so a later one without a plugin would
    wrap with FSDP (version 1) instead of DDP (benchmark/dist_check.py runs both in one process)."""
    from accelerate.state import AcceleratorState

    environ = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(environ)


def _prepare(model, optimizer, wrap: str, mixed_precision: str, device: torch.device):
    """(model, optimizer) as ``accelerator.prepare`` returns them: DDP, or FSDP2 with accelerate's own
    wrapping (the decoder layers, then the root with the embeddings, final norm and head)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if wrap == "fsdp2" else None
    with fsdp_on_cpu():
        acc = Accelerator(cpu=device.type == "cpu", fsdp_plugin=plugin, mixed_precision=mixed_precision)
    assert acc.is_fsdp2 == (wrap == "fsdp2"), acc.distributed_type
    return acc.prepare(model, optimizer)


def _uses_fused_loss(loss: torch.Tensor) -> bool:
    """Whether flce's autograd Function is in the loss's graph (not transformers' own cross-entropy)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CrossEntropyFunction" in type(node).__name__:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def _train_one_process(model, batches) -> list[list[torch.Tensor]]:
    """transformers' own loss (materialized logits) in the model's dtype, one SGD step per entry of
    ``batches`` on the mean of the ranks' losses (what DDP and FSDP2 average); each step's losses, rank by
    rank."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for step_batches in batches:
        outputs = [model(input_ids=ids, labels=labels) for ids, labels in step_batches]
        assert all(o.logits is not None for o in outputs)  # unfused: the reference is transformers' loss
        torch.stack([o.loss for o in outputs]).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append([o.loss.detach() for o in outputs])
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def patched_training_case(rank, world, *, wrap, family="llama", tied=False, dtype=torch.float64, device=CPU,
                          mixed_precision="no", steps=3, flce_experts=False, router_logits=True, baseline=False):
    """Relative errors of a patched tiny model trained ``steps`` SGD steps under ``wrap`` ("ddp" or
    "fsdp2", through accelerate): each step's loss on this rank and each parameter's change over the run,
    against the unpatched model trained in one process (bf16 mixed precision: in float32, the exact run both
    roundings are measured from). Mixtral: eager experts unpatched, flce's experts backend when
    ``flce_experts``; ``router_logits`` adds the router's aux loss. ``baseline``: the same errors of the
    unpatched model under the same wrap (what bf16 and the wrap alone change, e.g. FSDP2's bf16 parameters
    against autocast). (Also run on GPUs by benchmark/dist_check.py.)"""
    torch.manual_seed(3)
    extra = {"output_router_logits": router_logits} if family == "mixtral" else {}
    model = tiny_model(family, dtype, vocab_size=97, tie_word_embeddings=tied, **extra).to(device)
    if family == "mixtral":
        model.set_experts_implementation("eager")  # transformers' default (grouped_mm) has no float64
    batches = [_batches(world, model.config.vocab_size, device) for _ in range(steps)]
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    ref_losses = _train_one_process(reference, batches)
    plain = copy.deepcopy(model) if baseline else None

    flce.apply_flce_patch(model, use_flce_experts=flce_experts)
    out = _train_wrapped(model, batches, rank, wrap, mixed_precision, device)
    flce.remove_flce_patch(model)
    out["errs"] = _training_errors(model, out.pop("losses"), reference, ref_losses, rank, start)
    if baseline:
        unpatched = _train_wrapped(plain, batches, rank, wrap, mixed_precision, device)
        out["baseline_errs"] = _training_errors(plain, unpatched["losses"], reference, ref_losses, rank, start)
    return out


def _train_wrapped(model, batches, rank: int, wrap: str, mixed_precision: str, device: torch.device) -> dict:
    """This rank's losses of one SGD step per entry of ``batches`` under ``wrap``; whether every loss went
    through flce, whether flce's experts backend ran, whether the head was sharded."""
    from flce import experts

    experts_forward, calls = experts.experts_forward, []

    def counted(*args, **kwargs):
        calls.append(1)
        return experts_forward(*args, **kwargs)

    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, fused = [], []
    with fresh_accelerate_state(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(experts, "experts_forward", counted)
        wrapped, optimizer = _prepare(model, optimizer, wrap, mixed_precision, device)
        for step_batches in batches:
            ids, labels = step_batches[rank]
            loss = wrapped(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            fused.append(_uses_fused_loss(loss))
            losses.append(loss.detach())
    return {"losses": losses, "fused": all(fused), "flce_experts": bool(calls),
            "sharded": type(model.lm_head.weight).__name__ == "DTensor"}


ALL_WEIGHTS = "all weights"  # _training_errors' key for every parameter's change taken as one vector


def _training_errors(model, losses, reference, ref_losses, rank: int, start: dict) -> dict[str, float]:
    """Relative errors of each step's loss, of each parameter's change over the run and of all changes
    together (``ALL_WEIGHTS``)."""
    errs = {f"loss, step {i + 1}": rel_err(loss, ref[rank]) for i, (loss, ref) in enumerate(zip(losses, ref_losses))}
    ref_params = dict(reference.named_parameters())
    got, want = [], []
    for name, p in model.named_parameters():
        got.append((_full(p) - start[name]).flatten())
        want.append((ref_params[name].detach() - start[name]).flatten())
        errs[name] = rel_err(got[-1], want[-1])
    errs[ALL_WEIGHTS] = rel_err(torch.cat(got), torch.cat(want))
    return errs


def assert_trained_alike(results, tol, flce_experts=False, sharded=False):
    for rank, res in enumerate(results):
        assert res["fused"], f"rank {rank}: the loss did not go through flce"
        assert res["flce_experts"] == flce_experts, f"rank {rank}: flce's experts backend ran: {res['flce_experts']}"
        assert res["sharded"] == sharded, f"rank {rank}: FSDP2-sharded head: {res['sharded']}"
        errs = res["errs"]
        worst = max(errs, key=errs.get)
        assert errs[worst] < tol, f"rank {rank}: {worst} relative error {errs[worst]:.3g}"


@pytest.mark.parametrize("wrap,tied", [("ddp", False), ("fsdp2", False), ("fsdp2", True), ("ddp", True)])
def test_patched_llama_trains_alike_under_ddp_and_fsdp2(cluster2, wrap, tied):
    results = cluster2.run(patched_training_case, wrap=wrap, tied=tied)
    assert_trained_alike(results, F64_TOL, sharded=wrap == "fsdp2")


@pytest.mark.parametrize("wrap,flce_experts,router_logits", [("fsdp2", True, True), ("ddp", True, True),
                                                             ("fsdp2", False, True), ("fsdp2", True, False)])
def test_patched_mixtral_trains_alike_under_ddp_and_fsdp2(cluster2, wrap, flce_experts, router_logits):
    results = cluster2.run(patched_training_case, wrap=wrap, family="mixtral", flce_experts=flce_experts,
                           router_logits=router_logits)
    assert_trained_alike(results, F64_TOL, flce_experts=flce_experts, sharded=wrap == "fsdp2")
