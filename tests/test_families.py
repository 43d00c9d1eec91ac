"""Target families z-lab publishes DFlash drafters for, by config on the bundle path: tiny
checkpoints of each built with transformers 5.24 (MLA: DeepSeek-V3 layout, as Kimi K2.x; GLM-5's
MLA + DSA indexer; MiniMax-M2; the hybrid GatedDeltaNet + MoE layouts of Qwen3-Next and
Qwen3.5/3.6), quantized by NVIDIA ModelOpt 0.47 (`mtq.quantize` + `export_hf_checkpoint`, the
oracle, as tests/test_quantize.py) and by us: every weight, weight_scale, weight_scale_2 and every
tensor left unquantized byte-identical, and hf_quant_config.json equal. input_scale is ModelOpt's
calibration and is not written by ours without --calib (which needs the CPU runtime's calibration,
and that covers llama / qwen3 / gpt-oss only). The CPU runtime runs these families
(models/families: tests/test_family_*.py); `check` notes a family it does not run in one line."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import safetensors.torch as st
import torch

from dflash_trt.models.check import require_target, runtime_coverage
from dflash_trt.models.families import RUNTIME_FAMILIES
from dflash_trt.quant.quantize import quantize_checkpoint

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
       "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4}
GDN = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
       "linear_key_head_dim": 16, "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}
FAMILIES = {
    "deepseek_v3": MLA,                                   # Kimi K2.5-K2.7 ship this layout (DeepseekV3ForCausalLM)
    "glm_moe_dsa": {**MLA, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8},   # GLM-5.1
    "minimax_m2": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "rotary_dim": 8},
    "qwen3_next": GDN,
    "qwen3_5_moe_text": GDN,                              # the decoder of Qwen3.5 / Qwen3.6 MoE (A3B, A17B)
}
CALIB = [[5, 17, 99, 3, 250, 42, 7, 7]]


def _build(family: str, folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]})
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _modelopt(src, out, fmt: str):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert next(m.parameters()).device.type == "cpu"
    qc = copy.deepcopy(mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = mtq.quantize(m, qc, lambda model: model(torch.tensor(CALIB)))
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: _build(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_is_modelopts(sources, tmp_path, family, fmt):
    src = sources[family]
    ref = _modelopt(src, tmp_path / "modelopt", fmt)
    quantize_checkpoint(src, tmp_path / "ours", fmt, progress=False)
    a = st.load_file(tmp_path / "ours" / "model.safetensors")
    b = {k: v for k, v in st.load_file(ref / "model.safetensors").items() if not k.endswith(".input_scale")}
    assert sorted(a) == sorted(b)
    assert any(k.endswith(".weight_scale") for k in a)
    for k, want in b.items():
        assert a[k].dtype == want.dtype and a[k].shape == want.shape, (k, a[k].dtype, want.dtype)
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), k
    ours_q = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    assert ours_q == json.loads((ref / "hf_quant_config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_check_takes_the_family_and_names_the_runtime_gap(sources, family):
    require_target(sources[family])     # configs and tensor headers: no problem
    cfg = json.loads((sources[family] / "config.json").read_text())
    note = runtime_coverage(cfg)
    if family in RUNTIME_FAMILIES:      # models/families (tests/test_family_*.py)
        assert note is None
    else:
        assert note is not None and f"model_type {family!r}" in note


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_reads_the_family(sources, family):
    """The planner's parameter count = the elements stored in the checkpoint transformers wrote; KV per
    token as the family stores it (MLA: kv_lora_rank + qk_rope_head_dim per layer, unsplit; GatedDeltaNet
    layers: none)."""
    from dflash_trt.io.checkpoint import CheckpointReader
    from dflash_trt.plan.planner import kv_bytes_per_token, plan, target_shape

    cfg = json.loads((sources[family] / "config.json").read_text())
    shape = target_shape(cfg)
    with CheckpointReader(sources[family]) as r:
        stored = sum(torch.Size(r.meta(k)[1]).numel() for k in r.keys())  # noqa: SIM118 (a reader, not a dict)
    assert shape.total_params == stored
    spec = FAMILIES[family]
    if "kv_lora_rank" in spec:
        want = 2 * (spec["kv_lora_rank"] + spec["qk_rope_head_dim"])        # 2 layers, fp8: 1 byte each
    else:
        attn = sum(t != "linear_attention" for t in spec.get("layer_types", ["full_attention"] * 2))
        want = attn * 2 * cfg["num_key_value_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // 4)
    assert kv_bytes_per_token(shape, "fp8") == want
    assert plan(cfg, None, "dgx-b300").chosen is not None


def test_build_takes_a_family_the_runtime_does_not_run(tmp_path):
    """build: the note line, then a whole bundle (FP8 target as above, every stack's configs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_trt.models.drafter import DFlashDrafter, save_drafter
    from dflash_trt.models.tiny import build_tokenizer, init_drafter_weights, tiny_drafter_config

    from helpers import run_cli

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("phi3", **{**BASE, "vocab_size": len(tok), "pad_token_id": None, "bos_token_id": 0,
                                          "eos_token_id": 1})     # a family the runtime does not run
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    d = DFlashDrafter(tiny_drafter_config(json.loads((tmp_path / "t" / "config.json").read_text()), 3))
    init_drafter_weights(d)
    save_drafter(d, tmp_path / "d")
    code, _, err = run_cli("build", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--arch",
                           "hopper", "--gpu", "h200", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert sum("does not cover model_type 'phi3'" in line for line in err.splitlines()) == 1
    for f in ("trtllm-serve.yaml", "vllm.json", "sglang.json"):
        assert (tmp_path / "b" / "configs" / f).is_file(), f
    assert json.loads((tmp_path / "b" / "target" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] \
        == "FP8"
