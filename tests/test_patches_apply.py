"""apply_flce_patch / remove_flce_patch: class and instance patching, idempotence, exact removal, clear
errors with nothing patched, models that override the forward or the loss, pickling, accelerate's mixed
precision before and after prepare."""

import contextlib
import copy
import gc
import inspect
import io
import weakref

import pytest
import torch
import transformers
from hf_tiny import assert_patched_matches, loss_and_grads, patched, tiny_batch, tiny_model
from reference import assert_close

import flce


@pytest.fixture
def accelerate_state():
    """accelerate keeps one process-wide state; start and leave it clean."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_class_patch_reaches_existing_and_later_instances_and_removes_exactly():
    cls = transformers.Qwen2ForCausalLM
    early = tiny_model("qwen2")
    before = dict(cls.__dict__)
    signature = inspect.signature(early.forward)
    with patched(cls):
        late = tiny_model("qwen2")
        assert early(**tiny_batch()).logits is None and late(**tiny_batch()).logits is None
        assert inspect.signature(early.forward) == signature  # Trainer inspects it
        assert "forward" not in early.__dict__
    assert dict(cls.__dict__) == before
    assert early(**tiny_batch()).logits is not None


def test_instance_patch_leaves_other_instances_and_removes_exactly():
    model, other = tiny_model("llama"), tiny_model("llama")
    signature = inspect.signature(model.forward)
    before = dict(model.__dict__)
    with patched(model):
        assert model(**tiny_batch()).logits is None
        assert other(**tiny_batch()).logits is not None
        assert inspect.signature(model.forward) == signature
        assert "labels" in inspect.signature(model.forward).parameters
    assert model.__dict__ == before


def test_idempotent_and_reapplying_updates_options():
    cls = transformers.MistralForCausalLM
    model = tiny_model("mistral")
    inputs = tiny_batch()
    with patched(cls):
        wrapper = cls.forward
        flce.apply_flce_patch(cls)
        assert cls.forward is wrapper
        flce.apply_flce_patch(model)
        instance_forward = model.__dict__["forward"]
        flce.apply_flce_patch(model, z_loss=0.5)
        assert model.__dict__["forward"] is instance_forward
        with_z = model(**inputs).loss  # the instance options win over the class's
        flce.remove_flce_patch(model)
        without_z = model(**inputs).loss  # back to the class patch
        assert with_z.item() > without_z.item() + 1.0
        assert model(**inputs).logits is None
    flce.remove_flce_patch(cls)  # removing twice is a no-op
    assert "forward" not in cls.__dict__ or not hasattr(cls.__dict__["forward"], "__flce_patch__")


def test_patched_model_deepcopies():
    model = tiny_model("llama")
    with patched(model):
        clone = copy.deepcopy(model)
        with torch.no_grad():
            clone.lm_head.weight.mul_(3.0)
        inputs = tiny_batch()
        assert clone(**inputs).logits is None
        assert clone(**inputs).loss.item() != pytest.approx(model(**inputs).loss.item())
    assert clone(**inputs).logits is None  # the copy keeps its own patch
    flce.remove_flce_patch(clone)
    assert "forward" not in clone.__dict__


@pytest.mark.parametrize("family", ["llama", "qwen3moe"])
@pytest.mark.parametrize("how", ["instance", "class"])
def test_a_patched_model_is_freed_when_its_last_reference_goes(family, how):
    """No reference cycle through the patch: parameters and gradients go with ``del model``, not at the next
    run of Python's cyclic collector (which GPU memory does not trigger)."""
    cls = type(tiny_model(family))
    inputs = tiny_batch()
    gc.collect()
    gc.disable()
    try:
        with patched(cls) if how == "class" else contextlib.nullcontext():
            model = tiny_model(family)
            if how == "instance":
                flce.apply_flce_patch(model)
            model(**inputs).loss.backward()
            assert model(**inputs).logits is None  # fused: the patch is on
            gone, grad = weakref.ref(model), weakref.ref(model.lm_head.weight.grad)
            del model
            assert gone() is None and grad() is None
    finally:
        gc.enable()


def _with_head(model, head):
    model.lm_head = head
    return model


@pytest.mark.parametrize("what, match", [
    (transformers.LlamaForSequenceClassification, "no GenerationMixin"),
    (transformers.Gemma4AssistantForCausalLM, "takes no labels"),
    ("sequence classifier", "no output embedding"),
    ("custom head", "output embedding is a Sequential"),
])
def test_what_cannot_be_fused_is_refused_at_patch_time_and_nothing_is_patched(what, match):
    if what == "sequence classifier":
        config = tiny_model("llama").config
        what = transformers.LlamaForSequenceClassification(config)
    elif what == "custom head":
        model = tiny_model("llama")
        what = _with_head(model, torch.nn.Sequential(model.lm_head))
    cls = what if isinstance(what, type) else type(what)
    before_cls, before = dict(cls.__dict__), None if isinstance(what, type) else dict(what.__dict__)
    with pytest.raises(ValueError, match=f"flce cannot fuse {cls.__name__}: .*{match}"):
        flce.apply_flce_patch(what)
    assert dict(cls.__dict__) == before_cls
    if before is not None:
        assert what.__dict__ == before


class _OwnForward(transformers.LlamaForCausalLM):
    """A subclass with its own forward (here: a label-smoothed loss): the patch runs it as it is."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-1].float() * 0.5
            out.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits.reshape(-1, logits.shape[-1]),
                                                                      labels[:, 1:].reshape(-1))
        return out


class _ReadsHeadWeight(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = hidden @ self.lm_head.weight.T
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _LossNotFromLogits(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        out.loss = None if labels is None else self.model.norm.weight.sum()  # logits computed, never used
        return out


def _as(cls, model):
    other = cls(model.config)
    other.load_state_dict(model.state_dict())
    return other.train()


def test_a_subclass_with_its_own_forward_is_fused_exactly():
    model = _as(_OwnForward, tiny_model("llama", head_scale=20.0))
    assert_patched_matches(model, tiny_batch(), loss_tol=2e-6, grad_tol=2e-5)


@pytest.mark.parametrize("cls, match", [(_ReadsHeadWeight, "does not call its output embedding"),
                                        (_LossNotFromLogits, "does not compute its loss with cross_entropy")])
def test_a_forward_that_bypasses_the_head_or_its_logits_is_refused_at_the_first_call(cls, match):
    model = _as(cls, tiny_model("llama"))
    inputs = tiny_batch()
    with patched(model):
        with pytest.raises(ValueError, match=f"flce cannot fuse {cls.__name__}: its forward {match}"):
            model(**inputs)
        assert model.lm_head.__class__ is torch.nn.Linear  # put back after the refusal
        assert model(**{k: v for k, v in inputs.items() if k != "labels"}).logits is not None


@pytest.mark.parametrize("what", [42, torch.nn.Linear(2, 2), dict])
def test_not_a_model_is_a_type_error(what):
    with pytest.raises((TypeError, ValueError)):
        flce.apply_flce_patch(what)


@pytest.mark.parametrize("options, error, match", [
    ({"reduction": "sum"}, ValueError, "reduction"),
    ({"ignore_index": 0}, ValueError, "ignore_index"),
    ({"zloss": 1e-4}, TypeError, "zloss"),
    ({"z_loss": -1.0}, ValueError, "z_loss"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"backend": "cuda"}, ValueError, "backend"),
    ({"materialize_logits": "yes"}, TypeError, "materialize_logits"),
])
def test_bad_options_raise_before_patching(options, error, match):
    model = tiny_model("llama")
    before = dict(model.__dict__)
    with pytest.raises(error, match=match):
        flce.apply_flce_patch(model, **options)
    assert model.__dict__ == before


def test_wrappers_are_looked_through():
    model = tiny_model("llama")
    wrapper = torch.nn.Module()
    wrapper.module = model  # as DDP / FSDP1 / DeepSpeedEngine hold the model
    assert flce.apply_flce_patch(wrapper) is wrapper
    assert model(**tiny_batch()).logits is None
    flce.remove_flce_patch(wrapper)
    assert "forward" not in model.__dict__


def test_a_custom_loss_function_is_fused_when_it_is_a_cross_entropy():
    model = tiny_model("llama", head_scale=20.0)
    model.loss_function = lambda logits, labels, vocab_size, **kw: torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab_size) / 2.0, labels[:, 1:].reshape(-1), label_smoothing=0.2)
    assert_patched_matches(model, tiny_batch(), loss_tol=2e-6, grad_tol=2e-5)


def test_a_custom_loss_function_that_uses_the_logits_otherwise_is_refused_by_name():
    model = tiny_model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()
    inputs = tiny_batch()
    want = model(**inputs).loss
    with patched(model), pytest.raises(ValueError, match=r"LlamaForCausalLM: it applies \.square .*"
                                                          "materialize_logits=True"):
        model(**inputs)
    with patched(model, materialize_logits=True):
        got = model(**inputs)
    assert got.logits is not None and torch.equal(got.loss, want)


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_patched_instance_saved_whole_comes_back_patched_and_unpatches_cleanly():
    model = tiny_model("llama", head_scale=20.0)
    inputs = tiny_batch()
    want = model(**inputs).loss
    flce.apply_flce_patch(model)
    loaded = _pickled(model)
    got = loaded(**inputs)
    assert got.logits is None and loaded.forward.model is loaded  # its own forward, not the original's
    assert_close(got.loss, want, 2e-6, "loss after loading")
    assert inspect.signature(loaded.forward) == inspect.signature(model.forward)
    flce.apply_flce_patch(loaded, z_loss=0.5)  # re-applying updates it
    assert loaded(**inputs).loss.item() > want.item() + 1.0
    flce.remove_flce_patch(loaded)
    assert not [k for k in loaded.__dict__ if k.startswith("_flce") or k == "forward"]
    assert loaded(**inputs).logits is not None
    flce.apply_flce_patch(loaded)
    assert loaded(**inputs).logits is None


def test_an_instance_of_a_patched_class_saved_whole_follows_the_class():
    cls = transformers.LlamaForCausalLM
    model = tiny_model("llama")
    with patched(cls):
        model(**tiny_batch())
        loaded = _pickled(model)
        assert loaded(**tiny_batch()).logits is None
    assert not [k for k in loaded.__dict__ if k.startswith("_flce") or k == "forward"]
    assert loaded(**tiny_batch()).logits is not None


def _prepared(model, accelerator):
    prepared = accelerator.prepare(model)
    assert "_original_forward" in prepared.__dict__  # accelerate wrapped the forward for autocast
    return prepared


@pytest.mark.parametrize("order", ["before", "after"])
def test_accelerate_bf16_autocast_instance_patch(order, accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    reference = _prepared(tiny_model("llama"), accelerator)
    model = tiny_model("llama")
    model.load_state_dict(reference.state_dict())
    if order == "before":
        flce.apply_flce_patch(model)
    model = _prepared(model, accelerator)
    if order == "after":
        flce.apply_flce_patch(model)
    autocast_in_head = []
    model.lm_head.register_forward_pre_hook(lambda m, a: autocast_in_head.append(torch.is_autocast_enabled("cpu")))
    inputs = tiny_batch()
    want, want_grads = loss_and_grads(reference, **inputs)
    got, got_grads = loss_and_grads(model, **inputs)
    assert got.logits is None and autocast_in_head == [True]
    assert model.lm_head.weight.dtype == torch.float32
    assert_close(got.loss, want.loss, 1e-2, "loss")
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, 6e-2, name)
    flce.remove_flce_patch(model)
    assert model(**inputs).logits is not None


def test_accelerate_class_patched_after_prepare_warns(accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    early = _prepared(tiny_model("olmo2"), accelerator)
    with pytest.warns(UserWarning, match="prepared by accelerate before"):
        flce.apply_flce_patch(transformers.Olmo2ForCausalLM)
    try:
        late = _prepared(tiny_model("olmo2"), accelerator)  # patched before its prepare: fused
        assert late(**tiny_batch()).logits is None
        assert early(**tiny_batch()).logits is not None
    finally:
        flce.remove_flce_patch(transformers.Olmo2ForCausalLM)


def test_trl_fused_head_calls_go_to_the_inner_forward_untouched():
    model = tiny_model("llama")
    seen = []

    def inner(*args, **kwargs):  # stands in for the forward TRL's add_fused_lm_head installs
        seen.append((args, kwargs))
        return "inner's output"

    model.forward = inner
    inputs = tiny_batch()
    with patched(model):
        out = model(**inputs, fused_lm_head=True, temperature=0.7)
    assert out == "inner's output" and len(seen) == 1
    assert seen[0][1]["labels"] is inputs["labels"] and seen[0][1]["temperature"] == 0.7
