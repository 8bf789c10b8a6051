"""The logits GEMM with tile statistics (kernels/logits_triton.py), and the CE kernel's one-read path
that uses them, against float64 and against the two-pass kernel.

On the CPU the GEMM runs under TRITON_INTERPRET=1 with small tiles and in float16 only: triton 3.9's
interpreter reads bfloat16 through tensor descriptors wrongly. On a Hopper GPU it runs in bf16 too."""

import math

import pytest
import torch
from conftest import DEVICE, HOPPER_DTYPE, ON_HOPPER
from reference import TOL, errors_in_roundings, peaked_case, poisoned_padded_copy, reference_loss, rel_err
from test_api import check

import flce
from flce import gemm
from flce.kernels import ce_chunk, ce_triton, triton_available
from flce.options import LossOptions

pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="triton cannot run here")

lt = pytest.importorskip("flce.kernels.logits_triton")
DTYPES = [torch.float16, torch.bfloat16] if ON_HOPPER else [torch.float16]
OPTIONS = [
    LossOptions(),
    LossOptions(label_smoothing=0.2, z_loss=1e-2),
    LossOptions(softcap=4.0, temperature=1.3, ignore_index=3),
]


@pytest.fixture
def fused(hopper_gemm_calls):
    """Let the fused path run on these small shapes (and under the interpreter); count its calls."""
    return hopper_gemm_calls


def tile_stats_of(logits: torch.Tensor, opts: LossOptions, block_n: int):
    """Per-row, per-tile max and sum exp(z - max) of the logits after temperature and softcap (float64)."""
    z = capped(logits.double() / opts.temperature, opts.softcap)
    n, vocab = z.shape
    tiles = -(-vocab // block_n)
    z = torch.nn.functional.pad(z, (0, tiles * block_n - vocab), value=float("-inf")).view(n, tiles, block_n)
    tile_max = z.amax(2)
    return tile_max, (z - tile_max[..., None]).exp().sum(2)


def per_column(tile_values: torch.Tensor, vocab: int, block_n: int) -> torch.Tensor:
    """(n, T) per-tile values spread over the (n, V) columns of their tiles."""
    return tile_values.repeat_interleave(block_n, 1)[:, :vocab]


def capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def tile_shift(tile_max: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """What the GEMM takes off a tile's r before storing it: the tile's max of r, with a softcap c at most
    c asinh(c / 2) / 2 (``softcap_triton.tile_shift``)."""
    return tile_max if softcap is None else tile_max.clamp(max=softcap * math.asinh(softcap / 2) / 2)


def stored_tile_sum(stored: torch.Tensor, tile_max: torch.Tensor, block_n: int, softcap: float | None):
    """Per row and tile, the sum of exp(z - max z) of the stored values, z = softcap(stored + shift) and max z =
    softcap(the tile max of r) (float64)."""
    n, vocab = stored.shape
    tile_max = tile_max.double()
    z = capped(stored.double() + per_column(tile_shift(tile_max, softcap), vocab, block_n), softcap)
    e = (z - per_column(capped(tile_max, softcap), vocab, block_n)).exp()
    tiles = tile_max.shape[1]
    return torch.nn.functional.pad(e, (0, tiles * block_n - vocab)).view(n, tiles, block_n).sum(2)


def shifted_store(r: torch.Tensor, block_n: int, dtype: torch.dtype, softcap: float | None = None):
    """What the GEMM stores for logits r (after temperature): r less its tile's shift, in ``dtype``, with the
    float32 tile max of r and the sum of exp(z - max z) of the stored values, z = softcap(r) (the CE kernel's
    inputs)."""
    tile_max, _ = tile_stats_of(r, LossOptions(), block_n)
    stored = (r.double() - per_column(tile_shift(tile_max, softcap), r.shape[1], block_n)).to(dtype)
    return stored, tile_max.float(), stored_tile_sum(stored, tile_max, block_n, softcap).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_and_tile_stats_match_float64(fused, dtype, opts, with_bias):
    n, hidden, vocab = 70, 48, 600  # partial row and column tiles
    x = torch.randn(n, hidden, device=DEVICE).to(dtype)
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5 * 3).to(dtype)
    b = (torch.randn(vocab, device=DEVICE)).to(dtype) if with_bias else None
    assert lt.supported(x, w, b)
    out = torch.empty(n, vocab, dtype=dtype, device=DEVICE)
    stats = torch.empty(2, n, lt.num_tiles(vocab), device=DEVICE)
    lt.logits_with_tile_stats(x, w, b, out, stats[0], stats[1], opts)
    want = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    block_n = lt.TILE.block_n
    # r = logits / T less its tile's shift (its max): a logit that carries probability is stored nearly exactly
    r = want / opts.temperature
    exact, tile_max, _ = shifted_store(r, block_n, torch.float64, opts.softcap)
    assert torch.allclose(stats[0].double(), tile_max.double(), rtol=1e-6, atol=1e-6)
    assert rel_err(out.double() + per_column(tile_shift(stats[0].double(), opts.softcap), vocab, block_n), r) \
        <= TOL[dtype] / 4
    near = (exact > -1) & (exact <= 0)  # within e of its tile's shift
    assert near.sum() >= n * stats.shape[2]  # every tile has its max there
    ulp = torch.finfo(dtype).eps / 2  # of values in [-1, 0)
    assert (out.double() - exact)[near].abs().max() <= ulp
    want_sum = stored_tile_sum(out, stats[0], block_n, opts.softcap)
    # The statistics are those of the stored values, so the CE kernel's softmax sums to one over them.
    assert torch.allclose(stats[1].double(), want_sum, rtol=1e-5)


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("block_v", [None, 2048])  # 2048: two whole blocks and a partial one
@pytest.mark.parametrize("vocab", [5000, 5001])  # 5001: rows padded to 5008, the padding poisoned with NaN
def test_ce_one_read_path_matches_two_passes(monkeypatch, opts, grad, block_v, vocab):
    """The CE kernel given tile statistics writes what its two-pass form writes (all outputs). In rows padded to
    whole lines (``gemm.padded_rows``) it takes whole 16-byte groups, the padding's included (``whole_groups``),
    which changes none of them."""
    if block_v:
        monkeypatch.setattr(ce_triton, "LAUNCH", ce_triton.LaunchConfig(block_v=block_v, few_rows_block_v=block_v))
    n, block_n = 9, 256  # several vocabulary blocks and tiles, a partial last tile
    logits = (torch.randn(n, vocab, device=DEVICE) * 3).bfloat16()
    target = torch.randint(0, vocab, (n,), device=DEVICE)
    target[1] = opts.ignore_index
    cw = torch.rand(vocab, device=DEVICE) + 0.5
    # the GEMM stores r = logits / T less its tile's shift; the two passes read the same r in float32
    stored, tile_max, tile_sum = shifted_store(logits.double() / opts.temperature, block_n, torch.bfloat16,
                                               opts.softcap)
    r = stored.float() + per_column(tile_shift(tile_max, opts.softcap), vocab, block_n)  # the kernel's own sum
    inputs = ((r * opts.temperature).double().float(), None), (stored, (tile_max, tile_sum))
    scale = torch.rand(n, device=DEVICE) + 0.5 if grad else None  # per-row grad_output
    for class_weight in (None, cw):
        outs = []
        for values, stats in inputs:
            buf = values.clone()
            if stats is not None and vocab % 8:
                buf = poisoned_padded_copy(values)
                assert ce_triton.whole_groups(buf, 8)
            loss, lse, correct = (torch.full((n,), float("nan"), device=DEVICE) for _ in range(3))
            ce_chunk("triton", buf, target, loss, lse, correct, class_weight,
                     class_weight.sum() if class_weight is not None else None,
                     scale, opts, tile_stats=stats)
            outs.append((buf, loss, lse, correct))
        for name, one, two in zip(("grad", "loss", "lse", "correct"), outs[1], outs[0]):
            if name == "grad" and not grad:
                continue  # the buffers hold their inputs
            # the gradients as stored: in bf16 by one path, float32 by the other
            rtol = 2**-7 if two.dtype != one.dtype else 1e-5
            assert torch.allclose(one.float(), two.to(one.dtype).float(), rtol=rtol, atol=1e-6), name
        if not grad:
            assert torch.equal(outs[1][0], inputs[1][0])  # loss only: the stored values untouched
    assert ce_triton.whole_groups(torch.empty(n, vocab, dtype=torch.bfloat16, device=DEVICE), 8) == (vocab % 8 == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 24])
def test_linear_cross_entropy_through_fused_gemm(fused, dtype, reduction, chunk_size):
    """Every option at once, single and multi-chunk: the loss and all gradients against float64, and
    the fused GEMM really ran (70 rows in chunks of 24: 3 calls; one chunk: 1)."""
    check("triton", dtype, DEVICE, shape=(70,), hidden=48, vocab=600, reduction=reduction, chunk_size=chunk_size,
          bias=True, weight_cls=True, ignore=0.25, label_smoothing=0.2, z_loss=1e-2, softcap=4.0,
          temperature=1.3)
    assert len(fused) == (3 if chunk_size else 1) * (2 if reduction == "none" else 1)


@pytest.mark.parametrize("chunk_size", [None, 24])
@pytest.mark.parametrize("vocab", [601, 37])
def test_odd_vocabulary_through_fused_gemm(fused, monkeypatch, chunk_size, vocab):
    """V not a multiple of 8: the GEMM stores into padded rows (``gemm.padded_rows``), the CE
    kernel follows their stride, and the gradient GEMMs cut V (``gemm._split_gemm``, on here as on CUDA)."""
    from flce import gemm

    monkeypatch.setattr(gemm, "SPLIT_ON_CPU", True)
    check("triton", HOPPER_DTYPE, DEVICE, shape=(70,), hidden=48, vocab=vocab, chunk_size=chunk_size, bias=True,
          ignore=0.25, label_smoothing=0.2, z_loss=1e-2)
    assert len(fused) == (3 if chunk_size else 1)


def test_accuracy_stats_through_fused_gemm(fused):
    x = torch.randn(40, 32, device=DEVICE).half()
    w = (torch.randn(256, 32, device=DEVICE) / 32**0.5 * 3).half()
    t = torch.randint(0, 256, (40,), device=DEVICE)
    t[:10] = (x.float() @ w.float().t()).argmax(1)[:10]  # some right answers
    _, stats = flce.linear_cross_entropy(x, w, t, return_stats=True, backend="triton")
    want = ((x.double() @ w.double().t()).argmax(1) == t).double().mean()
    assert len(fused) == 1 and stats.accuracy.item() == pytest.approx(want.item()) and want > 0


def test_not_used_where_it_cannot_run(monkeypatch):
    x, w, b = torch.randn(512, 64).half(), torch.randn(1000, 64).half(), torch.randn(1000).half()
    assert not lt.supported(x, w, None)  # CPU without the interpreter opt-in
    monkeypatch.setattr(lt, "ALLOW_INTERPRETER", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert lt.supported(x, w, None) and lt.supported(x, w, b)
    assert lt.supported(x, w[:999], None)  # any V: the logits go into padded rows
    assert not lt.tma_ready(torch.empty(512, 999).half())
    assert lt.tma_ready(gemm.padded_rows(512, 999, x.dtype, x.device))
    assert not lt.supported(x.float(), w.float(), None)  # 16-bit floats only
    assert not lt.supported(x[: lt.MIN_ROWS - 1], w, None)  # small batches keep cuBLAS
    assert not lt.supported(x, w, torch.randn(2000).half()[::2])  # a strided bias
    x63, w63 = torch.randn(512, 63).half(), torch.randn(1000, 63).half()
    assert not lt.supported(x63, w63, None)  # rows of x and W not 16-byte aligned


@pytest.mark.gpu
@pytest.mark.parametrize("opts", OPTIONS)
def test_gpu_bf16_real_shapes(opts):
    """bf16 at a chunked size with a real vocabulary: the default path (no patching) on Hopper."""
    if not ON_HOPPER:
        pytest.skip("needs Hopper (TMA)")
    n, hidden, vocab = 3000, 512, 32000
    x = torch.randn(n, hidden, device=DEVICE).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5 * 2).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (n,), device=DEVICE)
    kw = dict(label_smoothing=opts.label_smoothing, z_loss=opts.z_loss, softcap=opts.softcap,
              temperature=opts.temperature, ignore_index=opts.ignore_index)
    loss = flce.linear_cross_entropy(x, w, t, chunk_size=1024, **kw)
    ref, (x64, w64, _) = reference_loss(x, w, t, **kw)
    loss.backward()
    ref.backward()
    assert rel_err(loss, ref) < 1e-3
    assert rel_err(x.grad, x64.grad) < TOL[torch.bfloat16] and rel_err(w.grad, w64.grad) < TOL[torch.bfloat16]


@pytest.mark.parametrize("chunk_size", [None, 32])
@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.7, label_smoothing=0.1, bias=True), dict(softcap=30.0)])
def test_peaked_logits_keep_the_gradients_at_the_rounding(fused, chunk_size, opts):
    """Logits of std 6 with targets drawn from their softmax, as a trained model's: a logit rounded to 16 bits
    is off by up to |z| ulps of 1, which 16-bit logits carry into every gradient (7-12x the 16-bit rounding of
    the exact gradients here). The GEMM stores z less its tile max, so the gradients stay near the rounding
    (what remains is the 16-bit dlogits' own rounding). With softcap 30 it stores r less the tile's shift
    (``softcap_triton.tile_shift``): 1.5-1.7x over seeds 0-2, 4.6-5.6x with the logits stored as such."""
    opts = dict(opts)
    x, w, b, target = peaked_case(96, 32, 512, HOPPER_DTYPE, DEVICE, opts.pop("bias", False),
                                  opts.get("temperature", 1.0), softcap=opts.get("softcap"))
    want, leaves = reference_loss(x, w, target, linear_bias=b, **opts)
    exact = torch.autograd.grad(want, [t for t in leaves if t is not None])
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(flce.linear_cross_entropy(x, w, target, linear_bias=b, chunk_size=chunk_size,
                                                        backend="triton", **opts), inputs)
    assert len(fused) == (3 if chunk_size else 1)
    # 1.3-2.1x over seeds 0-5 (the dlogits' own rounding); 7-12x with the logits stored as such
    assert max(errors_in_roundings(got, exact, HOPPER_DTYPE)) <= 2.5


@pytest.mark.parametrize("chunk_size", [None, 32])
@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.7, label_smoothing=0.1, bias=True), dict(softcap=30.0)])
def test_peaked_logits_row_losses_from_a_dot_at_the_target(fused, chunk_size, opts):
    """The loss at logits of std 6, summed over rows (with gradients: the CE kernel on the GEMM's shifted values):
    each row's logit at its target is a float32 dot of the GEMM's operands, not the stored value, which a tile max
    leaves off by up to |z_y - tile max| ulps of 1 in 16 bits."""
    opts = dict(opts)
    x, w, b, target = peaked_case(96, 32, 512, HOPPER_DTYPE, DEVICE, opts.pop("bias", False),
                                  opts.get("temperature", 1.0), softcap=opts.get("softcap"))
    want, _ = reference_loss(x, w, target, linear_bias=b, reduction="sum", **opts)
    got = flce.linear_cross_entropy(x, w, target, linear_bias=b, chunk_size=chunk_size, reduction="sum",
                                    backend="triton", **opts)
    assert len(fused) == (3 if chunk_size else 1)
    # 1.0-2.0e-4 here (in 134-334 nats); 0.96-3.0e-3 from each target's stored value
    assert (got.double() - want).abs() <= 0.5 * torch.finfo(HOPPER_DTYPE).eps


def test_tile_maxima_alone(fused):
    """Without tile_sum (``linear_log_probs`` reads the maxima alone) the GEMM stores the same values and maxima."""
    x = torch.randn(70, 48, device=DEVICE).half()
    w = (torch.randn(600, 48, device=DEVICE) / 48**0.5 * 3).half()
    opts = LossOptions(softcap=4.0, temperature=1.3)
    outs = [torch.full((70, 600), float("nan"), dtype=x.dtype, device=DEVICE) for _ in range(2)]
    stats = torch.full((3, 70, lt.num_tiles(600)), float("nan"), device=DEVICE)
    lt.logits_with_tile_stats(x, w, None, outs[0], stats[0], stats[1], opts)
    lt.logits_with_tile_stats(x, w, None, outs[1], stats[2], None, opts)
    assert torch.equal(outs[0], outs[1]) and torch.equal(stats[0], stats[2]) and not stats[0].isnan().any()
