"""Gemma 4 (12B, 31B, 26B-A4B) and MiniMax-M2 (M2.5 / M2.7) on the bundle path, by config.

- quantize: tiny checkpoints built by transformers 5.24, quantized by ModelOpt 0.47 (`mtq.quantize` +
  `export_hf_checkpoint`, the oracle; tests/test_families.py's helpers) and by us: every tensor
  byte-identical, hf_quant_config.json equal (MiniMax-M2 is in test_families.py already).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import textwrap

import pytest
import safetensors.torch as st
import torch
from test_families import _modelopt

from dflash_trt.quant.quantize import quantize_checkpoint

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
# Gemma 4: sliding layers (head_dim, num_key_value_heads) and full layers (global_head_dim,
# num_global_key_value_heads; keys double as values: attention_k_eq_v), proportional partial RoPE on
# full layers, logit softcapping; the 26B-A4B adds a routed-expert block beside each layer's MLP.
GEMMA4 = {**TINY, "num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
          "attention_k_eq_v": True, "sliding_window": 6, "final_logit_softcapping": 30.0,
          "hidden_size_per_layer_input": 0, "tie_word_embeddings": True,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}
GEMMA4_MOE = {**GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
QUANT = {
    "gemma4_text": ("gemma4_text", GEMMA4),
    "gemma4_text-moe": ("gemma4_text", GEMMA4_MOE),
    # the released Gemma 4 checkpoints are the multimodal wrapper (Gemma4ForConditionalGeneration: the decoder
    # under model.language_model); no vision tower here
    "gemma4-moe": ("gemma4", {"text_config": {**GEMMA4_MOE, "vocab_size": 256}, "vision_config": None,
                              "audio_config": None}),
    "qwen3_5_text": ("qwen3_5_text", {**TINY, "num_hidden_layers": 2, "head_dim": 16, "linear_num_value_heads": 4,
                                      "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                      "layer_types": ["linear_attention", "full_attention"],
                                      "tie_word_embeddings": False}),
}


def _build_bf16(model_type: str, fields: dict, folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **(fields if "text_config" in fields else {**fields, "vocab_size": 256}))
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def quant_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_quant")
    return {name: _build_bf16(mt, f, root / name) for name, (mt, f) in QUANT.items()}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("name", QUANT)
def test_quantize_is_modelopts(quant_sources, tmp_path, name, fmt):
    src = quant_sources[name]
    ref = _modelopt(src, tmp_path / "modelopt", fmt)
    quantize_checkpoint(src, tmp_path / "ours", fmt, progress=False)
    a = st.load_file(tmp_path / "ours" / "model.safetensors")
    b = {k: v for k, v in st.load_file(ref / "model.safetensors").items() if not k.endswith(".input_scale")}
    assert sorted(a) == sorted(b), (sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5])
    assert any(k.endswith(".weight_scale") for k in a)
    for k, want in b.items():
        assert a[k].dtype == want.dtype and a[k].shape == want.shape, (k, a[k].dtype, want.dtype, a[k].shape, want.shape)
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), k
    ours_q = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    assert ours_q == json.loads((ref / "hf_quant_config.json").read_text())


# ----------------------------------------------------------------------------------------- runtime
MINIMAX = {**TINY, "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "rotary_dim": 8, "tie_word_embeddings": False}


def _minimax_init(model):
    for layer in model.model.layers:   # transformers leaves the selection bias at zero
        layer.mlp.e_score_correction_bias.normal_(0, 0.5)
        layer.self_attn.q_norm.weight.normal_(1, 0.3)
        layer.self_attn.k_norm.weight.normal_(1, 0.3)


def _gemma4_init(model):
    """Norm weights, layer scalars and router scales transformers initializes to ones: random, so a
    misplaced one shows."""
    for name, p in model.named_parameters():
        if p.dim() == 1 and ("norm" in name or "scale" in name):
            p.normal_(1, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.uniform_(0.5, 1.5)


GEMMA4_RUNTIME = {**GEMMA4, "num_hidden_layers": 5, "max_position_embeddings": 256,
                  "layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention"]}
GEMMA4_MOE_RUNTIME = {**GEMMA4_RUNTIME, **{k: GEMMA4_MOE[k] for k in ("enable_moe_block", "num_experts",
                                                                      "top_k_experts", "moe_intermediate_size")}}
# E2B / E4B's extras: per-layer inputs, the last layers reusing earlier layers' K/V with a double-width MLP
GEMMA4_PLE = {**GEMMA4_RUNTIME, "num_hidden_layers": 6, "attention_k_eq_v": False, "hidden_size_per_layer_input": 16,
              "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
              "layer_types": ["sliding_attention", "full_attention"] * 3}
RUNTIME = {
    "minimax_m2": ("minimax_m2", MINIMAX, _minimax_init),
    "gemma4_text": ("gemma4_text", GEMMA4_RUNTIME, _gemma4_init),            # 31B / 12B layout
    "gemma4_text-moe": ("gemma4_text", GEMMA4_MOE_RUNTIME, _gemma4_init),    # 26B-A4B layout
    "gemma4_text-ple": ("gemma4_text", GEMMA4_PLE, _gemma4_init),            # E2B / E4B layout
}


# transformers' Gemma 4 norms, router softmax and eager attention softmax compute in float32 even in a
# float64 model; the oracle runs transformers' own source of them with those casts made float64
# (as tests/test_family_hybrid.py does for the hybrids). Unpatched it agrees to float32's precision
# (test_unpatched_transformers_agrees_to_float32_precision).
FLOAT64 = ((".float()", ".double()"), ("torch.float32", "torch.float64"))
IN_FLOAT32 = {"gemma4": ("eager_attention_forward", "Gemma4RMSNorm.forward", "Gemma4TextRouter.forward")}


def _float64_copy(fn, namespace: dict):
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    for a, b in FLOAT64:
        src = src.replace(a, b)
    scope = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), namespace, scope)   # noqa: S102 (transformers' own source)
    return scope[fn.__name__]


@contextlib.contextmanager
def hf_in_float64(family: str):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    undo = []
    for path in IN_FLOAT32.get(family, ()):
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(mod, owner_name) if owner_name else mod
        orig = owner.__dict__[attr]
        undo.append((owner, attr, orig))
        setattr(owner, attr, _float64_copy(orig, mod.__dict__))
    try:
        yield
    finally:
        for owner, attr, orig in reversed(undo):
            setattr(owner, attr, orig)


def _hf_family(name: str) -> str:
    return "gemma4" if name.startswith("gemma4") else name


@pytest.fixture(scope="module")
def runtime_targets(tmp_path_factory):
    from family_oracle import build_hf_tiny

    root = tmp_path_factory.mktemp("runtime")
    return {name: build_hf_tiny(mt, fields, root / name, init=init) for name, (mt, fields, init) in RUNTIME.items()}


def test_unpatched_transformers_agrees_to_float32_precision(runtime_targets):
    """transformers as installed (its float32 casts kept) is the same model, to float32's precision."""
    from family_oracle import hf_float64, random_ids

    from dflash_trt.models.target import load_target

    ours = load_target(runtime_targets["gemma4_text-moe"], torch.float64, max_len=32)
    ours.setup_cache(32)
    ids = random_ids(ours.vocab_size, 24)
    logits, _ = ours(torch.tensor(ids), 0, all_logits=True)
    with torch.no_grad():
        diff = float((logits - hf_float64(runtime_targets["gemma4_text-moe"])(torch.tensor([ids])).logits[0]).abs().max())
    assert 1e-9 < diff < 1e-5, diff      # float32 rounding shows, nothing larger


@pytest.fixture(scope="module")
def gemma4_wrapped(tmp_path_factory):
    """Gemma 4 as released: the multimodal wrapper (model.language_model.*, a vision tower beside it)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from dflash_trt.models.tiny import build_tokenizer

    folder = tmp_path_factory.mktemp("gemma4_wrapped")
    tok = build_tokenizer(256)
    torch.manual_seed(0)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
              "position_embedding_size": 64}
    cfg = AutoConfig.for_model("gemma4", text_config={**GEMMA4_MOE_RUNTIME, "vocab_size": len(tok)},
                               vision_config=vision, audio_config=None)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    with torch.no_grad():
        _gemma4_init(model)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def test_the_wrapper_runs_its_text_decoder(gemma4_wrapped, tmp_path):
    """config.json's text_config, model.language_model.* loaded, the vision tower not: same logits and
    layers as transformers' Gemma4ForConditionalGeneration, and lossless."""
    import safetensors
    from family_oracle import lossless, random_drafter, same_as_transformers

    with safetensors.safe_open(gemma4_wrapped / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.vision_tower.") for n in names), names[:5]
    assert any(n.startswith("model.language_model.layers.0.experts.") for n in names)
    with hf_in_float64("gemma4"):
        same_as_transformers(gemma4_wrapped, capture=(0, 1, 4))
        drafter = random_drafter(tmp_path / "d", json.loads((gemma4_wrapped / "config.json").read_text())["text_config"])
        lossless(gemma4_wrapped, drafter, prompts=2, blocks=(4,))


@pytest.mark.parametrize("name", RUNTIME)
def test_same_as_transformers(runtime_targets, name):
    from family_oracle import same_as_transformers

    with hf_in_float64(_hf_family(name)):
        same_as_transformers(runtime_targets[name], capture=tuple(range(RUNTIME[name][1]["num_hidden_layers"])))


@pytest.mark.parametrize("name", RUNTIME)
def test_incremental_with_rollback(runtime_targets, name):
    from family_oracle import incremental_with_rollback

    incremental_with_rollback(runtime_targets[name])


@pytest.mark.parametrize("name", RUNTIME)
def test_lossless(runtime_targets, name, tmp_path):
    from family_oracle import lossless, random_drafter

    target = runtime_targets[name]
    drafter = random_drafter(tmp_path / "d", json.loads((target / "config.json").read_text()))
    with hf_in_float64(_hf_family(name)):
        lossless(target, drafter)


# --------------------------------------------------------------------------------- check / convert
def test_check_takes_the_wrapped_pair_with_no_runtime_note(gemma4_wrapped, tmp_path):
    """check: the released layout (vision tower beside the decoder) has no problem and no runtime gap."""
    from family_oracle import random_drafter

    from dflash_trt.models.check import check_pair

    drafter = random_drafter(tmp_path / "d", json.loads((gemma4_wrapped / "config.json").read_text())["text_config"])
    report = check_pair(gemma4_wrapped, drafter)
    assert report["ok"], report
    assert report["runtime_note"] is None


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4-moe", "minimax_m2"])
def test_convert_names_the_path_that_serves_it(quant_sources, tmp_path, name):
    """TensorRT-LLM <= 1.2's engine-checkpoint path has no Gemma 4 / MiniMax-M2 layout: convert refuses in
    one line naming the PyTorch backend (trtllm-serve reads the HF / ModelOpt checkpoint)."""
    from dflash_trt.errors import DFlashError
    from dflash_trt.stacks.trtllm.convert import convert_checkpoint

    src = quant_sources[name] if name in quant_sources else _build_bf16("minimax_m2", MINIMAX, tmp_path / "m")
    with pytest.raises(DFlashError) as e:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "no engine (TensorRT) checkpoint layout" in msg and "PyTorch backend" in msg, msg
    assert msg.startswith(json.loads((src / "config.json").read_text())["model_type"] + ":")
    assert not (tmp_path / "out").exists()
