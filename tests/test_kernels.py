"""The Triton CE kernel against its torch twin on the per-chunk contract (loss, lse, argmax, gradients)."""

import pytest
import torch

from flce.kernels import ce_chunk, resolve_backend, triton_available
from flce.options import LossOptions

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                reason="triton cannot run here")


def run(backend, logits, target, opts, class_weight=None, grad_scale=None, stats=True):
    n = logits.shape[0]
    buf = logits.clone()
    loss, lse = torch.full((n,), float("nan"), device=logits.device), torch.full((n,), float("nan"), device=logits.device)
    correct = torch.full((n,), float("nan"), device=logits.device) if stats else None
    weight_sum = class_weight.sum() if class_weight is not None else None
    ce_chunk(backend, buf, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts)
    return buf, loss, lse, correct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [
    LossOptions(),
    LossOptions(label_smoothing=0.1, z_loss=1e-2),
    LossOptions(softcap=2.5, temperature=0.8, ignore_index=3),
])
@pytest.mark.parametrize("vocab", [1, 37, 5000])
def test_triton_matches_torch_twin(device, dtype, opts, vocab):
    n = 9
    logits = (torch.randn(n, vocab, device=device) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,), device=device)
    target[1] = opts.ignore_index
    cw = torch.rand(vocab, device=device) + 0.5
    scale = torch.rand(n, device=device) + 0.5  # per-row grad_output (reduction="none" backward)
    for class_weight in (None, cw):
        got = run("triton", logits, target, opts, class_weight, scale)
        want = run("torch", logits, target, opts, class_weight, scale)
        names = ("grad", "loss", "lse", "correct")
        for name, g, w in zip(names, got, want):
            tol = 2e-2 if (name == "grad" and dtype == torch.bfloat16) else 1e-5
            assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol * 1e-2 if name == "grad" else 1e-5), name
        assert torch.all(got[0][1] == 0)  # ignored row: exact zeros


def test_loss_only_leaves_logits_untouched(device):
    logits = torch.randn(4, 100, device=device)
    target = torch.randint(0, 100, (4,), device=device)
    buf, loss, _, _ = run("triton", logits, target, LossOptions(), stats=False)
    assert torch.equal(buf, logits) and torch.isfinite(loss).all()


def test_auto_backend(device):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", device)


@pytest.mark.parametrize("n", [1, 7, 5000])  # 5000: more than one block of the Triton kernel
def test_count_targets_backends_agree_with_a_python_count(backend, device, n):
    from flce.kernels.targets import count_targets

    t = torch.randint(-3, 23, (n,), device=device)
    t[torch.rand(n, device=device) < 0.3] = -100
    counts, scale = count_targets(t, -100, 20, backend)
    values = t.tolist()
    valid = sum(v != -100 for v in values)
    bad = sum(v != -100 and not 0 <= v < 20 for v in values)
    assert counts.tolist() == [valid, bad]
    assert scale.item() == pytest.approx(1.0 / max(valid, 1))


@pytest.mark.parametrize("g", [1.0, 0.37])
@pytest.mark.parametrize("torch_below", [0, 1 << 20])  # 0: the Triton kernel even for this small tensor
def test_scale_into_in_place_out_of_place_and_cast(backend, device, g, torch_below, monkeypatch):
    import flce.kernels.scale
    from flce.kernels.scale import scale_into

    monkeypatch.setattr(flce.kernels.scale, "TORCH_BELOW", torch_below)
    scale = torch.tensor(g, device=device)
    src = torch.randn(3, 5001, device=device)  # more than one block of the Triton kernel
    want = src.double() * g

    same = src.clone()
    assert scale_into(same, scale, torch.float32, backend) is same  # in place (g == 1 reads nothing)
    assert torch.allclose(same.double(), want, rtol=1e-6, atol=0)
    out = torch.full_like(src, float("nan"))
    assert scale_into(src, scale, torch.float32, backend, out=out) is out
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=0) and torch.equal(src.double() * g, want)
    cast = scale_into(src, scale, torch.bfloat16, backend)
    # Within one bf16 step (the interpreter's cast truncates where CUDA rounds to nearest).
    assert cast.dtype == torch.bfloat16 and torch.allclose(cast.double(), want, rtol=2**-7, atol=0)
    strided = src.t()  # not contiguous: the torch path
    assert torch.allclose(scale_into(strided, scale, torch.float32, backend, out=torch.empty_like(strided)).double(),
                          want.t(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [1, 9, 150])  # 150: more rows than programs, so programs take several
@pytest.mark.parametrize("opts", [LossOptions(), LossOptions(label_smoothing=0.1, z_loss=1e-2, softcap=3.0)])
def test_kernel_finishes_the_mean(backend, device, n, opts):
    """With counts, the kernel counts the targets, writes the mean's scale and the mean, and leaves the
    gradient unscaled: the same numbers as the plain kernel with the scale given, divided back out."""
    vocab = 300
    logits = torch.randn(n, vocab, device=device) * 3
    target = torch.randint(0, vocab, (n,), device=device)
    target[torch.rand(n, device=device) < 0.3] = opts.ignore_index
    valid = int((target != opts.ignore_index).sum())
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    scale, total = torch.full((), float("nan"), device=device), torch.full((), float("nan"), device=device)
    buf, loss, lse = logits.clone(), torch.empty(n, device=device), torch.empty(n, device=device)
    ce_chunk(backend, buf, target, loss, lse, None, None, None, scale, opts, counts, total)

    assert counts[:2].tolist() == [valid, 0]
    assert scale.item() == pytest.approx(1.0 / max(valid, 1), rel=1e-6)
    want_grad, want_loss, _, _ = run("torch", logits, target, opts, grad_scale=torch.ones((), device=device))
    assert torch.allclose(buf, want_grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert total.item() == pytest.approx(want_loss.double().sum().item() / max(valid, 1), rel=1e-5, abs=1e-7)


def test_kernel_finishes_the_mean_of_all_ignored_and_bad_targets(backend, device):
    opts = LossOptions()
    logits = torch.randn(70, 50, device=device)

    def finish(target):
        counts = torch.zeros(3, dtype=torch.int64, device=device)
        scale, total = torch.empty((), device=device), torch.empty((), device=device)
        buf = logits.clone()
        ce_chunk(backend, buf, target, torch.empty(70, device=device), torch.empty(70, device=device), None, None,
                 None, scale, opts, counts, total)
        return counts[:2].tolist(), scale.item(), total.item(), buf

    counts, scale, total, grad = finish(torch.full((70,), -100, device=device))
    assert (counts, scale, total) == ([0, 0], 1.0, 0.0) and torch.all(grad == 0)
    target = torch.randint(0, 50, (70,), device=device)
    target[[3, 40]] = torch.tensor([50, -7], device=device)
    counts, _, total, grad = finish(target)
    assert counts == [70, 2] and total != total  # a bad target never gives a plausible mean
    assert torch.isnan(grad[3]).all() and torch.isfinite(grad[4]).all()
