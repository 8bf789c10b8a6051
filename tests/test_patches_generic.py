"""A set of tiny models (hf_tiny.CONFIGS): patched loss and gradients equal the unpatched model's (fp32
tight, bf16 loose), and the call semantics (logits, tuple output, logits_to_keep, shift_labels,
num_items_in_batch, the model's own softcap) follow transformers. Every other causal LM: test_patches_zoo.py."""

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import CONFIGS, assert_patched_matches, patched, tiny_batch, tiny_model
from reference import assert_close


FAMILY_NAMES = list(CONFIGS)
HEAD_SCALE = 40.0  # logits of a few units: softcaps bite, and the loss is far from log(V)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fp32_loss_and_grads_match(family):
    model = tiny_model(family, head_scale=HEAD_SCALE)
    assert_patched_matches(model, tiny_batch(), loss_tol=2e-6, grad_tol=2e-5, use_flce_experts=False)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_loss_and_grads_match(family):
    model = tiny_model(family, dtype=torch.bfloat16, head_scale=HEAD_SCALE)
    assert_patched_matches(model, tiny_batch(), loss_tol=1e-2, grad_tol=6e-2, use_flce_experts=False)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_softcap_comes_from_config(family):
    model = tiny_model(family, head_scale=HEAD_SCALE)
    inputs = tiny_batch()
    want, got = assert_patched_matches(model, inputs, loss_tol=2e-6, grad_tol=2e-5)
    model.config.final_logit_softcapping = None  # the cap must have mattered for this test to mean anything
    uncapped = model(**inputs).loss
    assert abs(uncapped.item() - want.loss.item()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_that_scales_its_columns(backend, device, dtype):
    """Dory's head multiplies its float32 logits column by column by a learned vector: fused as a linear map of
    the scaled weight, whose gradient reaches the weight and the vector (checked among every gradient)."""
    model = tiny_model("dory", dtype=dtype, head_scale=HEAD_SCALE).to(device)
    with torch.no_grad():
        model.lm_head.logit_scale.uniform_(0.25, 2.0).mul_(model.config.initializer_range)
    inputs = {k: v.to(device) for k, v in tiny_batch(batch=2, seq=6).items()}
    tols = dict(loss_tol=2e-5, grad_tol=2e-4) if dtype == torch.float32 else dict(loss_tol=1e-2, grad_tol=6e-2)
    want, _ = assert_patched_matches(model, inputs, backend=backend, **tols)
    with torch.no_grad():
        model.lm_head.logit_scale.mul_(3.0)  # the scale must have mattered for this test to mean anything
    assert abs(model(**inputs).loss.item() - want.loss.item()) > 1e-2


def test_scaled_rows_gradients_in_pieces(monkeypatch):
    """The scaled weight of such a head, made piece by piece: gradcheck in float64, pieces of 2 of 5 rows."""
    from flce.patches.head import ScaleRows

    monkeypatch.setattr(ScaleRows, "PIECE_ELEMENTS", 6)
    weight = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(5, dtype=torch.float64).add(0.5).requires_grad_()
    assert len(ScaleRows.pieces(weight)) == 3
    torch.autograd.gradcheck(ScaleRows.apply, (weight, scale))
    bf16 = torch.randn(5, 3).bfloat16()
    assert torch.equal(ScaleRows.apply(bf16, scale.float()), (bf16.float() * scale.float()[:, None]).bfloat16())


def test_scaled_rows_on_the_triton_scale_kernel(monkeypatch):
    """As on CUDA: the weight and its gradient scaled by the streaming Triton kernel (interpreted here), each value
    within one bf16 step of the float64 product (the interpreter's cast truncates where CUDA rounds to nearest)."""
    from flce import kernels
    from flce.kernels import scale
    from flce.patches import head

    if not kernels.triton_available(torch.device("cpu")):
        pytest.skip("the Triton interpreter is not available here")
    monkeypatch.setattr(head, "resolve_backend", lambda *args: "triton")
    monkeypatch.setattr(scale, "TORCH_BELOW", 0)
    weight = torch.randn(6, 5).bfloat16().requires_grad_()
    factor = torch.rand(6).add(0.5).requires_grad_()
    out = head.ScaleRows.apply(weight, factor)
    grad = torch.randn(6, 5).bfloat16()
    out.backward(grad)
    for got, want in ((out, weight.double() * factor.double()[:, None]),
                      (weight.grad, grad.double() * factor.double()[:, None])):
        assert got.dtype == torch.bfloat16 and ((got.double() - want).abs() <= want.abs() * 2**-7).all()
    assert_close(factor.grad, (grad.double() * weight.double()).sum(1), 1e-6, "grad of the scale")


def test_head_that_scales_its_columns_refuses_a_dtensor_weight(monkeypatch):
    """A sharded weight cannot be scaled row by row in place: a clear refusal instead of a DTensor error."""
    from flce.patches import head

    model = tiny_model("dory")
    monkeypatch.setattr(head, "is_dtensor", lambda t: t is model.lm_head.weight)
    with patched(model), pytest.raises(ValueError, match="scales its columns by a learned vector.*not a DTensor"):
        model(**tiny_batch())


def test_softcap_option_on_a_model_that_caps_its_logits_is_refused():
    model = tiny_model("gemma2")
    with patched(model, softcap=10.0), pytest.raises(ValueError, match="already caps at 2 .*leave the option out"):
        model(**tiny_batch())


@pytest.mark.parametrize("tie", [False, True])
def test_tied_and_untied_heads(tie):
    model = tiny_model("qwen3", head_scale=HEAD_SCALE, tie_word_embeddings=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert_patched_matches(model, tiny_batch(), loss_tol=2e-6, grad_tol=2e-5)


@pytest.mark.parametrize("keep", [4, "index"])
def test_logits_to_keep(keep):
    model = tiny_model("mistral", head_scale=HEAD_SCALE)
    inputs = tiny_batch(seq=10)
    positions = torch.tensor([1, 4, 6, 9]) if keep == "index" else slice(-keep, None)
    inputs["labels"] = inputs["labels"][:, positions]
    inputs["logits_to_keep"] = positions if keep == "index" else keep
    assert_patched_matches(model, inputs, loss_tol=2e-6, grad_tol=2e-5)


def test_labels_not_matching_kept_positions_raise():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="batch_size"):  # unpatched: F.cross_entropy's own check
        model(**tiny_batch(), logits_to_keep=3)
    with patched(model), pytest.raises(ValueError, match="do not match"):
        model(**tiny_batch(), logits_to_keep=3)


def test_shift_labels_num_items_and_ignore_index_pass_through():
    model = tiny_model("qwen2", head_scale=HEAD_SCALE)
    inputs = tiny_batch()
    shift = torch.roll(inputs["labels"], -2, dims=1)
    inputs.update(shift_labels=shift, num_items_in_batch=torch.tensor(41), ignore_index=7)
    inputs["labels"][inputs["labels"] == -100] = 7
    shift[shift == -100] = 7
    assert_patched_matches(model, inputs, loss_tol=2e-6, grad_tol=2e-5)


def test_all_labels_ignored_gives_zero_not_nan():
    model = tiny_model("llama")
    inputs = tiny_batch()
    inputs["labels"].fill_(-100)
    with patched(model):
        out = model(**inputs)
    assert out.loss.item() == 0.0  # the unpatched mean over no tokens is NaN


def test_tuple_output_matches_transformers_layout():
    model = tiny_model("llama")
    inputs = tiny_batch()
    want = model(**inputs, return_dict=True, use_cache=False)
    with patched(model):
        got = model(**inputs, return_dict=False, use_cache=False)
        positional = model(inputs["input_ids"], inputs["attention_mask"], None, None, None, inputs["labels"],
                           False)
    assert isinstance(got, tuple) and len(got) == 1  # (loss,): logits are None and dropped like every None
    assert_close(got[0], want.loss, 2e-6, "tuple loss")
    assert positional.logits is None
    assert_close(positional.loss, want.loss, 2e-6, "positional labels")


def test_without_labels_or_in_eval_logits_are_exactly_unpatched():
    model = tiny_model("qwen3moe")
    inputs = {**tiny_batch(), "output_router_logits": True}
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    train_logits = model(**no_labels).logits
    model.eval()
    want = model(**inputs)
    model.train()
    with patched(model):
        assert torch.equal(model(**no_labels).logits, train_logits)
        model.eval()
        got = model(**inputs)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert torch.equal(got.aux_loss, want.aux_loss)


def test_materialize_logits_switch():
    model = tiny_model("llama")
    inputs = tiny_batch()
    want = model(**inputs)
    with patched(model, materialize_logits=True):
        got = model(**inputs)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    model.eval()
    with patched(model, materialize_logits=False):
        fused = model(**inputs)
    assert fused.logits is None
    assert_close(fused.loss, want.loss, 2e-6, "fused in eval mode")


@pytest.mark.parametrize("options", [{"z_loss": 1e-3}, {"label_smoothing": 0.1}, {"softcap": 3.0},
                                     {"temperature": 0.8}])
def test_loss_options_pass_through(options):
    model = tiny_model("llama", head_scale=HEAD_SCALE)
    inputs = tiny_batch()
    logits = model(**inputs).logits.double() / options.get("temperature", 1.0)
    if "softcap" in options:
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    target = F.pad(inputs["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)
    rows = logits.reshape(-1, logits.shape[-1])
    want = F.cross_entropy(rows, target, label_smoothing=options.get("label_smoothing", 0.0))
    valid = target != -100
    want = want + options.get("z_loss", 0.0) * torch.logsumexp(rows[valid], 1).square().mean()
    with patched(model, **options):
        got = model(**inputs).loss
    assert_close(got, want, 2e-6, str(options))


def test_fused_loss_runs_inside_a_call_of_lm_head():
    model = tiny_model("llama")
    weight = model.lm_head.weight
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(("post", out.shape, out.requires_grad)))
    inputs = tiny_batch()
    with patched(model):
        out = model(**inputs)
    hidden = (*inputs["input_ids"].shape, model.config.hidden_size)
    assert seen == [("pre", hidden), ("post", torch.Size([]), True)]  # the head's output is the loss
    assert model.lm_head.weight is weight and "forward" not in model.lm_head.__dict__
    out.loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_backends(backend, device):  # torch, and triton (on CUDA, or interpreted on the CPU)
    model = tiny_model("llama", head_scale=HEAD_SCALE).to(device)
    inputs = {k: v.to(device) for k, v in tiny_batch(batch=2, seq=6).items()}
    assert_patched_matches(model, inputs, loss_tol=2e-5, grad_tol=2e-4, backend=backend)


def test_accelerate_hooks_on_lm_head_fire():
    from accelerate.hooks import ModelHook, add_hook_to_module

    class CountingHook(ModelHook):  # as accelerate's offload / device-map hooks wrap a module
        calls = []

        def pre_forward(self, module, *args, **kwargs):
            self.calls.append(args[0].shape)
            return args, kwargs

    model = tiny_model("llama")
    inputs = tiny_batch()
    want = model(**inputs).loss
    add_hook_to_module(model.lm_head, CountingHook())
    hooked_forward, inner_forward = model.lm_head.forward, model.lm_head._old_forward
    with patched(model):
        got = model(**inputs)
    assert got.logits is None and len(CountingHook.calls) == 1
    assert_close(got.loss, want, 2e-6, "loss")
    assert model.lm_head.forward is hooked_forward and model.lm_head._old_forward is inner_forward
