"""A loss without gradients (loss_only.py, logits_triton.tile_stats, exp_rows_triton.loss_rows): against
float64 for every option it takes (z-loss, softcap and label smoothing too), to float32 precision (it reads no rounded
logits), the calls that keep the chunked path, loss_only_runs split by the statistics budget, and NaN for an unchecked
bad target.

On the CPU it runs under TRITON_INTERPRET=1 with small tiles and in float16 (the interpreter reads bf16
through tensor descriptors wrongly); on a Hopper GPU in bf16 at real sizes."""

import pytest
import torch
from reference import ROW_PATH_OPTIONS, TOL, reference_loss, rel_err, row_case, split_options

import flce
from conftest import DEVICE, HOPPER_DTYPE, ON_HOPPER
from flce.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")

lt = pytest.importorskip("flce.kernels.logits_triton")
DTYPE = HOPPER_DTYPE
# Float32 arithmetic on the unrounded logits: far inside the 16-bit tolerance the chunked path needs.
FLOAT32_TOL = 1e-4


def case(*args, dtype=DTYPE, **kwargs):
    """``reference.row_case`` on this file's device and dtype, logits of about 2 standard deviations, no
    leaf that requires grad."""
    return row_case(*args, **{"scale": 2.0, **kwargs}, dtype=dtype, device=DEVICE, requires_grad=False)


def loss_and_reference(x, w, b, t, cw, mode=None, **opts):
    """flce's loss without gradients (``mode``: its own settings) and the float64 reference."""
    with torch.no_grad():
        loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, backend="triton", **opts, **(mode or {}))
    ref, _ = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, **opts)
    return loss, ref


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", ROW_PATH_OPTIONS + [
    {"z_loss": 1e-3},
    {"softcap": 5.0},
    {"softcap": 3.0, "temperature": 1.3, "z_loss": 1e-2, "weight_cls": True, "bias": True, "ignore": 0.2},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "temperature": 1.3, "z_loss": 1e-2, "weight_cls": True, "bias": True, "ignore": 0.2},
])
def test_matches_float64(loss_only_runs, reduction, opts):
    inputs, opts = split_options(opts)
    x, w, b, t, cw = case(**inputs)
    loss, ref = loss_and_reference(x, w, b, t, cw, reduction=reduction, **opts)
    assert loss_only_runs == [x.shape[0]]
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) <= FLOAT32_TOL


@pytest.mark.parametrize("mode, opts", [({"chunk_size": 1}, {}), ({"low_memory": True, "chunk_size": 1}, {}),
                                        ({"low_memory": True, "chunk_size": 1}, {"label_smoothing": 0.1})])
def test_statistics_take_no_more_than_a_chunk_of_logits(loss_only_runs, monkeypatch, mode, opts):
    """The statistics of one launch fit the chunk plan's logits buffer (here one row of 120 logits: 15 rows
    of statistics with the interpreter's 2 tiles a row, 30 with Hopper's 1), the low-memory mode's included."""
    gemms, tile_stats = [], lt.tile_stats
    monkeypatch.setattr(lt, "tile_stats", lambda x, *a, **k: gemms.append(x.shape[0]) or tile_stats(x, *a, **k))
    x, w, b, t, cw = case(n=40, bias=True, ignore=0.2)
    loss, ref = loss_and_reference(x, w, b, t, cw, mode, reduction="none", **opts)
    tiles = lt.num_tiles(120)
    per_launch = max(120 * x.element_size() // (2 * 4 * tiles), lt.MIN_ROWS)
    assert loss_only_runs == [40] and gemms == [min(per_launch, 40 - start) for start in range(0, 40, per_launch)]
    assert len(gemms) > 1
    assert rel_err(loss, ref) <= FLOAT32_TOL


@pytest.mark.parametrize("rows, opts", [
    (40, {"softcap": 5.0}),  # a capped row's sum of logits is not linear in x: no thin GEMM gives it
    (15, {}),  # fewer rows than H / 2: the chunked path's logits cost less than a pass over W
])
def test_label_smoothing_keeps_the_chunked_path_where_it_costs_less(loss_only_runs, rows, opts):
    x, w, b, t, cw = case(n=rows)
    assert 2 * rows < x.shape[1] or opts
    loss, ref = loss_and_reference(x, w, b, t, cw, label_smoothing=0.1, **opts)
    assert loss_only_runs == [] and rel_err(loss, ref) <= TOL[DTYPE]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_scale", [None, 1.0, 1e6])  # 1e6: beyond float16's range unless scaled
@pytest.mark.parametrize("split_rows", [2048, 64])  # 64: four batches of 75 vocabulary rows and one left over
def test_smoothing_sums_match_float64(dtype, weight_scale, split_rows, monkeypatch):
    """sum_j c_j z_j and sum_j c_j from the two thin GEMMs, at float32 precision in both 16-bit dtypes."""
    from flce import loss_only
    from flce.options import LossOptions

    monkeypatch.setattr(loss_only, "SPLIT_K_ROWS", split_rows)
    x, w, b, t, cw = row_case(n=33, hidden=48, vocab=301, bias=True, weight_cls=weight_scale is not None,
                              dtype=dtype, device=DEVICE, requires_grad=False)
    cw = None if cw is None else cw * weight_scale
    sum_z, total = loss_only.smoothing_sums(x, w, b, cw, LossOptions(temperature=1.3))
    c = torch.ones(301, dtype=torch.float64, device=DEVICE) if cw is None else cw.double()
    z = (x.double() @ w.double().t() + b.double()) / 1.3
    want = z @ c
    assert sum_z.dtype == total.dtype == torch.float32 and sum_z.shape == (33,)
    assert (sum_z.double() - want).abs().max() <= 1e-5 * (z.abs() @ c).max()
    assert rel_err(total, c.sum()) <= 1e-6


def test_statistics_keep_the_chunked_path(loss_only_runs):
    x, w, b, t, cw = case()
    with torch.no_grad():
        loss, stats = flce.linear_cross_entropy(x, w, t, backend="triton", return_stats=True)
    assert loss_only_runs == [] and stats is not None and rel_err(loss, reference_loss(x, w, t)[0]) <= TOL[DTYPE]


def test_training_keeps_its_path(loss_only_runs):
    x, w, b, t, cw = case()
    loss = flce.linear_cross_entropy(x.requires_grad_(), w, t, backend="triton")
    loss.backward()
    assert loss_only_runs == [] and x.grad is not None


def test_unchecked_bad_target_gives_nan_not_a_number(loss_only_runs):
    x, w, b, t, cw = case()
    t[5] = 120
    with torch.no_grad():
        rows = flce.linear_cross_entropy(x, w, t, reduction="none", backend="triton", validate_target=False)
    assert loss_only_runs == [40] and torch.isnan(rows[5]) and torch.isfinite(rows[torch.arange(40) != 5]).all()


def test_bad_target_raises_when_checked(loss_only_runs):
    x, w, b, t, cw = case()
    t[5] = -7
    with pytest.raises(ValueError, match="target"), torch.no_grad():
        flce.linear_cross_entropy(x, w, t, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096, 128256), (4096, 2048, 32000)])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("opts", [{}, {"softcap": 30.0, "z_loss": 1e-4}, {"label_smoothing": 0.1, "z_loss": 1e-4}])
def test_gpu_real_shapes(shape, autocast, opts, loss_only_runs):
    """bf16 (or float32 leaves under bf16 autocast) at real sizes with flce's own thresholds: the path
    runs and its loss sits at float32 precision, while the chunked path's carries the logits' rounding."""
    if not ON_HOPPER:
        pytest.skip("the path needs Hopper")
    x, w, b, t, cw = case(*shape, ignore=0.1, dtype=torch.float32 if autocast else torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = flce.linear_cross_entropy(x, w, t, reduction="none", **opts)
    ref, _ = reference_loss(x.bfloat16(), w.bfloat16(), t, reduction="none", **opts)
    assert loss_only_runs == [int((t != -100).sum())]  # the target check drops ignored rows first
    assert rel_err(loss, ref) <= FLOAT32_TOL
