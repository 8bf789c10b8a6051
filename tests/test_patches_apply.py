"""apply_flce_patch / remove_flce_patch: class and instance patching, idempotence, exact removal, clear
errors with nothing patched, accelerate's mixed precision before and after prepare."""

import copy
import inspect

import pytest
import torch
import transformers
from hf_tiny import loss_and_grads, patched, tiny_batch, tiny_model
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


class _NotSupported(transformers.LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("what", [transformers.GPT2LMHeadModel, transformers.LlamaForSequenceClassification,
                                  _NotSupported, "instance"])
def test_unsupported_class_names_it_and_patches_nothing(what):
    if what == "instance":
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        cls, state = type(model), dict(model.__dict__)
    else:
        model, cls, state = what, what, None
    before = dict(cls.__dict__)
    with pytest.raises(ValueError, match=cls.__name__):
        flce.apply_flce_patch(model)
    assert dict(cls.__dict__) == before
    if state is not None:
        assert model.__dict__ == state


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


def test_custom_loss_function_runs_unfused_with_a_warning():
    model = tiny_model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()
    inputs = tiny_batch()
    want = model(**inputs).loss
    with patched(model), pytest.warns(UserWarning, match="loss_function"):
        got = model(**inputs)
    assert got.logits is not None and torch.equal(got.loss, want)


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
