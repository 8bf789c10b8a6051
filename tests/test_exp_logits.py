"""The exp-logits path (exp_logits.py, kernels/exp_rows_triton.py, logits_triton's store_exp): loss and
every gradient against float64 for each option it takes, the fallback when rows leave the window, and
which calls take it.

On the CPU it runs under TRITON_INTERPRET=1 with small tiles and in float16 (the interpreter reads bf16
through tensor descriptors wrongly), with a window that float16's narrow range allows and logits that fit
it. On a Hopper GPU it runs in bf16, as users get it."""

from unittest.mock import patch

import pytest
import torch
from reference import ROW_PATH_OPTIONS, TOL, assert_close, reference_loss, row_case, split_options

import flce
from conftest import DEVICE, HOPPER_DTYPE, ON_HOPPER
from flce import exp_logits
from flce.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")

lt = pytest.importorskip("flce.kernels.logits_triton")
DTYPE = HOPPER_DTYPE


def case(*args, dtype=DTYPE, **kwargs):
    """``reference.row_case`` on this file's device and dtype: leaves that require grad."""
    return row_case(*args, dtype=dtype, device=DEVICE, **kwargs)


def run_and_compare(x, w, b, t, cw, reduction="mean", grad_out=1.7, tol=None, mode=None, **opts):
    """flce's loss and gradients against float64 (eager cross-entropy on float64 copies); ``mode``: flce's
    own settings (low_memory, chunk_size). reduction='none' takes a random grad_output per row."""
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction, backend="triton",
                                     **opts, **(mode or {}))
    ref, (x64, w64, ref_b) = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, reduction=reduction, **opts)
    tol = tol or TOL[x.dtype]
    assert_close(loss, ref, tol, "loss")
    g = torch.rand(loss.shape, device=loss.device, dtype=torch.float64) + 0.5 if loss.dim() else torch.tensor(
        grad_out, dtype=torch.float64, device=loss.device)
    loss.backward(g.to(loss.dtype))
    ref.backward(g)
    grads = [("grad_input", x.grad, x64.grad), ("grad_weight", w.grad, w64.grad)]
    if b is not None and b.requires_grad:
        grads.append(("grad_bias", b.grad, ref_b.grad))
    for name, got, want in grads:
        if want is not None:
            assert got.dtype == x.dtype, name
            assert_close(got, want, tol, name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", ROW_PATH_OPTIONS)
def test_matches_float64(path, reduction, opts):
    inputs, opts = split_options(opts)
    run_and_compare(*case(**inputs), reduction=reduction, **opts)
    assert path.taken == [1] and path.fell_back == []


def test_confident_and_repeated_targets(path):
    """Both ways of the one-hot term: rows whose target holds p_y >= 1/2 (folded into e) and the others
    (subtracted apart, runs of rows with one target summed together), and ignored rows among them."""
    x, w, _, t, _ = case(scale=0.3, ignore=0.2)
    b = torch.zeros(w.shape[0], device=DEVICE)
    b[[7, 11]] = 5.5  # exp(5.5) against ~120 terms of about 1: p_y ~ 2/3 for these targets
    b = b.to(x.dtype)
    t[:12] = 7
    t[12:16] = 11
    t[16:24] = 3  # a run of a non-confident target
    run_and_compare(x, w, b, t, None, reduction="sum")  # float16 keeps x * exp(-lse) normal without 1/rows
    assert path.taken == [1] and path.fell_back == []
    apart = path.pending[0].target_coef[t != -100] != 0
    assert apart.any() and not apart.all()  # both ways taken


@pytest.mark.parametrize("wanted", ["input", "weight"])
def test_one_gradient_wanted(path, wanted):
    x, w, b, t, cw = case()
    (w if wanted == "input" else x).requires_grad_(False)
    run_and_compare(x, w, b, t, cw)
    assert path.taken == [1]
    assert (x.grad is None) == (wanted == "weight") and (w.grad is None) == (wanted == "input")


@pytest.mark.parametrize("vocab", [117, 125])
def test_odd_vocabulary(path, monkeypatch, vocab):
    """V not a multiple of 8 (a token added to a vocabulary): e is stored in padded rows
    (``gemm.padded_rows``) and backward's GEMMs cut V into a multiple of 8 and the rest (``gemm._split_gemm``,
    on here as on CUDA)."""
    from flce import gemm

    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    run_and_compare(*case(vocab=vocab))
    assert path.taken == [1] and path.fell_back == []
    assert path.pending[0].e.stride(0) == gemm.padded_width(vocab, DTYPE.itemsize)


def test_rows_of_a_wider_tensor(path):
    """x and W as column slices of wider tensors (row strides beyond H): the row kernel's dot and the
    backward row scale follow the strides."""
    x, w, _, t, _ = case(hidden=32)
    xw = torch.randn(x.shape[0], 48, device=DEVICE).to(x.dtype)
    ww = torch.randn(w.shape[0], 48, device=DEVICE).to(x.dtype)
    xw[:, :32], ww[:, :32] = x.detach(), w.detach()
    xs, ws = xw[:, :32].requires_grad_(), ww[:, :32].requires_grad_()
    run_and_compare(xs, ws, None, t, None)
    assert path.taken == [1]


def test_rows_out_of_the_window_fall_back(path, monkeypatch):
    """Logits far beyond the window: e overflows, forward's loss is still right (its statistics are
    computed safely), backward recomputes through the standard path (so its gradients are the standard
    path's: at such logits the rounding of stored 16-bit logits dominates), and the device then takes the
    standard path for COOL_DOWN calls."""
    x, w, b, t, cw = case(scale=40.0 if DTYPE == torch.float16 else 150.0)
    loss = flce.linear_cross_entropy(x, w, t, backend="triton")
    ref, _ = reference_loss(x, w, t)
    assert_close(loss, ref, 1e-5, "loss")
    loss.backward()
    assert path.taken == [1] and path.fell_back == [1]
    assert exp_logits._cool_down[x.device] == exp_logits.COOL_DOWN
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    flce.linear_cross_entropy(x2, w2, t, backend="triton").backward()
    assert path.taken == [1]  # the cool-down: the standard path from the start
    assert exp_logits._cool_down[x.device] == exp_logits.COOL_DOWN - 1
    # The same computation up to where grad_output is applied: within a tenth of the dtype's tolerance.
    assert_close(x.grad, x2.grad.double(), TOL[x.dtype] / 10, "grad_input")
    assert_close(w.grad, w2.grad.double(), TOL[x.dtype] / 10, "grad_weight")


def test_ignored_rows_out_of_the_window_fall_back(path):
    """An ignored row contributes nothing, but its exponentials enter the GEMMs: out of the window it
    must fall back too (0 * inf would be NaN)."""
    x, w, b, t, cw = case()
    with torch.no_grad():
        x[5] *= 60.0 if DTYPE == torch.float16 else 600.0
    t[5] = -100
    run_and_compare(x, w, b, t, cw)
    assert path.taken == [1] and path.fell_back == [1]
    assert torch.isfinite(x.grad).all() and (x.grad[5] == 0).all()


def test_a_tile_far_below_the_rest_falls_back(path):
    """A tile whose logits all lie below logits_triton.EXP_LOW is stored shifted by its max: every row
    holding one falls back, whatever its lse."""
    block = lt.TILE.block_n
    x, w, _, t, _ = case(vocab=block + 56)
    b = torch.zeros(w.shape[0], device=DEVICE)
    b[block:] = -200.0  # the second, last tile
    b = b.to(x.dtype)
    t.clamp_(max=block - 1)
    run_and_compare(x, w, b, t, None)
    assert path.taken == [1] and path.fell_back == [1]


@pytest.mark.parametrize("opts", [
    {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0}, {"reduction": "none"},
    {"bias_grad": True}, {"return_stats": True}, {"dtype": torch.float32},
    {"bias_grad": True, "chunk_size": 16}, {"accum_dtype": DTYPE, "chunk_size": 16},
])
def test_standard_path_where_it_does_not_apply(path, opts):
    opts = dict(opts)
    x, w, b, t, cw = case(bias=opts.pop("bias_grad", False), dtype=opts.pop("dtype", DTYPE))
    if b is not None:
        b.requires_grad_()
    out = flce.linear_cross_entropy(x, w, t, linear_bias=b, backend="triton", **opts)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()
    assert path.taken == [] and path.chunks == []


def test_small_batches_keep_their_path(path, monkeypatch):
    monkeypatch.setattr(exp_logits, "MIN_ROWS", 1024)
    x, w, b, t, cw = case()
    flce.linear_cross_entropy(x, w, t, backend="triton").backward()
    assert path.taken == []


def test_unchecked_bad_target_gives_nan_not_a_number(path):
    x, w, b, t, cw = case()
    t[4] = w.shape[0] + 3
    loss = flce.linear_cross_entropy(x, w, t, backend="triton", validate_target=False)
    loss.backward()
    assert path.taken == [1] and torch.isnan(loss) and torch.isnan(x.grad[4]).all()


@pytest.mark.parametrize("chunk_size", [None, 16])
@pytest.mark.parametrize("changed", ["input", "weight"])
def test_in_place_change_after_forward_raises(path, chunk_size, changed):
    """Backward reads the GEMM operands (one chunk), or may run the loop again (several): they are kept as eager's
    F.linear keeps them, so changing one in place between forward and backward raises."""
    x, w, b, t, cw = case()
    loss = flce.linear_cross_entropy(x, w, t, backend="triton", chunk_size=chunk_size)
    with torch.no_grad():
        (x if changed == "input" else w).mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert (path.taken, path.chunks) == (([1], []) if chunk_size is None else ([], [16, 16, 8]))


# ---------------------------------------------------------------- several chunks

@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", [
    {},
    {"temperature": 1.3, "weight_cls": True},
    {"ignore": 0.3, "ignore_index": 3, "weight_cls": True},
])
def test_several_chunks_match_float64(path, reduction, opts):
    """Each chunk stores exp(logits) and computes both gradients in forward: grad_input from its float32
    product, grad_weight summed in float32 from the exponentials less the one-hot rows."""
    inputs, opts = split_options(opts)
    run_and_compare(*case(**inputs), reduction=reduction, mode={"chunk_size": 16}, **opts)
    assert path.chunks == [16, 16, 8] and path.taken == [] and path.fell_back == []


def test_several_chunks_and_a_short_last_one(path, monkeypatch):
    """A last chunk below the path's fewest rows takes the standard path in the same loop: the two paths'
    sums take the same part of the mean's scale (``function.unit_dlogits``)."""
    monkeypatch.setattr(exp_logits, "MIN_ROWS", 12)
    x, w, b, t, cw = case(n=41, weight_cls=True)
    run_and_compare(x, w, b, t, cw, mode={"chunk_size": 16})
    assert path.chunks == [16, 16]


def test_several_chunks_odd_vocabulary(path, monkeypatch):
    """V not a multiple of 8: each chunk's exponentials sit in the buffer's padded rows."""
    from flce import gemm

    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    run_and_compare(*case(vocab=117, weight_cls=True), mode={"chunk_size": 16})
    assert path.chunks == [16, 16, 8] and path.fell_back == []


@pytest.mark.parametrize("frozen", ["input", "weight"])
def test_several_chunks_one_gradient_wanted(path, frozen):
    x, w, b, t, cw = case(weight_cls=True)
    (x if frozen == "input" else w).requires_grad_(False)
    run_and_compare(x, w, b, t, cw, mode={"chunk_size": 16})
    assert path.chunks == [16, 16, 8]


# ---------------------------------------------------------------- the low-memory mode's forward chunks

@pytest.fixture
def low_memory_plan(monkeypatch):
    """Backward blocks of 8 vocabulary columns, and forward's float32 product in pieces of
    ``budget / (rows * 4)`` columns (``low_memory_plan``'s budget, patched)."""
    from flce import low_memory_plan as lmp

    monkeypatch.setattr(lmp, "MIN_BLOCK_ELEMENTS", 0)
    monkeypatch.setattr(lmp, "BLOCK_ALIGN", 8)
    monkeypatch.setattr(lmp, "FORWARD_MIN_ROWS", 1)  # forward's share of grad_weight wherever it fits
    return lambda budget: monkeypatch.setattr(lmp, "LOW_MEMORY_BUDGET", budget)



@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [
    {},
    {"temperature": 1.3, "weight_cls": True},
    {"bias": True, "weight_cls": True, "ignore": 0.3, "ignore_index": 3},
])
def test_low_memory_chunks_match_float64(path, low_memory_plan, monkeypatch, reduction, opts):
    """Each forward chunk computes grad_input from its stored exponentials, the product in column pieces
    (16 rows, 16 of 32 columns at a time), and, for a mean or sum, its part of forward's share of
    grad_weight from them too (the bias here needs no gradient); backward's blocks recompute the logits of
    the other columns."""
    low_memory_plan(16 * 16 * 4)
    shares = []
    real = exp_logits.weight_grad
    monkeypatch.setattr(exp_logits, "weight_grad", lambda *a: shares.append((a[6].shape[0], a[7])) or real(*a))
    inputs, opts = split_options(opts)
    run_and_compare(*case(**inputs), reduction=reduction, mode={"low_memory": True, "chunk_size": 16}, **opts)
    assert path.chunks == [16, 16, 8] and path.taken == []
    assert [s[1] for s in shares] == ([False, True, True] if reduction != "none" else [])  # written, then summed into
    assert all(0 < k < 120 for k, _ in shares)


def test_low_memory_odd_vocabulary(path, low_memory_plan, monkeypatch):
    """V not a multiple of 8: forward's buffer in grad_weight's storage and backward's block buffer take padded
    rows, so forward's chunks stay on the exp-logits GEMM; the GEMMs cut V (on here as on CUDA)."""
    from flce import gemm

    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    low_memory_plan(16 * 16 * 4)
    run_and_compare(*case(vocab=117), mode={"low_memory": True, "chunk_size": 16})
    assert path.chunks == [16, 16, 8] and path.taken == []


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [16, None])
def test_low_memory_share_of_a_bias_gradient(path, low_memory_plan, monkeypatch, reduction, chunk):
    """A trainable bias: forward's chunks sum the share's grad_bias entries from their stored exponentials too
    (e^T times the row coefficients, the one-hot terms subtracted), beside the share of grad_weight."""
    low_memory_plan(16 * 16 * 4 if chunk else 1 << 15)
    shares = []
    real = exp_logits.weight_grad
    monkeypatch.setattr(exp_logits, "weight_grad", lambda *a: shares.append(a[8]) or real(*a))
    x, w, b, t, cw = case(hidden=32 if chunk else 96, bias=True, weight_cls=True, ignore=0.2)
    b.requires_grad_(True)  # one chunk: its buffer fits in half of a wider grad_weight's storage
    run_and_compare(x, w, b, t, cw, reduction=reduction, mode={"low_memory": True, "chunk_size": chunk})
    assert path.chunks == ([16, 16, 8] if chunk else [40]) and path.taken == []
    assert shares and all(s is not None and 0 < s.shape[0] < 120 for s in shares)


def test_low_memory_frozen_input_sums_the_share_alone(path, low_memory_plan, monkeypatch):
    """A frozen input: forward's chunks store exp(z) for forward's share of grad_weight alone (no grad_input
    product), backward's blocks take the other columns."""
    low_memory_plan(16 * 16 * 4)
    products, shares = [], []
    monkeypatch.setattr(exp_logits, "input_grad", lambda *a: products.append(1))
    real = exp_logits.weight_grad
    monkeypatch.setattr(exp_logits, "weight_grad", lambda *a: shares.append(a[7]) or real(*a))
    x, w, b, t, cw = case(weight_cls=True)
    x.requires_grad_(False)
    run_and_compare(x, w, b, t, cw, mode={"low_memory": True, "chunk_size": 16})
    assert path.chunks == [16, 16, 8] and shares == [False, True, True] and not products


def test_low_memory_frozen_weight_and_one_chunk(path, low_memory_plan):
    low_memory_plan(1 << 20)
    x, w, b, t, cw = case(weight_cls=True)
    w.requires_grad_(False)
    run_and_compare(x, w, b, t, cw, mode={"low_memory": True})
    assert path.chunks == [x.shape[0]]


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("row", [3, 21, 37])  # in the first, a middle and the last of the chunks
def test_chunks_rows_out_of_the_window_fall_back(path, low_memory_plan, low_memory, row):
    """A row far beyond the window in one of several chunks: forward's loss stands; backward runs forward's loop
    again with the path off (the device then cools down), and in the low-memory mode its blocks with that loop's
    lse: the gradients are the standard path's. The last chunk's miss counts although its count is copied out
    before that chunk's GEMMs."""
    low_memory_plan(1 << 20)
    x, w, b, t, cw = case(scale=0.5)
    with torch.no_grad():
        x[row] *= 80.0 if DTYPE == torch.float16 else 800.0
    mode = {"low_memory": low_memory, "chunk_size": 16}
    loss = flce.linear_cross_entropy(x, w, t, backend="triton", **mode)
    ref, (x64, w64, _) = reference_loss(x, w, t)
    assert_close(loss, ref, TOL[x.dtype], "loss")
    assert path.chunks == [16, 16, 8]
    loss.backward()
    assert exp_logits._cool_down[x.device] == exp_logits.COOL_DOWN - 1  # the recompute took one turn
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    flce.linear_cross_entropy(x2, w2, t, backend="triton", **mode).backward()
    assert path.chunks == [16, 16, 8]  # cooling down: the standard path from the start
    assert exp_logits._cool_down[x.device] == exp_logits.COOL_DOWN - 2  # one turn per call, not per chunk
    # as the standard path computes them (at such logits the rounding of 16-bit logits dominates)
    assert_close(x.grad, x2.grad.double(), TOL[x.dtype] / 10, "grad_input")
    assert_close(w.grad, w2.grad.double(), TOL[x.dtype] / 10, "grad_weight")


@pytest.mark.parametrize("min_rows", [8, 12])  # the last chunk (8 rows) on the path, or on the standard one
def test_chunks_copy_the_window_count_before_the_last_gemms(path, monkeypatch, min_rows):
    """The count leaves the device once, after the last chunk of the path's row kernel and before its GEMMs, so
    that backward's wait for it does not wait for them."""
    monkeypatch.setattr(exp_logits, "MIN_ROWS", min_rows)
    events, check, input_grad = [], exp_logits.WindowCheck, exp_logits.input_grad
    monkeypatch.setattr(exp_logits, "WindowCheck", lambda m: events.append("check") or check(m))
    monkeypatch.setattr(exp_logits, "input_grad", lambda *a, **k: events.append("gemms") or input_grad(*a, **k))
    x, w, b, t, cw = case()
    run_and_compare(x, w, b, t, cw, mode={"chunk_size": 16})
    assert events == ["gemms"] * (len(path.chunks) - 1) + ["check", "gemms"]


def test_low_memory_cool_down_counts_calls_that_could_take_the_path(path, low_memory_plan):
    """While the device cools down, a call whose chunks could not take the path anyway (float32) leaves the
    count alone; one that could takes one turn, however many chunks it has."""
    low_memory_plan(1 << 20)
    x, w, b, t, cw = case(dtype=torch.float32)
    exp_logits._cool_down[x.device] = 5  # keyed by the tensors' device (cuda:0, not cuda)
    flce.linear_cross_entropy(x, w, t, backend="triton", low_memory=True, chunk_size=16).backward()
    assert exp_logits._cool_down[x.device] == 5
    x, w, b, t, cw = case()
    flce.linear_cross_entropy(x, w, t, backend="triton", low_memory=True, chunk_size=16).backward()
    assert exp_logits._cool_down[x.device] == 4 and path.chunks == []


def test_low_memory_unchecked_bad_target_gives_nan(path, low_memory_plan):
    low_memory_plan(1 << 20)
    x, w, b, t, cw = case()
    t[4] = w.shape[0] + 3
    loss = flce.linear_cross_entropy(x, w, t, backend="triton", validate_target=False, low_memory=True)
    loss.backward()
    assert path.chunks == [x.shape[0]] and torch.isnan(loss) and torch.isnan(x.grad[4]).all()
    assert torch.isfinite(x.grad[:4]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 1024, 32000), (2048, 4096, 128256), (8192, 1024, 151936)])
def test_gpu_default_path_real_shapes(shape):
    """bf16 at real sizes with flce's own thresholds (no patching): the path runs (8192 x 1024 x 151936 in
    three chunks), and its gradients are as close to float64 as the standard path's."""
    if not ON_HOPPER:
        pytest.skip("the path needs Hopper")
    n, hidden, vocab = shape
    x, w, b, t, cw = case(n, hidden, vocab, scale=3.0, ignore=0.1, dtype=torch.bfloat16)
    errors = {}
    for name, rows in (("exp", exp_logits.MIN_ROWS), ("standard", 1 << 62)):
        with patch.object(exp_logits, "MIN_ROWS", rows):
            xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            loss = flce.linear_cross_entropy(xs, ws, t)
            loss.backward()
        ref, (x64, w64, _) = reference_loss(xs, ws, t)
        ref.backward()
        errors[name] = [((g.double() - r).norm() / r.norm()).item()
                        for g, r in ((xs.grad, x64.grad), (ws.grad, w64.grad))]
        assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    for got, standard in zip(errors["exp"], errors["standard"]):
        assert got <= 1.5 * standard + 1e-4, errors
