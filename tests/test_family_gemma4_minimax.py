"""Gemma 4 (12B, 31B, 26B-A4B) and MiniMax-M2 (M2.5 / M2.7) on the bundle path, by config.

- quantize: tiny checkpoints built by transformers 5.24, quantized by ModelOpt 0.47 (`mtq.quantize` +
  `export_hf_checkpoint`, the oracle; tests/test_families.py's helpers) and by us: every tensor
  byte-identical, hf_quant_config.json equal (MiniMax-M2 is in test_families.py already).
"""
from __future__ import annotations

import json

import pytest
import safetensors.torch as st
import torch

from dflash_trt.quant.quantize import quantize_checkpoint
from test_families import _modelopt

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


RUNTIME = {"minimax_m2": ("minimax_m2", MINIMAX, _minimax_init)}


@pytest.fixture(scope="module")
def runtime_targets(tmp_path_factory):
    from family_oracle import build_hf_tiny

    root = tmp_path_factory.mktemp("runtime")
    return {name: build_hf_tiny(mt, fields, root / name, init=init) for name, (mt, fields, init) in RUNTIME.items()}


@pytest.mark.parametrize("name", RUNTIME)
def test_same_as_transformers(runtime_targets, name):
    from family_oracle import same_as_transformers

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
    lossless(target, drafter)
