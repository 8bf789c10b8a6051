"""flce.grouped_linear_cross_entropy against a per-group float64 loop of the reference loss."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, HOPPER_DTYPE
from reference import TOL, assert_close, errors_in_roundings, peaked_case, reference_loss, rel_err

import flce
from flce import grouped_loss

OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "class_weight": {"weight_cls": True},
    "all": {"bias": True, "weight_cls": True, "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0,
            "temperature": 1.3, "ignore": 0.25},
}


def make_case(B, G, hidden, vocab, dtype, device, *, group_major=False, bias=False, weight_cls=False,
              ignore=0.0, ignore_index=-100):
    lead = (G, B) if group_major else (B, G)
    x = torch.randn(*lead, hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(G, vocab, hidden, device=device) / hidden**0.5 * 2).to(dtype).requires_grad_()
    b = (torch.randn(G, vocab, device=device) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, lead, device=device)
    if ignore:
        t[torch.rand(lead, device=device) < ignore] = ignore_index
    cw = (torch.rand(vocab, device=device) + 0.2) if weight_cls else None
    return x, w, b, t, cw


def grouped_reference(x, w, b, t, cw, group_major, reduction="mean", num_items_in_batch=None, group_reduction="sum",
                      **opts):
    """Per group g, the float64 reference L_g under ``reduction`` and ``num_items_in_batch``; then the
    groups' combination (see grouped_loss's docstring): sum_g L_g, their mean, or "pooled", every token
    of every group as one batch. Returns (loss, grads_fn) where grads_fn() gathers the float64 grads;
    ``grouped_reference.group_losses`` holds the (G,) per-group losses as LossStats reports them."""
    dim = 0 if group_major else 1
    per_group, rows, leaves = [], [], []
    for g in range(w.shape[0]):
        b_g = b[g] if b is not None else None
        kw = dict(linear_bias=b_g, weight_cls=cw, **opts)
        r, lv = reference_loss(x.select(dim, g), w[g], t.select(dim, g), reduction="none", **kw)
        rows.append(r)
        leaves.append(lv)
        if reduction != "none":  # L_g through the same (float64) leaves
            loss_g, _ = _reduce(r, t.select(dim, g), cw, reduction, num_items_in_batch, opts)
            per_group.append(loss_g)
    rows = torch.stack(rows, dim)
    if reduction == "none":
        loss = rows
    elif group_reduction == "pooled":
        loss, _ = _reduce(rows, t, cw, reduction, num_items_in_batch, opts)
        sums = rows.sum(1 - dim)
        grouped_reference.group_losses = sums * (loss / rows.sum() if rows.sum() != 0 else 0.0)
    else:
        stacked = torch.stack(per_group)
        grouped_reference.group_losses = stacked.detach()
        loss = stacked.sum() if group_reduction == "sum" else stacked.mean()

    def grads():
        out = []
        for k, stack_dim in ((0, dim), (1, 0), (2, 0)):
            parts = [lv[k].grad if lv[k] is not None else None for lv in leaves]
            out.append(None if parts[0] is None else torch.stack(parts, stack_dim))
        return out

    return loss, grads


def _reduce(rows, t, cw, reduction, num_items_in_batch, opts):
    """F.cross_entropy's reduction of per-token losses (float64), with num_items_in_batch as HF's."""
    if num_items_in_batch is not None:
        return rows.sum() / float(num_items_in_batch), None
    if reduction == "sum":
        return rows.sum(), None
    valid = t != opts.get("ignore_index", -100)
    denom = cw.double()[t[valid]].sum() if cw is not None else valid.sum().double()
    return (rows.sum() / denom if denom != 0 else rows.sum() * 0.0), None


def check(backend, device, *, B=7, G=3, hidden=16, vocab=50, dtype=torch.float32, group_major=False,
          reduction="mean", grad_tol=None, **opts):
    case = {k: opts.pop(k) for k in ("bias", "weight_cls", "ignore") if k in opts}
    x, w, b, t, cw = make_case(B, G, hidden, vocab, dtype, device, group_major=group_major,
                               ignore_index=opts.get("ignore_index", -100), **case)
    loss = flce.grouped_linear_cross_entropy(x, w, t, group_major=group_major, linear_bias=b, weight=cw,
                                             reduction=reduction, backend=backend, **opts)
    for k in ("chunk_size", "accum_dtype", "validate_target", "return_stats"):
        opts.pop(k, None)
    ref, ref_grads = grouped_reference(x, w, b, t, cw, group_major, reduction, **opts)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, tol, "loss")
    grad_out = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    loss.backward(grad_out.to(loss.device, loss.dtype))
    ref.backward(grad_out.to(ref.device))
    for name, got, want in zip(("grad_input", "grad_weight", "grad_bias"),
                               (x.grad, w.grad, b.grad if b is not None else None), ref_grads()):
        if want is not None:
            assert got.dtype == dtype and got.shape == want.shape, name
            assert_close(got, want, grad_tol or tol, name)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("group_major", [False, True])
def test_layouts_and_reductions(backend, device, group_major, reduction):
    check(backend, device, group_major=group_major, reduction=reduction, ignore=0.2, chunk_size=3)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(backend, device, name):
    check(backend, device, group_major=name == "all", chunk_size=4, **dict(OPTIONS[name]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device, dtype):
    check("torch", device, dtype=dtype, B=20, hidden=32, vocab=70, chunk_size=6, **dict(OPTIONS["all"]))


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("group_major", [False, True])
def test_input_gradient_in_pieces(backend, device, monkeypatch, group_major, chunk_size):
    """A chunk's bf16 grad_input comes from float32 products of a few rows at a time (the pieces of a
    batch-major chunk keep its layout; a group-major one's are copied out)."""
    monkeypatch.setattr(flce.function, "PRODUCT_BYTES", 5 * 3 * 16 * 4)  # 5 rows of 3 heads x 16
    check(backend, device, dtype=torch.bfloat16, B=23, G=3, hidden=16, vocab=40, group_major=group_major,
          chunk_size=chunk_size, bias=True, ignore=0.2)


@pytest.mark.parametrize("B,G,hidden,vocab,chunk,group_major", [
    (1, 3, 9, 37, None, False),   # B = 1, V not a multiple of 8
    (6, 1, 8, 21, 4, True),       # G = 1, short last chunk
    (11, 2, 7, 1, 5, False),      # V = 1: loss 0, gradients 0
    (13, 4, 12, 30, 1, True),     # one position per chunk
])
def test_odd_shapes(backend, device, B, G, hidden, vocab, chunk, group_major):
    check(backend, device, B=B, G=G, hidden=hidden, vocab=vocab, chunk_size=chunk, group_major=group_major,
          label_smoothing=0.1, ignore=0.2, reduction="none")


@pytest.mark.parametrize("group_reduction", ["sum", "mean", "pooled"])
@pytest.mark.parametrize("group_major", [False, True])
def test_equals_a_loop_of_linear_cross_entropy(device, group_major, group_reduction):
    """The contract, against flce's own per-group calls L_g = linear_cross_entropy(x_g, W_g, t_g, ...):
    "sum" is sum_g L_g, "mean" their mean, "pooled" the per-group sums over the valid tokens (class
    weights) of all groups, i.e. each L_g with num_items_in_batch = that total. Values and gradients."""
    x, w, b, t, cw = make_case(9, 3, 12, 40, torch.float32, device, group_major=group_major, bias=True,
                               weight_cls=True, ignore=0.3)
    t.select(0 if group_major else 1, 2)[:7] = -100  # groups with different valid counts
    dim = 0 if group_major else 1
    denom = cw[t[t != -100]].sum()
    per_group_kw = {"num_items_in_batch": denom} if group_reduction == "pooled" else {}
    for reduction in ("sum", "mean"):
        for p in (x, w, b):
            p.grad = None
        grouped_l = flce.grouped_linear_cross_entropy(x, w, t, group_major=group_major, linear_bias=b, weight=cw,
                                                      reduction=reduction, z_loss=1e-3, chunk_size=4,
                                                      group_reduction=group_reduction)
        grouped_l.backward()
        grouped_grads = [p.grad.clone() for p in (x, w, b)]
        for p in (x, w, b):
            p.grad = None
        kw = per_group_kw if reduction == "mean" else {}
        losses = [flce.linear_cross_entropy(x.select(dim, g), w[g], t.select(dim, g), linear_bias=b[g], weight=cw,
                                            z_loss=1e-3, reduction=reduction, **kw) for g in range(3)]
        loop = sum(losses) / (3 if group_reduction == "mean" else 1)
        loop.backward()
        assert_close(grouped_l, loop, 1e-6, reduction)
        for got, want in zip(grouped_grads, (x.grad, w.grad, b.grad)):
            assert_close(got, want, 1e-5, reduction)


@pytest.mark.parametrize("group_reduction", ["sum", "mean", "pooled"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_group_losses_in_stats_match_float64(backend, device, group_reduction, reduction):
    """LossStats.group_losses: each group's loss L_g (its share of the pooled loss for "pooled"), against
    the per-group float64 reference; their sum (mean for "mean") is the loss."""
    x, w, b, t, cw = make_case(8, 3, 12, 30, torch.float32, device, bias=True, weight_cls=True, ignore=0.3)
    t[:6, 1] = -100
    kw = dict(linear_bias=b, weight=cw, reduction=reduction, label_smoothing=0.1, group_reduction=group_reduction)
    loss, stats = flce.grouped_linear_cross_entropy(x, w, t, return_stats=True, backend=backend, chunk_size=3, **kw)
    kw.pop("linear_bias"), kw.pop("weight")
    ref, _ = grouped_reference(x, w, b, t, cw, False, **kw)
    assert_close(loss, ref, 1e-5, "loss")
    assert stats.group_losses.shape == (3,)
    assert_close(stats.group_losses, grouped_reference.group_losses, 1e-5, "group_losses")
    combined = stats.group_losses.mean() if group_reduction == "mean" else stats.group_losses.sum()
    assert_close(combined, loss.detach(), 1e-6, "sum of group losses")


@pytest.mark.parametrize("chunk_size", [None, 64])
@pytest.mark.parametrize("group_reduction", ["sum", "mean"])
@pytest.mark.parametrize("g", [1.0, 1 / 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_group_scales_stay_out_of_the_rounded_dlogits(backend, device, chunk_size, group_reduction, g, temperature):
    """Each head's mean, 1 / count_g, folded into its 16-bit dlogits put that scale's rounding on every target
    entry of the head: 1.75x the bf16 rounding in both gradients at these counts (172 and 161), 2.0x with
    grad_output 1/3. The dlogits now take none of it (each scale's power of two until 18546e1); the scale meets
    grad_input's float32 product and the float32 weight sums (1.0x); grad_output 1/3 still rounds the grad_input they
    stored a second time (1.4x). A single chunk leaves its dlogits unscaled for backward's GEMMs, which apply
    scale and grad_output to grad_input's float32 product (1.0x) and to x_c for grad_weight (1.4x). The
    temperature's 1 / 0.7 joins the scales."""
    if backend == "triton" and device.type == "cpu":
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    B, G, vocab, hidden = 200, 2, 4096, 64
    x = torch.randn(B, G, hidden, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(G, vocab, hidden, device=device) * hidden**-0.5 * 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (B, G), device=device)
    for group, ignored in enumerate((28, 39)):  # 172 and 161 tokens count
        t[torch.randperm(B, device=device)[:ignored], group] = -100
    loss = flce.grouped_linear_cross_entropy(x, w, t, backend=backend, chunk_size=chunk_size,
                                             group_reduction=group_reduction, temperature=temperature)
    grads = torch.autograd.grad(loss * g, (x, w))
    z = torch.einsum("bgh,gvh->bgv", x, w).double().requires_grad_()  # the 16-bit logits both compute from
    per_group = [F.cross_entropy(z[:, k] / temperature, t[:, k]) for k in range(G)]
    ref = sum(per_group) / (G if group_reduction == "mean" else 1)
    (dz,) = torch.autograd.grad(ref * g, z)
    exact = [torch.einsum("bgv,gvh->bgh", dz, w.double()), torch.einsum("bgv,bgh->gvh", dz, x.double())]
    rounding = [rel_err(e.to(torch.bfloat16), e) for e in exact]
    assert rel_err(grads[0], exact[0]) <= (1.05 if g == 1 or not chunk_size else 1.6) * rounding[0]
    assert rel_err(grads[1], exact[1]) <= (1.05 if chunk_size else 1.5) * rounding[1]


@pytest.mark.parametrize("chunk_size", [None, 256])
def test_fp16_means_keep_the_softmax_tail(backend, device, chunk_size):
    """As the one-head loss (``test_api.py::test_fp16_mean_keeps_the_softmax_tail``): several chunks' fp16 dlogits
    took each head's power of two of its mean (2^-11 here), sinking the softmax's tail below fp16's smallest
    normal, and their fp16 grad_input the whole scale before grad_output (1024) came: 4.0x the fp16 rounding in
    both gradients. Now 1.2x."""
    if backend == "triton" and device.type == "cpu":
        pytest.skip("the interpreter truncates 16-bit casts where CUDA rounds: covered on a GPU")
    B, G, vocab, hidden = 1024, 2, 2048, 16
    x = torch.randn(B, G, hidden, device=device).half().requires_grad_()
    w = (torch.randn(G, vocab, hidden, device=device) * hidden**-0.5).half().requires_grad_()
    t = torch.randint(0, vocab, (B, G), device=device)
    loss = flce.grouped_linear_cross_entropy(x, w, t, backend=backend, chunk_size=chunk_size, group_reduction="mean")
    grads = torch.autograd.grad(loss * 1024, (x, w))
    z = torch.einsum("bgh,gvh->bgv", x.double(), w.double()).requires_grad_()
    (dz,) = torch.autograd.grad(sum(F.cross_entropy(z[:, k], t[:, k]) for k in range(G)) / G * 1024, z)
    exact = [torch.einsum("bgv,gvh->bgh", dz, w.double()), torch.einsum("bgv,bgh->gvh", dz, x.double())]
    for got, e, bound in zip(grads, exact, (1.5, 1.8 if chunk_size is None else 1.5)):
        assert rel_err(got, e) <= bound * rel_err(e.half(), e)


def test_num_items_in_batch(device):
    for reduction in ("mean", "sum"):
        check("torch", device, reduction=reduction, ignore=0.3, num_items_in_batch=11)
    check("torch", device, ignore=0.3, num_items_in_batch=torch.tensor(11, device=device), group_major=True)


def test_accumulators(device):
    for accum in (torch.float32, torch.bfloat16):
        check("torch", device, dtype=torch.bfloat16, B=16, chunk_size=3, accum_dtype=accum)


def test_autocast_bf16_with_fp32_weights(device):
    x, w, b, t, _ = make_case(10, 3, 16, 40, torch.float32, device, bias=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = flce.grouped_linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=4)
    loss.backward()
    ref, ref_grads = grouped_reference(x, w, b, t, None, False)
    ref.backward()
    assert_close(loss, ref, 3e-2, "loss")
    for name, got, want in zip(("x", "w", "b"), (x.grad, w.grad, b.grad), ref_grads()):
        assert got.dtype == torch.float32, name
        assert_close(got, want, 3e-2, name)


@pytest.mark.parametrize("group_major", [False, True])
def test_positions_ignored_everywhere_are_skipped(backend, device, monkeypatch, group_major):
    """Batch positions whose every group is ignored never reach the GEMMs (validate_target=True); the
    sync-free path computes and zeroes them; both give the reference's values."""
    B, G = 10, 3
    x, w, b, t, _ = make_case(B, G, 8, 20, torch.float32, device, group_major=group_major, bias=True, ignore=0.2)
    dim = 1 if group_major else 0
    t.index_fill_(dim, torch.tensor([0, 4, 5], device=device), -100)  # three positions ignored in every group
    seen = []
    real = grouped_loss.ce_chunk
    monkeypatch.setattr(grouped_loss, "ce_chunk", lambda *a, **k: seen.append(a[1].shape[0]) or real(*a, **k))
    results = []
    g = torch.randn(t.shape, device=device)
    for validate in (True, False):
        seen.clear()
        for p in (x, w, b):
            p.grad = None
        rows = flce.grouped_linear_cross_entropy(x, w, t, group_major=group_major, linear_bias=b,
                                                 reduction="none", backend=backend, validate_target=validate)
        assert sum(seen) == G * (B - 3 if validate else B)
        rows.backward(g)
        results.append([rows.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone()])
    ref, ref_grads = grouped_reference(x, w, b, t, None, group_major, "none")
    ref.backward(g.double())
    for got in results:
        assert_close(got[0], ref, 1e-5, "loss")
        for a, want in zip(got[1:], ref_grads()):
            assert_close(a, want, 1e-5)
    assert torch.all(results[0][1].select(dim, 0) == 0)


def test_chunks_never_hold_all_logits(device, monkeypatch):
    """Each chunk's logits are G * chunk_size rows (the last one fewer), never (B, G, V)."""
    B, G, chunk = 11, 3, 4
    seen = []
    real = grouped_loss.ce_chunk
    monkeypatch.setattr(grouped_loss, "ce_chunk", lambda *a, **k: seen.append(tuple(a[1].shape)) or real(*a, **k))
    x, w, _, t, _ = make_case(B, G, 8, 30, torch.float32, device)
    flce.grouped_linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
    assert seen == [(G * 4, 30), (G * 4, 30), (G * 3, 30)]


def test_no_grad_path_and_stats(backend, device):
    x, w, _, t, _ = make_case(12, 2, 16, 30, torch.float32, device, ignore=0.25)
    t[:3] = (torch.einsum("bgh,gvh->bgv", x.detach(), w.detach())[:3]).argmax(-1)  # some sure hits
    loss, stats = flce.grouped_linear_cross_entropy(x, w, t, z_loss=1e-2, return_stats=True, backend=backend,
                                                    chunk_size=5)
    with torch.no_grad():
        loss_ng = flce.grouped_linear_cross_entropy(x, w, t, z_loss=1e-2, backend=backend, chunk_size=5)
    assert_close(loss_ng, loss.detach(), 1e-6)
    logits = torch.einsum("bgh,gvh->bgv", x.detach().double(), w.detach().double())
    valid = t != -100
    lse = torch.logsumexp(logits, -1)
    assert stats.num_valid.item() == valid.sum().item()
    acc = ((logits.argmax(-1) == t) & valid).sum() / valid.sum()
    assert stats.accuracy.item() == pytest.approx(acc.item(), abs=1e-6)
    z_per_group = (1e-2 * lse.square() * valid).sum(0) / valid.sum(0)  # group_reduction="sum": of each group's mean
    assert stats.z_loss.item() == pytest.approx(z_per_group.sum().item(), rel=1e-5)
    rows, stats_none = flce.grouped_linear_cross_entropy(x, w, t, z_loss=1e-2, reduction="none",
                                                         return_stats=True, backend=backend)
    assert rows.shape == t.shape and stats_none.z_loss.shape == t.shape
    assert torch.allclose(stats_none.z_loss.double(), 1e-2 * lse.square() * valid, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nothing_to_count_is_zero_not_nan(device, reduction):
    x, w, _, _, _ = make_case(4, 2, 8, 20, torch.float32, device)
    t = torch.full((4, 2), -100, device=device)
    loss = flce.grouped_linear_cross_entropy(x, w, t, reduction=reduction)
    assert loss.shape == ((4, 2) if reduction == "none" else ())
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert torch.all(x.grad == 0) and torch.all(w.grad == 0)


def test_second_backward(device):
    x, w, _, t, _ = make_case(6, 2, 8, 20, torch.float32, device)
    loss = flce.grouped_linear_cross_entropy(x, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    x.grad = None
    rows = flce.grouped_linear_cross_entropy(x, w, t, reduction="none")
    g = torch.randn_like(rows)
    rows.backward(g, retain_graph=True)
    first = x.grad.clone()
    rows.backward(g)
    assert torch.allclose(x.grad, 2 * first, rtol=1e-5, atol=1e-7)


def test_bad_inputs_raise(device):
    x, w, b, t, _ = make_case(4, 3, 8, 20, torch.float32, device)
    call = flce.grouped_linear_cross_entropy
    with pytest.raises(ValueError, match="linear_weight must be"):
        call(x, w[0], t)
    with pytest.raises(ValueError, match="input must be"):
        call(x, w[:2], t)
    with pytest.raises(ValueError, match="input must be"):
        call(x, w, t, group_major=True)
    with pytest.raises(ValueError, match="target shape"):
        call(x, w, t.t())
    with pytest.raises(ValueError, match="linear_bias"):
        call(x, w, t, linear_bias=torch.randn(20, device=device))
    with pytest.raises(ValueError, match=r"weight \(class weights\) must be"):
        call(x, w, t, weight=torch.rand(3, 20, device=device))
    with pytest.raises(TypeError, match="target"):
        call(x, w, t.float())
    with pytest.raises(TypeError, match="share a dtype"):
        call(x.double(), w, t)
    bad = t.clone()
    bad[1, 2] = 20
    with pytest.raises(ValueError, match="outside"):
        call(x, w, bad)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        call(x, w, t, reduction="none", num_items_in_batch=3)
    with pytest.raises(ValueError, match="chunk_size"):
        call(x, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="reduction"):
        call(x, w, t, reduction="avg")


# ---------------------------------------------------------------- GPU: real shapes

@pytest.mark.gpu
@pytest.mark.parametrize("group_major", [False, True])
def test_gpu_real_shape_bf16(group_major):
    """B=2048 positions, G=4 heads of a 32000-word vocabulary at H=1024 in bf16, several chunks: the
    float64 per-group reference, and peak memory below what the (B, G, V) logits alone would take."""
    dev = torch.device("cuda")
    B, G, H, V = 2048, 4, 1024, 32000
    x, w, b, t, _ = make_case(B, G, H, V, torch.bfloat16, dev, group_major=group_major, ignore=0.1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = flce.grouped_linear_cross_entropy(x, w, t, group_major=group_major, label_smoothing=0.1,
                                             chunk_size=512)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = G * V * H * (4 + 2) + B * G * H * 2  # fp32 accumulator, bf16 grad_weight, grad_input
    chunk_logits = G * 512 * V * 2
    assert extra < grads + 2 * chunk_logits < grads + B * G * V * 2  # the full logits would not fit
    ref, ref_grads = grouped_reference(x, w, b, t, None, group_major, label_smoothing=0.1)
    ref.backward()
    assert_close(loss, ref, TOL[torch.bfloat16], "loss")
    for name, got, want in zip(("x", "w"), (x.grad, w.grad), ref_grads()):
        assert_close(got, want, TOL[torch.bfloat16], name)


# ---------------------------------------------------------------- flce's Hopper logits GEMM, one per group

@pytest.mark.parametrize("name", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("group_major", [False, True])
def test_through_the_hopper_gemm(hopper_gemm_calls, name, reduction, group_major):
    """Each group's logits from flce's GEMM, stored less their tile max, read once by the CE kernel with the
    tile statistics: every option against float64, both layouts (a batch-major x_c[g] is a strided view)."""
    check("triton", DEVICE, B=40, G=3, hidden=32, vocab=600, dtype=HOPPER_DTYPE, group_major=group_major,
          reduction=reduction, chunk_size=16, **dict(OPTIONS[name]))
    assert hopper_gemm_calls and len(hopper_gemm_calls) % 3 == 0  # every group of every chunk
    if name == "plain":  # 40 positions in chunks of 16, once more in backward for reduction="none"
        assert len(hopper_gemm_calls) == 3 * 3 * (2 if reduction == "none" else 1)


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_odd_vocabulary_through_the_hopper_gemm(hopper_gemm_calls, monkeypatch, chunk_size):
    """V not a multiple of 8: the heads' logits in padded rows (the Hopper GEMM stores them there)
    and the batched GEMMs cut V (``gemm._split_gemm``, on here as on CUDA); deferred single chunk and chunks."""
    from flce import gemm

    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    check("triton", DEVICE, B=40, G=3, hidden=32, vocab=601, dtype=HOPPER_DTYPE, chunk_size=chunk_size,
          **dict(OPTIONS["all"]))
    assert hopper_gemm_calls and len(hopper_gemm_calls) % 3 == 0  # every group of every chunk


@pytest.mark.parametrize("chunk_size", [None, 32])
def test_peaked_logits_through_the_hopper_gemm(monkeypatch, hopper_gemm, hopper_gemm_calls, chunk_size):
    """Logits of a trained model's spread (std 6, targets drawn from each head's softmax): the heads' GEMMs
    store them less their tile max, so the gradients stay near the 16-bit rounding (1.3-1.6x here), where
    one batched cuBLAS GEMM's rounded logits read ~8x, as the one-head loss's."""
    B, G, H, V = 96, 2, 32, 512
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(B, G, H, device=DEVICE, generator=gen).to(HOPPER_DTYPE).requires_grad_()
    w = (torch.randn(G, V, H, device=DEVICE, generator=gen) * 6 / H**0.5).to(HOPPER_DTYPE).requires_grad_()
    z = torch.einsum("bgh,gvh->bgv", x.double(), w.double())
    gumbel = -torch.log(-torch.log(torch.rand(B, G, V, device=DEVICE, generator=gen, dtype=torch.float64)))
    t = (z + gumbel).argmax(-1)
    ref, ref_grads = grouped_reference(x, w, None, t, None, False)
    ref.backward()
    exact = ref_grads()[:2]
    errs = {}
    for min_rows in (8, 1 << 40):  # flce's GEMM, then cuBLAS's bmm
        monkeypatch.setattr(hopper_gemm, "MIN_ROWS", min_rows)
        loss = flce.grouped_linear_cross_entropy(x, w, t, chunk_size=chunk_size, backend="triton")
        errs[min_rows] = errors_in_roundings(torch.autograd.grad(loss, (x, w)), exact, HOPPER_DTYPE)
    assert hopper_gemm_calls and max(errs[8]) <= 2.5
    assert all(e <= c / 2 for e, c in zip(errs[8], errs[1 << 40]))


@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 32])
@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.7, label_smoothing=0.1, bias=True), dict(softcap=30.0)])
def test_peaked_logits_losses_from_a_dot_at_the_target(hopper_gemm_calls, chunk_size, opts, group_major):
    """Where the heads' GEMMs store the logits less their tile max, each row's logit at its target comes from a
    float32 dot of its head's operands, as in the one-head loss: the summed loss of two heads of std-6 logits within
    half a 16-bit ulp of 1 (from the stored values 7e-4 and 2.3e-3 off here without a softcap). Rows of either
    layout: x's group stride H and row stride G * H, or (group-major) B * H and H."""
    opts = dict(opts)
    bias = opts.pop("bias", False)
    heads = [peaked_case(96, 32, 512, HOPPER_DTYPE, DEVICE, bias, opts.get("temperature", 1.0),
                         softcap=opts.get("softcap"), seed=g) for g in range(2)]
    x, t = (torch.stack([h[i].detach() for h in heads], 1) for i in (0, 3))  # (B, G, H), (B, G)
    w = torch.stack([h[1].detach() for h in heads]).requires_grad_()  # (G, V, H)
    b = torch.stack([h[2].detach() for h in heads]).requires_grad_() if bias else None
    want, _ = grouped_reference(x.requires_grad_(), w, b, t, None, False, reduction="sum", **opts)
    lead = (lambda a: a.transpose(0, 1).contiguous()) if group_major else (lambda a: a)
    got = flce.grouped_linear_cross_entropy(lead(x), w, lead(t), group_major=group_major, linear_bias=b,
                                            chunk_size=chunk_size, reduction="sum", backend="triton", **opts)
    assert len(hopper_gemm_calls) == 2 * (3 if chunk_size else 1)
    assert (got.double() - want).abs() <= 0.5 * torch.finfo(HOPPER_DTYPE).eps
