"""Every option of every public function at its edges: a clear Python error that names the argument and
what it accepts, raised at the call (the module form: at construction), and the accepted forms working.

Covers linear_cross_entropy, LinearCrossEntropyLoss, grouped_linear_cross_entropy, grouped_linear and
GroupedLinear here; the vocab-parallel loss runs the same option table on two gloo ranks in
test_distributed.py (``OPTION_CASES`` is shared).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import assert_close, reference_loss

import flce

# (option, bad value, exception, message pattern): the keyword options every loss shares.
OPTION_CASES = [
    ("reduction", "avg", ValueError, r"reduction must be one of \('mean', 'sum', 'none'\)"),
    ("reduction", None, ValueError, "reduction must be one of"),
    ("ignore_index", -100.0, TypeError, "ignore_index must be an int"),
    ("ignore_index", True, TypeError, "ignore_index must be an int"),
    ("ignore_index", 2**70, ValueError, r"ignore_index must fit in int64"),
    ("ignore_index", -(2**64), ValueError, r"ignore_index must fit in int64"),
    ("label_smoothing", -0.1, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ("label_smoothing", 1.5, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ("label_smoothing", float("nan"), ValueError, "label_smoothing must be finite"),
    ("label_smoothing", "0.1", TypeError, "label_smoothing must be a real number"),
    ("label_smoothing", torch.tensor(0.1), TypeError, "label_smoothing must be a real number"),
    ("label_smoothing", True, TypeError, "label_smoothing must be a real number"),
    ("z_loss", -1e-4, ValueError, "z_loss must be >= 0"),
    ("z_loss", float("inf"), ValueError, "z_loss must be finite"),
    ("z_loss", [1e-4], TypeError, "z_loss must be a real number"),
    ("softcap", 0.0, ValueError, r"softcap must be > 0 \(or None\)"),
    ("softcap", -3.0, ValueError, "softcap must be > 0"),
    ("softcap", float("inf"), ValueError, "softcap must be finite"),
    ("softcap", "30", TypeError, "softcap must be a real number"),
    ("temperature", 0.0, ValueError, "temperature must be > 0"),
    ("temperature", -1.0, ValueError, "temperature must be > 0"),
    ("temperature", float("nan"), ValueError, "temperature must be finite"),
    ("temperature", None, TypeError, "temperature must be a real number"),
    ("num_items_in_batch", "7", TypeError, r"num_items_in_batch must be None or .*got str '7'"),
    ("num_items_in_batch", True, TypeError, "num_items_in_batch must be None or"),
    ("num_items_in_batch", -1, ValueError, r"num_items_in_batch must be .*>= 0.*got -1"),
    ("num_items_in_batch", float("nan"), ValueError, "num_items_in_batch must be"),
    ("num_items_in_batch", float("inf"), ValueError, "num_items_in_batch must be"),
    ("num_items_in_batch", 10**400, ValueError, "num_items_in_batch must be"),
    ("num_items_in_batch", torch.tensor([5.0, 6.0]), TypeError, r"one-element real tensor.*shape \(2,\)"),
    ("num_items_in_batch", torch.tensor([]), TypeError, r"one-element real tensor.*shape \(0,\)"),
    ("num_items_in_batch", torch.tensor(True), TypeError, r"one-element real tensor.*torch.bool"),
    ("num_items_in_batch", torch.tensor(4 + 0j), TypeError, r"one-element real tensor.*complex"),
    ("num_items_in_batch", torch.tensor(-2.0), ValueError, r"num_items_in_batch must be .*got -2.0"),
    ("accum_dtype", torch.int32, TypeError, "accum_dtype must be a floating torch.dtype or None"),
    ("accum_dtype", "float32", TypeError, "accum_dtype must be a floating torch.dtype"),
    ("chunk_size", 0, ValueError, "chunk_size must be a positive int or None"),
    ("chunk_size", 2.5, ValueError, "chunk_size must be a positive int"),
    ("chunk_size", True, ValueError, "chunk_size must be a positive int"),
    ("backend", "cuda", ValueError, r"backend must be one of \('auto', 'triton', 'torch'\)"),
    ("backend", None, ValueError, "backend must be one of"),
    ("return_stats", 1, TypeError, "return_stats must be True or False"),
    ("return_stats", "yes", TypeError, "return_stats must be True or False"),
    ("validate_target", None, TypeError, "validate_target must be True or False"),
]
OPTION_IDS = [f"{name}={value!r}"[:40] for name, value, _, _ in OPTION_CASES]


def core_args():
    """x (6, 8), w (20, 8), t (6,): fresh random inputs of the core loss."""
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    t = torch.randint(0, 20, (6,))
    return x, w, t


def grouped_args():
    """x (5, 3, 8), w (3, 20, 8), t (5, 3): fresh random inputs of the grouped loss."""
    x = torch.randn(5, 3, 8, requires_grad=True)
    w = torch.randn(3, 20, 8, requires_grad=True)
    t = torch.randint(0, 20, (5, 3))
    return x, w, t


@pytest.fixture
def core():
    return core_args()


@pytest.fixture
def grouped():
    return grouped_args()


@pytest.mark.parametrize("name,value,exc,match", OPTION_CASES, ids=OPTION_IDS)
def test_core_options(core, name, value, exc, match):
    with pytest.raises(exc, match=match):
        flce.linear_cross_entropy(*core, **{name: value})


@pytest.mark.parametrize("name,value,exc,match", OPTION_CASES, ids=OPTION_IDS)
def test_module_options_fail_at_construction(name, value, exc, match):
    with pytest.raises(exc, match=match):
        flce.LinearCrossEntropyLoss(**{name: value})


@pytest.mark.parametrize("name,value,exc,match", OPTION_CASES, ids=OPTION_IDS)
def test_grouped_options(grouped, name, value, exc, match):
    with pytest.raises(exc, match=match):
        flce.grouped_linear_cross_entropy(*grouped, **{name: value})


@pytest.mark.parametrize("call", ["core", "module", "grouped"])
def test_num_items_with_reduction_none(core, grouped, call):
    kw = {"reduction": "none", "num_items_in_batch": 4}
    with pytest.raises(ValueError, match="num_items_in_batch cannot be combined with reduction='none'"):
        if call == "core":
            flce.linear_cross_entropy(*core, **kw)
        elif call == "module":
            flce.LinearCrossEntropyLoss(**kw)
        else:
            flce.grouped_linear_cross_entropy(*grouped, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    ({"low_memory": 1}, TypeError, "low_memory must be a bool"),
    ({"low_memory": True, "accum_dtype": torch.float32}, ValueError, "accum_dtype cannot be combined with low_memory"),
])
def test_low_memory_option(core, kw, exc, match):
    with pytest.raises(exc, match=match):
        flce.linear_cross_entropy(*core, **kw)
    with pytest.raises(exc, match=match):
        flce.LinearCrossEntropyLoss(**kw)


def test_module_unknown_and_misplaced_options():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['label_smothing'\]"):
        flce.LinearCrossEntropyLoss(label_smothing=0.1)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['linear_bias'\].*argument of forward"):
        flce.LinearCrossEntropyLoss(linear_bias=torch.zeros(3))
    with pytest.raises(TypeError, match=r"weight \(class weights\) must be a 1-D floating tensor"):
        flce.LinearCrossEntropyLoss(weight=torch.ones(3, dtype=torch.int64))


def test_module_options_match_the_function():
    import inspect

    from flce.api import MODULE_OPTIONS

    params = inspect.signature(flce.linear_cross_entropy).parameters
    keyword = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY} - {"linear_bias"}
    assert set(MODULE_OPTIONS) == keyword


def test_module_class_weights_are_a_buffer(core):
    x, w, t = core
    cw = torch.rand(20) + 0.1
    mod = flce.LinearCrossEntropyLoss(weight=cw, label_smoothing=0.1)
    assert "weight" in dict(mod.named_buffers()) and "class weights (20,)" in repr(mod)
    ref, _ = reference_loss(x, w, t, weight_cls=cw, label_smoothing=0.1)
    assert_close(mod(x, w, t), ref, 1e-5)


# (case, build(x, w, t) -> (args, kwargs), exception, message): cases of both losses (the core's and the
# grouped loss's tensors: x (6, 8) or (5, 3, 8), w (20, 8) or (3, 20, 8), t (6,) or (5, 3)).
SHARED_TENSOR_CASES = {
    "integer class weights": (lambda x, w, t: ((x, w, t), {"weight": torch.ones(20, dtype=torch.int64)}), TypeError,
                              r"weight \(class weights\) must be a floating tensor .* got dtype torch.int64"),
    "meta tensors": (lambda x, w, t: ((x.to("meta"), w.to("meta"), t.to("meta")), {}), ValueError,
                     "input is on the meta device"),
    "devices": (lambda x, w, t: ((x, w.to("meta"), t), {}), ValueError,
                "all tensors must be on one device, got input on cpu, linear_weight on meta"),
}
# The core's own.
TENSOR_CASES = {
    "input not a tensor": (lambda x, w, t: ((x.tolist(), w, t), {}), TypeError, "input must be a torch.Tensor"),
    "integer input": (lambda x, w, t: ((x.long(), w, t), {}), TypeError, "input must be a floating-point"),
    "0-d input": (lambda x, w, t: ((x[0, 0], w, t[0]), {}), ValueError, "hidden size mismatch"),
    "weight not a tensor": (lambda x, w, t: ((x, None, t), {}), TypeError, "linear_weight must be a torch.Tensor"),
    "integer weight": (lambda x, w, t: ((x, w.long(), t), {}), TypeError, "linear_weight must be a floating"),
    "1-D weight": (lambda x, w, t: ((x, w[0], t), {}), ValueError, r"linear_weight must be a 2-D tensor \(V, H\)"),
    "3-D weight": (lambda x, w, t: ((x, w[None], t), {}), ValueError, "linear_weight must be a 2-D tensor"),
    "V = 0": (lambda x, w, t: ((x, w[:0], torch.full_like(t, -100)), {}), ValueError,
              r"at least one row \(V >= 1\)"),
    "hidden mismatch": (lambda x, w, t: ((x[:, :7], w, t), {}), ValueError, "hidden size mismatch"),
    "dtype mismatch": (lambda x, w, t: ((x, w.double(), t), {}), TypeError,
                       "input, linear_weight must share a dtype outside autocast"),
    "target not a tensor": (lambda x, w, t: ((x, w, t.tolist()), {}), TypeError, "target must be a torch.Tensor"),
    "float target": (lambda x, w, t: ((x, w, t.float()), {}), TypeError, "integer class indices"),
    "bool target": (lambda x, w, t: ((x, w, t > 3), {}), TypeError, "integer class indices"),
    "complex target": (lambda x, w, t: ((x, w, t.to(torch.complex64)), {}), TypeError, "integer class indices"),
    "target shape": (lambda x, w, t: ((x, w, t[:5]), {}), ValueError, r"target shape \(5,\) must equal"),
    "target >= V": (lambda x, w, t: ((x, w, torch.where(t == t[0], 20, t)), {}), ValueError,
                    r"outside \[0, 20\) that are not ignore_index=-100 \(first: 20\)"),
    "target < 0": (lambda x, w, t: ((x, w, torch.where(t == t[0], -3, t)), {}), ValueError, r"\(first: -3\)"),
    "uint64 target": (lambda x, w, t: ((x, w, torch.tensor([1, 2, 3, 4, 5, 2**64 - 100], dtype=torch.uint64)), {}),
                      ValueError, r"1 value\(s\) outside \[0, 20\).*\(first: 18446744073709551516\)"),
    "bias list": (lambda x, w, t: ((x, w, t), {"linear_bias": [0.0] * 20}), TypeError,
                  r"linear_bias must be a floating tensor of shape \(20,\) or None, got list"),
    "integer bias": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(20, dtype=torch.int64)}), TypeError,
                     "linear_bias must be a floating tensor of shape .20,., got dtype torch.int64"),
    "bias shape": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(21)}), ValueError,
                   r"linear_bias must be a floating tensor of shape \(20,\), got shape \(21,\)"),
    "bias dtype": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(20, dtype=torch.float64)}), TypeError,
                   "linear_bias torch.float64"),
    "class weights list": (lambda x, w, t: ((x, w, t), {"weight": [1.0] * 20}), TypeError,
                           r"weight \(class weights\) must be a floating tensor of shape \(20,\) or None"),
    "class weights shape": (lambda x, w, t: ((x, w, t), {"weight": torch.ones(20, 1)}), ValueError,
                            r"got shape \(20, 1\)"),
    **SHARED_TENSOR_CASES,
}


def _uint64_grouped(t):
    t = t.to(torch.uint64)
    t[2, 1] = torch.tensor(2**64 - 100, dtype=torch.uint64)
    return t


# The same for the grouped loss: x (5, 3, 8), w (3, 20, 8), t (5, 3).
GROUPED_TENSOR_CASES = {
    "input not a tensor": (lambda x, w, t: ((x.tolist(), w, t), {}), TypeError, "input must be a torch.Tensor"),
    "integer input": (lambda x, w, t: ((x.long(), w, t), {}), TypeError, "input must be a floating-point"),
    "2-D input": (lambda x, w, t: ((x[:, 0], w, t), {}), ValueError, r"input must be \(B, G, H\)"),
    "weight 2-D": (lambda x, w, t: ((x, w[0], t), {}), ValueError, r"linear_weight must be \(G, V, H\)"),
    "integer weight": (lambda x, w, t: ((x, w.long(), t), {}), TypeError, "linear_weight must be a floating"),
    "V = 0": (lambda x, w, t: ((x, w[:, :0], torch.full_like(t, -100)), {}), ValueError, r"V >= 1"),
    "groups mismatch": (lambda x, w, t: ((x, w[:2], t), {}), ValueError, "input must be"),
    "dtype mismatch": (lambda x, w, t: ((x, w.double(), t), {}), TypeError, "must share a dtype"),
    "float target": (lambda x, w, t: ((x, w, t.float()), {}), TypeError, "integer class indices"),
    "target shape": (lambda x, w, t: ((x, w, t.t()), {}), ValueError, r"target shape \(3, 5\) must equal"),
    "target >= V": (lambda x, w, t: ((x, w, torch.where(t == t[0, 0], 20, t)), {}), ValueError,
                    r"outside \[0, 20\) that are not ignore_index=-100 \(first: 20\)"),
    "uint64 target": (lambda x, w, t: ((x, w, _uint64_grouped(t)), {}), ValueError,
                      r"\(first: 18446744073709551516\)"),
    "bias shape": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(20)}), ValueError,
                   r"linear_bias must be \(3, 20\), got \(20,\)"),
    "integer bias": (lambda x, w, t: ((x, w, t), {"linear_bias": torch.zeros(3, 20, dtype=torch.int64)}), TypeError,
                     r"linear_bias must be a floating tensor of shape \(3, 20\)"),
    "class weights shape": (lambda x, w, t: ((x, w, t), {"weight": torch.ones(3, 20)}), ValueError,
                            r"weight \(class weights\) must be a floating tensor of shape \(20,\)"),
    **SHARED_TENSOR_CASES,
}


TENSOR_TABLES = {"linear_cross_entropy": (TENSOR_CASES, core_args),
                 "grouped_linear_cross_entropy": (GROUPED_TENSOR_CASES, grouped_args)}


@pytest.mark.parametrize("fn,case", [(fn, case) for fn, (table, _) in TENSOR_TABLES.items() for case in table])
def test_tensor_edges(fn, case):
    table, make_args = TENSOR_TABLES[fn]
    build, exc, match = table[case]
    args, kw = build(*make_args())
    with pytest.raises(exc, match=match):
        getattr(flce, fn)(*args, **kw)


def test_grouped_specific_options(grouped):
    with pytest.raises(ValueError, match=r"group_reduction must be one of \('sum', 'mean', 'pooled'\)"):
        flce.grouped_linear_cross_entropy(*grouped, group_reduction="avg")
    with pytest.raises(TypeError, match="group_major must be True or False"):
        flce.grouped_linear_cross_entropy(*grouped, group_major=1)


def test_grouped_linear_arguments():
    x, w, b = torch.randn(4, 3, 8), torch.randn(3, 5, 8), torch.randn(3, 5)
    cases = [
        ((x.tolist(), w), {}, TypeError, "input must be a floating-point torch.Tensor"),
        ((x.long(), w), {}, TypeError, "input must be a floating-point torch.Tensor, got torch.int64"),
        ((x, w[0]), {}, ValueError, r"weight must be \(G, out, in\)"),
        ((x, w.long()), {}, TypeError, "weight must be a floating-point"),
        ((x, w[:, :, :7]), {}, ValueError, r"input must be \(\.\.\., 7\)"),
        ((x, w, b[:, :4]), {}, ValueError, r"bias must be \(3, 5\)"),
        ((x, w, b.long()), {}, TypeError, r"bias must be a floating tensor of shape \(3, 5\)"),
        ((x, w, "b"), {}, TypeError, "bias must be a floating tensor"),
        ((x, w.double()), {}, TypeError, "input, weight must share a dtype outside autocast"),
        ((x.to("meta"), w.to("meta")), {}, ValueError, "input is on the meta device"),
        ((x, w.to("meta")), {}, ValueError, "all tensors must be on one device"),
        ((x, w[:2]), {}, ValueError, r"G = 2 \(weight's groups\)"),
        ((x, w), {"group_major": "yes"}, TypeError, "group_major must be True or False"),
    ]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            flce.grouped_linear(*args, **kw)


def test_grouped_linear_module_arguments():
    for kw in ({"num_groups": 0}, {"in_features": 2.0}, {"out_features": True}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a positive int"):
            flce.GroupedLinear(**{"num_groups": 2, "in_features": 3, "out_features": 4, **kw})
    with pytest.raises(TypeError, match="group_major must be True or False"):
        flce.GroupedLinear(2, 3, 4, group_major=None)


# --- accepted forms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [11, 11.0, np.int64(11), np.float32(11.0), torch.tensor(11), torch.tensor(11.0),
                                   torch.tensor([11]), torch.tensor([[11.0]]), torch.tensor(11, dtype=torch.int32)],
                         ids=lambda v: f"{type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
def test_num_items_accepted_forms(backend, device, value):
    """An int, a float (NumPy scalars too), or a one-element tensor of any real dtype: 0-d as Trainer
    passes it, (1,) or (1, 1) as it reaches nn.DataParallel replicas. The loss stays 0-d."""
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device, requires_grad=True)
    t = torch.randint(0, 20, (6,), device=device)
    t[1] = -100
    value = value.to(device) if isinstance(value, torch.Tensor) else value
    loss = flce.linear_cross_entropy(x, w, t, num_items_in_batch=value, backend=backend)
    ref, (x64, _, _) = reference_loss(x, w, t, num_items_in_batch=11)
    assert loss.shape == ()
    assert_close(loss, ref, 1e-5)
    loss.backward()
    ref.backward()
    assert_close(x.grad, x64.grad, 1e-5, "grad_input")


def test_num_items_zero_means_nothing_counts(backend, device):
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(20, 8, device=device)
    t = torch.full((6,), -100, device=device)
    for value in (0, 0.0, torch.tensor(0, device=device)):
        loss = flce.linear_cross_entropy(x, w, t, num_items_in_batch=value, backend=backend)
        assert loss.item() == 0.0


def test_num_items_bad_values_on_a_gpu_tensor_give_nan(device):
    """A GPU tensor's value is not read on the host (a sync): a negative or non-finite count gives NaN,
    never a plausible loss (the scale a GPU tensor goes through, checked here on ``device``)."""
    from flce.reduction import items_scale

    for bad in (-3.0, float("inf"), float("nan")):
        assert items_scale(torch.tensor(bad, device=device), device, torch.float32).isnan()
    assert items_scale(torch.tensor(0.0, device=device), device, torch.float32).item() == 0.0
    assert items_scale(torch.tensor(4.0, device=device), device, torch.float32).item() == 0.25


def test_numpy_scalars_are_numbers(core):
    x, w, t = core
    a = flce.linear_cross_entropy(x, w, t, label_smoothing=np.float32(0.25), temperature=np.float64(0.5),
                                  ignore_index=np.int64(3))
    b = flce.linear_cross_entropy(x, w, t, label_smoothing=0.25, temperature=0.5, ignore_index=3)
    assert_close(a, b, 1e-7)


def test_integer_targets_of_every_width(backend, device):
    x = torch.randn(6, 8, device=device)
    w = torch.randn(20, 8, device=device)
    t = torch.randint(0, 20, (6,), device=device)
    want = flce.linear_cross_entropy(x, w, t, backend=backend)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.uint32, torch.uint64):
        got = flce.linear_cross_entropy(x, w, t.to(dtype), backend=backend, ignore_index=-1)
        assert_close(got, want, 1e-7, str(dtype))


def test_uint64_target_never_meets_ignore_index():
    """A uint64 value from 2**63 on would wrap to a negative int64, possibly ignore_index: it is out of
    range (an error; NaN unchecked), never silently ignored."""
    x, w = torch.randn(2, 8), torch.randn(20, 8)
    t = torch.tensor([3, 2**64 - 100], dtype=torch.uint64)  # wraps to -100
    with pytest.raises(ValueError, match="first: 18446744073709551516"):
        flce.linear_cross_entropy(x, w, t)
    rows = flce.linear_cross_entropy(x, w, t, validate_target=False, reduction="none")
    assert rows[1].isnan() and rows[0].isfinite()


# --- V = 0, empty batches, empty hidden ---------------------------------------------------------------

def test_empty_vocabulary_is_refused_on_every_backend(backend, device):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    for w, t, fn in ((torch.randn(0, 8, device=device), torch.full((3,), -100, device=device),
                      flce.linear_cross_entropy),
                     (torch.randn(2, 0, 8, device=device), torch.full((3, 2), -100, device=device),
                      flce.grouped_linear_cross_entropy)):
        xi = x if w.dim() == 2 else x[:, None].expand(3, 2, 8)
        for validate in (True, False):
            with pytest.raises(ValueError, match=r"V >= 1"):
                fn(xi, w, t, backend=backend, validate_target=validate)


def test_empty_hidden_is_defined(backend, device):
    """H = 0: every logit is the bias (0 without), so the loss is the cross-entropy of the bias alone."""
    x = torch.randn(4, 0, device=device, requires_grad=True)
    w = torch.randn(7, 0, device=device, requires_grad=True)
    b = torch.randn(7, device=device, requires_grad=True)
    t = torch.randint(0, 7, (4,), device=device)
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, backend=backend)
    ref, (_, _, b64) = reference_loss(x, w, t, linear_bias=b)
    assert_close(loss, ref, 1e-6)
    loss.backward()
    ref.backward()
    assert_close(b.grad, b64.grad, 1e-5)


def test_grouped_linear_with_no_outputs(device):
    x = torch.randn(4, 3, 8, device=device, requires_grad=True)
    w = torch.randn(3, 0, 8, device=device, requires_grad=True)
    y = flce.grouped_linear(x, w)
    assert y.shape == (4, 3, 0)
    y.sum().backward()
    assert torch.all(x.grad == 0) and w.grad.shape == (3, 0, 8)


# --- dtypes: float64 stays float64, also under autocast -----------------------------------------------

@pytest.mark.parametrize("autocast", [False, True])
def test_float64_in_float64_out(backend, device, autocast):
    """As eager: float64 GEMMs (autocast leaves float64 alone) and a float64 loss and gradients, on the
    torch twin whatever the backend asked for."""
    x = torch.randn(6, 8, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, device=device, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 20, (6,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, stats = flce.linear_cross_entropy(x, w, t, backend=backend, return_stats=True, z_loss=1e-3)
        eager = torch.nn.functional.linear(x, w)
    assert eager.dtype == torch.float64  # what flce matches
    loss.backward()
    assert loss.dtype == x.grad.dtype == w.grad.dtype == stats.z_loss.dtype == torch.float64


def test_float64_under_autocast_grouped(backend, device):
    """The grouped loss and the grouped linear follow the same rule: float64 stays float64."""
    x = torch.randn(4, 2, 8, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 20, 8, device=device, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 20, (4, 2), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = flce.grouped_linear_cross_entropy(x, w, t, backend=backend)
        y = flce.grouped_linear(x, w)
    (loss + y.sum()).backward()
    assert loss.dtype == y.dtype == x.grad.dtype == w.grad.dtype == torch.float64


def test_autocast_mixed_float64_is_refused_like_eager(device):
    x = torch.randn(6, 8, device=device, dtype=torch.float64)
    w = torch.randn(20, 8, device=device)
    t = torch.randint(0, 20, (6,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(x, w)
        with pytest.raises(TypeError, match="float64 operands stay float64"):
            flce.linear_cross_entropy(x, w, t)


# --- TRITON_INTERPRET set too late --------------------------------------------------------------------

def test_triton_interpret_set_after_triton_import_is_a_clear_error(tmp_path):
    """triton decides on interpretation when it is first imported: setting TRITON_INTERPRET=1 later
    cannot work, and backend='triton' on the CPU says so."""
    pytest.importorskip("triton")
    code = (
        "import os, torch, triton, flce\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])\n"
        "    flce.linear_cross_entropy(x, w, t, backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ValueError: backend='triton' cannot run on the CPU in this process: TRITON_INTERPRET=1 was set " \
           "after triton was first imported" in out.stdout, out.stdout + out.stderr
