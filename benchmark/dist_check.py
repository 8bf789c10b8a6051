"""Vocab-parallel flce over NCCL against one-GPU flce; patched models and a TRL SFT run trained under
FSDP2 and DDP against one process.

On a machine with two GPUs, from the repository root, the trl and datasets wheels in .whl/ (an offline
machine), results and the log under $OUT:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src && torchrun --nproc_per_node=2 benchmark/dist_check.py 2>&1 | tee $OUT/dist_check_log.txt

1. Heads (bf16, 8192 x 4096 x 128256 and 32768 x 4096 x 128256, an eighth of the targets ignored): the
   vocab-parallel loss, grad_input and each rank's grad_weight shard against float64, next to the
   one-GPU function's errors on the full weight and the difference of the two; the time of one
   forward+backward per GPU against one GPU alone (also sync-free, and the grad_input all-reduce alone),
   and each one's extra memory per rank.
2. Options on an uneven split (shares 1:2) with the Triton backend: every option set x mean/sum/none in
   float32, all options at once in bf16 (also with a bf16 grad_weight accumulator), and a custom
   ignore_index, num_items_in_batch, the sync-free setting, autocast over float32 weights and an empty
   shard; against float64, with the one-device function's errors next to them.
3. A patched tiny Llama and Mixtral (router aux loss on and off, flce's experts backend and eager) trained
   3 SGD steps under accelerate's DDP and FSDP2: each step's loss and each weight's change against the
   unpatched model trained in one process; float64 to 1e-6; bf16 mixed precision against that run in
   float32, as close as the unpatched model under the same wrap (FSDP2's bf16 parameters are not
   autocast): each loss within 5e-2 or 1.5x its error, all weights' changes together within 1.5x.
4. TRL's SFTTrainer on FSDP2 with flce patched in (flce's kernels counted, TRL's never) against the same
   training in one process without flce: each step's loss and each weight's change (float32).

Writes dist_check.json and dist_check.md under $OUT (default ./out) and prints the tables, the verdict
line last; exits with 1 when a check fails. ``--smoke``: every part at tiny shapes on CPUs with gloo,
``OUT=/tmp/dist_check PYTHONPATH=src torchrun --nproc_per_node=2 benchmark/dist_check.py --smoke``
(tests/test_benchmark.py runs it).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# NVLink multicast stays off on the lent machines (set before NCCL initializes).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU tests' rank functions

import test_distributed as cases  # noqa: E402
from common import environment, markdown_table, median_ms, peak_extra_mb, print_table, write_json  # noqa: E402
from reference import TOL, chunked_reference_grads, rel_err  # noqa: E402
from test_api import OPTION_SETS  # noqa: E402

import flce  # noqa: E402
from flce.distributed import vocab_parallel_linear_cross_entropy  # noqa: E402

SMOKE = "--smoke" in sys.argv[1:]
HEADS = [(96, 32, 1001), (160, 32, 1001)] if SMOKE else [(8192, 4096, 128256), (32768, 4096, 128256)]
OPTIONS_SHAPE = {"shape": (3, 17), "hidden": 16, "vocab": 301} if SMOKE else \
    {"shape": (4, 509), "hidden": 512, "vocab": 50257}
BF16_TOL = 5e-2  # bf16 training: the least bound on a step's loss error (3 steps)
# (family, wrap, precision, extra): "float64", or "bf16" mixed precision over float32 weights
MODEL_CASES = [
    ("llama", "ddp", "float64", {}),
    ("llama", "fsdp2", "float64", {}),
    ("llama", "fsdp2", "float64", {"tied": True}),
    ("llama", "ddp", "bf16", {}),
    ("llama", "fsdp2", "bf16", {}),
    ("mixtral", "ddp", "float64", {"flce_experts": True}),
    ("mixtral", "fsdp2", "float64", {"flce_experts": True}),
    ("mixtral", "fsdp2", "float64", {"flce_experts": False}),
    ("mixtral", "fsdp2", "float64", {"flce_experts": True, "router_logits": False}),
    ("mixtral", "ddp", "bf16", {"flce_experts": True}),
    ("mixtral", "fsdp2", "bf16", {"flce_experts": True}),
]
# What torchrun sets; the one-process TRL run must not see it (accelerate would join the group).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
LOSS_COLUMNS = ["check", "status", "loss_err", "grad_input_err", "grad_weight_err", "one_device_err", "tol", "note"]
TRAIN_COLUMNS = ["check", "status", "loss_err", "update_err", "baseline_err", "tol", "note"]
TIME_COLUMNS = ["check", "shape", "ms", "extra_mb", "note"]


def main() -> None:
    device = _device()
    seconds = {}

    def part(name, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        seconds[name] = time.perf_counter() - start
        return out

    dist.init_process_group("gloo" if SMOKE else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    trl_one_process = OneProcessRun(device, world) if rank == 0 else None  # runs meanwhile
    loss_rows, time_rows = [], []
    for shape in HEADS:
        rows, timing = part(f"head {'x'.join(map(str, shape))}", head_check, rank, world, device, *shape)
        loss_rows += rows
        time_rows += timing
    loss_rows += part("options", option_checks, rank, world, device)
    train_rows = part("models", model_checks, rank, world, device)
    train_rows.append(part("trl (waits for the one-process run)", trl_check, rank, world, device, trl_one_process))
    ok = report(loss_rows, train_rows, time_rows, world, device, seconds) if rank == 0 else True
    dist.barrier()
    dist.destroy_process_group()
    # Every result is written: skip the interpreter's teardown. An abort there (gloo's threads releasing
    # work at finalization, one way is described in pytorch/pytorch#179291) would fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def _device() -> torch.device:
    if SMOKE:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 checks mean float32
    return device


# --- 1. heads ------------------------------------------------------------------------------------------

def head_check(rank: int, world: int, device: torch.device, bt: int, hidden: int,
               vocab: int) -> tuple[list[dict], list[dict]]:
    """Errors against float64 and step times at one head shape, vocab-parallel vs one GPU."""
    torch.manual_seed(0)
    x = torch.randn(bt, hidden, device=device, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device) * 2 / hidden**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (bt,), device=device)
    t[torch.rand(bt, device=device) < 0.125] = -100
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
        "vocab-parallel vs one GPU": (rel_err(loss_tp, loss_one), rel_err(x_tp.grad, x_one.grad),
                                      rel_err(w_shard.grad, w_full.grad[start:end])),
    }
    del ref_gx, ref_gw
    worst = {k: [max(e[k][i] for e in _gather(errs)) for i in range(3)] for k in errs}
    # The vocab-parallel path rounds grad_input once more (a bf16 sum of partial products): allow 2x.
    ok = all(tp <= 2 * one + 1e-4 for tp, one in zip(worst["vocab-parallel"], worst["one GPU"]))
    shape = f"{bt}x{hidden}x{vocab}"
    diff = ", ".join(f"{k} {v:.2g}" for k, v in zip(("loss", "grad_input", "grad_weight"),
                                                     worst["vocab-parallel vs one GPU"]))
    rows = [_loss_row(f"head {shape}: vocab-parallel", "ok" if ok else "FAIL", worst["vocab-parallel"],
                      f"bf16, shards {sizes}, 1/8 ignored; vs one GPU: {diff}", tol="2x one GPU"),
            _loss_row(f"head {shape}: one GPU", "ok", worst["one GPU"], "flce.linear_cross_entropy")]

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
    speedup = timing["one_gpu_ms"] / timing["vocab_parallel_ms"]
    time_rows = [
        {"check": "one GPU, full weight", "shape": shape, "ms": timing["one_gpu_ms"],
         "extra_mb": timing["one_gpu_extra_mb"]},
        {"check": f"vocab-parallel, per GPU ({world})", "shape": shape, "ms": timing["vocab_parallel_ms"],
         "extra_mb": timing["vocab_parallel_extra_mb"], "speedup": speedup,
         "note": f"speedup {speedup:.2f}x (ideal {world}x)"},
        {"check": "same, sync-free", "shape": shape, "ms": timing["sync_free_ms"],
         "note": "shard_sizes given, validate_target=False"},
        {"check": "grad_input all-reduce alone", "shape": shape, "ms": timing["grad_input_allreduce_ms"]},
    ]
    return rows, time_rows


# --- 2. options ----------------------------------------------------------------------------------------

def option_cases() -> list[tuple[str, torch.dtype, str, dict]]:
    """(name, dtype, reduction, options): every option set x reduction in float32, then the rest."""
    out = [(name, torch.float32, reduction, dict(opts))
           for name, opts in OPTION_SETS.items() for reduction in ("mean", "sum", "none")]
    out += [("all", torch.bfloat16, reduction, dict(OPTION_SETS["all"])) for reduction in ("mean", "sum", "none")]
    out.append(("all, accum_dtype=bfloat16", torch.bfloat16, "mean", {**OPTION_SETS["all"],
                                                                     "accum_dtype": torch.bfloat16}))
    half = math.prod(OPTIONS_SHAPE["shape"]) // 2
    out += [
        ("ignore_index=7", torch.float32, "mean", {"ignore": 0.3, "ignore_index": 7}),
        ("all, num_items_in_batch", torch.float32, "sum", {**OPTION_SETS["all"], "num_items_in_batch": half}),
        ("all, sync-free", torch.float32, "mean", {**OPTION_SETS["all"], "validate_target": False,
                                                   "shard_sizes": True}),
        ("all, autocast bf16", torch.float32, "mean", {**OPTION_SETS["all"], "autocast": True}),
        ("all, empty first shard", torch.float32, "mean", {**OPTION_SETS["all"], "sizes": "empty"}),
    ]
    return out


def option_checks(rank: int, world: int, device: torch.device) -> list[dict]:
    """Every option on an uneven split with the Triton backend, through the CPU tests' rank function."""
    vocab, n = OPTIONS_SHAPE["vocab"], math.prod(OPTIONS_SHAPE["shape"])
    weights = [r + 1 for r in range(world)]  # rank r holds a share proportional to r + 1
    uneven = [vocab * w // sum(weights) for w in weights]
    uneven[-1] += vocab - sum(uneven)
    rows = []
    for name, dtype, reduction, opts in option_cases():
        sizes = [0] * (world - 1) + [vocab] if opts.pop("sizes", None) == "empty" else uneven
        if opts.get("shard_sizes"):
            opts["shard_sizes"] = sizes
        res = _gather(cases.vocab_parallel_case(rank, world, sizes=sizes, dtype=dtype, reduction=reduction,
                                                shape=OPTIONS_SHAPE["shape"], hidden=OPTIONS_SHAPE["hidden"],
                                                backend="torch" if SMOKE else "triton", device=device,
                                                chunk_size=11 if SMOKE else 700, one_device=True, **opts))
        errs = [max(r["errs"][k] for r in res) for k in ("loss", "grad_input", "grad_weight")]
        errs[2] = max([errs[2]] + [r["errs"]["grad_bias"] for r in res if "grad_bias" in r["errs"]])
        one = max(v for r in res for v in r["one_errs"].values())
        tol = TOL[torch.bfloat16] if dtype == torch.bfloat16 or opts.get("autocast") else TOL[dtype]
        rows.append(_loss_row(f"options: {name}, {reduction}, {str(dtype)[6:]}",
                              "ok" if max(errs) <= tol else "FAIL", errs,
                              f"{n}x{OPTIONS_SHAPE['hidden']}x{vocab}, shards {sizes}", tol=tol, one_device_err=one))
    return rows


# --- 3. patched models ---------------------------------------------------------------------------------

def model_checks(rank: int, world: int, device: torch.device) -> list[dict]:
    """Patched tiny Llama and Mixtral trained under accelerate's DDP and FSDP2 against one process."""
    rows = []
    for family, wrap, precision, extra in MODEL_CASES:
        bf16 = precision == "bf16"
        name = f"{family}: {wrap}, {precision}" + "".join(f", {k}={v}" for k, v in extra.items())
        try:
            res = _gather(cases.patched_training_case(
                rank, world, wrap=wrap, family=family, dtype=torch.float32 if bf16 else torch.float64,
                device=device, mixed_precision="bf16" if bf16 else "no", baseline=bf16, **extra))
        except Exception as exc:  # noqa: BLE001 - report it, go on with the other checks
            rows.append(_error_row(name, exc, rank))
            continue
        rows.append(_training_row(name, res, wrap, extra.get("flce_experts", False), bf16))
    return rows


def _training_row(name: str, res: list[dict], wrap: str, flce_experts: bool, bf16: bool) -> dict:
    errs = {k: max(r["errs"][k] for r in res) for k in res[0]["errs"]}
    params = [k for k in errs if not k.startswith("loss") and k != cases.ALL_WEIGHTS]
    if bf16:
        # Against the float32 run, as close as the unpatched model under the same wrap: the losses (or within
        # BF16_TOL) and all weights' changes together. One weight's change is no verdict in bf16: a routing
        # decision that rounds the other way moves one expert's change by 5-10% in either model.
        base = {k: max(r["baseline_errs"][k] for r in res) for k in res[0]["errs"]}
        allowed = {k: max(BF16_TOL, 1.5 * base[k]) for k in errs if k.startswith("loss")}
        allowed[cases.ALL_WEIGHTS] = 1.5 * base[cases.ALL_WEIGHTS]
        shown = cases.ALL_WEIGHTS
        worst = max(params, key=lambda k: errs[k] / max(base[k], 1e-12))
        note = f"worst weight: {worst} {errs[worst]:.3g} (unpatched {base[worst]:.3g})"
    else:
        base, allowed = {}, {k: cases.F64_TOL for k in errs}
        shown = worst = max(params, key=errs.get)
        note = f"worst: {worst}"
    flags = {"loss through flce": all(r["fused"] for r in res),
             "experts backend as asked": all(r["flce_experts"] == flce_experts for r in res),
             "head sharded as wrapped": all(r["sharded"] == (wrap == "fsdp2") for r in res)}
    bad = [k for k, ok in flags.items() if not ok] + [k for k in allowed if errs[k] > allowed[k]]
    return {"check": name, "status": "ok" if not bad else "FAIL",
            "loss_err": max(errs[k] for k in errs if k.startswith("loss")), "update_err": errs[shown],
            "baseline_err": base.get(shown), "tol": allowed[shown],
            "note": note + (f"; FAILED: {bad[:3]}" if bad else "")}


# --- 4. TRL --------------------------------------------------------------------------------------------

class OneProcessRun:
    """TRL's SFT run without flce in a process of its own, started now, read by ``result()``: one visible
    GPU (with two, transformers' Trainer would wrap the model in DataParallel) and none of torchrun's
    variables (accelerate would join the group)."""

    def __init__(self, device: torch.device, world: int):
        self.dir = Path(tempfile.mkdtemp(prefix="dist_check_trl_"))
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        if device.type == "cuda":
            visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")
            env["CUDA_VISIBLE_DEVICES"] = visible[device.index] if visible != [""] else str(device.index)
        command = [sys.executable, __file__, "--one-process-trl", str(self.dir), str(world)]
        self.log = open(self.dir / "log.txt", "w")  # noqa: SIM115 - closed in result()
        self.proc = subprocess.Popen(command + (["--smoke"] if SMOKE else []), env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def result(self) -> dict | str:
        """The run's losses, weight changes and kernel counts, or why there are none (its log then goes
        to stderr)."""
        code = self.proc.wait()
        self.log.close()
        log = (self.dir / "log.txt").read_text().strip()
        if code == 0:
            result = torch.load(self.dir / "result.pt")
        else:
            print(f"dist_check: the one-process TRL run exited {code}; its log:\n{log}", file=sys.stderr)
            result = f"one process exited {code}: {log.splitlines()[-1] if log else ''}"
        shutil.rmtree(self.dir, ignore_errors=True)
        return result


def one_process_trl(out_dir: Path, world: int) -> None:
    """The body of :class:`OneProcessRun`'s process."""
    import test_distributed_trl as sft

    device = torch.device("cpu" if SMOKE else "cuda")
    torch.save(sft.sft_run(out_dir / "trainer", device, world=world, fsdp=False), out_dir / "result.pt")


def trl_check(rank: int, world: int, device: torch.device, one_process: OneProcessRun | None) -> dict:
    """TRL's SFT run on FSDP2 with flce patched in, against the one-process run (rank 0's, sent to all:
    every rank takes the same path, so none waits in a collective that another skipped)."""
    name = "trl sft: fsdp2 + flce vs one process"
    sent = [one_process.result() if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    want = sent[0]
    if isinstance(want, str):
        return {"check": name, "status": f"error: {want[:160]}"}
    try:
        import test_distributed_trl as sft

        with tempfile.TemporaryDirectory() as out_dir:
            got = sft.sft_fsdp2_case(rank, world, out_dir=out_dir, device=device)
    except (Exception, pytest.skip.Exception) as exc:  # noqa: BLE001 - report it (the other parts are done)
        return _error_row(name, exc, rank)
    ranks = _gather({"errs": sft.sft_errors(got, want), "kernels": got["kernels"], "sharded": got["sharded"]})
    problems = sft.sft_problems(ranks, want)
    errs = {k: max(r["errs"][k] for r in ranks) for k in ranks[0]["errs"]}
    worst = max((k for k in errs if not k.startswith("loss")), key=errs.get)
    calls = ranks[0]["kernels"]
    return {"check": name, "status": "ok" if not problems else "FAIL",
            "loss_err": max(errs[k] for k in errs if k.startswith("loss")), "update_err": errs[worst],
            "tol": f"{sft.LOSS_TOL:g} / {sft.UPDATE_TOL:g}",
            "note": f"{len(want['losses'])} SGD steps, float32; calls: flce {calls['flce_stats']}+"
                    f"{calls['flce_grad']}, TRL {calls['trl_function']} (one process: TRL "
                    f"{want['kernels']['trl_function']})" + (f"; FAILED: {problems[:3]}" if problems else "")}


# --- report --------------------------------------------------------------------------------------------

def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _error_row(check: str, exc: BaseException, rank: int) -> dict:
    """A check's row for an exception, whose traceback goes to stderr at once: raised on one rank alone,
    it leaves the others in a collective that this rank will not join, and the run may die there."""
    print(f"dist_check: rank {rank}, {check}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return {"check": check, "status": f"error: {type(exc).__name__}: {str(exc)[:120]}"}


def _loss_row(check: str, status: str, errs, note: str, tol=None, one_device_err: float | None = None) -> dict:
    return {"check": check, "status": status, "loss_err": errs[0], "grad_input_err": errs[1],
            "grad_weight_err": errs[2], "one_device_err": one_device_err, "tol": tol, "note": note}


def report(loss_rows: list[dict], train_rows: list[dict], time_rows: list[dict], world: int,
           device: torch.device, seconds: dict) -> bool:
    """Write the result files, print the tables and the verdict; whether every check passed."""
    out_dir = Path(os.environ.get("OUT", "out"))
    meta = {**environment(device), "world": world, "backend": dist.get_backend(), "smoke": SMOKE,
            "heads": HEADS, "options_shape": OPTIONS_SHAPE, "seconds": seconds}
    tables = [
        ("vocab-parallel loss: relative errors against float64, worst rank", loss_rows, LOSS_COLUMNS),
        ("training under DDP/FSDP2 against one process: worst step loss, weight changes (bf16: all together)",
         train_rows, TRAIN_COLUMNS),
        ("step time (median of 10, forward+backward) and extra memory per rank", time_rows, TIME_COLUMNS),
    ]
    write_json(out_dir / "dist_check.json", meta, [{"part": title, **r} for title, rows, _ in tables for r in rows])
    text = ["# dist_check", "", f"{meta['device']} x {world}, torch {meta['torch']}, {meta['backend']}"
            f"{', smoke' if SMOKE else ''}; seconds per part: "
            + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()), ""]
    for title, rows, columns in tables:
        text += [f"## {title}", "", markdown_table(rows, columns)]
    (out_dir / "dist_check.md").write_text("\n".join(text))
    for title, rows, columns in tables[::-1]:
        print_table(rows, title, columns, width=None)
    bad = [r["check"] for r in loss_rows + train_rows if r["status"] != "ok"]
    speedups = ", ".join(f"{r['shape']} {r['speedup']:.2f}x" for r in time_rows if "speedup" in r)
    print(f"{'ALL OK' if not bad else f'NOT OK: {bad}'} ({len(loss_rows) + len(train_rows)} checks, "
          f"{sum(seconds.values()):.0f} s) | vocab-parallel speedup {speedups}")
    return not bad


if __name__ == "__main__":
    if "--one-process-trl" in sys.argv:
        at = sys.argv.index("--one-process-trl")
        one_process_trl(Path(sys.argv[at + 1]), int(sys.argv[at + 2]))
    else:
        main()
