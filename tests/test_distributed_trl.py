"""TRL's SFT trainer on FSDP2 (accelerate, two gloo ranks) with flce patched in, against the same training
in one process without flce: the same per-step losses and weights, flce's kernels counted on every rank and
TRL's never."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install flce[test])")
pytest.importorskip("datasets", reason="datasets is not installed (a TRL dependency)")

from hf_tiny import tiny_model  # noqa: E402
from reference import rel_err  # noqa: E402
from test_distributed import Cluster, fresh_accelerate_state, fsdp_on_cpu  # noqa: E402
from test_patches_trl import counting_kernels, train  # noqa: E402

import flce  # noqa: E402
from flce.patches import trl as flce_trl  # noqa: E402

BATCH = 2  # per rank; the one-process run takes world x BATCH rows a step, the same rows
# test_patches_trl's SGD without clipping, float32 throughout (SFTConfig's default bf16 would be autocast in one
# process and bf16 parameters under FSDP2).
SFT_ARGS = dict(bf16=False, tf32=False)
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4  # float32; TRL's kernel and flce's round differently


def sft_run(out_dir, device: torch.device, *, world: int, fsdp: bool) -> dict:
    """A tiny TRL SFT training: flce patched in and FSDP2 over ``world`` ranks (``fsdp``), or unpatched in
    one process on world x BATCH rows a step. Per-step losses, each parameter's change (full tensors, on
    the CPU), kernel counts, and whether the head was sharded."""
    torch.manual_seed(0)  # the same initial weights in every process
    model = tiny_model("llama")
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = dict(SFT_ARGS, use_cpu=device.type == "cpu", per_device_train_batch_size=BATCH * (1 if fsdp else world))
    if fsdp:
        args.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    flce_trl.unroute_trl()
    try:
        with fresh_accelerate_state(), fsdp_on_cpu(), counting_kernels() as take:
            losses = train("sft_completion", model, Path(out_dir), "before" if fsdp else None, **args)
            kernels = take()
    finally:
        flce.remove_flce_patch(model)
        flce_trl.unroute_trl()
    params = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
    return {"losses": losses.tolist(), "kernels": kernels,
            "sharded": type(model.lm_head.weight).__name__ == "DTensor",
            "updates": {name: (p.detach().cpu() - start[name]) for name, p in params.items()}}


def sft_fsdp2_case(rank, world, *, out_dir, device=torch.device("cpu")):
    """A rank of the FSDP2 run (also run on GPUs by benchmark/dist_check.py)."""
    return sft_run(Path(out_dir) / f"rank{rank}", device, world=world, fsdp=True)


def sft_errors(got: dict, want: dict) -> dict[str, float]:
    """Relative errors of each step's loss and of each parameter's change, FSDP2 run against one process."""
    errs = {f"loss, step {i + 1}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(got["losses"], want["losses"]))}
    assert len(got["losses"]) == len(want["losses"]) and got["updates"].keys() == want["updates"].keys()
    errs.update({name: rel_err(u, want["updates"][name]) for name, u in got["updates"].items()})
    return errs


def sft_problems(ranks: list[dict], want: dict) -> list[str]:
    """What is wrong with the FSDP2 run: ``ranks`` holds each rank's {"errs": sft_errors(...),
    "kernels", "sharded"}; flce's kernels must have run on every rank and TRL's never (the one-process
    run: the other way round), the head must be sharded, and the errors within tolerance."""
    seen = want["kernels"]
    problems = [] if seen["trl_function"] and not (seen["flce_stats"] or seen["flce_grad"]) else \
        [f"one process: kernel calls {seen}"]
    for rank, res in enumerate(ranks):
        seen = res["kernels"]
        if not (seen["flce_stats"] and seen["flce_grad"]) or seen["trl_function"]:
            problems.append(f"rank {rank}: kernel calls {seen}")
        if not res["sharded"]:
            problems.append(f"rank {rank}: the head is not sharded by FSDP2")
        problems += [f"rank {rank}: {what} relative error {err:.3g}" for what, err in res["errs"].items()
                     if err > (LOSS_TOL if what.startswith("loss") else UPDATE_TOL)]
    return problems


@pytest.fixture(scope="module")
def cluster2():
    c = Cluster(2)
    yield c
    c.close()


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="with CUDA present accelerate's barriers take one "
                    "device per rank, and this machine has one GPU; benchmark/dist_check.py runs this case over NCCL")
def test_trl_sft_on_fsdp2_with_flce_matches_one_process(cluster2, tmp_path):
    want = sft_run(tmp_path / "one", torch.device("cpu"), world=cluster2.world, fsdp=False)
    results = cluster2.run(sft_fsdp2_case, out_dir=str(tmp_path / "fsdp2"))
    ranks = [{"errs": sft_errors(got, want), "kernels": got["kernels"], "sharded": got["sharded"]}
             for got in results]
    problems = sft_problems(ranks, want)
    assert not problems, problems
