"""Every entry of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, built tiny from its own config class.

A config's defaults are often full-size; ``tiny_config`` shrinks them generically (the sizes in ``TINY``,
in the config and every sub-config; per-layer lists cut to a few layers that keep every layer kind) and
then applies the per-model data in ``OVERRIDES``. ``zoo_batch`` adds the inputs a few models need
(``EXTRA_INPUTS``), ``SETUP`` holds the calls a few need after construction. A new transformers release
that adds a model adds an entry here without any edit; one that needs data the generic shrinking cannot
guess shows up as a build failure naming it.
"""

from __future__ import annotations

import copy
import inspect
import json
import textwrap
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import flce
from flce.patches.moe import has_flce_experts

ZOO = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # model_type -> class name
VOCAB = 128
MAX_PARAMETERS = 2_000_000  # checked on the meta device before anything is allocated

# Size fields set wherever a config (or sub-config) has them with an int (or None: "derive it") value.
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "embedding_size",
                     "word_embed_proj_dim", "attention_hidden_size", "lru_width", "embedding_dim"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff",
                     "dim_ff", "ffn_hidden_size", "feed_forward_size", "dff", "d_inner", "dense_intermediate_size",
                     "intermediate_size_mlp"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "expert_ffn_hidden_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_encoder_layers", "num_decoder_layers", "num_blocks"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
                     "attention_heads", "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads",
                     "index_n_heads", "indexer_n_heads", "mamba_n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "indexer_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "linear_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "index_head_dim", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim", "kv_channels", "mamba_d_head", "attention_head_size", "d_head",
                     "indexer_head_dim", "mamba_headdim"), 8),
    "n_mamba_heads": 8,
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_head_dim", "mamba_d_state", "state_size",
                     "mamba_chunk_size", "chunk_size", "mamba_dt_rank", "time_step_rank", "o_lora_rank"), 16),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group", "n_shared_experts", "num_shared_experts",
                     "moe_num_shared_experts", "first_k_dense_replace", "num_dense_layers"), 1),
    "max_position_embeddings": 128,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 0,
    "index_topk": 4,
}
# Logit transforms set to values that change the loss (several default to 1.0 or None): the zoo checks
# that each one reaches the fused loss.
LOGIT_TRANSFORMS = {"final_logit_softcapping": 20.0, "logits_soft_cap": 20.0, "output_logit_soft_cap": 20.0,
                    "logit_scale": 0.25, "logits_scaling": 4.0, "lm_head_multiplier": 0.5,
                    "logits_mup_width_multiplier": 2.0}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_blocks")
_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                "forced_eos_token_id", "cls_token_id", "mask_token_id", "eod_token_id")
_DROPPED = ("transformers_version", "model_type", "architectures")

# Per-model data the generic shrinking cannot guess (model_type -> fields; "sub.field" for a sub-config).
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1], "mamba_d_head": 16},
    "blt": {"encoder_hash_byte_group_vocab": 64, "decoder_config.hidden_size_global": 32},
    "codegen": {"rotary_dim": 4},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    # Dory's dict form counts an attention and an mlp block per layer: 3 layers, 1 in each part.
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    "dots3_note": {"text_config.head_dim": 16, "vision_config.adapter_in_dim": 32, "vision_config.adapter_out_dim": 32,
                   "audio_config.adapter_input_size": 32, "audio_config.adapter_out_dim": 32,
                   "audio_config.downsample_hidden_size": 32},
    "dots3_note_text": {"head_dim": 16},
    "falcon_h1": {"mamba_d_ssm": 32},
    "gemma4_assistant": {"text_config.hidden_size_per_layer_input": 0, "text_config.vocab_size_per_layer_input": 0},
    "git": {"vision_config.image_size": 8, "vision_config.patch_size": 4},
    "got_ocr2": {"vision_config.image_size": 64, "vision_config.mlp_dim": 64, "vision_config.output_channels": 32},
    "gptj": {"rotary_dim": 4},
    "granitemoehybrid": {"mamba_d_head": 16, "layer_types": ["linear_attention", "full_attention"]},
    "hrm_text": {"num_layers_per_stack": None, "num_hidden_layers": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "use_mamba_kernels": False},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "longcat_flash": {"zero_expert_num": 2},  # beside 4 routed experts (not 256): a tiny batch reaches both kinds
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "phi4_multimodal": {"audio_config.ext_pw_out_channel": 32, "audio_config.depthwise_separable_out_channel": 32,
                        "audio_config.nemo_conv_channels": 32},
    "qwen4_exp": {"text_config.indexer_budget": 4, "text_config.indexer_compress_ratio": 2,
                  "text_config.indexer_kv_heads": 1},
    "qwen4_exp_text": {"indexer_budget": 4, "indexer_compress_ratio": 2, "indexer_kv_heads": 1},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "reformer": {"is_decoder": True, "axial_pos_shape": [3, 3], "axial_pos_embds_dim": [16, 16],
                 "attn_layers": ["local", "local"], "local_attn_chunk_length": 3, "lsh_attn_chunk_length": 3},
    "roc_bert": {"pronunciation_vocab_size": 16, "pronunciation_embed_dim": 8, "shape_vocab_size": 16,
                 "shape_embed_dim": 8},
    "xlstm": {"mode": "train", "chunk_size": 3, "hidden_size": 128, "embedding_dim": 128},
    "zamba": {"num_hidden_layers": 4, "attention_hidden_size": 64,
              "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "zamba2": {"num_hidden_layers": 3, "attention_hidden_size": 64, "hybrid_layer_ids": [1, 2],
               "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1},
}


def _codebook_inputs(config, batch: int, seq: int) -> dict:
    """MusicGen: input_ids (batch * codebooks, seq), labels (batch, seq, codebooks)."""
    codes = torch.randint(3, VOCAB, (batch, config.num_codebooks, seq))
    labels = torch.randint(3, VOCAB, (batch, seq, config.num_codebooks))
    labels[0, :2] = -100
    return {"input_ids": codes.reshape(-1, seq), "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "labels": labels}


# Inputs beyond input_ids / attention_mask / labels (model_type -> fn(config, batch, seq) -> dict).
EXTRA_INPUTS: dict[str, object] = {
    "musicgen": _codebook_inputs,
    "musicgen_melody": _codebook_inputs,
    "git": lambda config, batch, seq: {"pixel_values": torch.randn(batch, 3, config.vision_config.image_size,
                                                                   config.vision_config.image_size)},
    # Their caches fail: BLT's config has no layer count for the cache, xLSTM's cached state breaks backward.
    "blt": lambda config, batch, seq: {"use_cache": False},
    "xlstm": lambda config, batch, seq: {"use_cache": False},
}
# Calls a model needs after construction (model_type -> fn(model)).
SETUP: dict[str, object] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
}


def default_config(model_type: str) -> transformers.PretrainedConfig:
    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - some defaults do not validate without the overrides
        return CONFIG_MAPPING[model_type](**_nested(OVERRIDES.get(model_type, {})))


def _nested(fields: dict) -> dict:
    """{"a.b": 1, "c": 2} -> {"a": {"b": 1}, "c": 2}"""
    out: dict = {}
    for key, value in fields.items():
        target = out
        *path, leaf = key.split(".")
        for part in path:
            target = target.setdefault(part, {})
        target[leaf] = value
    return out


def _shrunk(values: dict, sub_configs: tuple) -> dict:
    """The config dict with TINY sizes, token ids inside the vocabulary and per-layer data cut short."""
    out = dict(values)
    for name, size in TINY.items():
        value = out.get(name, False)
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            out[name] = size
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):  # per-layer sizes
            out[name] = [size] * len(value)
    out.update({name: value for name, value in LOGIT_TRANSFORMS.items() if name in out})
    for name, value in out.items():  # deterministic: dropout masks would differ between two runs
        if isinstance(name, str) and any(d in name for d in ("dropout", "pdrop", "layerdrop")) \
                and isinstance(value, float):
            out[name] = 0.0
    if "kv_lora_rank" in values and "num_attention_heads" in out:  # MLA: every head has its own keys
        out["num_key_value_heads"] = out["num_attention_heads"]
    vocab = out.get("vocab_size")
    for name in _SPECIAL_IDS:
        value = out.get(name)
        if isinstance(value, int) and vocab and value >= vocab:
            out[name] = {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
        elif isinstance(value, list) and vocab and any(v >= vocab for v in value):
            out[name] = [2]
    _cut_layers(values[_depth_key(values)] if _depth_key(values) else 0, out)
    for name in sub_configs:
        if isinstance(out.get(name), dict):
            out[name] = _shrunk(out[name], tuple(k for k, v in out[name].items() if isinstance(v, dict)))
    return out


def _depth_key(values: dict) -> str | None:
    return next((k for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)


def _cut_layers(depth: int, out: dict) -> None:
    """Per-layer lists (as long as the default depth) keep each layer kind once, in order of appearance."""
    depth_key = _depth_key(out)
    if depth_key is None:
        return
    per_layer = {k: v for k, v in out.items() if isinstance(v, list) and len(v) == depth and depth > 2
                 and all(isinstance(x, (str, int, float, bool)) for x in v)}
    kinds = {k: list(dict.fromkeys(v)) for k, v in per_layer.items()}
    layers = max([out[depth_key], *(len(v) for v in kinds.values())])
    out[depth_key] = layers
    for name, distinct in kinds.items():
        out[name] = [distinct[i % len(distinct)] for i in range(layers)]
    for name, value in list(out.items()):
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):  # per-layer overrides
            out[name] = {k: v for k, v in value.items() if int(k) < layers}
        elif name.endswith(("_layer_ids", "only_layers", "_layer_indices")) and isinstance(value, list):
            out[name] = [i for i in value if isinstance(i, int) and i < layers]


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    config = default_config(model_type)
    values = {k: v for k, v in config.to_dict().items() if k not in _DROPPED}
    sub_configs = tuple(getattr(type(config), "sub_configs", {}) or {})
    values = _shrunk(values, sub_configs)
    _merge(values, _nested(OVERRIDES.get(model_type, {})))
    return type(config)(**values)


def _merge(values: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict) and key.endswith("config"):
            _merge(values[key], value)
        else:
            values[key] = value


def build(model_type: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny model in train mode; RuntimeError if it is not tiny after shrinking."""
    config = tiny_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            meta = _construct(model_type, config, torch.float32)
        count = sum(p.numel() for p in meta.parameters())
        if count > MAX_PARAMETERS:
            raise RuntimeError(f"{model_type} still has {count} parameters after shrinking")
        model = _construct(model_type, config, dtype)
    setup = SETUP.get(model_type)
    if setup is not None:
        setup(model)
    return model.train()


def _construct(model_type: str, config, dtype: torch.dtype) -> torch.nn.Module:
    cls = getattr(transformers, ZOO[model_type])
    decoder = next((v for v in vars(config).values() if isinstance(v, cls.config_class)), None)
    if decoder is not None and not isinstance(config, cls.config_class):  # musicgen: the class takes its decoder's
        return cls._from_config(decoder, attn_implementation="eager", dtype=dtype)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)


def zoo_batch(model: torch.nn.Module, model_type: str, batch: int = 2, seq: int = 9) -> dict:
    """input_ids, attention_mask and labels (-100 at a few positions), plus what the model needs."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if isinstance(getattr(head, "weight", None), torch.Tensor) else VOCAB
    input_ids = torch.randint(3, min(vocab, VOCAB), (batch, seq))
    labels = torch.randint(3, min(vocab, VOCAB), (batch, seq))  # not the inputs: no copying shortcut
    labels[0, :2] = -100
    labels[1, -1] = -100
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    extra = EXTRA_INPUTS.get(model_type)
    if extra is not None:
        inputs.update(extra(model.config, batch, seq))
    return inputs


# -- the protocol every entry goes through ------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """kind: "fused" (patched equals unpatched), "refused" (a ValueError says why) or "cannot_run" (the
    unpatched model itself cannot be built or trained here; reason says why)."""

    kind: str
    reason: str = ""


HEAD_SCALE = 40.0  # logits of several units: softcaps and logit scales change the loss far beyond the tolerance


def installed(model_types: list[str]) -> list:
    """pytest params of ``model_types``, each skipped with the reason where this transformers lacks it."""
    return [pytest.param(m, marks=pytest.mark.skipif(m not in ZOO, reason=f"transformers "
                                                     f"{transformers.__version__} has no {m!r}")) for m in model_types]


def zoo_verdict(model_type: str, backend: str = "torch", device: str = "cpu",
                tol: tuple[float, float] = (2e-6, 2e-5)) -> Verdict:
    """Patch the class (static refusal?), build tiny, patch the instance, and compare one training step
    (loss, every gradient, num_items_in_batch, the router aux loss, logits None) and eval mode (logits
    identical on the CPU, where the same forward twice is bitwise the same) with the unpatched model.
    tol: relative (loss, gradient) tolerances. AssertionError when a fused result differs."""
    cls = getattr(transformers, ZOO[model_type])
    try:
        flce.apply_flce_patch(cls)
    except ValueError as e:
        return Verdict("refused", str(e))
    finally:
        flce.remove_flce_patch(cls)
    torch.manual_seed(0)
    try:
        model = build(model_type).to(device)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in zoo_batch(model, model_type).items()}
    except Exception as e:  # noqa: BLE001 - whatever stops it, the unpatched model cannot run here
        return Verdict("cannot_run", f"it cannot be built here: {_first_line(e)}")
    head_weight = getattr(model.get_output_embeddings(), "weight", None)
    if isinstance(head_weight, torch.Tensor):
        with torch.no_grad():
            head_weight.mul_(HEAD_SCALE)
    reference = copy.deepcopy(model)
    try:
        flce.apply_flce_patch(model, backend=backend)  # and flce's experts where it computes every one
    except ValueError as e:
        return Verdict("refused", str(e))
    try:
        want, want_grads, inputs = _unpatched_step(reference, inputs)
    except Exception as e:  # noqa: BLE001
        return Verdict("cannot_run", f"the unpatched model fails here: {_first_line(e)}")
    try:
        got, got_grads = train_step(model, inputs)
    except ValueError as e:
        if "flce cannot fuse" not in str(e):
            raise
        return Verdict("refused", str(e))
    _assert_same_step(got, want, got_grads, want_grads, *tol)
    _assert_same_eval(model, reference, inputs, exact=device == "cpu" and not has_flce_experts(model))
    return Verdict("fused")


def train_step(model: torch.nn.Module, inputs: dict):
    """(output, {name: grad}) of one seeded forward/backward from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    output = model(**inputs)
    output.loss.backward()
    return output, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _unpatched_step(model: torch.nn.Module, inputs: dict):
    """train_step with the loss kwargs, or without them where the unpatched model fails with them."""
    try:
        return (*train_step(model, {**inputs, **_loss_kwargs(model)}), {**inputs, **_loss_kwargs(model)})
    except Exception:  # noqa: BLE001
        return (*train_step(model, inputs), inputs)


def _loss_kwargs(model: torch.nn.Module) -> dict:
    """num_items_in_batch where the forward passes **kwargs to its loss; router logits where it has them."""
    params = inspect.signature(type(model).forward).parameters
    kwargs = {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["num_items_in_batch"] = torch.tensor(7, device=model.device)
    if "output_router_logits" in params:
        kwargs["output_router_logits"] = True
    return kwargs


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, floor: float) -> bool:
    """||a - e|| <= tol * max(||e||, floor): relative, but a near-zero gradient is judged on the model's scale."""
    err = (actual.double() - expected.double()).norm().item()
    return err <= tol * max(expected.double().norm().item(), floor)


def _assert_same_step(got, want, got_grads: dict, want_grads: dict, loss_tol: float, grad_tol: float) -> None:
    assert getattr(got, "logits", None) is None, "a fused call returns logits=None"
    assert _close(got.loss, want.loss, loss_tol, 1.0), f"loss {got.loss.item()} != {want.loss.item()}"
    aux_got, aux_want = getattr(got, "aux_loss", None), getattr(want, "aux_loss", None)
    assert (aux_got is None) == (aux_want is None), "aux_loss present on one side only"
    if aux_want is not None:
        assert _close(aux_got, aux_want, loss_tol, 1.0), f"aux_loss {aux_got} != {aux_want}"
    assert got_grads.keys() == want_grads.keys(), f"gradients of different parameters: " \
                                                  f"{sorted(got_grads.keys() ^ want_grads.keys())}"
    scale = max(g.double().norm().item() for g in want_grads.values())
    bad = [n for n, g in want_grads.items() if not _close(got_grads[n], g, grad_tol, 1e-3 * scale)]
    assert not bad, f"gradients differ: {bad[:5]}"


def _assert_same_eval(model: torch.nn.Module, reference: torch.nn.Module, inputs: dict, exact: bool) -> None:
    """In eval mode the patched model is the unpatched forward: the same logits and loss."""
    model.eval()
    reference.eval()
    with torch.no_grad():
        got, want = model(**inputs), reference(**inputs)
    if exact:
        assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss), "eval output differs"
    else:  # e.g. CUDA atomics in MoE scatters, or flce's experts against the model's own
        assert _close(got.logits, want.logits, 1e-5, 1.0) and _close(got.loss, want.loss, 1e-5, 1.0), "eval differs"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].rstrip(':') if text else ''}"[:300]


# -- the recorded verdicts and the supported-model list generated from them -----------------------------------

VERDICTS_FILE = Path(__file__).with_name("zoo_verdicts.json")
MODELS_FILE = Path(__file__).resolve().parents[1] / "docs" / "supported_models.md"
README_FILE = Path(__file__).resolve().parents[1] / "README.md"
README_MARKS = ("<!-- supported models: generated by `python tests/hf_zoo.py` -->", "<!-- end of supported models -->")


def recorded_verdicts() -> dict:
    return json.loads(VERDICTS_FILE.read_text()) if VERDICTS_FILE.exists() else {}


def render_models(verdicts: dict) -> str:
    """docs/supported_models.md: the fused entries, then the refused ones and why, then the rest."""
    version = verdicts.get("_transformers", "?")
    rows = {kind: [(k, v) for k, v in sorted(verdicts.items()) if not k.startswith("_") and v["verdict"] == kind]
            for kind in ("fused", "refused", "cannot_run")}
    lines = [f"# Models apply_flce_patch fuses (transformers {version})", "",
             "Generated by `python tests/hf_zoo.py` from tests/test_patches_zoo.py's verdicts: every entry of "
             "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny, patched vs unpatched (loss, every gradient, "
             "`num_items_in_batch`, the router aux loss, eval logits).", "",
             f"## Fused and exact: {len(rows['fused'])} of {sum(map(len, rows.values()))}", "",
             "| model type | class |", "| --- | --- |"]
    lines += [f"| `{k}` | `{v['class']}` |" for k, v in rows["fused"]]
    lines += ["", f"## Refused with a reason: {len(rows['refused'])}", "", "| model type | class | reason |",
              "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{v['class']}` | {v['reason']} |" for k, v in rows["refused"]]
    lines += ["", f"## Not run here (the unpatched model cannot run on this CPU test setup): "
              f"{len(rows['cannot_run'])}", "", "| model type | class | why |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{v['class']}` | {v['reason']} |" for k, v in rows["cannot_run"]]
    return "\n".join(lines) + "\n"


def readme_with_models(readme: str, verdicts: dict) -> str:
    """README.md with its supported-models block (between ``README_MARKS``) rendered from the verdicts."""
    start, end = README_MARKS
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    entries = {k: v for k, v in verdicts.items() if not k.startswith("_")}
    fused = sorted(k for k, v in entries.items() if v["verdict"] == "fused")
    summary = (f"{len(fused)} of the {len(entries)} causal-LM entries of transformers "
               f"{verdicts.get('_transformers', '?')} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), each built tiny and "
               "checked patched against unpatched (loss, every gradient, `num_items_in_batch`, the MoE aux loss) "
               "by tests/test_patches_zoo.py; the others, and why, in [docs/supported_models.md]"
               "(docs/supported_models.md). Anything flce cannot fuse raises a `ValueError` that says why; "
               "nothing runs silently different.")
    names = ", ".join(f"`{k}`" for k in fused) + "."
    block = "\n\n".join(textwrap.fill(p, 110, break_long_words=False, break_on_hyphens=False)
                        for p in (summary, names))
    return f"{head}{start}\n{block}\n{end}{tail}"


def main() -> None:
    """Run every entry and write tests/zoo_verdicts.json and docs/supported_models.md."""
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than the work
    verdicts = {"_transformers": transformers.__version__}
    failed = []
    for model_type in sys.argv[1:] or sorted(ZOO):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                verdict = zoo_verdict(model_type)
        except AssertionError as e:
            failed.append(model_type)
            print(f"{'MISMATCH':10s} {model_type:28s} {e}", flush=True)
            continue
        verdicts[model_type] = {"class": ZOO[model_type], "verdict": verdict.kind, "reason": verdict.reason}
        print(f"{verdict.kind:10s} {model_type:28s} {verdict.reason[:120]}", flush=True)
    if failed or sys.argv[1:]:
        raise SystemExit(f"not written: {len(failed)} mismatches {failed}" if failed else "not written: a subset")
    VERDICTS_FILE.write_text(json.dumps(verdicts, indent=1, sort_keys=True) + "\n")
    MODELS_FILE.parent.mkdir(exist_ok=True)
    MODELS_FILE.write_text(render_models(verdicts))
    README_FILE.write_text(readme_with_models(README_FILE.read_text(), verdicts))


if __name__ == "__main__":
    main()
