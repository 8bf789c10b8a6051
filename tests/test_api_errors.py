"""Bad targets: raised before any work (large batches) or by backward at the latest (small ones), or
NaN rows when unchecked. Every other argument edge: test_argument_edges.py."""

import pytest
import torch
from test_argument_edges import core_args

import flce


@pytest.fixture
def args():
    return core_args()


def test_unchecked_targets_skip_the_check(args):
    """validate_target=False trusts the targets (sync-free); a valid call gives the checked result."""
    x, w, t = args
    a = flce.linear_cross_entropy(x, w, t)
    b = flce.linear_cross_entropy(x, w, t, validate_target=False)
    assert torch.allclose(a, b)


def test_triton_on_cpu_without_interpreter(monkeypatch, args):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flce.linear_cross_entropy(*args, backend="triton")


@pytest.mark.parametrize("n", [6, 2000])  # asynchronous check below COMPACT_MIN_ROWS, early sync above
def test_bad_targets_raise_for_small_and_large_batches(n):
    x = torch.randn(n, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (n,))
    t[n // 2] = 25
    with pytest.raises(ValueError, match=r"1 value\(s\) outside \[0, 20\).*first: 25"):
        flce.linear_cross_entropy(x, w, t)
    assert x.grad is None and w.grad is None


def test_small_batch_check_still_running_raises_in_backward(monkeypatch):
    """On the GPU the small-batch check may still be in flight when forward returns: then the loss is
    NaN (never a plausible number) and backward raises before any gradient reaches .grad."""
    monkeypatch.setattr(flce.api._TargetCheck, "done", lambda self: False)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (6,))
    t[3] = -7
    loss = flce.linear_cross_entropy(x, w, t)
    assert loss.isnan()
    with pytest.raises(ValueError, match=r"outside \[0, 20\).*first: -7"):
        loss.backward()
    assert x.grad is None and w.grad is None


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy NaN arithmetic
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_unchecked_bad_target_poisons_its_row(backend, device, reduction):
    """validate_target=False trusts the targets, but one outside [0, V) gives NaN, not a wrong number."""
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    t = torch.randint(0, 20, (6,), device=device)
    t[2] = 20
    loss = flce.linear_cross_entropy(x, w, t, validate_target=False, backend=backend, reduction=reduction)
    assert torch.equal(loss.isnan(), t == 20 if reduction == "none" else loss.new_ones((), dtype=torch.bool))
    loss.sum().backward()
    assert x.grad[2].isnan().all() and not x.grad[t != 20].isnan().any()
