"""flce.linear_log_probs against a float64 reference on materialized logits: every field, gradients of
log_probs and entropy for random per-token grad_outputs, options, odd shapes, dtypes, both backends."""

import hypothesis
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (TOL, assert_close, capped, count_172_case, errors_in_roundings, linear_grads, logits_leaf,
                       peaked_case, poisoned_padded_copy, reference_logits, rel_err)

import flce
from conftest import BACKENDS, DEVICE, GPU_FUZZ_EXAMPLES, HOPPER_DTYPE
from flce import log_probs
from flce.kernels import token_stats, token_stats_triton, triton_available

FIELDS = flce.TokenStats._fields


@pytest.fixture(autouse=True)
def _on_device():
    """Every tensor a test makes lives on the device the suite runs on (the Triton backend needs CUDA
    there, or the interpreter on the CPU)."""
    with torch.device(DEVICE):
        yield


def stats_of_logits(z, t, ignore_index=-100):
    """TokenStats of materialized logits z (..., V) (after temperature and softcap) in z's dtype."""
    log_p = torch.log_softmax(z, -1)
    valid = t != ignore_index
    y = t.clamp(0, max(z.shape[-1] - 1, 0))

    def masked(v):
        return torch.where(valid, v, 0.0)

    return flce.TokenStats(
        log_probs=masked(log_p.gather(-1, y[..., None])[..., 0]),
        entropy=masked(-(log_p.exp() * log_p).sum(-1)),
        log_sum_sq_probs=masked(torch.logsumexp(2 * log_p, -1)),
        mean_logits=masked(z.mean(-1)),
        is_top1=valid & (z.argmax(-1) == y),
    )


def reference_stats(x, w, t, b=None, ignore_index=-100, temperature=1.0, softcap=None):
    """(TokenStats in float64, the float64 leaves, z (..., V)) on float64 copies of the inputs."""
    z, leaves = reference_logits(x, w, b, temperature, softcap)
    return stats_of_logits(z, t, ignore_index), leaves, z.detach()


def make(shape, hidden, vocab, dtype, *, bias=False, ignore=0.0, scale=2.0, ignore_index=-100):
    x = torch.randn(*shape, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5 * scale).to(dtype).requires_grad_()
    b = (torch.randn(vocab) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, shape)
    if ignore:
        t[torch.rand(shape) < ignore] = ignore_index
    return x, w, b, t


def assert_top1(got, want, z, dtype, min_share=0.3):
    """is_top1 agrees wherever the top two logits are further apart than the dtype's rounding (which
    leaves at least ``min_share`` of the rows)."""
    top2 = z.topk(2, -1).values if z.shape[-1] > 1 else torch.cat([z, z - 1e9], -1)
    clear = (top2[..., 0] - top2[..., 1]) > 4 * torch.finfo(dtype).eps * (1 + z.abs().amax(-1))
    assert got.dtype == torch.bool and got.shape == want.shape
    assert torch.equal(got[clear], want[clear])
    assert not clear.numel() or clear.float().mean() >= min_share


def check(backend, dtype=torch.float32, shape=(37,), hidden=24, vocab=300, grad_tol=None, outputs=FIELDS,
          bias=False, ignore=0.0, scale=2.0, autocast=None, **opts):
    x, w, b, t = make(shape, hidden, vocab, dtype, bias=bias, ignore=ignore, scale=scale,
                      ignore_index=opts.get("ignore_index", -100))
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=outputs, backend=backend, **opts)
    opts.pop("chunk_size", None), opts.pop("validate_target", None)
    want, (x64, w64, b64), z = reference_stats(x, w, t, b, **opts)
    tol = TOL[autocast or dtype]
    for name in FIELDS:
        field = getattr(got, name)
        if name not in outputs:
            assert field is None, name
        elif name == "is_top1":
            saturated = opts.get("softcap", 1e9) < 1  # logits capped at the same value tie
            assert_top1(field, want.is_top1, z, autocast or dtype, 0.0 if saturated else 0.3)
        else:
            assert field.dtype == torch.float32 and field.shape == t.shape, name
            assert_close(field, getattr(want, name), tol, name)

    grad_fields = [n for n in ("log_probs", "entropy") if n in outputs]
    if not grad_fields:
        return
    g = {n: torch.randn(t.shape, dtype=torch.float64) for n in grad_fields}
    sum(getattr(got, n) * g[n].float() for n in grad_fields).sum().backward()
    sum(getattr(want, n) * g[n] for n in grad_fields).sum().backward()
    for name, got_g, want_g, leaf in (("grad_input", x.grad, x64.grad, x), ("grad_weight", w.grad, w64.grad, w),
                                      ("grad_bias", b.grad if b is not None else None,
                                       b64.grad if b64 is not None else None, b)):
        if want_g is None:
            continue
        assert got_g.dtype == leaf.dtype, name
        assert_close(got_g, want_g, grad_tol or tol, name)


OPTION_SETS = {
    "plain": {},
    "bias": {"bias": True},
    "temperature": {"temperature": 0.6},
    "softcap": {"softcap": 3.0},
    "softcap saturated": {"softcap": 0.5, "scale": 8.0},  # |r / c| up to ~30: sech^2 without cancellation
    "softcap near linear": {"softcap": 2e3},  # r / c ~ 1e-3: tanh without cancellation
    "ignore": {"ignore": 0.4},
    "ignore unchecked": {"ignore": 0.4, "validate_target": False},
    "ignore_index 5": {"ignore": 0.3, "ignore_index": 5},
    "chunks": {"chunk_size": 8, "bias": True, "ignore": 0.2},
    "all": {"bias": True, "temperature": 1.4, "softcap": 4.0, "ignore": 0.25, "chunk_size": 16},
}


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_fields_and_grads_float32(backend, name):
    check(backend, **OPTION_SETS[name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_fields_and_grads_half(backend, dtype, name):
    check(backend, dtype, **OPTION_SETS[name])


@pytest.mark.parametrize("shape,hidden,vocab", [((1,), 8, 1), ((2, 5), 7, 37), ((3, 1, 4), 16, 129), ((6,), 1, 64)])
def test_odd_shapes(backend, shape, hidden, vocab):
    check(backend, shape=shape, hidden=hidden, vocab=vocab, bias=True, softcap=5.0)


@pytest.mark.parametrize("outputs", [("log_probs",), ("entropy",), ("log_probs", "is_top1"),
                                     ("entropy", "mean_logits", "log_sum_sq_probs")])
def test_output_subsets(backend, outputs):
    check(backend, outputs=outputs, bias=True, temperature=0.8)


def test_autocast_bf16(backend):
    check(backend, torch.float32, autocast=torch.bfloat16, bias=True, softcap=4.0)


def test_many_vocabulary_blocks(backend, monkeypatch):
    """The kernels' online softmax across blocks of the vocabulary (one block at the default size)."""
    monkeypatch.setattr(token_stats_triton, "BLOCK_V", 32)
    check(backend, vocab=300, bias=True, softcap=3.0, ignore=0.2, scale=6.0)


@pytest.mark.parametrize("block_v", [8192, 32])  # 32: many blocks, the last one partial
def test_kernels_in_padded_rows_leave_the_padding_out(monkeypatch, block_v):
    """bf16 padded rows (``gemm.padded_rows``, V = 301 in rows of 320, as the CE kernel's
    ``ce_triton.whole_groups`` takes them) whose padding holds NaN: every statistic and gradient of the Triton
    kernels is the torch twin's on the same values."""
    from flce.kernels import ce_triton

    if not triton_available(DEVICE):
        pytest.skip("triton cannot run here")
    monkeypatch.setattr(token_stats_triton, "BLOCK_V", block_v)
    n, vocab = 7, 301
    values = (torch.randn(n, vocab, device=DEVICE) * 3).bfloat16()
    padded = poisoned_padded_copy(values)
    assert ce_triton.whole_groups(padded, 8)
    target = torch.randint(0, vocab, (n,), device=DEVICE)
    target[2] = -100
    tf = token_stats.Transform(-100, 1 / 1.3, 4.0)
    g_lp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)  # per-row grad_outputs
    outs = {}
    for backend, buf in (("triton", padded), ("torch", values.clone())):
        floats = [torch.empty(n, device=DEVICE) for _ in range(5)]
        out = token_stats.RowStats(*floats, torch.empty(n, dtype=torch.bool, device=DEVICE))
        token_stats.row_stats(backend, buf, target, out, tf)
        token_stats.row_grad(backend, buf, target, out.lse, out.entropy, g_lp, g_ent, tf)
        outs[backend] = (*out, buf)
    for name, got, want in zip((*token_stats.RowStats._fields, "grad"), outs["triton"], outs["torch"]):
        if got.dtype == torch.bool:
            assert torch.equal(got, want), name
        else:
            assert torch.allclose(got.float(), want.float(), rtol=2e-2 if name == "grad" else 1e-5, atol=1e-5), name


@pytest.mark.parametrize("validate_target", [True, False])
def test_all_ignored(backend, validate_target):
    x, w, b, t = make((5,), 8, 20, torch.float32, bias=True)
    t[:] = -100
    got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=FIELDS, backend=backend,
                                validate_target=validate_target)
    for name in FIELDS:
        assert not getattr(got, name).any(), name
    (got.log_probs.sum() + got.entropy.sum()).backward()
    for leaf in (x, w, b):
        assert leaf.grad is not None and not leaf.grad.any()


def test_empty_inputs(backend):
    for n, vocab, ignored in ((0, 20, False), (4, 0, True)):
        x, w, b, t = make((n,), 8, max(vocab, 1), torch.float32, bias=True)
        w = w.detach()[:vocab].requires_grad_()
        b = b.detach()[:vocab].requires_grad_()
        if ignored:
            t[:] = -100
        got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=FIELDS, backend=backend)
        assert all(getattr(got, f).shape == (n,) and not getattr(got, f).any() for f in FIELDS)
        (got.log_probs.sum() + got.entropy.sum()).backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
        assert not (x.grad.any() or w.grad.any() or b.grad.any())


def test_unchecked_bad_target_gives_nan_in_its_row(backend):
    x, w, _, t = make((6,), 8, 20, torch.float32)
    t[2] = 20
    got = flce.linear_log_probs(x, w, t, outputs=FIELDS, backend=backend, validate_target=False)
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        field = getattr(got, name)
        assert field[2].isnan() and field[[0, 1, 3, 4, 5]].isfinite().all(), name
    assert not got.is_top1[2]


def test_grad_of_one_output_only(backend):
    """Only the entropy gets a gradient (an RL entropy bonus): log_probs' grad_output is None."""
    x, w, _, t = make((9,), 12, 50, torch.float32)
    got = flce.linear_log_probs(x, w, t, backend=backend)
    want, (x64, w64, _), _ = reference_stats(x, w, t)
    got.entropy.sum().backward()
    want.entropy.sum().backward()
    assert_close(x.grad, x64.grad, TOL[torch.float32], "grad_input")
    assert_close(w.grad, w64.grad, TOL[torch.float32], "grad_weight")


def test_no_grad_and_frozen_weight(backend):
    x, w, _, t = make((9,), 12, 50, torch.float32)
    with torch.no_grad():
        got = flce.linear_log_probs(x, w, t, backend=backend)
    assert not got.log_probs.requires_grad
    w.requires_grad_(False)
    got = flce.linear_log_probs(x, w, t, backend=backend)
    got.log_probs.sum().backward()
    want, (x64, _, _), _ = reference_stats(x, w, t)
    want.log_probs.sum().backward()
    assert w.grad is None
    assert_close(x.grad, x64.grad, TOL[torch.float32], "grad_input")


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.7, "softcap": 4.0}, {"bias": True, "ignore": 0.3}])
def test_log_probs_alone_without_gradients_skip_the_logits(loss_only_runs, opts):
    """A reference model's log-probs (no gradients, log_probs alone) come from the loss's statistics-only
    path on Hopper: float32 precision against float64, and +0.0 at ignored tokens."""
    opts = dict(opts)
    x, w, b, t = make((40,), 32, 120, HOPPER_DTYPE, bias=opts.pop("bias", False), ignore=opts.pop("ignore", 0.0))
    with torch.no_grad():
        got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=("log_probs",), backend="triton", **opts)
    want, _, _ = reference_stats(x, w, t, b, **opts)
    valid = t != -100
    assert loss_only_runs == [int(valid.sum())] and got.entropy is None
    assert rel_err(got.log_probs, want.log_probs) <= 1e-4
    assert not torch.signbit(got.log_probs[~valid]).any()


@pytest.mark.gpu
def test_gpu_log_probs_alone_real_shape(loss_only_runs):
    """bf16 at 4096 x 4096 x 128256 with flce's own thresholds: the path runs, at float32 precision."""
    if HOPPER_DTYPE != torch.bfloat16:
        pytest.skip("the path needs Hopper")
    x, w, b, t = make((4096,), 4096, 128256, torch.bfloat16, ignore=0.1)
    with torch.no_grad():
        got = flce.linear_log_probs(x, w, t, outputs=("log_probs",), temperature=0.9)
    want, _, _ = reference_stats(x, w, t, temperature=0.9)
    assert loss_only_runs == [int((t != -100).sum())]
    assert rel_err(got.log_probs, want.log_probs) <= 1e-4


@pytest.mark.parametrize("case", ["entropy too", "gradients"])
def test_other_log_prob_calls_keep_their_path(loss_only_runs, case):
    x, w, b, t = make((40,), 32, 120, HOPPER_DTYPE)
    outputs = ("log_probs", "entropy") if case == "entropy too" else ("log_probs",)
    with torch.set_grad_enabled(case == "gradients"):
        got = flce.linear_log_probs(x, w, t, outputs=outputs, backend="triton")
    want, _, _ = reference_stats(x, w, t)
    assert loss_only_runs == []
    assert rel_err(got.log_probs, want.log_probs) <= TOL[HOPPER_DTYPE]


def test_matches_cross_entropy_loss(backend):
    """-log_probs is flce.linear_cross_entropy's per-token loss (same logit model)."""
    x, w, b, t = make((4, 6), 16, 90, torch.float32, bias=True, ignore=0.3)
    opts = dict(linear_bias=b, temperature=0.9, softcap=2.5, backend=backend)
    got = flce.linear_log_probs(x, w, t, outputs=("log_probs",), **opts).log_probs
    want = flce.linear_cross_entropy(x, w, t, reduction="none", **opts)
    assert_close(-got, want, 1e-6, "per-token loss")


def test_in_place_change_after_forward_raises(backend):
    x, w, _, t = make((5,), 8, 20, torch.float32)
    h = x * 1.0
    got = flce.linear_log_probs(h, w, t, backend=backend)
    h.data.add_(1.0)  # not seen by autograd: allowed
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.log_probs.sum().backward()


def test_double_backward_refused(backend):
    x, w, _, t = make((5,), 8, 20, torch.float32)
    got = flce.linear_log_probs(x, w, t, backend=backend)
    (gx,) = torch.autograd.grad(got.log_probs.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|differentiate twice"):
        gx.sum().backward()


class GradKernelSpy:
    """Counts calls of the gradient kernel (one per chunk that computes gradients)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        inner = token_stats.row_grad

        def counting(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(token_stats, "row_grad", counting)
        monkeypatch.setattr(log_probs._Speculation, "_kinds", {})  # no guesses carried over from other tests

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def speculation_step(spy, backend, case, g_lp, g_ent=None, retain=False, **opts):
    """One forward and backward of sum(g_lp * log_probs + g_ent * entropy); returns the gradient kernel's
    calls in forward and in backward, after checking the gradients against float64."""
    x, w, b, t = (None if a is None else a.detach().requires_grad_(a.requires_grad) for a in case)
    out = flce.linear_log_probs(x, w, t, linear_bias=b, backend=backend, chunk_size=8, **opts)
    in_forward = spy.take()
    loss = (out.log_probs * g_lp).sum() + (0 if g_ent is None else (out.entropy * g_ent).sum())
    loss.backward(retain_graph=retain)
    in_backward = spy.take()
    want, (x64, w64, b64), _ = reference_stats(x, w, t, b)
    want_loss = (want.log_probs * g_lp.double()).sum()
    (want_loss + (0 if g_ent is None else (want.entropy * g_ent.double()).sum())).backward()
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert_close(got, ref, TOL[torch.float32], "gradient")
    if retain:  # a second backward through the same graph recomputes: the guessed gradients are used once
        for leaf in (x, w, b):
            leaf.grad = None
        loss.backward()
        assert spy.take() == 3
        for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
            assert_close(got, ref, TOL[torch.float32], "second gradient")
    return in_forward, in_backward


def test_speculation_follows_the_last_backward(backend, monkeypatch):
    """After a backward with a uniform log-prob grad_output (an SFT loss), forward computes the gradients
    itself and backward only scales them; any other grad_output is still exact, by recomputing."""
    spy = GradKernelSpy(monkeypatch)
    case = make((20,), 12, 50, torch.float32, bias=True)  # 3 chunks of 8 rows
    uniform, other = torch.full((20,), -1 / 20), torch.randn(20)
    assert speculation_step(spy, backend, case, uniform) == (0, 3)  # nothing known yet: recomputed
    assert speculation_step(spy, backend, case, uniform) == (3, 0)  # guessed in forward, scaled in backward
    assert speculation_step(spy, backend, case, other) == (3, 3)  # a wrong guess: recomputed, still exact
    assert speculation_step(spy, backend, case, uniform) == (0, 3)
    assert speculation_step(spy, backend, case, uniform, g_ent=other) == (3, 3)  # an entropy gradient too
    assert speculation_step(spy, backend, case, 2 * uniform) == (0, 3)
    assert speculation_step(spy, backend, case, 2 * uniform, retain=True) == (3, 0)
    assert speculation_step(spy, backend, case, uniform, validate_target=False) == (0, 3)  # sync-free: no guess


def test_speculation_holds_one_guess_at_a_time(backend, monkeypatch):
    spy = GradKernelSpy(monkeypatch)
    x, w, _, t = make((20,), 12, 50, torch.float32)
    flce.linear_log_probs(x, w, t, backend=backend).log_probs.mean().backward()
    spy.take()
    first = flce.linear_log_probs(x, w, t, backend=backend)
    second = flce.linear_log_probs(x, w, t, backend=backend)
    assert spy.take() == 1  # the second forward does not hold a second (V, H) gradient
    (first.log_probs.mean() + second.log_probs.mean()).backward()
    del first
    third = flce.linear_log_probs(x, w, t, backend=backend)
    assert spy.take() == 2 and third.log_probs.requires_grad  # the second's recompute, then a new guess


def test_in_place_change_after_a_guessing_forward_raises(backend, monkeypatch):
    GradKernelSpy(monkeypatch)
    x, w, _, t = make((5,), 8, 20, torch.float32)
    h = x * 1.0
    flce.linear_log_probs(h, w, t, backend=backend).log_probs.mean().backward()
    got = flce.linear_log_probs(h, w, t, backend=backend)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.log_probs.mean().backward()


ERRORS = {
    "outputs name": ({"outputs": ("log_prob",)}, ValueError, "unknown field"),
    "outputs string": ({"outputs": "entropy"}, TypeError, "outputs must be"),
    "temperature": ({"temperature": 0.0}, ValueError, "temperature"),
    "softcap": ({"softcap": -1.0}, ValueError, "softcap"),
    "ignore_index": ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    "chunk_size": ({"chunk_size": 0}, ValueError, "chunk_size"),
    "backend": ({"backend": "cuda"}, ValueError, "backend"),
    "bias shape": ({"linear_bias": torch.zeros(19)}, ValueError, "linear_bias"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_argument_errors(case):
    kwargs, error, match = ERRORS[case]
    x, w, _, t = make((6,), 8, 20, torch.float32)
    with pytest.raises(error, match=match):
        flce.linear_log_probs(x, w, t, **kwargs)


def test_tensor_errors():
    x, w, _, t = make((6,), 8, 20, torch.float32)
    with pytest.raises(ValueError, match="target shape"):
        flce.linear_log_probs(x, w, t[:5])
    with pytest.raises(TypeError, match="integer class indices"):
        flce.linear_log_probs(x, w, t.float())
    with pytest.raises(TypeError, match="share a dtype"):
        flce.linear_log_probs(x, w.double(), t)
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        flce.linear_log_probs(x, w, torch.where(t == t[0], 20, t))


def chunked_reference(x, w, t, b, g_lp, g_ent, rows=1024, **opts):
    """reference_stats chunk by chunk (GPU-sized shapes): (float64 fields, (grad_x, grad_w, grad_b)) of
    sum(g_lp * log_probs + g_ent * entropy)."""
    fields, grad_x, grad_w, grad_b = [], [], 0, 0
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        stats, (x64, w64, b64), _ = reference_stats(x[part], w, t[part], b, **opts)
        (stats.log_probs * g_lp[part] + stats.entropy * g_ent[part]).sum().backward()
        fields.append([f.detach() for f in stats])
        grad_x.append(x64.grad)
        grad_w = grad_w + w64.grad
        grad_b = grad_b + (b64.grad if b64 is not None else 0)
    return [torch.cat(f) for f in zip(*fields)], (torch.cat(grad_x), grad_w, grad_b)


def eager_grads(x, w, t, b, g_lp, g_ent, ignore_index=-100, temperature=1.0, softcap=None):
    """(grad_x, grad_w, grad_b) of the same loss on materialized logits in the inputs' dtype, softmax in
    float32 (how a model's own head computes it): the precision an unfused run has."""
    leaves = [None if a is None else a.detach().requires_grad_() for a in (x, w, b)]
    logits = leaves[0] @ leaves[1].T
    z = (logits if leaves[2] is None else logits + leaves[2]).float() / temperature
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    stats = stats_of_logits(z, t, ignore_index)
    (stats.log_probs * g_lp.float() + stats.entropy * g_ent.float()).sum().backward()
    return [None if a is None else a.grad for a in leaves]


def bf16_matches_float64(device, bt, hidden, vocab, opts, backend="auto"):
    """bf16 against float64: every field, and gradients of a per-token weighted log-prob + entropy loss
    as close to float64 as the unfused bf16 computation's (whose logits are rounded to bf16 as well)."""
    opts = dict(opts)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(bt, hidden, device=device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 2 * hidden**-0.5).bfloat16().requires_grad_()
    b = (torch.randn(vocab, device=device, generator=g) * 0.5).bfloat16().requires_grad_() if opts.pop("bias", 0) \
        else None
    t = torch.randint(0, vocab, (bt,), device=device, generator=g)
    t[::9] = -100
    g_lp, g_ent = (torch.randn(bt, device=device, generator=g, dtype=torch.float64) for _ in range(2))
    got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=FIELDS, backend=backend, **opts)
    (got.log_probs * g_lp.float() + got.entropy * g_ent.float()).sum().backward()
    opts.pop("chunk_size", None)
    want, reference = chunked_reference(x, w, t, b, g_lp, g_ent, **opts)
    for name, field, ref in zip(FIELDS, got, want):
        if name == "is_top1":
            assert (field == ref).float().mean() > 0.99, name  # near-ties round differently in bf16
        else:
            assert_close(field, ref, TOL[torch.bfloat16], name)
    eager = eager_grads(x, w, t, b, g_lp, g_ent, **opts)
    for name, grad, ref, unfused in zip(("grad_input", "grad_weight", "grad_bias"),
                                        (x.grad, w.grad, None if b is None else b.grad), reference, eager):
        if grad is not None:
            err, unfused_err, floor = rel_err(grad, ref), rel_err(unfused, ref), rel_err(ref.to(torch.bfloat16), ref)
            assert err <= 1.1 * unfused_err + 0.1 * floor, f"{name}: {err:.3g}, unfused {unfused_err:.3g}"


@pytest.mark.parametrize("chunk_size", [None, 64])
@pytest.mark.parametrize("case", ["masked mean", "entropy bonus", "temperature", "guessed in forward"])
def test_masked_mean_stays_out_of_the_rounded_dlogits(backend, device, monkeypatch, chunk_size, case, wide_logits):
    """-(log_probs * mask).sum() / mask.sum(), an SFT or GRPO token mean: every kept row's grad_output is
    -1 / 172. Folded into the 16-bit dlogits it read 1.84x the bf16 rounding in both gradients (eager and
    TRL's own kernel likewise); split per row, the residual meets grad_input's float32 product (1.0x) and
    x_c (1.3x). An entropy term's grad_output is divided by the same residual; 1 / temperature joins it.
    A forward that guesses a uniform grad_output (the second such call) computes both gradients for a
    grad_output of 1 and backward scales them: grad_input is kept in float32 until then (stored in bf16 it
    was rounded twice: 1.40x); a single chunk's bf16 grad_weight still is (1.3x)."""
    monkeypatch.setattr(log_probs._Speculation, "_kinds", {})
    guesses = []
    predicts = log_probs._Speculation.predicts_uniform
    monkeypatch.setattr(log_probs._Speculation, "predicts_uniform", lambda self: guesses.append(predicts(self))
                        or guesses[-1])
    x, w, t, kept = count_172_case(backend, device)
    t[~kept] = -100
    temperature = 0.7 if case == "temperature" else 1.0
    g_lp = kept.double() / -172
    g_ent = kept.double() * 0.05 / 172 if case == "entropy bonus" else torch.zeros_like(g_lp)
    guess = case == "guessed in forward"
    scaled = []  # the residual's scaled copies of x_c, per forward (a guess's grad_output of 1 needs none)
    scaled_operand = flce.function.scaled_operand
    monkeypatch.setattr(flce.function, "scaled_operand", lambda *a: scaled.append(1) or scaled_operand(*a))
    for _ in range(2 if guess else 1):  # after a uniform backward the next forward guesses
        scaled.clear()
        got = flce.linear_log_probs(x, w, t, backend=backend, chunk_size=chunk_size, temperature=temperature,
                                    outputs=("log_probs", "entropy") if case == "entropy bonus" else ("log_probs",),
                                    validate_target=guess)  # False: no guess, backward recomputes
        assert not scaled
        loss = (got.log_probs * g_lp.float()).sum()
        if got.entropy is not None:
            loss = loss + (got.entropy * g_ent.float()).sum()
        grads = torch.autograd.grad(loss, (x, w))
    assert guesses == ([False, True] if guess else [])
    assert bool(scaled) != guess  # backward splits what it recomputes
    # the logits flce computes from
    z = logits_leaf(x, w, None, torch.float64 if wide_logits and chunk_size is None else x.dtype)
    ref = stats_of_logits(z / temperature, t)
    (dz,) = torch.autograd.grad((ref.log_probs * g_lp + ref.entropy * g_ent).sum(), z)
    exact = [dz @ w.double(), dz.t() @ x.double()]  # grad_input, grad_weight
    rounding = [rel_err(e.to(torch.bfloat16), e) for e in exact]
    assert rel_err(grads[0], exact[0]) <= 1.05 * rounding[0]
    assert rel_err(grads[1], exact[1]) <= (1.05 if guess and chunk_size else 1.5) * rounding[1]


def test_bf16_matches_float64_small(backend):
    bf16_matches_float64(DEVICE, 300, 64, 500, {"chunk_size": 128, "softcap": 30.0, "bias": True},
                         backend)


@pytest.mark.gpu
@pytest.mark.parametrize("bt,hidden,vocab,opts", [
    (4096, 2048, 32000, {}),
    (3000, 1024, 50257, {"chunk_size": 1024, "softcap": 30.0, "temperature": 0.9, "bias": True}),
])
def test_gpu_bf16_matches_float64(bt, hidden, vocab, opts):
    bf16_matches_float64(torch.device("cuda"), bt, hidden, vocab, opts)


@pytest.mark.gpu
def test_gpu_speculation_matches_recompute(monkeypatch):
    """On CUDA the uniform flag is copied to the host in the background: after a synced step the next
    forward guesses, and its gradients match the recomputed ones to bf16 rounding."""
    spy = GradKernelSpy(monkeypatch)
    cuda = torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(0)
    x = torch.randn(2048, 1024, device=cuda, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(32000, 1024, device=cuda, generator=g) * 1024**-0.5).bfloat16().requires_grad_()
    t = torch.randint(0, 32000, (2048,), device=cuda, generator=g)
    grads = []
    for _ in range(3):
        x.grad = w.grad = None
        (-flce.linear_log_probs(x, w, t).log_probs.mean()).backward()
        torch.cuda.synchronize()  # the flag has landed before the next forward
        grads.append((x.grad, w.grad))
    assert spy.take() == 3  # backward of the first step, then forward of each guessing step
    for got, want in zip(grads[2], grads[0]):  # guessed vs recomputed: bf16 roundings apart (2^-9)
        assert rel_err(got, want) <= 1e-2


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.8, "softcap": 30.0}], ids=["plain", "softcap"])
def test_small_batch_peaked_logits(backend, device, wide_logits, opts):
    """Logits of std 6 with targets drawn from their softmax at a small batch (one chunk below the fused GEMM's
    rows: cuBLAS multiplies). Rounded to 16 bits, the logits put up to |z_y| / 256 into each log-prob (0.03-0.05 in
    bf16 here) and 9-15x the rounding into the gradients; kept in float32 (as the loss's, ``function.wide_logits``)
    the log-probs and the entropy are off by ~1e-6 and the gradients sit at the 16-bit dlogits' own rounding
    (1.0-1.7x here)."""
    dtype = torch.float16 if backend == "triton" and device.type == "cpu" else torch.bfloat16  # the interpreter
    x, w, b, t = peaked_case(24, 32, 512, dtype, device, bias=True, temperature=opts.get("temperature", 1.0),
                             softcap=opts.get("softcap"))  # truncates bf16 casts
    g_lp, g_ent = torch.randn(2, 24, dtype=torch.float64, device=device)
    got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=("log_probs", "entropy"), backend=backend, **opts)
    grads = torch.autograd.grad((got.log_probs * g_lp.float() + got.entropy * g_ent.float()).sum(), (x, w, b))
    want, leaves, _ = reference_stats(x, w, t, b, **opts)
    exact = torch.autograd.grad((want.log_probs * g_lp + want.entropy * g_ent).sum(), leaves)
    lp_err = (got.log_probs.double() - want.log_probs).abs().max().item()
    errors = errors_in_roundings(grads, exact, dtype)
    if wide_logits:
        assert lp_err <= 1e-4 and (got.entropy.double() - want.entropy).abs().max() <= 1e-4
        assert max(errors) <= 2.0, errors
    else:  # what the float32 logits mend: the case is one where 16-bit logits show
        assert lp_err >= 2 * torch.finfo(dtype).eps and max(errors) >= 3, (lp_err, errors)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk_size", [None, 32])
def test_peaked_logits_through_the_hopper_gemm(hopper_gemm_calls, chunk_size, softcap):
    """Logits of a trained model's spread (std 6, targets drawn from the softmax): the loss's Hopper GEMM stores
    them less their tile max, so the entropy and the gradients keep what the 16-bit rounding of the logits would
    take; each target's logit is a float32 dot of the operands (a stored value less its tile max is still off by
    up to |z_y - tile max| ulps of 1), so the log-probs are float32-exact but for the lse."""
    x, w, b, t = peaked_case(96, 32, 512, HOPPER_DTYPE, DEVICE, bias=True, temperature=0.8, softcap=softcap)
    g_lp, g_ent = torch.randn(2, 96, dtype=torch.float64)
    got = flce.linear_log_probs(x, w, t, linear_bias=b, outputs=("log_probs", "entropy"), temperature=0.8,
                                softcap=softcap, chunk_size=chunk_size, backend="triton")
    grads = torch.autograd.grad((got.log_probs * g_lp.float() + got.entropy * g_ent.float()).sum(), (x, w, b))
    want, leaves, _ = reference_stats(x, w, t, b, temperature=0.8, softcap=softcap)
    exact = torch.autograd.grad((want.log_probs * g_lp + want.entropy * g_ent).sum(), leaves)
    assert len(hopper_gemm_calls) == 2 * (3 if chunk_size else 1)  # forward and backward's recompute
    # in float16 1.3e-3 / 1.2e-4 and 1.4-1.6x; 1.0e-2 / 5.8e-3 and 13.6-13.8x with the logits stored as such
    eps = torch.finfo(HOPPER_DTYPE).eps
    # the log-probs from each target's float32 dot with the lse: 7e-5 / 8.5e-5; 1.3e-3 from the stored value
    assert (got.log_probs.double() - want.log_probs).abs().max() <= 0.25 * eps
    assert (got.entropy.double() - want.entropy).abs().max() <= 0.5 * eps
    assert max(errors_in_roundings(grads, exact, HOPPER_DTYPE)) <= 2.5


@pytest.mark.gpu
@settings(deadline=None, max_examples=GPU_FUZZ_EXAMPLES)
@given(
    n=st.one_of(st.sampled_from([1, 16, 17, 255, 256, 1024, 3000]), st.integers(0, 3000)),
    hidden=st.sampled_from([8, 64, 100, 256, 1024]),
    vocab=st.one_of(st.sampled_from([1, 1000, 32000, 32003, 65536]), st.integers(1, 20000)),
    lead=st.sampled_from([(), (2,)]), chunk=st.sampled_from([None, None, 100, 256, 1024]),
    ignore=st.sampled_from([0.0, 0.0, 0.3, 1.0]), bias=st.sampled_from(["none", "none", "frozen", "trained"]),
    temperature=st.sampled_from([1.0, 1.0, 0.7]), softcap=st.sampled_from([None, None, 30.0]),
    dtype=st.sampled_from(["bf16", "bf16", "fp16", "fp32", "autocast"]), validate=st.booleans(),
    outputs=st.sampled_from([FIELDS, ("log_probs",), ("log_probs", "entropy"), ("entropy", "is_top1")]),
    steps=st.lists(st.sampled_from(["nll", "nll", "weighted", "entropy", "forward"]), min_size=3, max_size=3),
    spread=st.sampled_from([1.0, 2.0, 8.0]), seed=st.integers(0, 2**31 - 1),
)
def test_gpu_random_log_prob_steps(n, hidden, vocab, lead, chunk, ignore, bias, temperature, softcap, dtype, validate,
                                   outputs, steps, spread, seed):
    """GPU-sized cases of ``_check_log_prob_steps``: the fused Hopper GEMM, float32 logits below 256 rows."""
    hypothesis.assume(n * vocab * (2 if lead else 1) <= 4e7)
    _check_log_prob_steps(n, hidden, vocab, lead, chunk, ignore, bias, temperature, softcap, dtype, validate, outputs,
                          steps, spread, seed)


@settings(deadline=None)
@given(
    n=st.integers(0, 40), hidden=st.integers(1, 24), vocab=st.integers(1, 300), lead=st.sampled_from([(), (2,)]),
    chunk=st.sampled_from([None, 1, 8, 32]), ignore=st.sampled_from([0.0, 0.3, 1.0]),
    bias=st.sampled_from(["none", "frozen", "trained"]), temperature=st.sampled_from([1.0, 0.7]),
    softcap=st.sampled_from([None, 30.0]), dtype=st.sampled_from(["bf16", "fp16", "fp32", "autocast"]),
    validate=st.booleans(),
    outputs=st.sampled_from([FIELDS, ("log_probs",), ("log_probs", "entropy"), ("entropy", "is_top1")]),
    steps=st.lists(st.sampled_from(["nll", "nll", "weighted", "entropy", "forward"]), min_size=3, max_size=3),
    spread=st.sampled_from([1.0, 2.0, 8.0]), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**31 - 1),
)
def test_random_log_prob_steps(n, hidden, vocab, lead, chunk, ignore, bias, temperature, softcap, dtype, validate,
                               outputs, steps, spread, backend, seed):
    """``_check_log_prob_steps`` on small cases, both backends (under the interpreter, which truncates 16-bit casts
    where CUDA rounds, the Triton backend in float32)."""
    hypothesis.assume(backend == "torch" or DEVICE.type == "cuda" or dtype == "fp32")
    _check_log_prob_steps(n, hidden, vocab, lead, chunk, ignore, bias, temperature, softcap, dtype, validate, outputs,
                          steps, spread, seed, backend)


def _check_log_prob_steps(n, hidden, vocab, lead, chunk, ignore, bias, temperature, softcap, dtype, validate, outputs,
                          steps, spread, seed, backend="auto"):
    """Three calls on one case, each with its own backward: a mean negative log-likelihood ("nll": the uniform
    grad_output after which the next call guesses and computes the gradients in forward), per-token weights,
    an entropy term too, or none; every field and gradient against the float64 reference, within the tolerance
    or twice the error of eager PyTorch's computation from the 16-bit logits it rounds."""
    torch.manual_seed(seed)
    store = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    gemm = torch.bfloat16 if dtype == "autocast" else store
    x, w, b, t = make((*lead, n), hidden, vocab, store, bias=bias != "none", ignore=ignore, scale=spread)
    if b is not None:
        b.requires_grad_(bias == "trained")
    opts = dict(temperature=temperature, softcap=softcap)
    want, leaves, z = reference_stats(x, w, t, b, **opts)
    eager_logits = logits_leaf(x, w, b, gemm)
    eager = stats_of_logits(capped(eager_logits, **opts), t)
    tol = TOL[gemm]
    for step in steps:
        case = [None if a is None else a.detach().requires_grad_(a.requires_grad) for a in (x, w, b)]
        with torch.autocast(DEVICE.type, dtype=gemm, enabled=dtype == "autocast"):
            got = flce.linear_log_probs(*case[:2], t, linear_bias=case[2], outputs=outputs, chunk_size=chunk,
                                        validate_target=validate, backend=backend, **opts)
        for name in outputs:
            if name == "is_top1":
                assert_top1(got.is_top1, want.is_top1, z, gemm, 0.0)
                continue
            field, exact = getattr(got, name), getattr(want, name).detach()
            allowed = 2 * rel_err(getattr(eager, name), exact)
            assert field.dtype == torch.float32 and rel_err(field, exact) <= tol + allowed, (step, name)
        weights = torch.randn(2, *t.shape, dtype=torch.float64)
        objective = {"nll": {"log_probs": -1.0 / max(int((t != -100).sum()), 1)},
                     "weighted": {"log_probs": weights[0]},
                     "entropy": {"log_probs": weights[0], "entropy": weights[1]}}.get(step, {})
        terms = {k: v for k, v in objective.items() if k in outputs}
        if not terms or not any(a is not None and a.requires_grad for a in case):
            continue
        sum((getattr(got, k) * (v.float() if torch.is_tensor(v) else v)).sum() for k, v in terms.items()).backward()
        exact_loss = sum((getattr(want, k) * v).sum() for k, v in terms.items())
        exact = torch.autograd.grad(exact_loss, [a for a in leaves if a is not None and a.requires_grad],
                                    retain_graph=True)
        eager_loss = sum((getattr(eager, k) * v).sum() for k, v in terms.items())
        rounded = linear_grads(torch.autograd.grad(eager_loss, eager_logits, retain_graph=True)[0], x, w)
        wanted = [(a, r) for a, r in zip(case, rounded) if a is not None and a.requires_grad]
        for (leaf, eager_grad), exact_grad in zip(wanted, exact):
            assert leaf.grad.dtype == leaf.dtype
            allowed = 2 * rel_err(eager_grad, exact_grad)
            assert rel_err(leaf.grad, exact_grad) <= tol + allowed, (step, "gradient")
