"""The Triton CE kernel against its torch twin on the per-chunk contract (loss, lse, argmax, gradients)."""

import pytest
import torch

from flce.kernels import ce_chunk, resolve_backend, triton_available
from flce.options import LossOptions

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                reason="triton cannot run here")


def run(backend, logits, target, opts, class_weight=None, grad_scale=None, stats=True, config=None):
    n = logits.shape[0]
    buf = logits.clone()
    loss, lse = torch.full((n,), float("nan"), device=logits.device), torch.full((n,), float("nan"), device=logits.device)
    correct = torch.full((n,), float("nan"), device=logits.device) if stats else None
    weight_sum = class_weight.sum() if class_weight is not None else None
    if config is None:
        ce_chunk(backend, buf, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts)
    else:
        from flce.kernels.ce_triton import ce_chunk_triton

        ce_chunk_triton(buf, target, loss, lse, correct, class_weight, weight_sum, grad_scale, opts, config)
    return buf, loss, lse, correct


def kernel_config(kind: str, vocab: int):
    """The Triton launch for ``kind``: the default, the slice kernel with several slices per row, or
    the row kernel (two passes over the row)."""
    from flce.kernels.ce_triton import LaunchConfig

    if kind == "default":
        return None
    if kind == "slices":
        return LaunchConfig(slice_v=16 if vocab < 100 else 1024, slice_warps=4)
    return LaunchConfig(slice_v=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [
    LossOptions(),
    LossOptions(label_smoothing=0.1, z_loss=1e-2),
    LossOptions(softcap=2.5, temperature=0.8, ignore_index=3),
])
@pytest.mark.parametrize("vocab", [1, 37, 5000])
@pytest.mark.parametrize("kernel", ["default", "slices", "rows"])
def test_triton_matches_torch_twin(device, dtype, opts, vocab, kernel):
    n = 9
    logits = (torch.randn(n, vocab, device=device) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,), device=device)
    target[1] = opts.ignore_index
    cw = torch.rand(vocab, device=device) + 0.5
    scale = torch.rand(n, device=device) + 0.5  # per-row grad_output (reduction="none" backward)
    for class_weight in (None, cw):
        got = run("triton", logits, target, opts, class_weight, scale, config=kernel_config(kernel, vocab))
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Llama-3 vocabulary is too slow for the interpreter")
@pytest.mark.parametrize("opts", [LossOptions(), LossOptions(label_smoothing=0.1, z_loss=1e-3, softcap=30.0)])
def test_slice_kernel_matches_row_kernel_on_a_large_vocabulary(opts):
    """Several slices per row, waiting on each other on a real GPU (the interpreter runs two launches)."""
    from flce.kernels.ce_triton import LaunchConfig

    n, vocab = 1000, 128256
    logits = (torch.randn(n, vocab, device="cuda") * 4).bfloat16()
    target = torch.randint(0, vocab, (n,), device="cuda")
    target[::7] = opts.ignore_index
    cw = torch.rand(vocab, device="cuda") + 0.5
    for class_weight in (None, cw):
        for slice_v in (4096, 16384):
            got = run("triton", logits, target, opts, class_weight, torch.tensor(0.5, device="cuda"),
                      config=LaunchConfig(slice_v=slice_v))
            want = run("triton", logits, target, opts, class_weight, torch.tensor(0.5, device="cuda"),
                       config=LaunchConfig(slice_v=None))
            assert torch.allclose(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-7)
            for g, w in zip(got[1:], want[1:]):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)
