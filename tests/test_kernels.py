"""The Triton CE kernel against its torch twin on the per-chunk contract (loss, lse, argmax, gradients)."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import poisoned_padded_copy, rel_err

from flce import gemm
from flce.kernels import ce_chunk, ce_triton, resolve_backend, triton_available
from flce.options import LossOptions

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                reason="triton cannot run here")


def run(backend, logits, target, opts, class_weight=None, grad_scale=None, stats=True, padded=False):
    """(gradient, loss, lse, correct) of ``ce_chunk`` on a copy of logits; ``padded``: the copy in a
    ``gemm.padded_rows`` buffer whose padding holds NaN."""
    n = logits.shape[0]
    buf = logits.clone()
    if padded:
        buf = poisoned_padded_copy(logits)
    loss, lse = (torch.full((n,), float("nan"), device=logits.device) for _ in range(2))
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
@pytest.mark.parametrize("block_v", [None, 2048])  # 2048: at V 5000 two whole blocks and a partial one
def test_triton_matches_torch_twin(device, monkeypatch, dtype, opts, vocab, block_v):
    if block_v:
        monkeypatch.setattr(ce_triton, "LAUNCH", ce_triton.LaunchConfig(block_v=block_v, few_rows_block_v=block_v))
    n = 9
    logits = (torch.randn(n, vocab, device=device) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,), device=device)
    target[1] = opts.ignore_index
    cw = torch.rand(vocab, device=device) + 0.5
    scale = torch.rand(n, device=device) + 0.5  # per-row grad_output (reduction="none" backward)
    # 16-bit logits also in padded rows: at V 37 and 5000 the kernel's whole-group form (``whole_groups``)
    layouts = (False, True) if dtype == torch.bfloat16 else (False,)
    for class_weight, padded in itertools.product((None, cw), layouts):
        got = run("triton", logits, target, opts, class_weight, scale, padded=padded)
        want = run("torch", logits, target, opts, class_weight, scale)
        names = ("grad", "loss", "lse", "correct")
        for name, g, w in zip(names, got, want):
            tol = 2e-2 if (name == "grad" and dtype == torch.bfloat16) else 1e-5
            assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol * 1e-2 if name == "grad" else 1e-5), name
        assert torch.all(got[0][1] == 0)  # ignored row: exact zeros


@pytest.mark.parametrize("row_align", [16, 128])
def test_whole_groups_only_where_the_groups_end_inside_the_row(monkeypatch, row_align):
    """The whole-group form is taken where the compiler cannot see 16-byte groups itself and they end at V or
    in a ``gemm.padded_rows`` buffer's padding; never over another tensor's values, past the allocation, from
    a misaligned start, or for 32-bit values."""
    monkeypatch.setattr(gemm, "ROW_ALIGN_BYTES", row_align)
    n, bf16 = 3, torch.bfloat16

    def grouped(t):
        return ce_triton.whole_groups(t, 8)

    assert grouped(gemm.padded_rows(n, 5001, bf16, "cpu"))  # padding that holds nothing
    assert grouped(torch.empty(n, 5000, dtype=bf16))  # V % 16 == 8: the groups end at V
    assert not grouped(torch.empty(n, 4096, dtype=bf16))  # the compiler sees V and the stride divisible by 16
    assert not grouped(torch.empty(n, 5001, dtype=bf16))  # no padding: the last group would run into the next row
    assert not grouped(torch.empty(n, 5096, dtype=bf16)[:, :5001])  # a wider tensor's values, not padding
    assert not grouped(gemm.padded_rows(n, 5001, torch.float32, "cpu"))  # 8 float32 values are 32 bytes
    width = gemm.padded_width(5001, 2)
    short = torch.empty((n - 1) * width + 5003, dtype=bf16).as_strided((n, 5001), (width, 1))
    assert not grouped(short)  # the last row's group would end past the allocation
    shifted = torch.empty(n * width + 8, dtype=bf16)[1:].as_strided((n, 5001), (width, 1))
    assert not grouped(shifted)  # rows start 2 bytes off 16


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


@pytest.mark.parametrize("torch_below", [0, 1 << 20])
def test_scale_into_one_scale_per_index_of_a_dim(backend, device, torch_below, monkeypatch):
    """The grouped loss's per-head scales: src times a scale with one full dim, the rest 1 ((G, 1, 1) for
    (G, n, H)), in place or cast, also on a permuted layout (a batched GEMM's output seen as (G, B, H));
    a scale of another shape takes torch's broadcasting multiply."""
    import flce.kernels.scale
    from flce.kernels.scale import scale_into

    monkeypatch.setattr(flce.kernels.scale, "TORCH_BELOW", torch_below)
    base = torch.randn(3, 7, 1001, device=device)  # slices that end inside a Triton block
    heads = torch.tensor([0.37, 1.0, -2.5], device=device)
    for src, scale in ((base, heads[:, None, None]), (base.transpose(0, 1), heads[None, :, None]),
                       (base, torch.rand(1, 7, 1, device=device) + 0.5)):
        want = src.double() * scale.double()
        same = src.clone()
        assert scale_into(same, scale, torch.float32, backend) is same
        assert torch.allclose(same.double(), want, rtol=1e-6, atol=0)
        cast = scale_into(src, scale, torch.bfloat16, backend, out=torch.empty_like(src, dtype=torch.bfloat16))
        assert cast.dtype == torch.bfloat16 and torch.allclose(cast.double(), want, rtol=2**-7, atol=0)
    per_column = torch.rand(1001, device=device) + 0.5
    assert torch.allclose(scale_into(base, per_column, torch.float32, backend, out=torch.empty_like(base)).double(),
                          base.double() * per_column.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("torch_below", [0, 1 << 20])
def test_scale_into_rounds_16_bit_products_once(backend, device, torch_below, monkeypatch):
    """A bf16 tensor times a float32 scale that bf16 cannot hold (1 / 172 lies near a rounding tie):
    each product is rounded once, so the errors carry no common sign. CUDA's bf16-by-0-d-tensor multiply
    rounds the scale first: a bias of 1.3e-3 on every element."""
    if backend == "triton" and device.type == "cpu" and torch_below == 0:
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    import flce.kernels.scale
    from flce.kernels.scale import scale_into

    monkeypatch.setattr(flce.kernels.scale, "TORCH_BELOW", torch_below)
    scale = torch.tensor(1 / 172, device=device)
    src = torch.randn(3, 5001, device=device).to(torch.bfloat16)
    exact = src.double() * scale.double()
    for out in (None, torch.empty_like(src)):
        got = scale_into(src.clone(), scale, torch.bfloat16, backend, out=out)
        bias = ((got.double() - exact) / exact).mean().item()
        assert abs(bias) < 1e-4


@pytest.mark.parametrize("presorted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subtract_target_rows_backends_match_float64(backend, device, dtype, presorted):
    """A weight gradient's one-hot rows: grad[v] -= scale * sum of coef[r] * x[r] over the rows whose key is v
    (repeated keys, keys past the end for rows without the term), one float32 sum and one rounding per row;
    ``presorted``: the keys come in a given order of the rows (the low-memory blocks sort once)."""
    from flce.kernels.target_rows_torch import subtract_target_rows_torch

    vocab, hidden, n = 37, 9, 50
    grad = torch.randn(vocab, hidden, device=device).to(dtype)
    x = torch.randn(n, hidden, device=device).to(dtype)
    keys = torch.randint(0, vocab + 5, (n,), device=device, dtype=torch.int32)  # >= vocab: no term
    coef, scale = torch.rand(n, device=device) + 0.5, torch.tensor(0.37, device=device)
    want = grad.double().index_add(0, keys[keys < vocab].long(),
                                   -0.37 * (coef.double()[:, None] * x.double())[keys < vocab])
    order = None
    if presorted:  # sorted by key, the rows past the end moved into the middle: still one run per key
        keys, order = torch.sort(torch.where(keys < vocab, keys, vocab // 2 + 0.5).float(), stable=True)
        keys = torch.where(keys == vocab // 2 + 0.5, vocab, keys).to(torch.int32)
    got = grad.clone()
    if backend == "triton":
        from flce.kernels.exp_rows_triton import subtract_target_rows

        subtract_target_rows(got, x, keys, coef, scale, order)
    else:
        subtract_target_rows_torch(got, x, keys, coef, scale, order)
    # Within one step of the dtype (the interpreter's 16-bit cast truncates where CUDA rounds).
    step = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(got.double(), want, rtol=step, atol=1e-6 * want.abs().max().item())
    untouched = torch.ones(vocab, dtype=torch.bool, device=device)
    untouched[keys[keys < vocab].long()] = False
    assert torch.equal(got[untouched], grad[untouched])


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


# ---------------------------------------------------------------- the torch twin against float64 autograd

def _row_reference(logits, target, opts, class_weight, scale):
    """Per-row loss, lse, argmax hit and d(sum scale * loss)/d logits, by float64 autograd on the logits."""
    z0 = logits.detach().double().requires_grad_()
    z = z0 / opts.temperature
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    cw = class_weight.double() if class_weight is not None else None
    rows = torch.nn.functional.cross_entropy(z, target, weight=cw, ignore_index=opts.ignore_index,
                                             label_smoothing=opts.label_smoothing, reduction="none")
    valid = target != opts.ignore_index
    lse = torch.logsumexp(z, 1)
    rows = rows + opts.z_loss * lse.square() * valid
    (grad,) = torch.autograd.grad((rows * scale.double()).sum(), z0)
    hit = (z.argmax(1) == target) & valid
    return rows.detach(), torch.where(valid, lse, 0.0).detach(), hit.double(), grad


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", [LossOptions(), LossOptions(label_smoothing=0.1, z_loss=1e-2, softcap=30.0,
                                                             temperature=0.8, ignore_index=3)])
def test_gradient_into_a_buffer_of_its_own(backend, device, grad_dtype, opts):
    """Float32 logits (a small batch's, ``function.wide_logits``) with the gradient written into a 16-bit buffer of
    its own (``grad_out``, rows padded as the loop's buffers, their padding NaN): the float64 gradient of those
    logits rounded once, the loss and lse as float64's; the padding is left alone."""
    n, vocab = 9, 5000
    logits = (torch.randn(n, vocab, dtype=torch.float64, device=device) * 6).float()  # logits of a trained model
    target = torch.randint(0, vocab, (n,), device=device)
    target[1] = opts.ignore_index
    scale = torch.rand(n, device=device) + 0.5
    want_loss, want_lse, _, want_grad = _row_reference(logits, target, opts, None, scale)
    grad = poisoned_padded_copy(torch.zeros(n, vocab, dtype=grad_dtype, device=device))
    loss, lse = (torch.full((n,), float("nan"), device=device) for _ in range(2))
    ce_chunk(backend, logits.clone(), target, loss, lse, None, None, None, scale, opts, grad_out=grad)
    assert torch.allclose(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    # Triton's CPU interpreter rounds float32 to bf16 toward zero (twice the error of the GPU's rounding to nearest)
    truncates = backend == "triton" and device.type == "cpu" and grad_dtype == torch.bfloat16
    assert rel_err(grad, want_grad) <= (2.1 if truncates else 1.05) * rel_err(want_grad.to(grad_dtype), want_grad)
    assert torch.all(grad[1] == 0)  # ignored row: exact zeros
    assert grad.as_strided((n, grad.stride(0)), grad.stride())[:, vocab:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("opts", [
    LossOptions(),
    LossOptions(label_smoothing=0.1, z_loss=1e-2),
    LossOptions(softcap=2.5, temperature=0.8, ignore_index=3),
])
@pytest.mark.parametrize("weighted", [False, True])
def test_torch_twin_matches_float64_autograd(dtype, opts, weighted, monkeypatch):
    import flce.kernels.ce_torch as ce_torch

    monkeypatch.setattr(ce_torch, "BLOCK_ELEMENTS", 3 * 257)  # 3 rows per block: several blocks, a short last one
    n, vocab = 11, 257
    logits = (torch.randn(n, vocab, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,))
    target[[1, 6]] = opts.ignore_index
    cw = torch.rand(vocab, dtype=torch.float64) + 0.5 if weighted else None
    scale = torch.rand(n, dtype=torch.float64) + 0.5  # per-row grad_output
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    buf = logits.clone()
    loss, lse, correct = (torch.full((n,), float("nan"), dtype=out_dtype) for _ in range(3))
    cw_k = cw.to(out_dtype) if weighted else None
    ce_torch.ce_chunk_torch(buf, target, loss, lse, correct, cw_k, cw_k.sum() if weighted else None,
                            scale.to(out_dtype), opts)

    want_loss, want_lse, want_hit, want_grad = _row_reference(logits, target, opts, cw_k, scale)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    assert torch.allclose(loss.double(), want_loss, rtol=tol, atol=tol)
    assert torch.allclose(lse.double(), want_lse, rtol=tol, atol=tol)
    assert torch.equal(correct.double(), want_hit)
    grad_tol = 2 ** -7 if dtype == torch.bfloat16 else tol  # the gradient is stored in the logits' dtype
    assert buf.dtype == dtype
    assert torch.allclose(buf.double(), want_grad, rtol=grad_tol, atol=grad_tol * want_grad.abs().max().item())
    assert torch.all(buf[[1, 6]] == 0)  # ignored rows: exact zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_twin_loss_alone_leaves_logits_untouched(dtype):
    from flce.kernels.ce_torch import ce_chunk_torch

    opts = LossOptions(temperature=0.7)
    logits = (torch.randn(5, 300) * 2).to(dtype)
    target = torch.randint(0, 300, (5,))
    buf, loss, lse = logits.clone(), torch.empty(5), torch.empty(5)
    ce_chunk_torch(buf, target, loss, lse, None, None, None, None, opts)
    want_loss, want_lse, _, _ = _row_reference(logits, target, opts, None, torch.ones(5))
    assert torch.equal(buf, logits)
    assert torch.allclose(loss.double(), want_loss, rtol=1e-5) and torch.allclose(lse.double(), want_lse, rtol=1e-5)


def test_torch_twin_empty_vocabulary_and_rows():
    from flce.kernels.ce_torch import ce_chunk_torch

    opts = LossOptions()
    target = torch.tensor([0, -100, 2])
    buf, loss, lse, correct = torch.empty(3, 0), torch.empty(3), torch.empty(3), torch.empty(3)
    ce_chunk_torch(buf, target, loss, lse, correct, None, None, torch.ones(()), opts)
    # No class exists: a counted row's target is out of range (NaN, as the kernel), an ignored row is 0.
    assert torch.isnan(loss[[0, 2]]).all() and loss[1] == 0 and lse[1] == 0 and correct.tolist() == [0, 0, 0]
    empty = torch.empty(0, 7)
    ce_chunk_torch(empty, torch.empty(0, dtype=torch.int64), torch.empty(0), torch.empty(0), None, None, None,
                   torch.ones(()), opts)


def test_torch_twin_infinite_logits():
    """A +inf logit gives NaN (never a finite or infinite loss); a row of -inf gives lse -inf."""
    from flce.kernels.ce_torch import ce_chunk_torch

    logits = torch.randn(3, 6)
    logits[0, 2] = float("inf")
    logits[1] = float("-inf")
    buf, loss, lse = logits.clone(), torch.empty(3), torch.empty(3)
    ce_chunk_torch(buf, torch.tensor([1, 1, 1]), loss, lse, None, None, None, torch.ones(()), LossOptions())
    assert torch.isnan(loss[0]) and torch.isnan(loss[1]) and lse[1] == float("-inf") and torch.isfinite(loss[2])


@pytest.mark.parametrize("hip, capability, expected", [(None, (9, 0), 9), (None, (8, 0), 8), ("6.2", (9, 4), 0)])
def test_nvidia_major_names_no_nvidia_generation_on_rocm(hip, capability, expected, monkeypatch):
    """A ROCm build reports its gfx version through get_device_capability (MI300: 9.4): the Hopper paths
    (TMA logits GEMM, CUTLASS grouped GEMMs) must not take it for sm90."""
    from flce.kernels import _capability_major, experts_dispatch, experts_torch, logits_triton, nvidia_major

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    _capability_major.cache_clear()
    try:
        gpu = torch.device("cuda", 0)
        assert nvidia_major(gpu) == expected
        assert logits_triton.hopper(gpu) == (expected >= 9)
        cutlass = experts_dispatch._grouped_mm_ok(gpu, torch.bfloat16, ())
        assert cutlass == (expected == 9 and experts_torch.has_grouped_mm())
        assert nvidia_major(torch.device("cpu")) == 0
    finally:
        _capability_major.cache_clear()


@pytest.fixture(scope="module")
def ptx_accesses():
    """{case: {PTX instruction: count}} from ``ptx_accesses.py``, compiled for sm_90 in a child process (the jit
    kernels, not the interpreter's)."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = Path(__file__).with_name("ptx_accesses.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("kernel", ["ce", "stats", "grad", "shard-stats", "shard-grad"])
@pytest.mark.parametrize("shifted", [False, True])
def test_padded_rows_move_in_16_byte_groups(ptx_accesses, kernel, shifted):
    """At a vocabulary no multiple of 8 the row kernels (CE, token statistics', vocab-parallel stages) read and
    write bf16 logits value by value; in padded rows (``GROUPED``) in 16-byte groups, but for the one scalar read
    of the target's logit. What the compiler emits, not a timing: 16-bit accesses cost the CE kernel 30%."""
    plain, padded = (ptx_accesses[f"{kernel} shifted={shifted} padded={p}"] for p in (False, True))
    assert plain.get("ld.global.b16", 0) > 8 and "ld.global.v4.b32" not in plain
    assert padded.get("ld.global.b16", 0) <= 1 and padded.get("st.global.b16", 0) == 0
    assert padded.get("ld.global.v4.b32", 0) > 0
    if not kernel.endswith("stats"):  # the others write the gradient over the row
        assert plain.get("st.global.b16", 0) > 8 and padded.get("st.global.v4.b32", 0) > 0
