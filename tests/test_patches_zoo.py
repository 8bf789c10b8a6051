"""Every entry of the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (hf_zoo.py), built tiny:
patched equals unpatched (loss, every gradient, num_items_in_batch, the router aux loss, eval logits) or
the patch refuses it with a ValueError that says why. On the transformers release they were recorded with,
the verdicts must match tests/zoo_verdicts.json, from which docs/supported_models.md is generated (``python
tests/hf_zoo.py`` rewrites both), so a model that changes fails here until they are regenerated. On another
release every installed entry still runs (a new model is a new case): fused exactly, refused clearly, or
unable to run unpatched."""

import pytest
import torch
import transformers
from conftest import BACKENDS, DEVICE
from hf_zoo import (MODELS_FILE, README_FILE, ZOO, build, installed, readme_with_models, recorded_verdicts,
                    render_models, train_step, zoo_batch, zoo_verdict)

import flce.experts
from flce.patches import moe_blocks
from flce.patches.moe import experts_modules

RECORDED = recorded_verdicts()
RECORDED_ON = RECORDED.get("_transformers")
SAME_RELEASE = RECORDED_ON == transformers.__version__
REGENERATE = "regenerate tests/zoo_verdicts.json and docs/supported_models.md with `python tests/hf_zoo.py`"
TRITON_SAMPLE = ["llama", "gemma2", "cohere", "granite", "bert", "inkling2_text"]  # plain, softcap, scale,
# division, a bias and a transformed head input, a softcap on float32 logits (before transformers 5.24: of a
# vocabulary slice)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: thread hand-offs cost more than the work (about 20x on two busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_zoo_entry_fuses_exactly_or_is_refused(model_type):
    verdict = zoo_verdict(model_type)  # AssertionError where a fused result differs from the unpatched one
    if SAME_RELEASE:
        recorded = RECORDED.get(model_type)
        assert recorded is not None, f"{model_type} is new in this transformers: {REGENERATE}"
        assert verdict.kind == recorded["verdict"], REGENERATE
        if verdict.kind != "cannot_run":  # why an entry cannot run here depends on what else is installed (timm)
            assert verdict.reason == recorded["reason"], REGENERATE
    if verdict.kind == "refused":
        assert verdict.reason.startswith(f"flce cannot fuse {ZOO[model_type]}: "), verdict.reason
    if verdict.kind == "cannot_run":
        pytest.skip(f"the unpatched {ZOO[model_type]} cannot run here: {verdict.reason}")


def test_recorded_verdicts_cover_the_installed_zoo_and_enough_fuse():
    if not SAME_RELEASE:
        pytest.skip(f"verdicts recorded on transformers {RECORDED_ON}, {transformers.__version__} installed: "
                    "each entry still runs above; to compare the whole zoo, " + REGENERATE)
    entries = {k: v for k, v in RECORDED.items() if not k.startswith("_")}
    assert set(entries) == set(ZOO), REGENERATE
    counts = {kind: sum(v["verdict"] == kind for v in entries.values()) for kind in ("fused", "refused", "cannot_run")}
    assert sum(counts.values()) == len(ZOO)
    assert counts["fused"] >= 150, counts
    assert counts["cannot_run"] <= 5, counts  # each one named, with its reason, in docs/supported_models.md


def test_supported_models_file_is_generated_from_the_verdicts():
    assert MODELS_FILE.read_text() == render_models(RECORDED), REGENERATE


def test_readme_model_list_is_generated_from_the_verdicts():
    readme = README_FILE.read_text()
    assert readme == readme_with_models(readme, RECORDED), REGENERATE


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton here (CUDA, or its interpreter on the CPU)")
@pytest.mark.parametrize("model_type", installed(TRITON_SAMPLE))
def test_zoo_sample_with_the_triton_backend(model_type):
    # on CUDA fp32 on both sides, but flce's GEMMs and cuBLAS's round differently (no TF32 on either)
    tol = (2e-6, 2e-5) if DEVICE.type == "cpu" else (1e-4, 1e-3)
    assert zoo_verdict(model_type, backend="triton", device=DEVICE.type, tol=tol).kind == "fused"


MOE_ON_FLCE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "glm4_moe", "granitemoe",
               "deepseek_v4", "hy_v4", "lfm2_moe", "aria_text",  # a clamped SwiGLU, F.silu, transposed weights
               "gpt_oss", "minimax_m3_vl_text",  # GPT-OSS's gate: alpha, up + 1, interleaved, biases
               "nemotron_h", "inkling2_text", "inkling2_loop_text"]  # ungated relu2, softcapped SwiGLU
# no experts decorator, computed by patches.moe_blocks: dense blocks (Llama 4), identity experts (LongCat-Flash)
MOE_UNDECORATED = ["llama4_text", "llama4", "longcat_flash"]
MOE_KEPT = ["dbrx", "jetmoe"]  # other layouts (no experts decorator)


@pytest.mark.parametrize("model_type", installed(MOE_ON_FLCE + MOE_UNDECORATED + MOE_KEPT))
def test_moe_entries_take_flce_experts_where_it_computes_every_one(model_type, monkeypatch):
    """The patch selects the "flce" experts backend on a MoE model whose experts flce computes, every one of
    them, or flce's forward on its MoE modules without the decorator, and then they run there (the zoo's verdicts
    compare those steps with the model's own experts); other layouts keep their implementation. Removing the patch
    puts it back."""
    calls = []
    fused = flce.experts.experts_forward
    monkeypatch.setattr(flce.experts, "experts_forward", lambda *a, **k: calls.append(1) or fused(*a, **k))
    try:
        model = build(model_type)
    except Exception as e:  # noqa: BLE001 - as the zoo's verdicts: this transformers' config cannot be built tiny
        pytest.skip(f"{model_type} cannot be built here: {type(e).__name__}: {e}")
    previous = model.config._experts_implementation
    flce.apply_flce_patch(model)
    train_step(model, zoo_batch(model, model_type))
    modules = [m for m in model.modules() if type(m).__name__ in moe_blocks.FORMS]
    undecorated = model_type in MOE_UNDECORATED
    # an older transformers may keep a family's experts in another layout (Aria before 5.24: fc1 / fc2 modules)
    on = undecorated or (model_type in MOE_ON_FLCE and bool(experts_modules(model)))
    assert (model.config._experts_implementation == "flce") == (on and not undecorated) and bool(calls) == on
    assert bool(modules) == undecorated and all(moe_blocks.enabled(m) for m in modules)
    flce.remove_flce_patch(model)
    assert model.config._experts_implementation == previous
    assert not any(moe_blocks.enabled(m) for m in modules)
