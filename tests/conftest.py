"""Shared fixtures. Without CUDA the Triton kernels run under the interpreter (set before any import)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

from flce.kernels import triton_available  # noqa: E402

# Fuzzing budgets: "default" keeps the whole suite within minutes on two CPU cores (Triton under the
# interpreter) and draws the same examples on every run (a CI failure is reproducible, never flaky);
# HYPOTHESIS_PROFILE=thorough draws new ones, many more. No deadline: the interpreter is slow.
for _name, _examples, _fixed in (("default", 30, True), ("thorough", 500, False)):
    settings.register_profile(_name, max_examples=_examples, deadline=None, derandomize=_fixed,
                              suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

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


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
