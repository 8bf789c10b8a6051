"""Shared fixtures. Without CUDA the Triton kernels run under the interpreter (set before any import)."""

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

from flce.kernels import nvidia_major, triton_available  # noqa: E402

# Fuzzing budgets: "default" keeps the whole suite within minutes on two CPU cores (Triton under the
# interpreter) and draws the same examples on every run (a CI failure is reproducible, never flaky);
# HYPOTHESIS_PROFILE=thorough draws new ones, many more. No deadline: the interpreter is slow.
for _name, _examples, _fixed in (("default", 30, True), ("thorough", 500, False)):
    settings.register_profile(_name, max_examples=_examples, deadline=None, derandomize=_fixed,
                              suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
# The GPU fuzz (the ``test_gpu_random_*`` cases): GPU-sized shapes, which reach the paths a CPU never runs.
GPU_FUZZ_EXAMPLES = int(os.environ.get("FLCE_GPU_FUZZ_EXAMPLES", "40"))

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", "triton"] if triton_available(DEVICE) else ["torch"]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


# The library's own gate (a ROCm build reports its gfx version as a capability).
ON_HOPPER = torch.cuda.is_available() and nvidia_major(torch.device("cuda")) >= 9
# The dtype the Hopper GEMM's tests run in: bf16 on Hopper, float16 under the interpreter (which reads bf16
# through tensor descriptors wrongly).
HOPPER_DTYPE = torch.bfloat16 if ON_HOPPER else torch.float16


@pytest.fixture(params=[False, True], ids=["logits16", "logits32"])
def wide_logits(request, monkeypatch):
    """Whether small single chunks keep their logits in float32 (``function.wide_logits``): CUDA's default, which
    the CPU reaches here through the GEMMs' upcast fallback; else in 16 bits, the CPU's default."""
    import flce.function

    monkeypatch.setattr(flce.function, "supports_out_dtype", lambda device, batched=False: request.param)
    return request.param


@pytest.fixture
def hopper_gemm(monkeypatch):
    """Let flce's Hopper GEMM (``kernels.logits_triton``) take small shapes: on the CPU under the
    interpreter with small tiles, on a Hopper GPU with its own. Returns the module."""
    if not triton_available(DEVICE):
        pytest.skip("triton cannot run here")
    lt = pytest.importorskip("flce.kernels.logits_triton")
    monkeypatch.setattr(lt, "ALLOW_INTERPRETER", True)
    monkeypatch.setattr(lt, "MIN_ROWS", 8)
    if not ON_HOPPER:
        monkeypatch.setattr(lt, "TILE", lt.TileConfig(32, 64, 16, 2, 4, 4))
    return lt


@pytest.fixture
def hopper_gemm_calls(hopper_gemm, monkeypatch):
    """``hopper_gemm``, its launches (``logits_with_tile_stats``) counted into the returned list."""
    calls, real = [], hopper_gemm.logits_with_tile_stats
    monkeypatch.setattr(hopper_gemm, "logits_with_tile_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.fixture
def loss_only_runs(hopper_gemm, monkeypatch):
    """The rows of every call that takes the statistics-only path (``loss_only.run``), on small shapes."""
    from flce import loss_only

    rows, run = [], loss_only.run
    monkeypatch.setattr(loss_only, "run", lambda *a, **k: rows.append(a[0].shape[0]) or run(*a, **k))
    return rows


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _release_gpu_cache():
    """Each test hands its cached GPU memory back: workers sharing one card (pytest -n) would otherwise
    hold tens of GB each and starve the Mixtral-size experts cases."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def capture_graph(step, before_capture=None):
    """Warm ``step`` up twice on a side stream (as torch.cuda.graphs asks), run ``before_capture`` if
    given, then capture one call of ``step``. Returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


@pytest.fixture
def small_products(monkeypatch):
    """Float32 product pieces of any width on these small shapes (``planner.product_cols``)."""
    from flce import planner

    monkeypatch.setattr(planner, "MIN_PRODUCT_ELEMENTS", 0)
    monkeypatch.setattr(planner, "PRODUCT_ALIGN", 8)


# The exp-logits path's window in float16 under the interpreter: exp(8) * V stays far below float16's 65504,
# exp(-lse) / rows above its normals.
FP16_WINDOW = (-4.0, 8.0)


@pytest.fixture
def path(monkeypatch, small_products, hopper_gemm):
    """Let the path run on small shapes (and under the interpreter in float16); record the calls that
    take it and those that fall back in backward."""
    import flce.function
    from flce import exp_logits

    monkeypatch.setattr(exp_logits, "MIN_ROWS", 8)
    monkeypatch.setattr(exp_logits, "WINDOWS", {**exp_logits.WINDOWS, torch.float16: FP16_WINDOW})
    monkeypatch.setattr(exp_logits, "_cool_down", {})
    seen = SimpleNamespace(taken=[], fell_back=[], pending=[], chunks=[])
    forward, standard, chunk = exp_logits.forward_chunk, flce.function.redo_standard, exp_logits.grads_chunk

    def counted_forward(*a, **k):
        seen.taken.append(1)
        seen.pending.append(forward(*a, **k))
        return seen.pending[-1]
    monkeypatch.setattr(exp_logits, "forward_chunk", counted_forward)
    monkeypatch.setattr(flce.function, "redo_standard",
                        lambda *a, **k: seen.fell_back.append(1) or standard(*a, **k))
    monkeypatch.setattr(exp_logits, "grads_chunk", lambda *a, **k: seen.chunks.append(a[0].shape[0]) or chunk(*a, **k))
    return seen
