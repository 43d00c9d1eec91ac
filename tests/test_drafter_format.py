"""z-lab checkpoint format: round trip, default layer ids, speculators conversion."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from dflash_trt.models.config import DrafterConfig, default_target_layer_ids, load_drafter_config
from dflash_trt.models.drafter import DFlashDrafter, load_drafter, save_drafter

ZLAB = json.loads("""{
  "architectures": ["DFlashDraftModel"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
  "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
  "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu", "hidden_size": 32,
  "initializer_range": 0.02, "intermediate_size": 48, "layer_types": ["full_attention", "full_attention"],
  "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 36, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}""")

ZLAB_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}


def test_default_target_layer_ids_match_zlab():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(30, 1) == [15]
    cfg = dict(ZLAB, dflash_config={"mask_token_id": 7})
    assert DrafterConfig.from_dict(cfg).target_layer_ids == [1, 33]  # 2 draft layers: ends of [1, L-3]


def test_zlab_round_trip_is_identical(tmp_path):
    cfg = DrafterConfig.from_dict(ZLAB)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg, max_len=64, dtype=torch.bfloat16)
    for p in d.parameters():
        torch.nn.init.normal_(p)
    save_drafter(d, tmp_path / "a")
    assert set(load_file(tmp_path / "a" / "model.safetensors")) == ZLAB_NAMES
    written = json.loads((tmp_path / "a" / "config.json").read_text())
    assert written == ZLAB  # every field kept, nothing added or reordered in value
    d2 = load_drafter(tmp_path / "a")
    for (k, v), (k2, v2) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert k == k2 and v.dtype == v2.dtype and torch.equal(v, v2)
    save_drafter(d2, tmp_path / "b")
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_speculators_config_converts_with_layer_id_shift(tmp_path):
    layer_cfg = {k: ZLAB[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                      "max_position_embeddings", "vocab_size")}
    spec = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": {"model_type": "qwen3", **layer_cfg}, "draft_vocab_size": 151936,
            "block_size": 16, "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34], "mask_token_id": 151669,
            "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "Qwen/Qwen3-8B"}}}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    cfg = DrafterConfig.from_dict(ZLAB)
    d = DFlashDrafter(cfg, max_len=64)
    state = {k: v.contiguous() for k, v in d.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(4, 32)  # speculators carries the verifier's embeddings
    save_file(state, tmp_path / "model.safetensors")
    got = load_drafter_config(tmp_path)
    assert got.target_layer_ids == [1, 9, 17, 25, 33]  # z-lab id = speculators id - 1
    assert got.block_size == 16 and got.mask_token_id == 151669 and got.hidden_size == 32
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.fc.weight, d.fc.weight)
