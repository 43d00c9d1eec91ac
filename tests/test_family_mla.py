"""The MLA target families of the CPU runtime (models/families/mla.py) against transformers 5.24 in
float64: DeepSeek-V3 (the layout Kimi K2.x ships; also with q_lora_rank None, non-interleaved
RoPE and yarn), Kimi K2.5's text decoder inside its vision wrapper (kimi_k25, tensors under
language_model.*), and GLM-5's MLA + DSA indexer (glm_moe_dsa; sequences longer than index_topk,
one layer sharing the previous layer's selection); also the hub's layouts (Kimi K2.5's
language_model.model.layers.* under a kimi_k2 text_config, DeepSeek-V3's MTP layer). transformers leaves e_score_correction_bias at
zero and the norms at one: they get random values here so the oracle sees them."""
from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch as st
import torch
from family_oracle import build_hf_tiny, incremental_with_rollback, lossless, random_drafter, same_as_transformers

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "initializer_range": 0.05}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
       "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
VISION = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
          "pos_emb_height": 4, "pos_emb_width": 4}
FAMILIES = {
    "deepseek_v3": ("deepseek_v3", {**BASE, **MLA}),
    # DeepSeek-V2-Lite-like attention: no q LoRA, RoPE halves (not pairs), yarn with mscale
    "deepseek_v3_yarn": ("deepseek_v3", {**BASE, **MLA, "q_lora_rank": None, "rope_interleave": False,
                                         "rope_parameters": YARN, "norm_topk_prob": False, "n_group": 1,
                                         "topk_group": 1}),
    "kimi_k25": ("kimi_k25", {"text_config": {"model_type": "kimi_k2", **BASE, **MLA}, "vision_config": VISION,
                              "projection_hidden_size": 32, "tie_word_embeddings": False}),
    "glm_moe_dsa": ("glm_moe_dsa", {**BASE, **MLA, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6,
                                    "indexer_types": ["full", "full", "shared"]}),
}


def _randomize(model):
    """What transformers initializes to constants gets random values."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn_like(t) * 0.05)
        elif "norm" in name and name.endswith(".weight"):
            t.copy_(1 + 0.1 * torch.randn_like(t))
        elif "norm" in name and name.endswith(".bias"):
            t.copy_(0.1 * torch.randn_like(t))


def _rewrite(src, dst, rename=lambda k: k, extra=lambda state: {}, config=lambda cfg: cfg):
    """A copy of checkpoint `src` with its tensors renamed / added to and its config.json edited."""
    shutil.copytree(src, dst)
    state = {rename(k): v for k, v in st.load_file(src / "model.safetensors").items()}
    st.save_file({**state, **extra(state)}, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def _mtp_layer(state, last=2, mtp=3):
    """DeepSeek-V3's multi-token-prediction layer as the hub checkpoint stores it after the last layer."""
    layer = {k.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): v.clone() for k, v in state.items()
             if k.startswith(f"model.layers.{last}.")}
    H = state["model.norm.weight"].shape[0]
    return {**layer, f"model.layers.{mtp}.eh_proj.weight": torch.randn(H, 2 * H),
            f"model.layers.{mtp}.enorm.weight": torch.ones(H), f"model.layers.{mtp}.hnorm.weight": torch.ones(H)}


def _kimi_hub_config(cfg):
    cfg["text_config"]["model_type"] = "kimi_k2"      # as moonshotai/Kimi-K2.5's config.json
    return cfg


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    out = {name: build_hf_tiny(mt, fields, root / name, init=_randomize) for name, (mt, fields) in FAMILIES.items()}
    # the hub's layouts: Kimi K2.5's language_model.model.layers.* (transformers writes .blocks.*)
    # under a text_config of model_type kimi_k2; DeepSeek-V3's MTP layer after the last decoder layer
    out["kimi_k25_hub"] = _rewrite(out["kimi_k25"], root / "kimi_k25_hub", config=_kimi_hub_config,
                                   rename=lambda k: k.replace("language_model.model.blocks.", "language_model.model.layers."))
    out["deepseek_v3_mtp"] = _rewrite(out["deepseek_v3"], root / "deepseek_v3_mtp", extra=_mtp_layer)
    return out


def _decoder_cfg(folder):
    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("text_config", cfg)


@pytest.mark.parametrize("family", [*FAMILIES, "kimi_k25_hub", "deepseek_v3_mtp"])
def test_same_as_transformers(targets, family):
    same_as_transformers(targets[family], n=24, capture=(0, 1, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_with_rollback(targets, family):
    incremental_with_rollback(targets[family], n=20)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25", "glm_moe_dsa"])
def test_lossless(targets, family, tmp_path):
    d = random_drafter(tmp_path / "d", _decoder_cfg(targets[family]))
    lossless(targets[family], d)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25", "glm_moe_dsa", "kimi_k25_hub", "deepseek_v3_mtp"])
def test_check_no_longer_notes_the_family(targets, family, tmp_path):
    """check on such a pair: ok, and no "the CPU reference runtime does not cover" note."""
    from helpers import run_cli

    d = random_drafter(tmp_path / "d", _decoder_cfg(targets[family]))
    code, out, err = run_cli("check", "--target", str(targets[family]), "--drafter", str(d))
    assert code == 0, err
    assert out.startswith("ok:") and "does not cover" not in err + out


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25", "glm_moe_dsa"])
def test_convert_refuses_the_family_in_one_line(targets, family, tmp_path):
    """TensorRT-LLM's engine path has no DeepSeek-V3 / GLM-5 layout: convert says which path serves them."""
    from helpers import run_cli

    code, _, err = run_cli("convert", "--model", str(targets[family]), "--out", str(tmp_path / "o"))
    assert code != 0 and not (tmp_path / "o").exists()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "has no engine (TensorRT) checkpoint layout" in lines[0], err
    assert "PyTorch backend" in lines[0] and "DeepSeek-V2" in lines[0]


def test_quantize_calib_refuses_the_family_in_one_line(targets, tmp_path):
    """--calib runs target.py's decoder layers: an MLA target is refused by name (weights-only quantize works)."""
    from helpers import run_cli

    (tmp_path / "calib.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n")
    code, _, err = run_cli("quantize", "--model", str(targets["deepseek_v3"]), "--format", "fp8", "--calib",
                           str(tmp_path / "calib.jsonl"), "--out", str(tmp_path / "q"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and not (tmp_path / "q").exists()
    assert len(lines) == 1 and "--calib" in lines[0] and "'deepseek_v3'" in lines[0], err
