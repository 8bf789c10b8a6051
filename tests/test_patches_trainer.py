"""transformers.Trainer with gradient accumulation: the patched model logs the unpatched per-step losses
(Trainer passes num_items_in_batch because the patched forward keeps its **kwargs signature)."""

import copy

import pytest
import torch
import transformers
from hf_tiny import patched, tiny_batch, tiny_model
from reference import assert_close


@pytest.fixture(autouse=True)
def _clean_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _dataset(n=12, seq=10):
    """Rows with different numbers of ignored labels, so num_items_in_batch differs from per-batch means."""
    torch.manual_seed(3)
    batch = tiny_batch(batch=n, seq=seq, ignore=0.4)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _train(model, tmp_path, **args):
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, dataloader_num_workers=0, **args)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_dataset())
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainer, torch.tensor(losses)


@pytest.mark.parametrize("how", ["instance", "class"])
def test_trainer_gradient_accumulation_losses_match(tmp_path, how):
    reference = tiny_model("llama", head_scale=10.0)
    model = copy.deepcopy(reference)
    _, want = _train(reference, tmp_path / "ref")
    target = model if how == "instance" else transformers.LlamaForCausalLM
    with patched(target):
        trainer, got = _train(model, tmp_path / "patched")
        assert trainer.model_accepts_loss_kwargs  # so num_items_in_batch reaches the loss
        assert model(**tiny_batch()).logits is None
    assert len(got) == len(want) == 3
    assert_close(got, want, 1e-5, "per-step losses")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, q, 1e-5, name)


def test_trainer_bf16_mixed_precision_patch_before_train(tmp_path):
    reference = tiny_model("qwen3", head_scale=10.0)
    model = copy.deepcopy(reference)
    _, want = _train(reference, tmp_path / "ref", bf16=True)
    with patched(model):
        _, got = _train(model, tmp_path / "patched", bf16=True)
    assert model.lm_head.weight.dtype == torch.float32
    assert_close(got, want, 1e-2, "per-step losses under bf16 autocast")


def test_trainer_evaluate_gets_logits(tmp_path):
    model = tiny_model("llama")
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4,
                                               report_to=[], use_cpu=True, disable_tqdm=True)
    seen = []
    with patched(model):
        trainer = transformers.Trainer(model=model, args=arguments, eval_dataset=_dataset(n=4),
                                       compute_metrics=lambda p: seen.append(p.predictions.shape) or {})
        metrics = trainer.evaluate()
    assert seen == [(4, 10, model.config.vocab_size)] and torch.isfinite(torch.tensor(metrics["eval_loss"]))
