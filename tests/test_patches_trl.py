"""TRL's trainers on flce's kernels: tiny SFT (completion-only and assistant-only loss), DPO and GRPO
trainings on the CPU, with flce patched before and after the trainer is built, against the unpatched run
(TRL's own fused-head kernel): in float32 the same per-step losses and weight updates; under bf16 autocast
no further from the float32 run than the unpatched bf16 run; spies prove whose kernels ran."""

import contextlib
import copy
import functools
import math
from typing import NamedTuple

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install flce[test])")

import transformers  # noqa: E402
from hf_tiny import patched, tiny_batch, tiny_model  # noqa: E402
from reference import TOL, assert_close, rel_err  # noqa: E402
from test_log_probs import chunked_reference  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from trl.kernels import chunked_logprob  # noqa: E402

import flce  # noqa: E402
from flce.kernels import token_stats  # noqa: E402
from flce.patches import trl as flce_trl  # noqa: E402

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0-2 as tiny_model's
WORDS = [f"w{i}" for i in range(40)] + ["dummy"]
CHAT_TEMPLATE = (  # with the {% generation %} markers that assistant-only loss needs
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
    "<|end|> {% endgeneration %}{% else %}<|user|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over 48 tokens (tiny_model has 96 embeddings), built offline."""
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def sentences(n, words, seed):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{i}" for i in torch.randint(0, 40, (words,), generator=g).tolist()) for _ in range(n)]


def dataset(kind):
    import datasets  # a TRL dependency that its kernels (the GPU tests) do not need

    if kind == "sft_completion":
        return datasets.Dataset.from_dict({"prompt": sentences(8, 3, 0), "completion": sentences(8, 4, 1)})
    if kind == "sft_assistant":
        return datasets.Dataset.from_dict({"messages": [
            [{"role": "user", "content": p}, {"role": "assistant", "content": a}]
            for p, a in zip(sentences(8, 3, 2), sentences(8, 4, 3))]})
    if kind == "dpo":
        return datasets.Dataset.from_dict({"prompt": sentences(8, 3, 4), "chosen": sentences(8, 3, 5),
                                           "rejected": sentences(8, 4, 6)})
    return datasets.Dataset.from_dict({"prompt": sentences(8, 3, 7)})


def reward_distinct_words(completions, **_):
    return [len(set(c.split())) + 0.1 * len(c) for c in completions]


# SGD without clipping: a weight's update is linear in its gradient, so two runs' updates differ as their
# gradients do. Adam's first steps are lr * sign(g) (a rounding that flips a near-zero gradient moves that
# weight by 2 lr), and Adam and clipping both hide a gradient off by a constant factor.
COMMON = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=0.5, optim="sgd", max_grad_norm=0.0,
              logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              dataloader_num_workers=0)


def build_trainer(kind, model, tmp_path, **overrides):
    tokenizer = tiny_tokenizer()
    common = {**COMMON, **overrides}
    if kind.startswith("sft"):
        args = trl.SFTConfig(output_dir=str(tmp_path), max_length=16, assistant_only_loss=kind == "sft_assistant",
                             **common)
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset(kind), processing_class=tokenizer)
    if kind == "dpo":
        args = trl.DPOConfig(output_dir=str(tmp_path), max_length=16, beta=0.5, **common)
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dataset(kind),
                              processing_class=tokenizer)
    # GRPO: per-token advantages and an entropy bonus give log_probs and entropy per-token gradients
    args = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=4, temperature=0.7,
                          entropy_coef=0.05, **{**common, "max_steps": 2})
    return trl.GRPOTrainer(model=model, reward_funcs=reward_distinct_words, args=args, train_dataset=dataset(kind),
                           processing_class=tokenizer)


def train(kind, model, tmp_path, order=None, **args):
    """Per-step losses of a TRL training; flce applied to the model before or after the trainer is built,
    or only TRL routed ("route"), or nothing (None). ``args`` override the trainer's arguments."""
    if order == "before":
        flce.apply_flce_patch(model)
    elif order == "route":
        assert flce_trl.route_trl_to_flce()
    trainer = build_trainer(kind, model, tmp_path, **args)
    if order == "after":
        flce.apply_flce_patch(trainer.model)
    trainer.train()
    losses = torch.tensor([row["loss"] for row in trainer.state.log_history if "loss" in row])
    assert len(losses) == trainer.args.max_steps and losses.isfinite().all()
    return losses


class Run(NamedTuple):
    """A training's per-step losses and the update of every parameter, flattened into one vector."""

    losses: torch.Tensor
    update: torch.Tensor


def training(kind, start, tmp_path, order=None, **args) -> Run:
    """``train`` on a copy of the model ``start`` (flce removed from it afterwards)."""
    model = copy.deepcopy(start)
    try:
        losses = train(kind, model, tmp_path, order, **args)
    finally:
        flce.remove_flce_patch(model)
        flce_trl.unroute_trl()
    return Run(losses, update_of(model, start))


def update_of(model, start) -> torch.Tensor:
    return torch.cat([(p - p0).detach().flatten() for p, p0 in zip(model.parameters(), start.parameters())])


def assert_same_training(got: Run, want: Run, what: str) -> None:
    """Two float32 trainings: flce's and TRL's kernels round differently, nothing more (a gradient 1% off
    moves the updates by 1e-2)."""
    assert_close(got.losses, want.losses, 1e-5, f"{what}, per-step losses")
    assert_close(got.update, want.update, 1e-4, f"{what}, weight updates")


def assert_as_close_as_unpatched(got: Run, unpatched: Run, float32: Run, what: str) -> None:
    """Two bf16-autocast trainings against a float32 one: flce's weight updates are no further from it than
    the unpatched run's (TRL's kernel folds grad_output into 16-bit logits: 1.8x the bf16 rounding at a
    masked mean, flce 1.0-1.3x; tests/test_log_probs.py). Not bit for bit: a head gradient one bf16 ulp apart
    rounds the rest of the backward differently, so both runs' updates lie 3e-3-1e-2 from the float32 run's
    and their ratio read 0.85-1.25 over six seeds of each trainer. Their per-step losses lie 1e-6-5e-3 from
    it, the nearer run by chance. The float32 comparison is the one that sees a small error."""
    err, own = rel_err(got.update, float32.update), rel_err(unpatched.update, float32.update)
    assert err <= 1.5 * own, f"{what}, weight updates: {err:.3g} from the float32 run's, the unpatched {own:.3g}"


@pytest.fixture(autouse=True)
def _fresh_state():
    from accelerate.state import AcceleratorState

    flce_trl.unroute_trl()
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    flce_trl.unroute_trl()
    AcceleratorState._reset_state(reset_partial_state=True)


@contextlib.contextmanager
def counting_kernels():
    """Counts of kernel calls: flce's statistics and gradient kernels, TRL's CPU tiles, and TRL's own
    autograd Function on any device ("trl_function"; on GPUs its tiles are Triton kernels). Yields
    ``take()``: the counts since the last take, then zeroed."""
    calls = {"flce_stats": 0, "flce_grad": 0, "trl_forward": 0, "trl_backward": 0, "trl_function": 0}

    def counting(key, fn):
        @functools.wraps(fn)  # keeps the signature that flce's routing reads
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    def take():
        seen = dict(calls)
        calls.update(dict.fromkeys(calls, 0))
        return seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(token_stats, "row_stats", counting("flce_stats", token_stats.row_stats))
        mp.setattr(token_stats, "row_grad", counting("flce_grad", token_stats.row_grad))
        mp.setattr(chunked_logprob, "_forward_tile", counting("trl_forward", chunked_logprob._forward_tile))
        mp.setattr(chunked_logprob, "_backward_tile", counting("trl_backward", chunked_logprob._backward_tile))
        own = chunked_logprob.ChunkedLogProbFunction
        mp.setattr(own, "forward", staticmethod(counting("trl_function", own.forward)))
        yield take


@pytest.fixture
def spy():
    with counting_kernels() as take:
        yield take


FLOAT32 = dict(bf16=False)  # TRL's configs default to bf16 autocast


@pytest.mark.parametrize("kind", ["sft_completion", "sft_assistant", "dpo", "grpo"])
def test_trainer_on_flce_matches_unpatched(kind, tmp_path, spy):
    start = tiny_model("llama")
    float32 = training(kind, start, tmp_path / "float32", **FLOAT32)
    seen = spy()
    assert seen["trl_forward"] and seen["trl_backward"] and not (seen["flce_stats"] or seen["flce_grad"]), seen
    for order in ("before", "after"):
        got = training(kind, start, tmp_path / order, order, **FLOAT32)
        seen = spy()
        assert seen["flce_stats"] and seen["flce_grad"] and not (seen["trl_forward"] or seen["trl_backward"]), \
            (order, seen)
        assert_same_training(got, float32, f"{kind}, flce applied {order} the trainer")
    unpatched = training(kind, start, tmp_path / "bf16")
    spy()
    got = training(kind, start, tmp_path / "bf16 flce", "before")
    seen = spy()
    assert seen["flce_stats"] and seen["flce_grad"] and not (seen["trl_forward"] or seen["trl_backward"]), seen
    assert_as_close_as_unpatched(got, unpatched, float32, f"{kind}, bf16 autocast")


def test_sft_with_trl_compaction_guesses_gradients_in_forward(tmp_path, spy, monkeypatch):
    """On a GPU TRL scores only the valid tokens, so SFT's log-prob grad_output is uniform: from the second
    step flce computes the head's gradients in forward (three GEMMs). Same losses and weights."""
    from flce import log_probs

    monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)  # TRL's compaction on the CPU
    monkeypatch.setattr(log_probs._Speculation, "_kinds", {})
    guesses = []
    predicts = log_probs._Speculation.predicts_uniform
    monkeypatch.setattr(log_probs._Speculation, "predicts_uniform", lambda self: guesses.append(predicts(self))
                        or guesses[-1])
    start = tiny_model("llama")
    want = training("sft_completion", start, tmp_path / "unpatched", **FLOAT32)
    got = training("sft_completion", start, tmp_path / "flce", "before", **FLOAT32)
    assert guesses == [False, True, True]  # one forward per step
    assert_same_training(got, want, "SFT, guessing")


def test_class_patch_after_the_trainer(tmp_path, spy):
    start = tiny_model("llama")
    want = training("sft_assistant", start, tmp_path / "unpatched", **FLOAT32)
    spy()
    model = copy.deepcopy(start)
    trainer = build_trainer("sft_assistant", model, tmp_path / "class", **FLOAT32)
    with patched(transformers.LlamaForCausalLM):
        trainer.train()
    seen = spy()
    assert seen["flce_stats"] and seen["flce_grad"] and not seen["trl_forward"], seen
    losses = torch.tensor([row["loss"] for row in trainer.state.log_history if "loss" in row])
    got = Run(losses, update_of(model, start))
    assert_same_training(got, want, "class patched after the trainer")


def test_route_without_patching_the_model(tmp_path, spy):
    """route_trl_to_flce alone puts TRL's fused head on flce (the model's own forward stays unpatched)."""
    start = tiny_model("qwen3")
    want = training("sft_completion", start, tmp_path / "unpatched", **FLOAT32)
    spy()
    got = training("sft_completion", start, tmp_path / "routed", "route", **FLOAT32)
    seen = spy()
    assert seen["flce_stats"] and seen["flce_grad"] and not seen["trl_forward"], seen
    assert_same_training(got, want, "routed")


@pytest.mark.parametrize("options", [
    dict(temperature=1.0, final_logit_softcapping=None, logit_scale=1.0),
    dict(temperature=0.7, final_logit_softcapping=None, logit_scale=1.0),
    dict(temperature=1.3, final_logit_softcapping=2.0, logit_scale=1.0),
    dict(temperature=0.8, final_logit_softcapping=3.0, logit_scale=0.25),  # Cohere-like scale with a cap
    dict(temperature=1.0, final_logit_softcapping=None, logit_scale=4.0),
])
@pytest.mark.parametrize("bias", [False, True])
def test_adapter_matches_trl_kernel(options, bias):
    """TrlHeadOnFlce.apply against TRL's own ChunkedLogProbFunction: every output and the gradients of a
    per-token-weighted log-prob + entropy loss (GRPO's shape), float32 on the CPU."""
    n, hidden, vocab = 23, 16, 70
    x = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.5).requires_grad_()
    b = (torch.randn(vocab) * 0.3).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,))
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    args = (options["temperature"], 32, options["final_logit_softcapping"], options["logit_scale"],
            chunked_logprob.OPTIONAL_OUTPUTS + ("log_probs",))
    results = []
    for fn in (chunked_logprob.ChunkedLogProbFunction, flce_trl.TrlHeadOnFlce):
        leaves = [None if a is None else a.detach().clone().requires_grad_() for a in (x, w, b)]
        out = fn.apply(leaves[0], leaves[1], leaves[2], t, *args)
        (out[0] * g_lp + out[1] * g_ent).sum().backward()
        results.append((out, [None if a is None else a.grad for a in leaves]))
    (want, want_grads), (got, got_grads) = results
    for name, a, e in zip(flce.TokenStats._fields, got, want):
        if name == "is_top1":
            assert torch.equal(a, e), name
        else:
            assert a.dtype == e.dtype and a.shape == e.shape, name
            assert_close(a, e, TOL[torch.float32], name)
    for name, a, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got_grads, want_grads):
        if e is not None:
            assert_close(a, e, TOL[torch.float32], name)


def adapter_as_precise_as_trl(device, n, hidden, vocab):
    """bf16: TrlHeadOnFlce's fields agree with TRL's kernel's, and its gradients of a GRPO-like loss are as
    close to float64 as TRL's."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, hidden, device=device, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 2 * hidden**-0.5).bfloat16()
    t = torch.randint(0, vocab, (n,), device=device, generator=g)
    g_lp, g_ent = (torch.randn(n, device=device, generator=g, dtype=torch.float64) for _ in range(2))
    results = {}
    for name, fn in (("trl", chunked_logprob.ChunkedLogProbFunction), ("flce", flce_trl.TrlHeadOnFlce)):
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = fn.apply(xl, wl, None, t, 1.0, 32768, None, 1.0, flce.TokenStats._fields)
        (out[0] * g_lp.float() + out[1] * g_ent.float()).sum().backward()
        results[name] = (out, (xl.grad, wl.grad))
    _, reference = chunked_reference(x.requires_grad_(), w.requires_grad_(), t, None, g_lp, g_ent)
    (trl_out, trl_grads), (out, grads) = results["trl"], results["flce"]
    for name, a, e in zip(flce.TokenStats._fields, out, trl_out):
        if name == "is_top1":
            assert (a == e).float().mean() > 0.99, name  # near-ties may round differently
        else:
            assert_close(a, e, TOL[torch.bfloat16], name)
    for name, a, e, ref in zip(("grad_hidden", "grad_weight"), grads, trl_grads, reference):
        err, trl_err, floor = rel_err(a, ref), rel_err(e, ref), rel_err(ref.to(torch.bfloat16), ref)
        assert err <= 1.1 * trl_err + 0.1 * floor, f"{name}: {err:.3g}, TRL {trl_err:.3g}"


def test_adapter_as_precise_as_trl_small():
    adapter_as_precise_as_trl(torch.device("cpu"), 200, 64, 700)


@pytest.mark.gpu
def test_gpu_adapter_as_precise_as_trl():
    adapter_as_precise_as_trl(torch.device("cuda"), 4096, 2048, 32000)


def test_adapter_fields_not_asked_are_none():
    x, w, t = torch.randn(5, 8), torch.randn(30, 8), torch.randint(0, 30, (5,))
    out = flce_trl.TrlHeadOnFlce.apply(x, w, None, t, 1.0, 32, None, 1.0, ("log_probs", "is_top1"))
    assert out[0] is not None and out[4] is not None and out[1] is None and out[2] is None and out[3] is None


def test_adapter_keeps_trl_kernel_for_a_non_positive_scale(spy):
    x, w, t = torch.randn(5, 8), torch.randn(30, 8), torch.randint(0, 30, (5,))
    flce_trl.route_trl_to_flce()
    out = flce_trl.TrlHeadOnFlce.apply(x, w, None, t, 1.0, 32, None, -0.5, ("log_probs",))
    assert spy()["trl_forward"] and out[0].isfinite().all()


def test_route_is_idempotent_and_undone():
    import trl.trainer.utils as caller

    own = caller._ChunkedLogProbFunction
    assert own is chunked_logprob.ChunkedLogProbFunction and not flce_trl.is_routed()
    assert flce_trl.route_trl_to_flce() and flce_trl.route_trl_to_flce()
    assert caller._ChunkedLogProbFunction is flce_trl.TrlHeadOnFlce and flce_trl.is_routed()
    assert trl.kernels.ChunkedLogProbFunction is flce_trl.TrlHeadOnFlce  # what a later import binds
    flce_trl.unroute_trl()
    assert caller._ChunkedLogProbFunction is own and trl.kernels.ChunkedLogProbFunction is own


def test_apply_flce_patch_routes_trl():
    with patched(tiny_model("llama")):
        assert flce_trl.is_routed()


def test_fused_head_call_passes_through_patched_forward():
    """A TRL fused-head call that reaches flce's patched forward (flce applied after add_fused_lm_head)
    goes to the forward it wraps with its labels, and returns TRL's per-token fields."""
    model = tiny_model("llama")
    trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    batch = tiny_batch()
    with patched(model):
        out = model(**batch, fused_lm_head=True)
        plain = model(**batch)
    assert out.log_probs.shape == (3, 10) and out.entropy.requires_grad
    assert plain.logits is None and torch.isfinite(plain.loss)  # other calls with labels stay fused
    assert_close(out.loss, plain.loss, 1e-5, "TRL's loss and flce's")


def test_old_trl_sft_loss_calls_pass_through():
    """TRL before 1.16 reads outputs.logits in SFTTrainer.compute_loss (loss_type="nll"): flce's patched
    forward leaves the calls made inside it unfused, once that method is guarded, and warns once."""

    class OldTrainer:
        def compute_loss(self, model, inputs):
            outputs = model(**inputs)
            return outputs.loss, outputs.logits[..., :-1, :].argmax(-1)  # as TRL 1.14's metrics do

    flce_trl._guard(OldTrainer)
    flce_trl._guard(OldTrainer)  # idempotent
    model = tiny_model("llama")
    batch = tiny_batch()
    want = model(**batch).loss
    with patched(model), pytest.warns(UserWarning, match="leaves its model calls unfused"):
        loss, predictions = OldTrainer().compute_loss(model, batch)
        assert model(**batch).logits is None  # outside it, the loss is fused
    assert predictions.shape == (3, 10) and math.isclose(loss.item(), want.item(), rel_tol=1e-6)


def test_trl_head_benchmark_cpu_smoke(tmp_path):
    """benchmark/trl_head.py runs end to end (tiny shape, CPU) and its methods agree (for the reference
    model's log-probs, ``ref``, the log-probs' errors stand in the grad_x columns)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    import trl_head

    assert trl_head.main(["--out", str(tmp_path), "--shapes", "40x16x70", "--reps", "1", "--warmup", "0"]) == 0
    rows = json.loads((tmp_path / "trl_head.json").read_text())["rows"]
    methods = ("floor", "trl", "flce")
    assert {(r["loss"], r["method"]) for r in rows} == {
        *((k, m) for k in ("sft", "grpo") for m in methods), *(("ref", m) for m in (*methods, "flce-chunked"))}
    for r in rows:
        assert r["status"] == "ok" and r["median_ms"] > 0, r
        if r["method"] != "floor":
            axis = "x" if r["loss"] == "ref" else "w"
            assert r[f"grad_{axis}_vs_other"] < 1e-2, r
            assert r[f"grad_{axis}_vs_fp32"] < 2 * r[f"rounding_{axis}"] + 1e-3, r
    assert "| flce |" in (tmp_path / "trl_head.md").read_text()


def test_routing_sees_through_a_wrapper_that_hides_the_signature(monkeypatch):
    """A profiler or spy wrapping TRL's kernel without functools.wraps must not silently stop the routing."""
    from trl.kernels import chunked_logprob

    from flce.patches import trl as flce_trl

    own = chunked_logprob.ChunkedLogProbFunction
    forward = own.forward

    def hiding(*args, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(own, "forward", staticmethod(hiding))
    flce_trl.unroute_trl()
    try:
        assert flce_trl.route_trl_to_flce() and flce_trl.is_routed()
    finally:
        flce_trl.unroute_trl()
