"""Vocab-parallel flce on several GPUs (NCCL) against one-GPU flce, and patched models under FSDP2/DDP.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src \\
        torchrun --nproc_per_node=2 benchmark/dist_check.py

1. The Llama-3 head (BT=8192, H=4096, V=128256, bf16): loss, grad_input and each rank's grad_weight
   shard against float64, next to the one-GPU function's errors on the full weight; then the time of
   one forward+backward step per GPU against one GPU alone, the grad_input all-reduce alone, and the
   extra memory of each.
2. Every option (bias, class weights, smoothing, z-loss, softcap, temperature, ignored rows) on an odd,
   uneven split, Triton backend, float32 and bf16, against float64.
3. The patched tiny Llama under FSDP2 and DDP through accelerate, against transformers' own loss in
   one process (float64; and bf16 mixed precision, loosely).

Writes dist_check.json and dist_check.md under $OUT (default ./out); prints a table last. ~1-2 minutes.
``--smoke`` runs the same checks at tiny shapes on CPUs with gloo (a dry run of this script).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# NVLink multicast stays off on the lent machines (set before NCCL initializes).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU tests' rank functions

import test_distributed as cases  # noqa: E402
from common import environment, median_ms, peak_extra_mb, print_table, write_json, markdown_table  # noqa: E402
from reference import TOL, chunked_reference_grads, rel_err  # noqa: E402
from test_api import OPTION_SETS  # noqa: E402

import flce  # noqa: E402
from flce.distributed import vocab_parallel_linear_cross_entropy  # noqa: E402

HEAD = {"bt": 8192, "hidden": 4096, "vocab": 128256}
OPTIONS_SHAPE = {"shape": (4, 509), "hidden": 512, "vocab": 50257}
SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:
    HEAD = {"bt": 96, "hidden": 32, "vocab": 1001}
    OPTIONS_SHAPE = {"shape": (3, 17), "hidden": 16, "vocab": 301}
COLUMNS = ["check", "status", "loss_err", "grad_input_err", "grad_weight_err", "note"]


def main() -> None:
    dist.init_process_group("gloo" if SMOKE else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if SMOKE:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 checks mean float32
    rows, timing = head_check(rank, world, device)
    rows += option_checks(rank, world, device)
    rows += patched_model_checks(rank, world, device)
    if rank == 0:
        report(rows, timing, world, device)
    dist.barrier()
    dist.destroy_process_group()


def head_check(rank: int, world: int, device: torch.device) -> tuple[list[dict], dict]:
    """Errors against float64 and step times at the Llama-3 head, vocab-parallel vs one GPU."""
    bt, hidden, vocab = HEAD["bt"], HEAD["hidden"], HEAD["vocab"]
    torch.manual_seed(0)
    x = torch.randn(bt, hidden, device=device, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device) * 2 / hidden**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (bt,), device=device)
    for tensor in (x, w, t):  # one problem for all ranks, whatever the GPUs' random streams do
        dist.broadcast(tensor, 0)
    step = -(-vocab // world)  # DTensor's Shard(0) split
    sizes = [max(0, min(step, vocab - r * step)) for r in range(world)]
    start, end = sum(sizes[:rank]), sum(sizes[: rank + 1])
    x_tp, x_one = x.clone().requires_grad_(), x.clone().requires_grad_()
    w_shard, w_full = w[start:end].clone().requires_grad_(), w.clone().requires_grad_()

    def tp_step(**options):
        x_tp.grad = w_shard.grad = None
        loss = vocab_parallel_linear_cross_entropy(x_tp, w_shard, t, **options)
        loss.backward()
        return loss

    def one_step():
        x_one.grad = w_full.grad = None
        loss = flce.linear_cross_entropy(x_one, w_full, t)
        loss.backward()
        return loss

    loss_tp, loss_one = tp_step().detach(), one_step().detach()
    ref_loss, ref_gx, ref_gw = chunked_reference_grads(x, w, t)
    errs = {
        "vocab-parallel": (rel_err(loss_tp, ref_loss), rel_err(x_tp.grad, ref_gx),
                           rel_err(w_shard.grad, ref_gw[start:end])),
        "one GPU": (rel_err(loss_one, ref_loss), rel_err(x_one.grad, ref_gx),
                    rel_err(w_full.grad[start:end], ref_gw[start:end])),
    }
    del ref_gx, ref_gw
    cases_errs = _gather(errs)
    rows = []
    shape = f"{bt}x{hidden}x{vocab} bf16, {world} ranks"
    worst = {k: [max(e[k][i] for e in cases_errs) for i in range(3)] for k in errs}
    # The vocab-parallel path rounds grad_input once more (a bf16 sum of partial products): allow 2x.
    ok = all(tp <= 2 * one + 1e-4 for tp, one in zip(worst["vocab-parallel"], worst["one GPU"]))
    for name, e in worst.items():
        rows.append(_row(f"head: {name}", "ok" if ok or name == "one GPU" else "FAIL", e, shape))

    timing = {"one_gpu_ms": median_ms(one_step, 3, 10, device)}
    dist.barrier()
    timing["vocab_parallel_ms"] = median_ms(tp_step, 3, 10, device)
    dist.barrier()
    timing["sync_free_ms"] = median_ms(lambda: tp_step(shard_sizes=sizes, validate_target=False), 3, 10, device)
    grad = torch.empty_like(x)
    dist.barrier()
    timing["grad_input_allreduce_ms"] = median_ms(lambda: dist.all_reduce(grad), 3, 10, device)
    timing["one_gpu_extra_mb"] = peak_extra_mb(one_step, device)
    timing["vocab_parallel_extra_mb"] = peak_extra_mb(tp_step, device)
    timing = {k: max(v[k] for v in _gather(timing)) for k in timing}  # the slowest rank
    return rows, timing


def option_checks(rank: int, world: int, device: torch.device) -> list[dict]:
    """Every option on an uneven split with the Triton backend, through the CPU tests' rank function."""
    vocab = OPTIONS_SHAPE["vocab"]
    weights = [r + 1 for r in range(world)]  # rank r holds a share proportional to r + 1
    sizes = [vocab * w // sum(weights) for w in weights]
    sizes[-1] += vocab - sum(sizes)
    rows = []
    for dtype, reduction, name in ((torch.float32, "mean", "all"), (torch.float32, "none", "all"),
                                   (torch.bfloat16, "sum", "all"), (torch.float32, "mean", "plain")):
        opts = dict(OPTION_SETS[name])
        res = _gather(cases.vocab_parallel_case(rank, world, sizes=sizes, dtype=dtype, reduction=reduction,
                                                shape=OPTIONS_SHAPE["shape"], hidden=OPTIONS_SHAPE["hidden"],
                                                backend="torch" if SMOKE else "triton", device=device,
                                                chunk_size=700 if not SMOKE else 11, **opts))
        errs = [max(r["errs"][k] for r in res) for k in ("loss", "grad_input", "grad_weight")]
        if "grad_bias" in res[0]["errs"]:
            errs[2] = max(errs[2], max(r["errs"]["grad_bias"] for r in res))
        status = "ok" if max(errs) <= TOL[dtype] else "FAIL"
        n = math.prod(OPTIONS_SHAPE["shape"])
        rows.append(_row(f"options: {name}, {reduction}", status, errs,
                         f"{n}x{OPTIONS_SHAPE['hidden']}x{vocab} {str(dtype)[6:]}, shards {sizes}"))
    return rows


def patched_model_checks(rank: int, world: int, device: torch.device) -> list[dict]:
    """The patched tiny Llama through accelerate's FSDP2 and DDP against transformers' loss in one process."""
    rows = []
    for wrap, tied, dtype, mp, tol in (("ddp", False, torch.float64, "no", cases.F64_TOL),
                                       ("fsdp2", False, torch.float64, "no", cases.F64_TOL),
                                       ("fsdp2", True, torch.float64, "no", cases.F64_TOL),
                                       ("ddp", False, torch.float32, "bf16", 5e-2),
                                       ("fsdp2", False, torch.float32, "bf16", 5e-2)):
        name = f"patched llama: {wrap}{', tied' if tied else ''}, {mp if mp != 'no' else str(dtype)[6:]}"
        try:
            res = _gather(cases.patched_model_case(rank, world, wrap=wrap, tied=tied, dtype=dtype,
                                                   device=device, mixed_precision=mp))
        except Exception as exc:  # noqa: BLE001 - report it, go on with the other checks
            rows.append({"check": name, "status": f"error: {type(exc).__name__}: {str(exc)[:120]}"})
            continue
        loss_err = max(r["errs"]["loss"] for r in res)
        grad_err = max(v for r in res for k, v in r["errs"].items() if k != "loss")
        fused = all(r["fused"] for r in res)
        status = "ok" if fused and max(loss_err, grad_err) <= tol else "FAIL"
        rows.append({"check": name, "status": status, "loss_err": loss_err, "grad_weight_err": grad_err,
                     "note": f"worst parameter; tol {tol:g}" + ("" if fused else "; loss NOT fused")})
    return rows


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _row(check: str, status: str, errs, note: str) -> dict:
    return {"check": check, "status": status, "loss_err": errs[0], "grad_input_err": errs[1],
            "grad_weight_err": errs[2], "note": note}


def report(rows: list[dict], timing: dict, world: int, device: torch.device) -> None:
    out_dir = Path(os.environ.get("OUT", "out"))
    speedup = timing["one_gpu_ms"] / timing["vocab_parallel_ms"]
    timing_rows = [
        {"check": "time: one GPU, full weight", "ms": timing["one_gpu_ms"], "extra_mb": timing["one_gpu_extra_mb"]},
        {"check": f"time: vocab-parallel, per GPU ({world})", "ms": timing["vocab_parallel_ms"],
         "extra_mb": timing["vocab_parallel_extra_mb"],
         "note": f"speedup {speedup:.2f}x (ideal {world}x)"},
        {"check": "time: same, sync-free", "ms": timing["sync_free_ms"],
         "note": "shard_sizes given, validate_target=False: no host sync"},
        {"check": "time: grad_input all-reduce alone", "ms": timing["grad_input_allreduce_ms"]},
    ]
    meta = {**environment(device), "world": world, "head": HEAD, "timing": timing}
    write_json(out_dir / "dist_check.json", meta, rows + timing_rows)
    text = ["# dist_check", "", f"{meta['device']} x {world}, torch {meta['torch']}, {dist.get_backend()}", "",
            markdown_table(rows, COLUMNS), markdown_table(timing_rows, ["check", "ms", "extra_mb", "note"])]
    (out_dir / "dist_check.md").write_text("\n".join(text))
    print_table(timing_rows, "step time (median of 10; forward+backward)", ["check", "ms", "extra_mb", "note"])
    print_table(rows, "correctness (relative errors, worst rank)", COLUMNS)
    bad = [r["check"] for r in rows if r["status"] != "ok"]
    print("ALL OK" if not bad else f"NOT OK: {bad}", "| speedup", f"{speedup:.2f}x" if math.isfinite(speedup) else "-")


if __name__ == "__main__":
    main()
