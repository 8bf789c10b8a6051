"""Autograd's contracts, held like eager PyTorch by every flce Function (core, grouped loss, grouped linear).

- An in-place change, between forward and backward, of a tensor backward reads raises eager's error.
  Gradients that forward computed already are those of the forward's values.
- Differentiable once: create_graph=True gives the right first derivative, and differentiating it again
  raises a clear "not twice differentiable" error (never a partial second derivative). The grouped
  linear, whose backward is plain GEMMs, is twice differentiable (gradgradcheck).
- An undefined (None) grad_output is a zero gradient.
- Gradients of every differentiable input (input, linear_weight, linear_bias) against float64 finite
  differences; class weights and num_items_in_batch are not differentiable and refuse requires_grad, as
  eager does.

The same functions run on the CPU (the Triton kernels under TRITON_INTERPRET=1) and on a GPU (the
``gpu`` cases add the launch-bound single-chunk path at a real vocabulary there).
"""

import pytest
import torch
import torch.nn.functional as F
from reference import DropGrad, assert_close, reference_loss

import flce

INPLACE = "modified by an inplace operation"
TWICE = "not twice differentiable"


def make(device, n=6, hidden=8, vocab=20, dtype=torch.float32, bias=False):
    x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, device=device, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (n,), device=device)
    return x, w, b, t


def eager_loss(x, w, t, b=None, reduction="mean"):
    return F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)


# --- in-place changes between forward and backward ----------------------------------------------------

def modify_after_forward(loss_fn, what: str, device, **kw):
    """Run loss_fn(h, w, t) with h = x * 1, change ``what`` ("input": h, "weight": w) in place, backward.
    Returns the exception backward raised (None if none)."""
    x, w, _, t = make(device, **kw)
    h = x * 1
    loss = loss_fn(h, w, t)
    with torch.no_grad():
        (h if what == "input" else w).add_(5.0)
    try:
        loss.sum().backward()
    except RuntimeError as e:
        return e
    return None


@pytest.mark.parametrize("what", ["input", "weight"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_eager_raises_for_these_changes(device, what, reduction):
    """The behaviour flce matches (guards the test below)."""
    err = modify_after_forward(lambda h, w, t: eager_loss(h, w, t, reduction=reduction), what, device)
    assert err is not None and INPLACE in str(err)


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("what", ["input", "weight"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_single_chunk_raises_like_eager(backend, device, what, reduction, low_memory):
    """One chunk (the default at small batches) defers its GEMMs to backward: the operands they read are
    version-checked, as eager's saved tensors (so are the low-memory mode's, which recomputes)."""
    err = modify_after_forward(lambda h, w, t: flce.linear_cross_entropy(h, w, t, reduction=reduction, backend=backend,
                                                                        low_memory=low_memory), what, device)
    assert err is not None and INPLACE in str(err)


def test_weight_change_raises_on_every_path(backend, device):
    """With several chunks the gradients are computed in forward; the weight is still version-checked
    (as eager's), so an optimizer step before backward raises there too."""
    err = modify_after_forward(lambda h, w, t: flce.linear_cross_entropy(h, w, t, backend=backend, chunk_size=2),
                               "weight", device)
    assert err is not None and INPLACE in str(err)


def test_input_change_after_a_chunked_forward_keeps_the_forward_gradient(backend, device):
    """Several chunks: the input's gradient was computed in forward, from the values forward saw; the
    input is not kept for backward (that would hold its memory), so a later change alters nothing."""
    x, w, _, t = make(device)
    h = x * 1
    loss = flce.linear_cross_entropy(h, w, t, backend=backend, chunk_size=2)
    ref, (x64, w64, _) = reference_loss(h, w, t)
    with torch.no_grad():
        h.add_(5.0)
    loss.backward()
    ref.backward()
    assert_close(x.grad, x64.grad, 1e-5, "grad_input")
    assert_close(w.grad, w64.grad, 1e-5, "grad_weight")


def test_autocast_copies_are_what_backward_reads(backend, device):
    """Under autocast the GEMMs read bf16 copies of float32 input and weight, as eager F.linear does:
    a later in-place change of the originals raises in neither, and the gradients are the forward's."""
    x, w, _, t = make(device, hidden=16, vocab=40)
    for fn in (eager_loss, lambda h, w_, t_: flce.linear_cross_entropy(h, w_, t_, backend=backend)):
        for p in (x, w):
            p.grad = None
        h = x * 1
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fn(h, w, t)
        ref, (x64, w64, _) = reference_loss(h, w, t)
        with torch.no_grad():
            h.add_(5.0)
            w.add_(1.0)
        loss.backward()
        ref.backward()
        assert_close(x.grad, x64.grad, 3e-2, "grad_input")
        with torch.no_grad():
            w.sub_(1.0)


@pytest.mark.parametrize("changed", ["weight", "input"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_grouped_loss_weight_or_input_change_raises(backend, device, reduction, changed):
    """A single chunk's backward reads both (its GEMMs wait for it), as eager's would."""
    x = torch.randn(5, 2, 8, device=device, requires_grad=True)
    w = torch.randn(2, 20, 8, device=device, requires_grad=True)
    t = torch.randint(0, 20, (5, 2), device=device)
    loss = flce.grouped_linear_cross_entropy(x, w, t, reduction=reduction, backend=backend)
    with torch.no_grad():
        (w if changed == "weight" else x).mul_(2.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.sum().backward()


def test_grouped_linear_input_change_raises(device):
    x = torch.randn(4, 3, 8, device=device, requires_grad=True)
    w = torch.randn(3, 5, 8, device=device, requires_grad=True)
    h = x * 1
    y = flce.grouped_linear(h, w)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.sum().backward()


# --- differentiable once ------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_second_derivative_raises_first_is_right(backend, device, reduction, chunk_size):
    x, w, b, t = make(device, bias=True)
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, backend=backend,
                                     chunk_size=chunk_size)
    gx, gw = torch.autograd.grad(loss.sum(), (x, w), create_graph=True)
    ref, (x64, w64, _) = reference_loss(x, w, t, linear_bias=b, reduction=reduction)
    rx, rw = torch.autograd.grad(ref.sum(), (x64, w64))
    assert_close(gx, rx, 1e-5, "grad_input")
    assert_close(gw, rw, 1e-5, "grad_weight")
    assert gx.requires_grad and gw.requires_grad  # a second derivative reaches flce, and raises there
    for penalty in (gx.square().sum(), gw.square().sum() + (x * 0).sum()):
        with pytest.raises(RuntimeError, match=f"flce.linear_cross_entropy is {TWICE}"):
            penalty.backward(retain_graph=True)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")  # torch's advice
def test_low_memory_refuses_create_graph(backend, device):
    """The low-memory mode raises already at the create_graph=True backward, clearly."""
    x, w, _, t = make(device)
    loss = flce.linear_cross_entropy(x, w, t, backend=backend, low_memory=True)
    with pytest.raises(RuntimeError, match=TWICE):
        torch.autograd.grad(loss, x, create_graph=True)


def test_create_graph_backward_accumulates_first_order_grads(backend, device):
    """loss.backward(create_graph=True) fills .grad with the right first derivative (no error until a
    second derivative is taken)."""
    x, w, _, t = make(device)
    flce.linear_cross_entropy(x, w, t, backend=backend).backward(create_graph=True)
    ref, (x64, w64, _) = reference_loss(x, w, t)
    ref.backward()
    assert_close(x.grad, x64.grad, 1e-5, "grad_input")
    assert_close(w.grad, w64.grad, 1e-5, "grad_weight")


def test_grouped_loss_second_derivative_raises(backend, device):
    x = torch.randn(5, 2, 8, device=device, requires_grad=True)
    w = torch.randn(2, 20, 8, device=device, requires_grad=True)
    t = torch.randint(0, 20, (5, 2), device=device)
    loss = flce.grouped_linear_cross_entropy(x, w, t, backend=backend)
    gx, = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"flce.grouped_linear_cross_entropy is {TWICE}"):
        gx.square().sum().backward()


@pytest.mark.parametrize("group_major", [False, True])
def test_grouped_linear_is_twice_differentiable(device, group_major):
    """Outside autocast the saved operands are the inputs themselves: gradgradcheck in float64."""
    lead = (3, 4) if group_major else (4, 3)
    x = torch.randn(*lead, 5, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 5, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 6, device=device, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        return flce.grouped_linear(x, w, b, group_major=group_major)

    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_grouped_linear_under_autocast_refuses_a_second_derivative(device):
    x = torch.randn(4, 3, 8, device=device, requires_grad=True)
    w = torch.randn(3, 5, 8, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = flce.grouped_linear(x, w)
    gx, = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=TWICE):
        gx.sum().backward()


# --- undefined grad_output ----------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_undefined_grad_output_is_a_zero_gradient(backend, device, reduction):
    x, w, b, t = make(device, bias=True)
    for call in (lambda: flce.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, backend=backend),
                 lambda: flce.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, backend=backend,
                                                   low_memory=True),
                 lambda: flce.grouped_linear_cross_entropy(x[:, None], w[None], t[:, None], linear_bias=b[None],
                                                           reduction=reduction, backend=backend)):
        for p in (x, w, b):
            p.grad = None
        loss = DropGrad.apply(call())
        (loss.sum() + (x.sum() + w.sum() + b.sum()) * 0).backward()
        assert all(p.grad is not None and torch.all(p.grad == 0) for p in (x, w, b))


# --- what is not differentiable -----------------------------------------------------------------------

def test_class_weights_requiring_grad_raise_like_eager(backend, device):
    x, w, _, t = make(device)
    cw = torch.rand(20, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        F.cross_entropy(x @ w.T, t, weight=cw)
    for call in (lambda: flce.linear_cross_entropy(x, w, t, weight=cw, backend=backend),
                 lambda: flce.linear_cross_entropy(x.detach(), w.detach(), t, weight=cw, backend=backend),
                 lambda: flce.grouped_linear_cross_entropy(x[:, None], w[None], t[:, None], weight=cw),
                 lambda: flce.LinearCrossEntropyLoss(weight=cw)):
        with pytest.raises(ValueError, match=r"weight \(class weights\) requires grad.*weight.detach\(\)"):
            call()
    with torch.no_grad():  # nothing to differentiate: accepted, as in eager
        flce.linear_cross_entropy(x, w, t, weight=cw, backend=backend)
    loss = flce.linear_cross_entropy(x, w, t, weight=cw.detach(), backend=backend)
    ref, _ = reference_loss(x, w, t, weight_cls=cw.detach())
    assert_close(loss, ref, 1e-5)


def test_num_items_requiring_grad_raises(device):
    x, w, _, t = make(device)
    with pytest.raises(ValueError, match="num_items_in_batch requires grad"):
        flce.linear_cross_entropy(x, w, t, num_items_in_batch=torch.tensor(5.0, requires_grad=True))


# --- gradients against float64 finite differences ----------------------------------------------------

def finite_difference_check(fn, inputs, eps=1e-6, tol=1e-7, probes=3):
    """gradcheck's fast mode, by hand: for random u (grad_output) and directions v, the backward's
    <grad_i, v> against the central difference of <u, fn> along v, input by input, in float64.

    torch.autograd.gradcheck itself runs backward twice through one graph (its reentrancy check); a
    fused loss hands its gradients over once (mean/sum), so the check is done here with one backward."""
    out = fn(*inputs)
    u = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, u)
    for i, (x, g) in enumerate(zip(inputs, grads)):
        for _ in range(probes):
            v = torch.randn_like(x)
            with torch.no_grad():
                plus = [t + eps * v if j == i else t for j, t in enumerate(inputs)]
                minus = [t - eps * v if j == i else t for j, t in enumerate(inputs)]
                numeric = ((fn(*plus) - fn(*minus)) * u).sum() / (2 * eps)
            analytic = (g * v).sum()
            scale = max(abs(numeric.item()), abs(analytic.item()), 1e-3)
            assert abs(numeric.item() - analytic.item()) <= tol * scale + 1e-9, (i, numeric.item(), analytic.item())


GRADCHECK_OPTIONS = {
    "plain": {},
    "smoothing+z_loss": {"label_smoothing": 0.2, "z_loss": 1e-2},
    "softcap+temperature": {"softcap": 2.0, "temperature": 0.7},
    "class weights+ignore": {"class_weight": True, "ignore": True, "label_smoothing": 0.1},
}


@pytest.mark.parametrize("name", list(GRADCHECK_OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size,low_memory", [(None, False), (3, False), (3, True)])
def test_finite_differences_float64(backend, device, name, reduction, chunk_size, low_memory):
    """Input, weight and bias, one chunk and several, and the low-memory mode. Float64 always takes the
    torch twin (float64 arithmetic), whatever ``backend`` says; the loss is float64."""
    opts = dict(GRADCHECK_OPTIONS[name])
    x, w, b, t = make(device, n=5, hidden=4, vocab=7, dtype=torch.float64, bias=True)
    cw = torch.rand(7, device=device, dtype=torch.float64) + 0.3 if opts.pop("class_weight", False) else None
    if opts.pop("ignore", False):
        t[1] = -100

    def fn(x, w, b):
        return flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction, backend=backend,
                                         chunk_size=chunk_size, low_memory=low_memory, **opts)

    assert fn(x, w, b).dtype == torch.float64
    finite_difference_check(fn, (x, w, b))


@pytest.mark.parametrize("group_reduction", ["sum", "mean", "pooled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_finite_differences_float64_grouped(device, group_reduction, reduction):
    x = torch.randn(4, 2, 3, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 6, 3, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 6, device=device, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (4, 2), device=device)
    t[0, 1] = -100

    def fn(x, w, b):
        return flce.grouped_linear_cross_entropy(x, w, t, linear_bias=b, group_reduction=group_reduction,
                                                 reduction=reduction, label_smoothing=0.1, chunk_size=3)

    finite_difference_check(fn, (x, w, b))


def test_finite_difference_check_catches_a_wrong_gradient():
    """The check above can fail: a Function whose backward is off by 1% does."""

    class Off(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return (a.sin()).sum()

        @staticmethod
        def backward(ctx, g):
            a, = ctx.saved_tensors
            return g * a.cos() * 1.01

    with pytest.raises(AssertionError):
        finite_difference_check(Off.apply, (torch.randn(5, dtype=torch.float64, requires_grad=True),))


# --- the same contracts on a GPU, launch-bound shapes of a real head ----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("what", ["input", "weight"])
def test_gpu_single_chunk_raises_like_eager(what):
    """64 tokens of a 32000-word bf16 head: one chunk, GEMMs deferred to backward, the CE kernel
    finishing the mean (the path a training step at small batches takes)."""
    dev = torch.device("cuda")
    err = modify_after_forward(lambda h, w, t: flce.linear_cross_entropy(h, w, t), what, dev, n=64, hidden=256,
                               vocab=32000, dtype=torch.bfloat16)
    assert err is not None and INPLACE in str(err)


@pytest.mark.gpu
def test_gpu_second_derivative_raises():
    x, w, _, t = make(torch.device("cuda"), n=64, hidden=256, vocab=32000, dtype=torch.bfloat16)
    gx, = torch.autograd.grad(flce.linear_cross_entropy(x, w, t), x, create_graph=True)
    with pytest.raises(RuntimeError, match=TWICE):
        gx.float().square().sum().backward()

