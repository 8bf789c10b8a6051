"""The benchmark CLI (benchmark/bench.py) and its helpers: a CPU smoke run and the precision reference;
benchmark/dist_check.py's CPU dry run."""

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))

import common  # noqa: E402
import suite_experts  # noqa: E402
import suite_lce  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env_with_src(**extra: str) -> dict[str, str]:
    """This process's environment with src/ first on PYTHONPATH: packages found through the caller's
    PYTHONPATH (trl on a machine that carries it there) stay importable in the child."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def _bench(tmp_path: Path, *flags: str, pythonpath: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, str(ROOT / "src")) if p),
               CUDA_VISIBLE_DEVICES="")
    env.pop("OUT", None)
    # The timeout only guards against a hang (a busy 2-core machine took ~2 minutes for the CPU default).
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "bench.py"), "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "results.json").read_text())


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _first_table(stdout: str) -> list[str]:
    """The lines of the first table printed: from its title to the next note or the closing line."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("lce ("))
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(("note:", "wrote "))), len(lines))
    return lines[start:end]


def test_cli_cpu_default(tmp_path):
    proc, result = _bench(tmp_path, "--reps", "1", "--warmup", "0")
    meta, rows = result["meta"], result["rows"]
    assert meta["device_type"] == "cpu" and meta["torch"] == torch.__version__ and meta["date"]
    assert any("CPU default" in n for n in meta["notes"])  # says it is not the GPU run

    expected = set(suite_lce.CPU_METHODS)
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        expected.discard("torch-native")
    assert {r["method"] for r in rows} == expected
    assert {r["mode"] for r in rows} == {"fwd+bwd"}
    for r in rows:
        assert r["status"] == "ok", r
        for key in ("median_ms", "ms_loop", "ms_mixed", "tflops", "x_floor", "peak_mb"):
            assert _finite(r[key]) and r[key] > 0, (key, r)
        assert r["median_ms"] == max(r["ms_loop"], r["ms_mixed"])  # the worse of the two readings
        flops = 6 * r["BT"] * (1 - r["ignored"]) * r["H"] * r["V"]
        assert r["tflops"] == pytest.approx(flops / (r["median_ms"] * 1e-3) / 1e12, rel=1e-6)
        # Every method returns both gradients, alive at the peak: at least their float32 bytes.
        assert r["peak_mb"] * common.MB >= 4 * (r["BT"] * r["H"] + r["V"] * r["H"])
    assert all(r["x_floor"] == 1 for r in rows if r["method"] == "floor")

    # Memory is what flce is for: one logits buffer that becomes its gradient, where eager keeps the
    # logits, their log-softmax and its gradient (3 x 32 MiB at 1024 x 8192 in float32).
    peak = {(r["method"], r["cell"]): r["peak_mb"] for r in rows}
    logits_mb = 1024 * 8192 * 4 / common.MB
    assert peak["flce", "1024x128x8192"] < peak["eager", "1024x128x8192"] - logits_mb
    assert peak["flce", "1024x128x8192 50% ign"] < peak["flce", "1024x128x8192"]  # ignored rows are dropped

    precise = [r for r in rows if "grad_w_err" in r]
    assert {r["method"] for r in precise} == expected - {"floor"}
    for r in precise:  # fp32 methods: far below bf16 rounding, yet not exactly the float64 result
        assert 0 < r["grad_w_err"] < 1e-4 and _finite(r["x_rounding"]) and r["x_rounding"] > 0
    halves = [r for r in rows if r["ignored"] == 0.5]
    assert {r["method"] for r in halves} == expected
    assert all(_finite(r["x_all_valid"]) and r["x_all_valid"] > 0 for r in halves)

    table = _first_table(proc.stdout)
    assert max(len(line) for line in table) <= common.TABLE_WIDTH
    for header in ("method", "shape", "ms", "x floor", "peak MB", "grad err"):
        assert header in table[2] or header in table[1], header
    assert all(any(m in line for line in table) for m in expected)
    assert "| flce |" in (tmp_path / "results.md").read_text()
    plots = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in plots] == ["lce_cpu_fwdbwd.png"] and plots[0].read_bytes()[:8] == PNG_MAGIC


def test_cli_reports_missing_suite_and_filters(tmp_path):
    _, result = _bench(tmp_path, "--suite", "lce,nosuchsuite", "--shapes", "48x32x300", "--methods",
                       "flce,floor,liger,quack", "--modes", "fwd", "--reps", "1", "--warmup", "0", "--no-plots")
    notes = result["meta"]["notes"]
    assert all("\n" not in n for n in notes)  # one line each
    joined = "\n".join(notes)
    assert "suite nosuchsuite skipped" in joined and "liger skipped" in joined and "quack skipped" in joined
    assert [(r["method"], r["mode"], r["shape"]) for r in result["rows"]] == [
        ("flce", "fwd", "48x32x300"), ("floor", "fwd", "48x32x300")]
    assert not list(tmp_path.glob("*.png"))


def test_a_peer_whose_call_cannot_import_is_skipped_with_the_reason(monkeypatch):
    """TRL's kernel imports trl.trainer.utils (and TRL's dependencies) when called: where that import fails the
    peer is skipped with the import's error, not timed into an error row."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # importing it now raises ImportError
    why = suite_lce.UNAVAILABLE["trl"](torch.device("cpu"))
    assert why is not None and why.startswith("cannot import trl.trainer.utils: ")
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", types.ModuleType("trl.trainer.utils"))  # importable
    assert suite_lce.UNAVAILABLE["trl"](torch.device("cpu")) is None


def test_cli_without_rich_and_matplotlib(tmp_path):
    """Optional packages cost only their part: plain tables, no plots, a one-line note each."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("rich", "matplotlib"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} blocked for this test')\n")
    out = tmp_path / "out"
    proc, result = _bench(out, "--shapes", "48x32x300,64x32x400", "--methods", "flce,eager,floor", "--modes",
                          "fwd+bwd", "--reps", "1", "--warmup", "0", "--time-limit", "0.000001",
                          pythonpath=str(blocked))
    notes = result["meta"]["notes"]
    assert any("matplotlib is not installed" in n for n in notes) and any("rich is not installed" in n for n in notes)
    assert any("stopped at the time limit" in n and "64x32x400" in n for n in notes)  # the first cell always runs
    assert {r["shape"] for r in result["rows"]} == {"48x32x300"}
    assert not list(out.glob("*.png")) and "| flce |" in (out / "results.md").read_text()
    table = _first_table(proc.stdout)
    assert "┏" not in proc.stdout and max(len(line) for line in table) <= common.TABLE_WIDTH
    assert table[1].split() == ["method", "shape", "ms", "x", "floor", "peak", "MB"]


def test_results_are_written_before_the_plots(tmp_path, monkeypatch):
    """A figure that fails (or a matplotlib that crashes) costs the figure, not the numbers."""
    import bench

    seen = {}

    def plot(rows, out_dir):
        seen["rows"] = json.loads((out_dir / "results.json").read_text())["rows"]
        seen["md"] = (out_dir / "results.md").read_text()
        raise RuntimeError("figure failed")

    monkeypatch.setattr(suite_lce, "plot", plot)
    monkeypatch.setattr(common, "has_module", lambda name: True)
    monkeypatch.setattr(bench, "has_module", lambda name: True)
    code = bench.main(["--out", str(tmp_path), "--device", "cpu", "--shapes", "40x16x200", "--methods", "flce,floor",
                       "--modes", "fwd", "--reps", "1", "--warmup", "0"])
    assert code == 0 and len(seen["rows"]) == 2 and "| flce |" in seen["md"]
    assert any("plots of lce failed: RuntimeError" in n
               for n in json.loads((tmp_path / "results.json").read_text())["meta"]["notes"])


def test_running_loop_ms_reads_the_loop_and_the_host_inside_each_call():
    """running_loop_ms: wall time per call of a back-to-back loop and the median host time inside a call."""
    import time

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    wall, inside = common.running_loop_ms(fn, torch.device("cpu"), steps=5, warmup=2)
    assert len(calls) == 7
    assert 2.0 <= inside < 20.0 and 2.0 <= wall < 20.0


def test_with_setting_sets_attributes_before_the_script_runs(tmp_path):
    """probes/with_setting.py: the A/B wrapper sets each module attribute, then runs the script with its own argv."""
    script = tmp_path / "show.py"
    script.write_text("import sys\nimport flce.function as f\nfrom flce.kernels import logits_triton as m\n"
                      "print(m.MIN_ROWS, f._thin_dtypes('cuda'), sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "probes" / "with_setting.py"),
                           "flce.kernels.logits_triton.MIN_ROWS=16", "flce.function._thin_dtypes=lambda device: ()",
                           "--", str(script), "--flag"], capture_output=True, text=True, env=_env_with_src(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["16", "()", "['--flag']"]


def test_profile_kernels_skips_peers_that_cannot_run(capsys):
    """profile_kernels.py --peers: a peer that is missing or needs CUDA, or a name suite_lce lacks, is named with why."""
    import profile_kernels

    x, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    for name in ("cce", "nosuch"):
        profile_kernels._run_peer(name, x, w, t, steps=1)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cce: skipped (") and ("not installed" in out[0] or "needs CUDA" in out[0])
    assert out[1] == "nosuch: skipped (not a peer of suite_lce)"


def test_bad_sweep_and_method_names_raise():
    args = types.SimpleNamespace(device=torch.device("cpu"), quick=False, sweep="nosuch", shapes=None,
                                 dtype=None, modes=None, methods="flce")
    with pytest.raises(ValueError, match="unknown lce sweep"):
        suite_lce._cells(args)
    args.methods = "flce,nosuch"
    with pytest.raises(ValueError, match="unknown lce method"):
        suite_lce._methods(args, [])
    args.sweep, args.dtype = None, "bf17"
    with pytest.raises(ValueError, match="unknown dtype"):
        suite_lce._cells(args)
    args.dtype, args.shapes = None, "64x32"
    with pytest.raises(ValueError, match="BTxHxV"):
        suite_lce._cells(args)


def test_heads_sweep_names_each_cell_by_its_model():
    args = types.SimpleNamespace(device=torch.device("cuda"), quick=True, sweep="heads", shapes=None, dtype=None,
                                 modes=None)
    cells = suite_lce._cells(args)
    assert [(c.hidden, c.vocab) for c in cells] == [suite_lce.MODEL_HEADS[n] for n in suite_lce.QUICK_HEADS]
    assert all(c.bt == 8192 and c.modes == ("fwd+bwd",) for c in cells)
    assert suite_lce._cell_label(cells[0]) == "8192x1024x151936 Qwen3-0.6B"
    args.quick = False
    assert len(suite_lce._cells(args)) == len(suite_lce.MODEL_HEADS)


def test_experts_custom_cells_default_to_mixtral_routing():
    args = types.SimpleNamespace(device=torch.device("cpu"), quick=False, shapes="64x32x48,64x32x48x4,64x32x48x4x1")
    assert [(c.tokens, c.hidden, c.inter, c.experts, c.top_k) for c in suite_experts.cells(args)] == [
        (64, 32, 48, 8, 2), (64, 32, 48, 4, 2), (64, 32, 48, 4, 1)]
    args.shapes = "64x32"
    with pytest.raises(ValueError, match="TxHxI"):
        suite_experts.cells(args)


@pytest.mark.parametrize("ignored", [0.0, 0.4])
def test_reference_grad_weight_matches_autograd(ignored):
    cell = suite_lce.Cell("t", 37, 16, 53, ignored=ignored, dtype=torch.float32)
    x, w, t = suite_lce._make_inputs(cell, torch.device("cpu"))
    assert (t == -100).sum() == round(ignored * 37)
    w64 = w.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(x.detach().double() @ w64.t(), t).backward()
    got = suite_lce.reference_grad_weight(x, w, t, budget=8 * 53 * 5)  # 5 rows per chunk: 8 chunks
    assert suite_lce.relative_error(got, w64.grad) < 1e-12


def test_measure_turns_errors_into_status():
    args = types.SimpleNamespace(device=torch.device("cpu"), warmup=0, reps=1)

    def oom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken():
        raise ValueError("bad shape")

    assert common.measure(oom, args, 1.0)["status"] == "OOM"
    assert common.measure(broken, args, 1.0)["status"].startswith("error: ValueError: bad shape")
    ok = common.measure(lambda: torch.ones(8).sum(), args, 1e6)
    assert ok["status"] == "ok" and ok["median_ms"] > 0 and ok["peak_mb"] >= 32 / common.MB  # ones(8): 32 bytes


def test_cpu_peak_memory_follows_allocations_in_time_order():
    """The peak is the most held at once: not the sum of everything allocated, not what is left at the end."""
    def step():
        a = torch.empty(10**6)  # 4 MB
        b = torch.empty(5 * 10**5)  # 2 MB: 6 MB held
        del a
        torch.empty(25 * 10**4)  # 1 MB, freed at once: 3 MB held
        return b  # alive at the end

    assert common.cpu_peak_extra_bytes(step) == 6 * 10**6
    assert common.cpu_peak_extra_bytes(lambda: torch.empty(10**6)) == 4 * 10**6
    assert common.cpu_peak_extra_bytes(lambda: None) == 0

    def temporary_inside_one_op():
        return torch.ones(1000, 1000).sum()  # the 4 MB ones live only inside this line

    assert common.cpu_peak_extra_bytes(temporary_inside_one_op) >= 4 * 10**6


def test_measure_steps_takes_both_readings_with_fresh_inputs():
    """Each timed call gets its own make_call() (fresh inputs); the reported time is the worse reading;
    a method failing in the mixed rounds alone is reported, the others still measured."""
    args = types.SimpleNamespace(device=torch.device("cpu"), warmup=1, reps=3)
    made = {"a": 0, "b": 0, "c": 0}
    calls = {"c": 0}

    def maker(name):
        def make():
            made[name] += 1
            if name == "c":
                calls["c"] += 1
                if calls["c"] > 6:  # first call, memory, 1 + 3 loop calls pass; the mixed rounds fail
                    return lambda: 1 / 0
            return lambda: torch.ones(1000).sum()
        return make

    out = common.measure_steps({n: maker(n) for n in made}, args, 1e6, timings=("loop", "mixed"))
    for name in ("a", "b"):
        r = out[name]
        assert r["status"] == "ok" and made[name] == 2 + (1 + 3) + (1 + 3)
        assert r["median_ms"] == max(r["ms_loop"], r["ms_mixed"]) > 0 and r["peak_mb"] > 0
    assert out["c"]["status"].startswith("error: ZeroDivisionError") and math.isnan(out["c"]["median_ms"])


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_neighbour_cycle_has_every_ordered_pair_once(k):
    names = [f"m{i}" for i in range(k)]
    walk = common.neighbour_cycle(names, common.random.Random(k))
    assert len(walk) == k * k + 1 and walk[0] == walk[-1] == names[0]
    pairs = list(zip(walk, walk[1:]))
    assert sorted(pairs) == sorted((a, b) for a in names for b in names)


def test_mixed_reading_gives_every_method_the_same_neighbours():
    """Each timed call's predecessor: every method (itself included) equally often, for every method."""
    trace = []

    def maker(name):
        return lambda: (lambda: trace.append(name))
    names = ["flce", "floor", "eager", "compile"]
    times = common.mixed_times({n: maker(n) for n in names}, 8, torch.device("cpu"), lambda *a: None)
    assert all(len(v) == 8 for v in times.values())
    timed = list(zip(trace[len(names) - 1:], trace[len(names):]))  # (predecessor, method) of each timed call
    for name in names:
        before = [p for p, m in timed if m == name]
        assert sorted(before) == sorted(names * 2)


def test_compact_table_fits_100_columns(monkeypatch):
    rows = []
    for method in suite_lce.METHODS:
        for mode in ("fwd", "fwd+bwd"):
            rows.append(dict(method=method, mode=mode, dtype="bfloat16", shape="32768x4096x256000",
                             cell="32768x4096x256000 50% ign",
                             median_ms=123456.7, x_floor=12.3456, peak_mb=51234.5, grad_w_err=1.234e-05,
                             status="ok" if method != "cce" else "error: RuntimeError: something long " * 5))
    cols = suite_lce.compact_columns(rows)
    assert [h for _, h in cols] == ["method", "mode", "shape", "ms", "x floor", "peak MB", "grad err"]
    for rich in (True, False):
        monkeypatch.setattr(common, "has_module", lambda name, rich=rich: rich)
        text = common.table_text(rows, suite_lce.title(rows), cols)
        assert max(map(len, text.splitlines())) <= common.TABLE_WIDTH
        assert "32768x4096x256000 50% ign" in text and "flce-unchecked" in text and "1.23e-05" in text
        assert ("┏" in text) == rich


def test_json_has_no_nan(tmp_path):
    path = common.write_json(tmp_path / "r.json", {"x": float("nan")}, [{"a": float("inf"), "b": 1.5}])
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "meta": {"x": None}, "rows": [{"a": None, "b": 1.5}]}


@pytest.mark.gpu
@pytest.mark.parametrize("bt,hidden,vocab", [(32768, 1024, 32000), (16384, 2048, 65536)])
def test_flce_grad_weight_precision_bf16(bt, hidden, vocab):
    """The precision target (benchmark/NOTES.md): default flce's grad_weight error <= 1.25x the bf16
    rounding of the exact gradient."""
    import flce

    cell = suite_lce.Cell("precision", bt, hidden, vocab)
    x, w, t = suite_lce._make_inputs(cell, torch.device("cuda"))
    ref = suite_lce.reference_grad_weight(x, w, t)
    rounding = suite_lce.relative_error(ref.to(torch.bfloat16), ref)
    _, grad_w = torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w))
    assert suite_lce.relative_error(grad_w, ref) <= 1.25 * rounding


@pytest.mark.gpu
def test_cli_gpu_takes_both_readings(tmp_path):
    """On a GPU: every method gets a loop and a mixed reading (CUDA events), the table the worse."""
    env = _env_with_src()
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "bench.py"), "--out", str(tmp_path), "--shapes",
                           "1024x512x8192", "--methods", "flce,eager,trl,quack,floor", "--modes", "fwd+bwd",
                           "--reps", "3", "--no-plots"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {"flce", "eager", "floor"} <= {r["method"] for r in rows}
    for r in rows:
        assert r["status"] == "ok", r
        assert _finite(r["ms_loop"]) and _finite(r["ms_mixed"]) and r["median_ms"] == max(r["ms_loop"], r["ms_mixed"])
        assert _finite(r["peak_mb"]) and r["peak_mb"] > 0


# What a dying rank prints first: a Python traceback, a C++ exception that ends in std::terminate (a gloo
# transport thread), or faulthandler's stacks on a fatal signal.
RANK_FAILURE_MARKS = ("Traceback", "terminate called", "Fatal Python error")


def _rank_failure(log: str, lines: int = 80) -> str:
    """The first failure a rank printed in a torchrun log (the root cause; torchrun's own traceback and
    summary come last), else the log's end."""
    starts = [i for i in (log.find(mark) for mark in RANK_FAILURE_MARKS) if i >= 0]
    return "\n".join(log[min(starts):].splitlines()[:lines]) if starts else log[-3000:]


def test_dist_check_smoke_on_two_cpu_ranks(tmp_path):
    """benchmark/dist_check.py --smoke (two gloo ranks through torchrun): every part runs and passes."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    # faulthandler: a rank killed by a signal prints its Python stacks.
    env = _env_with_src(OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    # --standalone: a free rendezvous port, so parallel test workers never meet on torchrun's default.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "benchmark" / "dist_check.py"), "--smoke"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, _rank_failure(proc.stdout + proc.stderr) + "\n...\n" + proc.stdout[-600:]
    rows = json.loads((tmp_path / "dist_check.json").read_text())["rows"]
    checks = [r["check"] for r in rows if "status" in r]
    assert all(r["status"] == "ok" for r in rows if "status" in r), [r for r in rows if r.get("status") != "ok"]
    for part in ("head", "options: all, none", "llama: fsdp2", "mixtral: fsdp2", "mixtral: ddp", "trl sft"):
        assert any(c.startswith(part) for c in checks), part
    assert proc.stdout.rstrip().splitlines()[-1].startswith("ALL OK")
    assert (tmp_path / "dist_check.md").read_text().startswith("# dist_check")


def _training_result(errs: dict, base: dict | None = None) -> list[dict]:
    """One rank's result of test_distributed.patched_training_case, as dist_check gathers it."""
    return [{"errs": errs, "baseline_errs": base or {}, "fused": True, "flce_experts": False, "sharded": False}]


def test_dist_check_training_verdicts():
    """dist_check's training rows: in bf16, the losses and all weights' changes together against the unpatched
    model's errors (one weight far off alone, a routing flip, passes); in float64 every weight at 1e-6."""
    import dist_check

    all_w = dist_check.cases.ALL_WEIGHTS
    base = {"loss, step 1": 1e-2, "experts": 7.5e-3, "head": 4e-3, all_w: 4.5e-3}

    def verdict(bf16: bool, **errs: float) -> str:
        row = dist_check._training_row("case", _training_result({**base, **errs}, base if bf16 else None), "ddp",
                                       False, bf16)
        return row["status"]

    assert verdict(True, experts=5.8e-2) == "ok"  # one expert 7.7x the unpatched model's, all weights alike
    assert verdict(True, **{all_w: 1.6 * base[all_w]}) == "FAIL"
    assert verdict(True, **{"loss, step 1": 6e-2}) == "FAIL"  # above 5e-2 and 1.5x the unpatched loss error
    assert verdict(True, **{"loss, step 1": 4e-2}) == "ok"
    assert verdict(False, **{"loss, step 1": 1e-7, "experts": 1e-7, "head": 2e-6, all_w: 1e-7}) == "FAIL"
    assert verdict(False, **{"loss, step 1": 1e-7, "experts": 1e-7, "head": 1e-7, all_w: 1e-7}) == "ok"
