"""Hypothesis: random shapes x options x dtypes x backends against the float64 reference.

The core loss (also in its low-memory mode), the grouped loss (every group_reduction) and float64
inputs (float64 arithmetic, held to float64 rounding). Triton runs under the interpreter on a CPU, so
shapes stay small; the example counts come from the hypothesis profile (tests/conftest.py: "default",
deterministic, or HYPOTHESIS_PROFILE=thorough, random). On a GPU the ``test_gpu_*`` cases take GPU-sized
shapes, which reach the paths a CPU never runs; FLCE_GPU_FUZZ_EXAMPLES sets their count (40).
"""

from unittest import mock

import hypothesis
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference import TOL, assert_loss_close, capped, linear_grads, logits_leaf, loss_of_logits, reference_loss
from test_grouped_loss import grouped_reference

import flce
from flce import exp_logits
from conftest import BACKENDS, DEVICE, GPU_FUZZ_EXAMPLES

options = st.fixed_dictionaries({
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "label_smoothing": st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    "z_loss": st.sampled_from([0.0, 1e-3, 0.1]),
    "softcap": st.sampled_from([None, 1e-2, 1.0, 30.0, 1e7, 1e30]),
    "temperature": st.sampled_from([1.0, 0.5, 2.0]),
})
# Low-precision storage rounds the logits once, which bounds what any exact method can reach.
DTYPES = st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16])
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: TOL[torch.bfloat16], torch.float16: TOL[torch.float16]}


def leaves(g, n_shape, hidden, vocab, dtype, bias, class_weight, ignore, dev):
    """Fresh random inputs (leaves) for a case: x (*n_shape, H), w (V, H), b (V,), t, class weights."""
    x = torch.randn(*n_shape, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / max(hidden, 1) ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    t = torch.randint(0, vocab, n_shape, generator=g)
    t[torch.rand(n_shape, generator=g) < ignore] = -100
    cw = torch.rand(vocab, generator=g) + 0.1 if class_weight else None
    x, w, b = (v.to(dev).requires_grad_() if v is not None else None for v in (x, w, b))
    return x, w, b, t.to(dev), cw.to(dev) if cw is not None else None


def loss_unit(t, reduction, num_items, ignore_index=-100) -> float:
    """The loss's scale for O(1) rows: the valid count for a plain sum, else 1 (see assert_loss_close)."""
    return float(max(int((t != ignore_index).sum()), 1)) if reduction == "sum" and num_items is None else 1.0


def grad_floors(reference, grad_out, opts, cols=slice(None)) -> list:
    """Per differentiable input, the norm of its gradient without softcap (0 if no softcap): the natural
    scale of that gradient. A saturating softcap multiplies dz by 1 - tanh^2, ~1e-18 for logits 50
    times the cap, which float32 resolves only to ~1e-7 of that scale (eager float32 alike). ``cols``: the
    vocabulary rows of the weight's and bias's gradients that count (a vocab-parallel shard)."""
    if opts["softcap"] is None:
        return [0.0, 0.0, 0.0]
    ref, ref_leaves = reference(softcap=None)
    ref.backward(grad_out)
    return [leaf.grad[part].norm().item() if leaf is not None and leaf.grad is not None else 0.0
            for leaf, part in zip(ref_leaves, (slice(None), cols, cols))]


def rounding_scales(x, w, b, t, cw, items, grad_out, opts, cols=slice(None)) -> list:
    """Per differentiable input, the norm that rounding each of its gradient's terms once (dz_iv w_vh,
    dz_iv x_ih, dz_iv) leaves when the errors add at random: sqrt(sum_iv dz_iv^2 ||w_v||^2),
    sqrt(sum_i ||dz_i||^2 ||x_i||^2), ||dz||. A sum whose terms cancel (grad_W of V = 1: 20 terms of
    random sign summing to 1/200 of their absolute sum) is then held to what its terms allow any
    low-precision method, not to its own small norm. dz: float64 dloss/dlogits (logits before bias and
    temperature). ``cols``: as in ``grad_floors``."""
    dz = exact_dz(x, w, b, t, cw, items, opts, grad_out)[1].flatten(0, -2)
    x64, w64, dz2 = x.detach().double().flatten(0, -2), w.detach().double(), dz.square()
    return [(dz2 @ w64.square().sum(1)).sum().sqrt().item(),
            (dz2[:, cols].sum(1) @ x64.square().sum(1)).sqrt().item(), dz[:, cols].norm().item()]


def exact_dz(x, w, b, t, cw, items, opts, grad_out=None) -> tuple:
    """(z, dz, loss dims): the float64 logits (``reference.logits_leaf``, before temperature and softcap), the
    gradient of the reference loss with respect to them for ``grad_out`` (None: ones), and the loss's dims."""
    leaf = logits_leaf(x, w, b, torch.float64)
    loss = loss_of_leaf(leaf, t, cw, items, opts)
    (dz,) = torch.autograd.grad(loss, leaf, torch.ones_like(loss) if grad_out is None else grad_out,
                                materialize_grads=True)
    return leaf.detach(), dz, loss.dim()


def loss_of_leaf(leaf, t, cw, items, opts: dict):
    """The float64 reference loss of logits ``leaf`` (before temperature and softcap, ``reference.logits_leaf``)."""
    rest = {k: v for k, v in opts.items() if k not in ("temperature", "softcap")}
    z = capped(leaf, opts["temperature"], opts["softcap"])
    return loss_of_logits(z, t, weight_cls=cw, num_items_in_batch=items, **rest)


def assert_grad_close(got, want, tol, floor, what, atol=0.0):
    """||got - want|| <= tol * max(||want||, floor) + atol (atol: rounding noise where the gradient is an
    exact 0, e.g. V = 1, whose terms cancel to a few ulps of O(1) values)."""
    err = (got.detach().double().cpu() - want.double().cpu()).norm().item()
    bound = tol * max(want.norm().item(), floor) + atol
    assert not got.isnan().any() and err <= bound, f"{what}: error {err:.3g} > {bound:.3g}"


def num_items_for(t, choice, ignore_index=-100):
    """None, or the valid count (as an int, a 0-d or a (1,) tensor, HF's forms) plus 1.5."""
    if choice == "none":
        return None
    count = int((t != ignore_index).sum()) + 1.5
    return {"float": count, "0-d": torch.tensor(count, device=t.device),
            "(1,)": torch.tensor([count], device=t.device)}[choice]


@given(
    n=st.integers(0, 40), hidden=st.integers(1, 24), vocab=st.integers(1, 300), lead=st.sampled_from([(), (2,)]),
    chunk=st.one_of(st.none(), st.integers(1, 16)), ignore=st.floats(0.0, 1.0),
    bias=st.booleans(), class_weight=st.booleans(), opts=options, dtype=DTYPES,
    num_items=st.sampled_from(["none", "none", "float", "0-d", "(1,)"]), validate=st.booleans(),
    accum=st.sampled_from([None, torch.float32]), low_memory=st.booleans(), wide=st.booleans(),
    frozen=st.sampled_from(["none", "none", "input", "weight", "all"]), backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**31 - 1),
)
# One vocabulary entry with z_loss: dz is only the z-loss term, which must not come out as the
# difference of two rounded O(1) numbers (it did once: grad_input off by 1.03e-4).
@example(n=1, hidden=1, vocab=1, lead=(), chunk=None, ignore=0.0, bias=False, class_weight=False,
         opts={"reduction": "mean", "label_smoothing": 0.0, "z_loss": 1e-3, "softcap": None, "temperature": 1.0},
         dtype=torch.float32, num_items="none", validate=True, accum=None, low_memory=False, wide=False,
         frozen="none", backend=BACKENDS[-1], seed=1)
# grad_W of V = H = 1 is a sum of ~20 terms of random sign that cancel to 1/200 of their absolute sum: held to
# what rounding each term allows (rounding_scales), not to its own norm (it failed the latter at 10x).
@example(n=38, hidden=1, vocab=1, lead=(2,), chunk=None, ignore=0.75, bias=True, class_weight=True,
         opts={"reduction": "none", "label_smoothing": 0.0, "z_loss": 0.1, "softcap": 30.0, "temperature": 0.5},
         dtype=torch.bfloat16, num_items="none", validate=True, accum=None, low_memory=False, wide=False,
         frozen="none", backend="torch", seed=1)
# No rows, low-memory, H = 1, V = 257: forward's one-row buffer, padded to 260 columns, outgrew grad_weight's storage.
@example(n=0, hidden=1, vocab=257, lead=(), chunk=1, ignore=0.0, bias=False, class_weight=False,
         opts={"reduction": "mean", "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None, "temperature": 1.0},
         dtype=torch.float32, num_items="none", validate=False, accum=None, low_memory=True, wide=False,
         frozen="none", backend="torch", seed=0)
# Low-memory, one row, V = 1, float32 logits from 16-bit operands: forward's lse of unrounded logits against
# backward's 16-bit recomputation gave grad_weight 1e-3 where it is an exact 0 (the GPU fuzz found it).
@example(n=1, hidden=64, vocab=1, lead=(), chunk=None, ignore=0.0, bias=False, class_weight=False,
         opts={"reduction": "mean", "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None, "temperature": 1.0},
         dtype=torch.bfloat16, num_items="none", validate=False, accum=None, low_memory=True, wide=True,
         frozen="none", backend=BACKENDS[-1], seed=0)
def test_random_cases_match_reference(n, hidden, vocab, lead, chunk, ignore, bias, class_weight, opts, dtype,
                                      num_items, validate, accum, low_memory, wide, frozen, backend, seed):
    """``wide``: small single chunks of 16-bit logits in float32 (``function.wide_logits``: CUDA's default, on the
    CPU through the GEMMs' upcast fallback) or in 16 bits. ``frozen``: operands that need no gradient ("all": the
    loss alone)."""
    with mock.patch.object(flce.function, "supports_out_dtype", lambda device, batched=False: wide):
        _check_random_case(n, hidden, vocab, lead, chunk, ignore, bias, class_weight, opts, dtype, num_items, validate,
                           accum, low_memory, backend, seed, frozen)


def _check_random_case(n, hidden, vocab, lead, chunk, ignore, bias, class_weight, opts, dtype, num_items, validate,
                       accum, low_memory, backend, seed, frozen="none"):
    g = torch.Generator().manual_seed(seed)
    dev = DEVICE if backend == "triton" else torch.device("cpu")  # Triton runs on CUDA, or the interpreter
    x, w, b, t, cw = leaves(g, (*lead, n), hidden, vocab, dtype, bias, class_weight, ignore, dev)
    for leaf, name in ((x, "input"), (w, "weight"), (b, "bias")):
        if leaf is not None and frozen in (name, "all"):
            leaf.requires_grad_(False)
    if opts["reduction"] == "none":
        num_items = "none"
    items = num_items_for(t, num_items)
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, chunk_size=chunk, backend=backend,
                                     num_items_in_batch=items, validate_target=validate, low_memory=low_memory,
                                     accum_dtype=None if low_memory else accum, **opts)
    ref, ref_leaves = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, num_items_in_batch=items, **opts)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_loss_close(loss, ref, 1e-5 if dtype == torch.float32 else TOL[dtype], loss_unit(t, opts["reduction"], items))
    if not loss.requires_grad:
        return
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dev)
    loss.backward(grad_out.float())
    ref.backward(grad_out)
    floors = grad_floors(lambda **o: reference_loss(x, w, t, linear_bias=b, weight_cls=cw, num_items_in_batch=items,
                                                    **{**opts, **o}), grad_out, opts)
    scales = rounding_scales(x, w, b, t, cw, items, grad_out, opts)
    for got, leaf, floor, scale, name in zip((x, w, b), ref_leaves, floors, scales, ("input", "weight", "bias")):
        if got is not None and got.requires_grad:
            # 1e-4: fp32 cancellation in coef * p - (1 - eps) when V is tiny (dz ~ z_loss * lse)
            assert got.grad.dtype == dtype
            assert_grad_close(got.grad, leaf.grad, GRAD_TOL[dtype], max(floor, scale), f"grad_{name}",
                              atol=GRAD_TOL[dtype] / 100)


@given(
    B=st.integers(0, 9), G=st.integers(1, 4), hidden=st.integers(1, 12), vocab=st.integers(1, 80),
    group_major=st.booleans(), group_reduction=st.sampled_from(["sum", "mean", "pooled"]),
    chunk=st.one_of(st.none(), st.integers(1, 5)), ignore=st.floats(0.0, 1.0), bias=st.booleans(),
    class_weight=st.booleans(), opts=options, num_items=st.sampled_from(["none", "none", "float"]),
    backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**31 - 1),
)
@example(B=1, G=1, hidden=3, vocab=1, group_major=False, group_reduction="sum", chunk=None, ignore=0.0, bias=False,
         class_weight=True, opts={"reduction": "none", "label_smoothing": 0.05, "z_loss": 0.0, "softcap": None,
                                  "temperature": 1.0}, num_items="none", backend="torch", seed=0)
def test_grouped_random_cases_match_reference(B, G, hidden, vocab, group_major, group_reduction, chunk, ignore, bias,
                                              class_weight, opts, num_items, backend, seed):
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    _check_grouped_case(B, G, hidden, vocab, group_major, group_reduction, chunk, ignore, bias, class_weight, opts,
                        num_items, torch.float32, dev, seed, backend=backend)


def _check_grouped_case(B, G, hidden, vocab, group_major, group_reduction, chunk, ignore, bias, class_weight, opts,
                        num_items, dtype, dev, seed, **kwargs):
    """A grouped loss in ``dtype`` on ``dev`` against the float64 reference: loss within 1e-5 (float32) or the
    dtype's tolerance, every gradient within 1e-4 or GRAD_TOL (logits of std 1: 16-bit rounding stays inside)."""
    g = torch.Generator().manual_seed(seed)
    lead = (G, B) if group_major else (B, G)
    x = torch.randn(*lead, hidden, generator=g).to(dtype).to(dev).requires_grad_()
    w = (torch.randn(G, vocab, hidden, generator=g) / hidden**0.5).to(dtype).to(dev).requires_grad_()
    b = torch.randn(G, vocab, generator=g).to(dtype).to(dev).requires_grad_() if bias else None
    t = torch.randint(0, vocab, lead, generator=g)
    t[torch.rand(lead, generator=g) < ignore] = -100
    t = t.to(dev)
    cw = (torch.rand(vocab, generator=g) + 0.1).to(dev) if class_weight else None
    items = None if opts["reduction"] == "none" else num_items_for(t, num_items)
    loss = flce.grouped_linear_cross_entropy(x, w, t, group_major=group_major, group_reduction=group_reduction,
                                             linear_bias=b, weight=cw, chunk_size=chunk, num_items_in_batch=items,
                                             **opts, **kwargs)
    ref, ref_grads = grouped_reference(x, w, b, t, cw, group_major, num_items_in_batch=items,
                                       group_reduction=group_reduction, **opts)
    assert loss.shape == ref.shape
    unit = loss_unit(t, opts["reduction"], items) * (G if group_reduction == "sum" else 1)
    wide = dtype == torch.float32
    assert_loss_close(loss, ref, 1e-5 if wide else TOL[dtype], unit)
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dev)
    loss.backward(grad_out.float())
    ref.backward(grad_out)

    floors = [0.0, 0.0, 0.0]
    if opts["softcap"] is not None:
        ref_nc, grads_nc = grouped_reference(x, w, b, t, cw, group_major, num_items_in_batch=items,
                                             group_reduction=group_reduction, **{**opts, "softcap": None})
        ref_nc.backward(grad_out)
        floors = [v.norm().item() if v is not None else 0.0 for v in grads_nc()]
    tol = 1e-4 if wide else GRAD_TOL[dtype]
    for name, got, want, floor in zip(("input", "weight", "bias"), (x.grad, w.grad, b.grad if b is not None else None),
                                      ref_grads(), floors):
        if want is not None:  # atol: V = 1 with smoothing, an exact 0 from O(1) terms (1e-9 off in float32)
            assert got.dtype == dtype
            assert_grad_close(got, want, tol, floor, f"grad_{name}", atol=tol / 100 * unit)


@given(
    n=st.integers(0, 30), hidden=st.integers(1, 16), vocab=st.integers(1, 200),
    chunk=st.one_of(st.none(), st.integers(1, 8)), ignore=st.floats(0.0, 1.0), bias=st.booleans(),
    class_weight=st.booleans(), opts=options, autocast=st.booleans(), low_memory=st.booleans(),
    backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**31 - 1),
)
def test_float64_cases_match_reference_to_float64_rounding(n, hidden, vocab, chunk, ignore, bias, class_weight,
                                                          opts, autocast, low_memory, backend, seed):
    """Float64 in, float64 out, float64 arithmetic throughout (torch twin whatever the backend), also
    under a bf16 autocast (which leaves float64 alone, as for F.linear)."""
    g = torch.Generator().manual_seed(seed)
    x, w, b, t, cw = leaves(g, (n,), hidden, vocab, torch.float64, bias, class_weight, ignore, DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, chunk_size=chunk, backend=backend,
                                         low_memory=low_memory, **opts)
    ref, ref_leaves = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, **opts)
    assert loss.dtype == torch.float64
    assert_loss_close(loss, ref, 1e-10, loss_unit(t, opts["reduction"], None))
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(DEVICE)
    loss.backward(grad_out)
    ref.backward(grad_out)
    floors = grad_floors(lambda **o: reference_loss(x, w, t, linear_bias=b, weight_cls=cw, **{**opts, **o}),
                         grad_out, opts)
    for got, leaf, floor, name in zip((x, w, b), ref_leaves, floors, ("input", "weight", "bias")):
        if got is not None:
            assert got.grad.dtype == torch.float64
            assert_grad_close(got.grad, leaf.grad, 1e-9, floor, f"grad_{name}", atol=1e-13)


# GPU-only paths need GPU-sized shapes: the fused Hopper GEMM from 256 rows, the exp-logits path from 1024 (bf16;
# several chunks where chunk_size cuts 1024 rows or more), the sync that drops ignored rows from 1024 tokens, float32
# logits below 256 rows, the thin grad_weight up to 16, the loss without gradients and the low-memory blocks. Options
# keep their defaults half the time (any other value takes the exp-logits path away); logits of a trained model's
# spread, confident targets and a window miss (every logit raised by 70: lse > 60) reach the path's other branches.
GPU_OPTIONS = st.fixed_dictionaries({
    "reduction": st.sampled_from(["mean", "mean", "sum", "none"]),
    "label_smoothing": st.sampled_from([0.0, 0.0, 0.0, 0.1]),
    "z_loss": st.sampled_from([0.0, 0.0, 0.0, 1e-3]),
    "softcap": st.sampled_from([None, None, None, 30.0]),
    "temperature": st.sampled_from([1.0, 1.0, 0.7]),
})


@pytest.mark.gpu
@settings(deadline=None, max_examples=GPU_FUZZ_EXAMPLES)
@given(
    n=st.one_of(st.sampled_from([1, 16, 17, 255, 256, 1023, 1024, 1536, 3000]), st.integers(0, 4200)),
    hidden=st.sampled_from([8, 64, 100, 128, 256, 1024]),
    vocab=st.one_of(st.sampled_from([1, 1000, 4096, 32000, 32003, 65536, 70001]), st.integers(1, 20000)),
    lead=st.sampled_from([(), (), (2,)]),
    chunk=st.one_of(st.none(), st.sampled_from([1, 100, 256, 1000, 1024, 2048])),
    ignore=st.sampled_from([0.0, 0.0, 0.3, 1.0]), bias=st.sampled_from(["none", "none", "frozen", "trained"]),
    class_weight=st.sampled_from([False, False, True]), opts=GPU_OPTIONS,
    dtype=st.sampled_from(["bf16", "bf16", "fp16", "fp32", "autocast"]),
    wants=st.sampled_from(["both", "both", "input", "weight", "none"]),
    num_items=st.sampled_from(["none", "none", "float", "0-d", "(1,)"]), validate=st.booleans(),
    low_memory=st.sampled_from([False, False, True]), spread=st.sampled_from([1.0, 1.0, 3.0, 8.0]),
    confident=st.booleans(), shift=st.sampled_from([0.0, 0.0, 70.0]), stats=st.sampled_from([False, False, True]),
    accum=st.sampled_from([None, None, None, torch.float32, torch.bfloat16]),
    backend=st.sampled_from(["auto", "auto", "auto", "torch"]), ignore_index=st.sampled_from([-100, -100, -1, 0]),
    compiled=st.sampled_from([False, False, False, True]), seed=st.integers(0, 2**31 - 1),
)
# A bias head's logits of std 8 in bf16 (odd H: cuBLAS, not the fused GEMM): the bias added to the rounded product
# rounded them twice, rows' losses off by 1.6x eager's error (seed 21 on an H200, 2026-11-28).
@example(n=256, hidden=100, vocab=1000, lead=(), chunk=None, ignore=0.0, bias="frozen", class_weight=False,
         opts={"reduction": "none", "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None, "temperature": 1.0},
         dtype="bf16", wants="both", num_items="none", validate=False, low_memory=False, spread=8.0, confident=True,
         shift=0.0, stats=False, accum=None, backend="auto", ignore_index=-100, compiled=False, seed=1)
def test_gpu_random_cases(n, hidden, vocab, lead, chunk, ignore, bias, class_weight, opts, dtype, wants, num_items,
                          validate, low_memory, spread, confident, shift, stats, accum, backend, ignore_index, compiled,
                          seed):
    """Every option, mode and path on a GPU against the float64 reference. Gradients: within the fuzz tolerance of
    the exact ones, or twice the error of what eager PyTorch computes from the 16-bit logits it rounds (a logit of a
    trained model's spread or raised by 70 is off by up to |z| / 256 in bf16, and flce rounds where eager does below
    the fused GEMM's 256 rows per chunk). ``backend="torch"``: the kernels' torch twins on the GPU. A bf16
    ``accum_dtype`` rounds grad_weight's running sum once a chunk (at most 8 chunks here), which the weight's
    tolerance allows. ``compiled``: the call under torch.compile (``fullgraph=True``), through the custom ops of
    ``loss_op``, which serve every call but those with ``return_stats`` or ``low_memory``."""
    rows = n * (2 if lead else 1)
    accum = None if low_memory else accum
    chunks = -(-rows // chunk) if chunk else 1  # without chunk_size these sizes fit one chunk of the planner's
    hypothesis.assume(rows * vocab <= 5e7 and not (low_memory and chunk == 1)
                      and not (accum == torch.bfloat16 and chunks > 8) and not (compiled and (stats or low_memory)))
    for drawn in (f"compiled {compiled}", f"accum_dtype {accum}", f"backend {backend}", f"low_memory {low_memory}"):
        hypothesis.event(drawn)  # --hypothesis-show-statistics: how often each path ran
    exp_logits._cool_down.clear()  # each example's path follows its own data, not an earlier window miss
    dev, g = DEVICE, torch.Generator().manual_seed(seed)
    store = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    gemm = torch.bfloat16 if dtype == "autocast" else store
    x, w, b, t, cw = leaves(g, (*lead, n), hidden, vocab, store, bias != "none", class_weight, ignore, dev)
    t = torch.where(t == -100, ignore_index, t)
    opts = {**opts, "ignore_index": ignore_index}
    with torch.no_grad():
        w.mul_(spread)
        if b is not None:
            b.add_(shift).requires_grad_(bias == "trained")
    for leaf, wanted in ((x, wants in ("both", "input")), (w, wants in ("both", "weight"))):
        leaf.requires_grad_(wanted)
    if confident:  # half the rows target their largest logit
        top = (x.detach().double() @ w.detach().double().T).argmax(-1)
        t = torch.where(torch.rand(t.shape, generator=g).to(dev) < 0.5, top, t)
    items = None if opts["reduction"] == "none" else num_items_for(t, num_items, ignore_index)
    kwargs = dict(linear_bias=b, weight=cw, chunk_size=chunk, num_items_in_batch=items, validate_target=validate,
                  low_memory=low_memory, return_stats=stats, accum_dtype=accum, backend=backend, **opts)
    call = flce.linear_cross_entropy
    if compiled:
        torch._dynamo.reset()  # each case compiles afresh: no recompile limit reached, no eager fallback
        call = torch.compile(lambda *a, **k: flce.linear_cross_entropy(*a, **k), fullgraph=True)
    with torch.autocast(dev.type, dtype=gemm, enabled=dtype == "autocast"):
        out = call(x, w, t, **kwargs)
    loss = out[0] if stats else out
    ref, ref_leaves = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, num_items_in_batch=items, **opts)
    eager_loss = eager_rounding(x, w, b, t, cw, items, gemm, opts)
    tol = 1e-5 if gemm == torch.float32 else TOL[gemm]
    loss_err = (loss.detach().double() - ref.detach()).abs()
    unit = loss_unit(t, opts["reduction"], items, ignore_index)
    # A bias head's 16-bit logits may take one more rounding than eager's on CUDA (gemm.linear_into)
    twice = one_more_rounding(x, w, b, t, cw, items, opts, gemm) if b is not None and gemm != torch.float32 else 0.0
    assert not loss.isnan().any() and (loss_err <= tol * (ref.detach().abs() + unit)
                                       + 2 * (eager_loss - ref.detach()).abs() + twice).all(), "loss"
    if stats:
        assert out[1].num_valid.item() == int((t != ignore_index).sum())
    if not loss.requires_grad:
        return
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dev)
    loss.backward(grad_out.float())
    ref.backward(grad_out)
    scales = rounding_scales(x, w, b, t, cw, items, grad_out, opts)
    eager_grads = eager_rounding(x, w, b, t, cw, items, gemm, opts, grad_out)
    # An exact 0 (V = 1) comes out as a few ulps of the logits per row (two computations of z), which a plain sum
    # adds up over its rows.
    z_max = logits_leaf(x, w, b, torch.float64).detach().abs().max().item() / opts["temperature"] if t.numel() else 0
    noise = GRAD_TOL[gemm] / 100 * unit * (1.0 + z_max)
    # A 16-bit running sum rounds once a chunk, by at most half an eps of each partial sum (taken as twice the sum).
    summed = chunks * torch.finfo(accum).eps if accum in (torch.bfloat16, torch.float16) else 0.0
    for got, leaf, scale, rounded, name in zip((x, w, b), ref_leaves, scales, eager_grads,
                                               ("input", "weight", "bias")):
        if got is not None and got.requires_grad:
            assert got.grad.dtype == got.dtype
            allowed = 2 * (rounded - leaf.grad).norm().item() + noise
            if name == "weight":
                allowed += summed * leaf.grad.norm().item()
            assert_grad_close(got.grad, leaf.grad, GRAD_TOL[gemm], scale, f"grad_{name}", atol=allowed)


def one_more_rounding(x, w, b, t, cw, items, opts, dtype):
    """Per loss value, what rounding every logit once more to ``dtype`` can move it by, to first order:
    sum_v |dloss/dz_v| |z_v| eps / 2 over the row's logits z (a scalar loss: over every row)."""
    z, dz, dims = exact_dz(x, w, b, t, cw, items, opts)
    moved = (dz.abs() * z.abs()).sum(-1) * torch.finfo(dtype).eps / 2
    return moved if dims else moved.sum()


def eager_rounding(x, w, b, t, cw, items, gemm_dtype, opts, grad_out=None):
    """The float64 reference computed from the logits as eager PyTorch has them (``logits_leaf``): its loss, or with
    ``grad_out`` its (input, weight, bias) gradients, through the rounding as if it were none."""
    leaf = logits_leaf(x, w, b, gemm_dtype)
    loss = loss_of_leaf(leaf, t, cw, items, opts)
    if grad_out is None:
        return loss.detach()
    return linear_grads(torch.autograd.grad(loss, leaf, grad_out, materialize_grads=True)[0], x, w)


@pytest.mark.gpu
@settings(deadline=None, max_examples=GPU_FUZZ_EXAMPLES)
@given(
    B=st.one_of(st.sampled_from([1, 16, 256, 1024, 2000]), st.integers(0, 2500)), G=st.integers(1, 4),
    hidden=st.sampled_from([8, 64, 100, 256]),
    vocab=st.one_of(st.sampled_from([1, 1000, 32000, 32003]), st.integers(1, 20000)),
    group_major=st.booleans(), group_reduction=st.sampled_from(["sum", "mean", "pooled"]),
    chunk=st.sampled_from([None, None, 100, 256, 1024]), ignore=st.sampled_from([0.0, 0.3, 1.0]), bias=st.booleans(),
    class_weight=st.booleans(), opts=GPU_OPTIONS, num_items=st.sampled_from(["none", "none", "float"]),
    dtype=st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gpu_grouped_random_cases(B, G, hidden, vocab, group_major, group_reduction, chunk, ignore, bias, class_weight,
                                  opts, num_items, dtype, seed):
    """The grouped loss at GPU sizes: its per-group Hopper GEMMs (16-bit, 256 rows per group and more), chunks."""
    hypothesis.assume(B * G * vocab <= 3e7)
    _check_grouped_case(B, G, hidden, vocab, group_major, group_reduction, chunk, ignore, bias, class_weight, opts,
                        num_items, dtype, torch.device("cuda"), seed)
