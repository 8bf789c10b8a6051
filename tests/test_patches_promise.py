"""The logits promise on its own: what a model does to its logits before cross_entropy (views, row
slices, masks, scales, softcaps, biases, a vocabulary slice, casts) gives the loss and gradients that the
same ops on materialized logits give; anything else is refused with a ValueError naming it."""

import pytest
import torch
import torch.nn.functional as F
from reference import assert_close, reference_loss

from flce.patches.promise import HeadCall, LogitsPromise
from flce.patches.transform import LogitTransform, Unfusable

B, T, H, V = 2, 7, 16, 40
MASK = torch.arange(B * T).view(B, T) % 3 != 1


def _setup(bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.mul_(8.0)  # logits of several units: softcaps and scales matter
    hidden = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    return head, hidden


def _promise(head, hidden, **options):
    call = HeadCall(head, hidden, "Toy", {"backend": "torch", **options})
    return LogitsPromise.of_head_call(call, V, hidden.dtype), call


def _loss_and_grads(loss, *leaves):
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return loss.detach(), grads


RECIPES = {  # (logits -> cross_entropy input, targets (B, T) -> cross_entropy targets)
    "flat": (lambda z: z.float().view(-1, V), lambda t: t.view(-1)),
    "reshape_contiguous": (lambda z: z.contiguous().reshape(B * T, V), lambda t: t.reshape(-1)),
    "scale": (lambda z: (z * 0.25).view(-1, V), lambda t: t.view(-1)),
    "scale_left_and_tensor": (lambda z: (2.0 * z / torch.tensor(3.0)).view(-1, V), lambda t: t.view(-1)),
    "softcap": (lambda z: (torch.tanh(z.float() / 5.0) * 5.0).view(-1, V), lambda t: t.view(-1)),
    "scale_then_softcap": (lambda z: ((z * 0.5) / 3.0).tanh().mul(3.0).view(-1, V), lambda t: t.view(-1)),
    "vocab_slice": (lambda z: z[..., : V - 6].reshape(-1, V - 6), lambda t: t.clamp_max(V - 7).view(-1)),
    "softcap_then_vocab_slice": (lambda z: (torch.tanh(z / 4.0) * 4.0)[..., 3:].flatten(0, 1),
                                 lambda t: (t.clamp(3) - 3).view(-1)),
    "row_slice": (lambda z: z[:, 2:-1, :].contiguous().view(-1, V), lambda t: t[:, 2:-1].reshape(-1)),
    "bool_mask": (lambda z: z[MASK], lambda t: t[MASK]),
    "index_rows": (lambda z: z[:, torch.tensor([0, 3, 5])].view(-1, V), lambda t: t[:, [0, 3, 5]].reshape(-1)),
    "ellipsis_and_none": (lambda z: z[None, ..., :][0].view(-1, V), lambda t: t.view(-1)),
    "transpose_leading": (lambda z: z.transpose(0, 1).reshape(-1, V), lambda t: t.transpose(0, 1).reshape(-1)),
    "cast_float64_back": (lambda z: z.to(torch.float64).to(dtype=torch.float32).view(-1, V), lambda t: t.view(-1)),
    "one_row": (lambda z: z[1, 4], lambda t: t[1, 4]),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
def test_recipe_matches_materialized_logits(recipe, bias):
    to_input, to_target = RECIPES[recipe]
    head, hidden = _setup(bias)
    targets = torch.randint(0, V, (B, T))
    targets[0, 1] = -100
    want = F.cross_entropy(to_input(head(hidden)), to_target(targets))
    want, want_grads = _loss_and_grads(want, hidden, head.weight, head.bias)
    promise, call = _promise(head, hidden)
    got = F.cross_entropy(to_input(promise), to_target(targets))
    got, got_grads = _loss_and_grads(got, hidden, head.weight, head.bias)
    assert call.losses == 1
    assert_close(got, want, 2e-6, "loss")
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, 2e-5, "grad")


def test_added_bias_reaches_its_gradient():
    head, hidden = _setup(bias=True)
    extra = torch.randn(V, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    recipe = lambda z: (torch.tanh((z + extra) / 6.0) * 6.0).view(-1, V)  # noqa: E731 - a bias before a softcap
    want, want_grads = _loss_and_grads(F.cross_entropy(recipe(head(hidden)), targets.view(-1)), extra, head.bias)
    got, got_grads = _loss_and_grads(F.cross_entropy(recipe(_promise(head, hidden)[0]), targets.view(-1)), extra,
                                     head.bias)
    assert_close(got, want, 2e-6, "loss")
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, 2e-5, "bias grad")


@pytest.mark.parametrize("kwargs", [
    {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 5}, {"label_smoothing": 0.2},
    {"weight": "classes"}, {"reduction": "sum", "weight": "classes", "label_smoothing": 0.1},
])
def test_cross_entropy_options_and_the_module_form(kwargs):
    head, hidden = _setup()
    targets = torch.randint(0, V, (B * T,))
    targets[3] = kwargs.get("ignore_index", -100)
    if kwargs.get("weight") == "classes":
        kwargs = {**kwargs, "weight": torch.rand(V) + 0.5}
    want = torch.nn.CrossEntropyLoss(**kwargs)(head(hidden).view(-1, V), targets)
    got = torch.nn.CrossEntropyLoss(**kwargs)(_promise(head, hidden)[0].view(-1, V), targets)
    assert got.shape == want.shape
    assert_close(got, want, 2e-6, "loss")


@pytest.mark.parametrize("options", [{"temperature": 2.0}, {"softcap": 3.0}, {"temperature": 0.5, "softcap": 7.0},
                                     {"z_loss": 1e-3, "label_smoothing": 0.1}])
def test_user_options_apply_on_top_of_the_model_logits(options):
    head, hidden = _setup()
    targets = torch.randint(0, V, (B, T))
    promise, _ = _promise(head, hidden, **options)
    got = F.cross_entropy((promise * 0.5).view(-1, V), targets.view(-1))
    # the model's logits are 0.5 * (x W^T + b): flce's linear map with weight and bias halved
    want, _ = reference_loss(hidden, head.weight * 0.5, targets, linear_bias=head.bias * 0.5, **options)
    assert_close(got, want, 2e-6, "loss")


REFUSED = {
    "softmax": (lambda z: z.softmax(-1), ".softmax"),
    "log_softmax": (lambda z: F.log_softmax(z, -1), "log_softmax"),
    "argmax": (lambda z: z.argmax(-1), ".argmax"),
    "negative scale": (lambda z: z * -2.0, "by -2.0"),
    "negation": (lambda z: -z, "negation"),
    "learned scale": (lambda z: z * torch.nn.Parameter(torch.tensor(2.0)), "requires grad"),
    "per-row scale": (lambda z: z * torch.rand(B, T, 1), "shape (2, 7, 1)"),
    "reciprocal": (lambda z: 1.0 / z, "division of a number by the logits"),
    "two tanh": (lambda z: torch.tanh(torch.tanh(z)), "a second tanh"),
    "bias after tanh": (lambda z: torch.tanh(z) + torch.zeros(V), "after the tanh"),
    "row bias": (lambda z: z + torch.zeros(B, T, V), "per-vocabulary bias"),
    "flatten all": (lambda z: z.view(-1), "mixes the vocabulary"),
    "vocab stride": (lambda z: z[..., ::2], "on the vocabulary dimension"),
    "vocab index": (lambda z: z[..., torch.tensor([1, 2])], "on the vocabulary dimension"),
    "detach": (lambda z: z.detach(), "detach"),
    "cat": (lambda z: torch.cat([z, z]), "cat"),
    "integer cast": (lambda z: z.long(), ".long"),
    "in-place": (lambda z: z.mul_(2.0), ".mul_"),
    "self product": (lambda z: z * z, "by themselves"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_uses_of_the_logits_are_refused_by_name(case):
    op, name = REFUSED[case]
    head, hidden = _setup()
    promise, call = _promise(head, hidden)
    with pytest.raises(ValueError, match="flce cannot fuse Toy: it applies ") as info:
        op(promise)
    assert name in str(info.value) and "materialize_logits=True" in str(info.value)
    assert call.losses == 0


def test_probability_targets_and_mismatched_shapes_are_refused():
    head, hidden = _setup()
    promise, _ = _promise(head, hidden)
    with pytest.raises(ValueError, match="class probabilities"):
        F.cross_entropy(promise.view(-1, V), torch.rand(B * T, V))
    with pytest.raises(ValueError, match="do not match"):
        F.cross_entropy(promise.view(-1, V), torch.zeros(B * T + 1, dtype=torch.long))


def test_metadata_reads_like_the_logits():
    head, hidden = _setup()
    promise, _ = _promise(head, hidden)
    logits = head(hidden)
    assert promise.shape == logits.shape and promise.size(-1) == V and promise.dim() == 3 and promise.ndim == 3
    assert promise.dtype == logits.dtype and promise.device == logits.device and len(promise) == B
    assert promise.numel() == logits.numel() and promise.float().dtype == torch.float32
    assert promise[:, 1:].shape == logits[:, 1:].shape and promise.view(-1, V).shape == (B * T, V)


@pytest.mark.parametrize("chain, softcap, temperature", [
    (lambda t: t, None, 1.0),
    (lambda t: t.scaled(0.25, "*"), None, 4.0),
    (lambda t: t.scaled(1 / 30.0, "/").tanh().scaled(30.0, "*"), 30.0, 1.0),
    (lambda t: t.scaled(0.5, "*").scaled(1 / 4.0, "/").tanh().scaled(4.0, "*"), 4.0, 2.0),
    (lambda t: t.with_options(2.0, None), None, 2.0),
    (lambda t: t.scaled(0.5, "*").with_options(None, 10.0), 10.0, 2.0),
])
def test_transform_folds_into_softcap_and_temperature(chain, softcap, temperature):
    options = chain(LogitTransform()).loss_options()
    assert options["softcap"] == pytest.approx(softcap) if softcap else options["softcap"] is None
    assert options["temperature"] == pytest.approx(temperature)


@pytest.mark.parametrize("chain, match", [
    (lambda t: t.scaled(0.0, "*"), "positive"),
    (lambda t: t.scaled(float("inf"), "*"), "positive"),
    (lambda t: t.tanh().tanh(), "second tanh"),
    (lambda t: t.tanh().plus(torch.zeros(3), "+"), "after the tanh"),
    (lambda t: t.tanh().with_options(None, 5.0), "already caps"),
])
def test_transform_refuses_what_has_no_fused_form(chain, match):
    with pytest.raises(Unfusable, match=match):
        chain(LogitTransform())
