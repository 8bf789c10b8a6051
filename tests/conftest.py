"""Shared fixtures. Without CUDA the Triton kernels run under the interpreter (set before any import)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flce.kernels import triton_available  # noqa: E402

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
