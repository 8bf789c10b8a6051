"""flce.linear_cross_entropy against the float64 reference: options, reductions, shapes, backends."""

import pytest
import torch
import torch.nn.functional as F
from reference import (TOL, assert_close, count_172_case, errors_in_roundings, logits_leaf, peaked_case,
                       reference_loss, rel_err)

import flce

OPTION_SETS = {
    "plain": {},
    "bias": {"bias": True},
    "class_weight": {"weight_cls": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 3.0},
    "temperature": {"temperature": 0.7},
    "ignore": {"ignore": 0.3},
    "all": {"bias": True, "weight_cls": True, "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0,
            "temperature": 1.3, "ignore": 0.25},
}


def make_case(shape, hidden, vocab, dtype, device, *, bias=False, weight_cls=False, ignore=0.0,
              ignore_index=-100):
    """Fresh random leaves; targets with a share of ``ignore`` set to ignore_index."""
    x = torch.randn(*shape, hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5 * 2).to(dtype).requires_grad_()
    b = (torch.randn(vocab, device=device) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, shape, device=device)
    if ignore:
        t[torch.rand(shape, device=device) < ignore] = ignore_index
    cw = (torch.rand(vocab, device=device) + 0.2) if weight_cls else None
    return x, w, b, t, cw


def check(backend, dtype, device, shape=(37,), hidden=24, vocab=300, reduction="mean", grad_tol=None,
          **opts):
    case_keys = {k: opts.pop(k) for k in ("bias", "weight_cls", "ignore") if k in opts}
    x, w, b, t, cw = make_case(shape, hidden, vocab, dtype, device, **case_keys,
                               ignore_index=opts.get("ignore_index", -100))
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction,
                                     backend=backend, **opts)
    opts.pop("chunk_size", None), opts.pop("accum_dtype", None), opts.pop("low_memory", None)
    ref, (x64, w64, b64) = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, reduction=reduction, **opts)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, tol, "loss")
    grad_out = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    loss.backward(grad_out.to(loss.device, loss.dtype))
    ref.backward(grad_out.to(ref.device))
    for name, got, want in (("grad_input", x.grad, x64.grad), ("grad_weight", w.grad, w64.grad),
                            ("grad_bias", b.grad if b is not None else None, b64.grad if b64 is not None else None)):
        if want is None:
            continue
        assert got.dtype == dtype, name
        assert_close(got, want, grad_tol or tol, name)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_reductions(backend, device, dtype, reduction):
    check(backend, dtype, device, reduction=reduction, ignore=0.2, chunk_size=16)


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options(backend, device, name, reduction):
    check(backend, torch.float32, device, reduction=reduction, chunk_size=8, **dict(OPTION_SETS[name]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_chunk_backward(backend, device, dtype):
    """A single chunk writes its logits' gradient in backward, where grad_output (1.7 here) is known."""
    check(backend, dtype, device, bias=True, ignore=0.2)


@pytest.mark.parametrize("n", [16, 200])
@pytest.mark.parametrize("g", [1.0, 1 / 3, 0.1])
def test_single_chunk_grad_input_rounds_once_whatever_grad_output(backend, device, n, g, wide_logits):
    """A single chunk applies grad_output and the mean's scale (over a count that is no power of two here)
    to grad_input's float32 product, rounded once: grad_input sits at the bf16 rounding of the exact
    gradient of the logits it sees. Scaling the rounded grad_input, or the rounded dlogits (as up to
    bfaea53), read 1.3-2.1x; eager up to 1.9x (the scale's rounding on every target entry of dlogits)."""
    if backend == "triton" and device.type == "cpu":
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    x = torch.randn(n, 64, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(8192, 64, device=device) * 64**-0.5 * 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 8192, (n,), device=device)
    t[torch.rand(n, device=device) < 0.2] = -100
    grads = torch.autograd.grad(flce.linear_cross_entropy(x, w, t, backend=backend) * g, (x, w))
    # The exact gradients of the logits flce computes from (their rounding is not under test here).
    z = logits_leaf(x, w, None, torch.float64 if wide_logits else x.dtype)
    (dz,) = torch.autograd.grad(F.cross_entropy(z, t) * g, z)
    exact = [dz @ w.double(), dz.t() @ x.double()]  # grad_input, grad_weight
    rounding = [rel_err(e.to(torch.bfloat16), e) for e in exact]
    assert rel_err(grads[0], exact[0]) <= 1.02 * rounding[0]
    # grad_weight also carries the rounding of x_c times the scale (1.0-1.3x here; CUDA's bf16-by-0-d
    # multiply, which rounded the scale first, read up to 2x before the scale met x_c in float32).
    assert rel_err(grads[1], exact[1]) <= 1.5 * rounding[1]


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_a_bias_joins_the_logits_one_rounding(backend, device, chunk_size, wide_logits):
    """A bias head's 16-bit logits are rounded once, as F.linear's (``gemm.linear_into``; on CUDA where the logits'
    rows are whole 128-byte lines, V a multiple of 64 here): the loss of each row is that of the rounded logits to
    float32 arithmetic. The bias added to the rounded product rounded them twice (the GPU fuzz found rows of std-8
    logits off by up to 1.6x eager's error: 0.25 against 0.18)."""
    dtype = torch.float16 if backend == "triton" and device.type == "cpu" else torch.bfloat16
    x = torch.randn(48, 32, device=device).to(dtype).requires_grad_()
    w = (torch.randn(1024, 32, device=device) * 32**-0.5 * 8).to(dtype).requires_grad_()
    b = (torch.randn(1024, device=device) * 4).to(dtype).requires_grad_()
    t = torch.randint(0, 1024, (48,), device=device)
    rows = flce.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none", chunk_size=chunk_size,
                                     backend=backend)
    z = logits_leaf(x, w, b, torch.float64 if wide_logits and chunk_size is None else dtype)
    assert_close(rows, F.cross_entropy(z, t, reduction="none"), 1e-5)


@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "temperature": 0.8, "bias": True},
                                  {"softcap": 30.0}, {"reduction": "none"}], ids=["mean", "options", "softcap", "none"])
def test_small_batch_peaked_logits_at_the_rounding(backend, device, wide_logits, opts):
    """Logits of std 6 with targets drawn from their softmax, as a trained model's, at a small batch (one chunk of
    fewer rows than the fused logits GEMM takes: cuBLAS multiplies). Rounded to 16 bits, the logits carry up to
    |z| / 256 of error into every gradient (4.7-21x the rounding here, as eager PyTorch's); kept in float32 what
    remains is the 16-bit dlogits' own rounding (1.1-1.7x here, as the fused GEMM's shifted logits leave)."""
    dtype = torch.float16 if backend == "triton" and device.type == "cpu" else torch.bfloat16  # the interpreter
    opts = dict(opts)  # truncates bf16 casts
    x, w, b, t = peaked_case(24, 32, 512, dtype, device, opts.pop("bias", False), opts.get("temperature", 1.0),
                             softcap=opts.get("softcap"))
    want, leaves = reference_loss(x, w, t, linear_bias=b, **opts)
    inputs = [a for a in (x, w, b) if a is not None]
    exact = torch.autograd.grad(want.sum(), [a for a in leaves if a is not None])
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, backend=backend, **opts)
    errors = errors_in_roundings(torch.autograd.grad(loss.sum(), inputs), exact, dtype)
    if wide_logits:
        assert max(errors) <= 2.0, errors
    else:  # what the float32 logits mend: the case is one where 16-bit logits show
        assert max(errors) >= 3, errors


@pytest.mark.parametrize("chunk_size", [None, 64])
@pytest.mark.parametrize("mean", ["count", "num_items"])
@pytest.mark.parametrize("g", [1.0, 1 / 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mean_scale_stays_out_of_the_rounded_dlogits(backend, device, chunk_size, mean, g, temperature, wide_logits):
    """A mean's 1 / count folded into the 16-bit dlogits puts that scale's rounding on every target entry:
    1.8x the bf16 rounding in both gradients at this count (172, or num_items_in_batch 172), 2.2x with
    grad_output 1/3 (eager 1.9 / 2.6). A single chunk now leaves dlogits unscaled (grad_weight then carries
    x_c's rounding: 1.3x here); several chunks' dlogits too (until 18546e1 they took its power of two), the scale
    meeting float32. grad_output 1/3 still rounds grad_input twice there: it is stored in forward. 1 / temperature
    joins the scale (folded into the dlogits it read 1.14x at 0.7 with a single chunk or several)."""
    x, w, t, kept = count_172_case(backend, device)
    t[~kept] = -100
    items = {"num_items_in_batch": 172} if mean == "num_items" else {}
    loss = flce.linear_cross_entropy(x, w, t, backend=backend, chunk_size=chunk_size, temperature=temperature,
                                     **items)
    grads = torch.autograd.grad(loss * g, (x, w))
    # the logits flce computes from
    z = logits_leaf(x, w, None, torch.float64 if wide_logits and chunk_size is None else x.dtype)
    (dz,) = torch.autograd.grad(F.cross_entropy(z / temperature, t, reduction="sum") / 172 * g, z)
    exact = [dz @ w.double(), dz.t() @ x.double()]  # grad_input, grad_weight
    rounding = [rel_err(e.to(torch.bfloat16), e) for e in exact]
    stored_twice = chunk_size is not None and g != 1
    assert rel_err(grads[0], exact[0]) <= (1.6 if stored_twice else 1.05) * rounding[0]
    assert rel_err(grads[1], exact[1]) <= (1.05 if chunk_size else 1.5) * rounding[1]


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_masked_mean_over_rows_stays_out_of_the_rounded_dlogits(backend, device, chunk_size, wide_logits):
    """reduction="none" then a masked mean, (rows * mask).sum() / mask.sum(): every kept row's grad_output is
    1 / 172. Folded into the 16-bit dlogits it read 1.84x the bf16 rounding in both gradients (eager 1.84x);
    split per row, the residual meets grad_input's float32 product (1.0x) and x_c (1.3x)."""
    x, w, t, kept = count_172_case(backend, device)
    mask = kept.float()
    rows = flce.linear_cross_entropy(x, w, t, backend=backend, chunk_size=chunk_size, reduction="none")
    grads = torch.autograd.grad((rows * mask).sum() / mask.sum(), (x, w))
    z = logits_leaf(x, w, None, torch.float64 if wide_logits and chunk_size is None else x.dtype)
    (dz,) = torch.autograd.grad((F.cross_entropy(z, t, reduction="none") * mask).sum() / 172, z)
    exact = [dz @ w.double(), dz.t() @ x.double()]
    rounding = [rel_err(e.to(torch.bfloat16), e) for e in exact]
    assert rel_err(grads[0], exact[0]) <= 1.05 * rounding[0]
    assert rel_err(grads[1], exact[1]) <= 1.5 * rounding[1]


@pytest.mark.parametrize("chunk_size", [None, 256])
def test_fp16_mean_keeps_the_softmax_tail(backend, device, chunk_size):
    """Several chunks' fp16 dlogits took a mean's power of two (2^-12 over 4000 items), which sank the softmax's
    tail, p ~ 1 / V, below fp16's smallest normal before backward's grad_output (a GradScaler's 1024 here) could
    lift it, and their fp16 grad_input took the whole scale: 8.9x the fp16 rounding in grad_input and 8.1x in
    grad_weight (90-110x at 8192 x 32 x 32000 without grad_output). The dlogits stay unscaled, as a single chunk's,
    and grad_input waits for grad_output in float32: ~1.2x, as the 16-bit logits allow (a single chunk's
    grad_weight 1.6x: x_c's rounding with the scale)."""
    if backend == "triton" and device.type == "cpu":
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    n, vocab, hidden = 1024, 2048, 16
    x = torch.randn(n, hidden, device=device).half().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).half().requires_grad_()
    t = torch.randint(0, vocab, (n,), device=device)
    loss = flce.linear_cross_entropy(x, w, t, backend=backend, chunk_size=chunk_size, num_items_in_batch=4000.0)
    grads = torch.autograd.grad(loss * 1024, (x, w))
    z = logits_leaf(x, w, None, torch.float64)
    (dz,) = torch.autograd.grad(F.cross_entropy(z, t, reduction="sum") / 4000.0 * 1024, z)
    bounds = (1.5, 1.8 if chunk_size is None else 1.5)
    for got, exact, bound in zip(grads, (dz @ w.double(), dz.t() @ x.double()), bounds):
        assert rel_err(got, exact) <= bound * rel_err(exact.half(), exact)


@pytest.mark.parametrize("reduction,chunk_size", [("mean", None), ("mean", 16), ("none", None), ("none", 16)])
def test_scaled_products_in_pieces(backend, device, monkeypatch, reduction, chunk_size):
    """A single chunk's grad_input float32 product, where a scale meets it before the one rounding (the
    deferred backward, per-row scales), is made a few rows at a time: every row, once (chunks: one piece)."""
    monkeypatch.setattr(flce.function, "PRODUCT_BYTES", 5 * 24 * 4)  # 5 rows of 24
    check(backend, torch.bfloat16, device, shape=(41,), reduction=reduction, chunk_size=chunk_size, ignore=0.2)


@pytest.mark.parametrize("calls", [
    ({}, 0),                           # one chunk, mean, training: the CE kernel counts and averages
    ({"chunk_size": 8}, 1),            # several chunks: the scale is needed before the first one
    ({"reduction": "sum"}, 1),
    ({"num_items_in_batch": 20}, 1),
    ({"bias": True, "ignore": 0.4}, 0),
])
def test_who_counts_the_targets(backend, device, monkeypatch, calls):
    """A single-chunk mean in training leaves the target count to the CE kernel (three launches fewer
    at small batches); every other call counts first. Both give the reference's loss and gradients."""
    import flce.reduction

    opts, want = calls
    counted = []
    count = flce.reduction.count_targets
    monkeypatch.setattr(flce.reduction, "count_targets", lambda *a: counted.append(1) or count(*a))
    check(backend, torch.float32, device, **opts)
    assert len(counted) == want


def test_all_options_bf16_sum(backend, device):
    check(backend, torch.bfloat16, device, reduction="sum", chunk_size=5, **dict(OPTION_SETS["all"]))


def test_custom_ignore_index(backend, device):
    check(backend, torch.float32, device, ignore=0.3, ignore_index=7)


@pytest.mark.parametrize("shape,hidden,vocab,chunk", [
    ((1,), 8, 1, None),          # V = 1: loss 0, gradients 0
    ((1,), 17, 50, None),        # BT = 1, H not a multiple of 16
    ((50,), 17, 33, 7),          # BT not a multiple of the chunk, many chunks
    ((3, 5), 12, 40, 4),         # batched leading shape
    ((2, 1, 3), 9, 20, 2),
])
def test_odd_shapes(backend, device, shape, hidden, vocab, chunk):
    check(backend, torch.float32, device, shape=shape, hidden=hidden, vocab=vocab, chunk_size=chunk,
          label_smoothing=0.1)


def test_large_odd_vocab(backend, device):
    check(backend, torch.float32, device, shape=(6,), hidden=16, vocab=32003, z_loss=1e-3)


def test_num_items_in_batch(backend, device):
    for red in ("mean", "sum"):
        check(backend, torch.float32, device, reduction=red, ignore=0.3, num_items_in_batch=11)
    check(backend, torch.float32, device, ignore=0.3, num_items_in_batch=torch.tensor(11, device=device))


def test_accumulator_choices(backend, device):
    for accum in (torch.float32, torch.bfloat16):
        check(backend, torch.bfloat16, device, chunk_size=4, accum_dtype=accum)


def test_matches_torch_cross_entropy_mean(device):
    """The reference itself equals torch's own mean reduction (guards the reference)."""
    x, w, _, t, cw = make_case((40,), 8, 30, torch.float64, device, weight_cls=True, ignore=0.3)
    ref, _ = reference_loss(x, w, t, weight_cls=cw, label_smoothing=0.15)
    want = F.cross_entropy(x @ w.T, t, weight=cw.double(), label_smoothing=0.15)
    assert torch.allclose(ref, want.detach(), rtol=1e-12)


def test_non_contiguous_inputs(backend, device):
    x_big = torch.randn(24, 40, device=device)
    x = x_big.t()[:, ::2].detach().requires_grad_()  # (40, 12), strided both ways
    w = torch.randn(60, 24, device=device)[:, ::2].detach().requires_grad_()  # (60, 12)
    t = torch.randint(0, 60, (80,), device=device)[::2]
    loss = flce.linear_cross_entropy(x, w, t, backend=backend, chunk_size=16)
    loss.backward()
    ref, (x64, w64, _) = reference_loss(x, w, t)
    ref.backward()
    assert_close(loss, ref, 1e-5, "loss")
    assert_close(x.grad, x64.grad, 1e-5, "grad_input")
    assert_close(w.grad, w64.grad, 1e-5, "grad_weight")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_tokens", [0, 5])
def test_nothing_to_count_is_zero_not_nan(backend, device, reduction, n_tokens):
    x = torch.randn(n_tokens, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    t = torch.full((n_tokens,), -100, device=device)
    loss = flce.linear_cross_entropy(x, w, t, reduction=reduction, backend=backend)
    assert loss.shape == ((n_tokens,) if reduction == "none" else ())
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert x.grad is not None and torch.all(x.grad == 0)
    assert w.grad is not None and torch.all(w.grad == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_propagate(backend, device, bad):
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device)
    with torch.no_grad():
        x[2, 3] = bad
    t = torch.randint(0, 20, (6,), device=device)
    rows = flce.linear_cross_entropy(x, w, t, reduction="none", backend=backend)
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3, 4, 5]]).all()
    assert torch.isnan(flce.linear_cross_entropy(x, w, t, backend=backend))


def test_ignored_rows_with_nan_do_not_leak(backend, device, monkeypatch):
    """An ignored row's NaN stays out of the loss and grad_input. From COMPACT_MIN_ROWS tokens on,
    validation also drops the row before the grad_weight GEMM (on a GPU: at a device's first count);
    otherwise 0 * NaN reaches grad_weight, as in eager PyTorch."""
    from flce.api import COMPACT_MIN_ROWS

    monkeypatch.setattr(flce.api, "_ignored_share", {})  # no count seen yet: the first call counts

    for n, validate in ((COMPACT_MIN_ROWS + 6, True), (COMPACT_MIN_ROWS + 6, False), (6, True)):
        x = torch.randn(n, 8, device=device, requires_grad=True)
        w = torch.randn(20, 8, device=device, requires_grad=True)
        with torch.no_grad():
            x[2] = float("nan")
        t = torch.randint(0, 20, (n,), device=device)
        t[2] = -100
        loss = flce.linear_cross_entropy(x, w, t, backend=backend, validate_target=validate)
        loss.backward()
        assert torch.isfinite(loss), (n, validate)
        assert torch.all(x.grad[2] == 0) and torch.isfinite(x.grad).all(), (n, validate)
        assert torch.isfinite(w.grad).all() == (validate and n >= COMPACT_MIN_ROWS), (n, validate)


def test_validate_target_false_is_the_same_function(backend, device):
    x, w, b, t, cw = make_case((30,), 16, 50, torch.float32, device, bias=True, weight_cls=True, ignore=0.3)
    results = []
    for validate in (True, False):
        for p in (x, w, b):
            p.grad = None
        loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, label_smoothing=0.1,
                                         backend=backend, validate_target=validate, chunk_size=8)
        loss.backward()
        results.append([loss.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone()])
    for a, c in zip(*results):
        assert_close(a, c, 1e-6)


def test_return_stats(backend, device):
    x, w, _, t, _ = make_case((40,), 16, 30, torch.float32, device, ignore=0.25)
    t[:5] = (x[:5].detach() @ w.detach().T).argmax(1)  # some sure hits
    loss, stats = flce.linear_cross_entropy(x, w, t, z_loss=1e-2, return_stats=True, backend=backend,
                                            chunk_size=16)
    logits = (x @ w.T).detach().double()
    valid = t != -100
    lse = torch.logsumexp(logits, 1)
    assert stats.num_valid.item() == valid.sum().item()
    acc = ((logits.argmax(1) == t) & valid).sum() / valid.sum()
    assert stats.accuracy.item() == pytest.approx(acc.item(), abs=1e-6)
    z_ref = (1e-2 * lse.square() * valid).sum() / valid.sum()
    assert stats.z_loss.item() == pytest.approx(z_ref.item(), rel=1e-5)
    assert not stats.z_loss.requires_grad
    rows, stats_none = flce.linear_cross_entropy(x, w, t, z_loss=1e-2, reduction="none", return_stats=True,
                                                 backend=backend)
    assert stats_none.z_loss.shape == t.shape
    assert torch.allclose(stats_none.z_loss.double(), 1e-2 * lse.square() * valid, rtol=1e-5)


def test_second_backward_raises_clearly(backend, device):
    x, w, _, t, _ = make_case((10,), 8, 20, torch.float32, device)
    loss = flce.linear_cross_entropy(x, w, t, backend=backend)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_second_backward_with_reduction_none_recomputes(backend, device):
    x, w, _, t, _ = make_case((10,), 8, 20, torch.float32, device)
    rows = flce.linear_cross_entropy(x, w, t, reduction="none", backend=backend)
    g = torch.randn_like(rows)
    rows.backward(g, retain_graph=True)
    first = x.grad.clone()
    rows.backward(g)
    assert torch.allclose(x.grad, 2 * first, rtol=1e-5, atol=1e-7)


def test_skips_gradients_nobody_needs(backend, device, monkeypatch):
    import flce.function as fn

    calls = []
    real = fn.mm_into
    monkeypatch.setattr(fn, "mm_into", lambda out, a, b, accumulate: calls.append(out.shape)
                        or real(out, a, b, accumulate=accumulate))
    x, w, _, t, _ = make_case((12,), 8, 20, torch.float32, device)
    w.requires_grad_(False)

    def gradient_calls():  # the logits GEMMs (n, 20) go through mm_into too
        return [tuple(s) for s in calls if s[1] == 8]

    flce.linear_cross_entropy(x, w, t, backend=backend, chunk_size=4).backward()
    assert w.grad is None and x.grad is not None
    assert gradient_calls() and all(s[0] <= 4 for s in gradient_calls())  # grad_input slices only
    calls.clear()
    x2 = x.detach()
    w.requires_grad_(True)
    flce.linear_cross_entropy(x2, w, t, backend=backend, chunk_size=4).backward()
    assert gradient_calls() and all(s == (20, 8) for s in gradient_calls())  # grad_weight only
    calls.clear()
    with torch.no_grad():
        flce.linear_cross_entropy(x, w, t, backend=backend)
    assert not gradient_calls()


def test_autocast_bf16_with_fp32_master_weights(backend, device):
    x, w, b, t, _ = make_case((33,), 16, 40, torch.float32, device, bias=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, backend=backend, chunk_size=8)
    loss.backward()
    ref, (x64, w64, b64) = reference_loss(x, w, t, linear_bias=b)
    ref.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert_close(loss, ref, 3e-2, "loss")
    assert_close(x.grad, x64.grad, 3e-2, "grad_input")
    assert_close(w.grad, w64.grad, 3e-2, "grad_weight")
    assert_close(b.grad, b64.grad, 3e-2, "grad_bias")


def test_module_form(backend, device):
    x, w, b, t, _ = make_case((9,), 8, 20, torch.float32, device, bias=True)
    mod = flce.LinearCrossEntropyLoss(label_smoothing=0.1, backend=backend)
    loss = mod(x, w, t, b)
    ref, _ = reference_loss(x, w, t, linear_bias=b, label_smoothing=0.1)
    assert_close(loss, ref, 1e-5)
    assert "label_smoothing=0.1" in repr(mod)


def test_same_call_as_torch_native():
    """Positional arguments and shared keywords mean what torch's own linear_cross_entropy means."""
    native = getattr(F, "linear_cross_entropy", None)
    if native is None:
        pytest.skip("this torch has no F.linear_cross_entropy")
    x, w, b, t, cw = make_case((21,), 8, 30, torch.float32, torch.device("cpu"), bias=True, weight_cls=True,
                               ignore=0.2)
    for red in ("mean", "sum", "none"):
        kw = dict(linear_bias=b, weight=cw, reduction=red, ignore_index=-100, label_smoothing=0.1)
        assert torch.allclose(flce.linear_cross_entropy(x, w, t, **kw), native(x, w, t, **kw), rtol=1e-5,
                              atol=1e-6)


def test_inside_torch_compile_training_step(device):
    """A compiled step with the fused loss gives the eager step's result (a graph break is fine)."""
    torch.manual_seed(1)
    head = torch.nn.Linear(12, 40, bias=False, device=device)
    proj = torch.nn.Linear(12, 12, device=device)
    x = torch.randn(16, 12, device=device)
    t = torch.randint(0, 40, (16,), device=device)

    def step(x, t):
        h = torch.tanh(proj(x))
        loss = flce.linear_cross_entropy(h, head.weight, t, z_loss=1e-3)
        loss.backward()
        return loss.detach()

    eager = step(x, t)
    eager_grads = [p.grad.clone() for p in (head.weight, proj.weight)]
    for p in (head.weight, proj.weight, proj.bias):
        p.grad = None
    compiled = torch.compile(step, backend="aot_eager")(x, t)
    assert torch.allclose(compiled, eager, rtol=1e-5)
    for p, g in zip((head.weight, proj.weight), eager_grads):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6)


def test_sync_for_ignored_rows_only_where_it_pays():
    from flce.api import _sync_pays

    llama3 = dict(n=1024, vocab=128256, hidden=4096)
    assert _sync_pays(None, **llama3)  # no count seen yet on the device
    assert not _sync_pays(0.0, **llama3)  # nothing was ignored last time: the sync buys nothing
    assert _sync_pays(0.3, **llama3)  # SFT prompt masking: dropping 30% saves ~1.3 ms of GEMMs
    assert not _sync_pays(0.3, n=1024, vocab=100, hidden=64)  # a tiny head: not worth a sync


def test_cpu_always_drops_ignored_rows(monkeypatch):
    """The CPU has no queue to drain, so its calls count and compact whatever the last share was."""
    import flce.api as api

    calls = []
    monkeypatch.setattr(api, "_ignored_share", {torch.device("cpu"): 0.0})
    real = api._check_and_compact
    monkeypatch.setattr(api, "_check_and_compact", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(api.COMPACT_MIN_ROWS, 8, requires_grad=True)
    t = torch.randint(0, 20, (api.COMPACT_MIN_ROWS,))
    flce.linear_cross_entropy(x, torch.randn(20, 8), t).backward()
    assert calls == [1]
