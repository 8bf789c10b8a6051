"""GPU checks at realistic shapes (skipped without CUDA): precision vs float64, autocast, CUDA graphs."""

import pytest
import torch
from conftest import capture_graph
from reference import assert_close, chunked_reference_grads, reference_loss, rel_err

import flce
from flce import gemm

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def llm_case(bt, hidden, vocab, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(bt, hidden, device=CUDA, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=CUDA, generator=g) * hidden**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (bt,), device=CUDA, generator=g)
    return x, w, t


@pytest.mark.parametrize("bt,hidden,vocab", [(32768, 1024, 32000), (16384, 2048, 65536)])
def test_default_grad_weight_precision_is_at_the_bf16_floor(bt, hidden, vocab):
    """grad_weight error vs float64 <= 1.25x the error of rounding the exact gradient once to bf16."""
    x, w, t = llm_case(bt, hidden, vocab)
    loss = flce.linear_cross_entropy(x, w, t)
    loss.backward()
    ref_loss, ref_gx, ref_gw = chunked_reference_grads(x.detach(), w.detach(), t)
    floor = rel_err(ref_gw.to(torch.bfloat16), ref_gw)
    err = rel_err(w.grad, ref_gw)
    assert err <= 1.25 * floor, f"grad_weight error {err:.3g} vs bf16 floor {floor:.3g} ({err / floor:.2f}x)"
    assert rel_err(x.grad, ref_gx) <= 1.25 * rel_err(ref_gx.to(torch.bfloat16), ref_gx) + 1e-3
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3


def test_llama3_head_matches_float64():
    x, w, t = llm_case(4096, 4096, 128256)
    loss = flce.linear_cross_entropy(x, w, t)
    loss.backward()
    ref_loss, ref_gx, ref_gw = chunked_reference_grads(x.detach(), w.detach(), t)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3
    assert rel_err(w.grad, ref_gw) < 1.25 * rel_err(ref_gw.to(torch.bfloat16), ref_gw)
    assert rel_err(x.grad, ref_gx) < 2e-2


@pytest.mark.parametrize("opts", [
    dict(), dict(label_smoothing=0.1, z_loss=1e-4), dict(softcap=30.0, temperature=0.9),
    dict(weight=True, label_smoothing=0.05),
])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_matches_reference_with_options(opts, reduction):
    opts = dict(opts)
    x, w, t = llm_case(1000, 512, 50257, dtype=torch.float32)
    t[::7] = -100
    b = torch.randn(50257, device=CUDA, requires_grad=True)
    cw = torch.rand(50257, device=CUDA) + 0.5 if opts.pop("weight", False) else None
    loss = flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction, chunk_size=384,
                                     **opts)
    ref, (x64, w64, b64) = reference_loss(x, w, t, linear_bias=b, weight_cls=cw, reduction=reduction, **opts)
    g = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.0, device=CUDA, dtype=torch.float64)
    loss.backward(g.float())
    ref.backward(g)
    assert_close(loss, ref, 1e-4, "loss")  # fp32 logits via TF32-free GEMMs
    for got, want, name in ((x.grad, x64.grad, "x"), (w.grad, w64.grad, "w"), (b.grad, b64.grad, "b")):
        assert_close(got, want, 1e-3, name)


def test_autocast_fp32_master_weights_on_cuda():
    x, w, t = llm_case(3000, 1024, 32000, dtype=torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = flce.linear_cross_entropy(x, w, t, chunk_size=1024)
    loss.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    ref_loss, ref_gx, ref_gw = chunked_reference_grads(x.detach(), w.detach(), t)
    assert rel_err(w.grad, ref_gw) < 1e-2 and rel_err(x.grad, ref_gx) < 1e-2


def test_out_dtype_path_equals_fallback(monkeypatch):
    x, w, t = llm_case(4096, 1024, 32000)
    grads = []
    for force in (False, True):
        monkeypatch.setattr(gemm, "FORCE_FALLBACK", force)
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t, chunk_size=1024).backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    assert rel_err(grads[0][0], grads[1][0]) < 1e-2
    assert rel_err(grads[0][1], grads[1][1]) < 5e-3


def test_triton_and_torch_backends_agree():
    x, w, t = llm_case(2048, 1024, 32000)
    out = []
    for backend in ("triton", "torch"):
        x.grad = w.grad = None
        loss = flce.linear_cross_entropy(x, w, t, backend=backend, z_loss=1e-4, label_smoothing=0.1)
        loss.backward()
        out.append((loss.detach(), x.grad.clone(), w.grad.clone()))
    for a, b in zip(*out):
        assert rel_err(a, b) < 1e-2


def test_cuda_graph_capture_and_replay():
    """validate_target=False makes the call sync-free, so forward+backward can be captured."""
    x, w, t = llm_case(1024, 512, 32000)
    static_t = t.clone()

    def step():
        x.grad = w.grad = None
        loss = flce.linear_cross_entropy(x, w, static_t, validate_target=False)
        loss.backward()
        return loss

    graph, static_loss = capture_graph(step)  # step clears .grad: the replay assigns, never accumulates
    new_t = torch.randint(0, 32000, t.shape, device=CUDA)
    static_t.copy_(new_t)
    graph.replay()
    torch.cuda.synchronize()
    eager_x, eager_w = x.grad.clone(), w.grad.clone()
    want = step()
    assert torch.allclose(static_loss, want, rtol=1e-5)
    assert rel_err(eager_x, x.grad) < 1e-3 and rel_err(eager_w, w.grad) < 1e-3


def test_small_batch_bad_target_raises_by_backward_without_a_forward_wait():
    """Below COMPACT_MIN_ROWS the check is read without draining the queue: with the GPU kept busy the
    error comes from backward (or forward, if the copy already landed), never not at all."""
    x, w, t = llm_case(64, 1024, 32000)
    t[5] = 32000
    busy = torch.randn(8192, 8192, device=CUDA)
    for _ in range(20):  # queue ~20 ms of work so the check's copy cannot have landed at forward
        busy = busy @ busy
        busy /= busy.norm()
    with pytest.raises(ValueError, match=r"outside \[0, 32000\).*first: 32000"):
        loss = flce.linear_cross_entropy(x, w, t)
        loss.backward()
    assert x.grad is None and w.grad is None


def test_large_batch_counts_ignored_rows_only_where_it_pays(monkeypatch):
    """A device's first call counts (one sync); with nothing ignored the next calls skip the sync and
    check in the background; once a background count sees many ignored rows, the sync comes back and
    drops them. A bad target is raised either way."""
    import flce.api as api

    calls = []
    monkeypatch.setattr(api, "_ignored_share", {})
    real = api._check_and_compact
    monkeypatch.setattr(api, "_check_and_compact", lambda *a: calls.append(1) or real(*a))
    x, w, t = llm_case(2048, 2048, 32000)  # half the rows dropped: 4e11 FLOPs > SYNC_WORTH_FLOP
    dev = t.device
    flce.linear_cross_entropy(x, w, t).backward()
    assert calls == [1] and api._ignored_share[dev] == 0.0
    flce.linear_cross_entropy(x, w, t).backward()
    assert calls == [1]
    half = t.clone()
    half[::2] = -100
    got = flce.linear_cross_entropy(x, w, half)  # not dropped yet; the background count sees 1/2
    got.backward()
    assert calls == [1] and api._ignored_share[dev] == 0.5
    x.grad = w.grad = None
    again = flce.linear_cross_entropy(x, w, half)
    again.backward()
    assert calls == [1, 1] and torch.allclose(got, again, rtol=1e-5)
    bad = t.clone()
    bad[7] = 32000
    monkeypatch.setattr(api, "_ignored_share", {dev: 0.0})
    with pytest.raises(ValueError, match=r"outside \[0, 32000\).*first: 32000"):
        flce.linear_cross_entropy(x, w, bad).backward()


@pytest.mark.parametrize("bt", [64, 2048])  # the background target check; the early sync that drops rows
def test_cuda_as_default_device(bt):
    """Under ``torch.device("cuda")`` (or set_default_device) the host buffers stay on the host."""
    with CUDA:
        x, w, t = llm_case(bt, 256, 1000, torch.float32)
        t[::3] = -100
        loss = flce.linear_cross_entropy(x, w, t)
        loss.backward()
        ref, (x64, w64, _) = reference_loss(x, w, t)
        ref.backward()
    assert_close(loss, ref, 1e-5, "loss")
    assert_close(x.grad, x64.grad, 1e-4, "grad_input")
    assert_close(w.grad, w64.grad, 1e-4, "grad_weight")
