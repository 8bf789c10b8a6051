"""Bad input: a clear Python error naming the problem, raised before any work is done."""

import pytest
import torch

import flce


@pytest.fixture
def args():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (6,))
    return x, w, t


CASES = {
    "hidden size": (lambda x, w, t: ((x[:, :7], w, t), {}), ValueError, "hidden size mismatch"),
    "target shape": (lambda x, w, t: ((x, w, t[:5]), {}), ValueError, "target shape"),
    "float target": (lambda x, w, t: ((x, w, t.float()), {}), TypeError, "integer class indices"),
    "bool target": (lambda x, w, t: ((x, w, t > 3), {}), TypeError, "integer class indices"),
    "devices": (lambda x, w, t: ((x, w.to("meta"), t), {}), ValueError, "one device"),
    "dtype mismatch": (lambda x, w, t: ((x, w.double(), t), {}), TypeError, "share a dtype"),
    "bias dtype": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(20, dtype=torch.float64)}),
                   TypeError, "linear_bias"),
    "bias shape": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(21)}), ValueError, "linear_bias"),
    "class weight shape": (lambda x, w, t: ((x, w, t), {"weight": torch.ones(19)}), ValueError,
                           r"weight \(class weights\) must"),
    "weight not 2-D": (lambda x, w, t: ((x, w[0], t), {}), ValueError, "2-D"),
    "integer input": (lambda x, w, t: ((t[:, None].expand(6, 8), w, t), {}), TypeError, "floating-point"),
    "reduction": (lambda x, w, t: ((x, w, t), {"reduction": "avg"}), ValueError, "reduction must be"),
    "smoothing > 1": (lambda x, w, t: ((x, w, t), {"label_smoothing": 1.5}), ValueError, "label_smoothing"),
    "smoothing < 0": (lambda x, w, t: ((x, w, t), {"label_smoothing": -0.1}), ValueError, "label_smoothing"),
    "softcap 0": (lambda x, w, t: ((x, w, t), {"softcap": 0.0}), ValueError, "softcap"),
    "softcap < 0": (lambda x, w, t: ((x, w, t), {"softcap": -3.0}), ValueError, "softcap"),
    "temperature 0": (lambda x, w, t: ((x, w, t), {"temperature": 0.0}), ValueError, "temperature"),
    "temperature < 0": (lambda x, w, t: ((x, w, t), {"temperature": -1.0}), ValueError, "temperature"),
    "z_loss < 0": (lambda x, w, t: ((x, w, t), {"z_loss": -1e-4}), ValueError, "z_loss"),
    "z_loss nan": (lambda x, w, t: ((x, w, t), {"z_loss": float("nan")}), ValueError, "z_loss"),
    "target >= V": (lambda x, w, t: ((x, w, torch.where(t == t[0], 20, t)), {}), ValueError, r"outside \[0, 20\)"),
    "target < 0": (lambda x, w, t: ((x, w, torch.where(t == t[0], -1, t)), {}), ValueError, "outside"),
    "none + num_items": (lambda x, w, t: ((x, w, t), {"reduction": "none", "num_items_in_batch": 4}),
                         ValueError, "num_items_in_batch"),
    "backend": (lambda x, w, t: ((x, w, t), {"backend": "cuda"}), ValueError, "backend must be"),
    "chunk_size": (lambda x, w, t: ((x, w, t), {"chunk_size": 0}), ValueError, "chunk_size"),
    "accum_dtype": (lambda x, w, t: ((x, w, t), {"accum_dtype": torch.int32}), TypeError, "accum_dtype"),
    "ignore_index": (lambda x, w, t: ((x, w, t), {"ignore_index": -100.0}), TypeError, "ignore_index"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_clear_error(args, case):
    build, exc, match = CASES[case]
    pos, kw = build(*args)
    with pytest.raises(exc, match=match):
        flce.linear_cross_entropy(*pos, **kw)


def test_module_rejects_bad_options_at_construction():
    with pytest.raises(ValueError, match="label_smoothing"):
        flce.LinearCrossEntropyLoss(label_smoothing=2.0)


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


@pytest.mark.parametrize("value", [[0.1], torch.tensor(0.1)])
def test_non_number_options_raise_clear_type_error(args, value):
    with pytest.raises(TypeError, match="label_smoothing must be a real number"):
        flce.linear_cross_entropy(*args, label_smoothing=value)
