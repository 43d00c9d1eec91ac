"""Serving configs: the drafter's settings reach each stack in that stack's own convention.

Oracles are the stacks' own code, read at the commits cited in dflash_trt/stacks/:
- vllm-project/speculators tests/unit/convert/test_dflash_converter.py: z-lab [1, 9, 17, 25, 33]
  -> aux_hidden_state_layer_ids [2, 10, 18, 26, 34], speculative_tokens 15 for block_size 16;
- vLLM eagle3_utils.get_eagle3_aux_layers_from_config: `[i + 1 for i in target_layer_ids]`;
- SGLang dflash_utils.parse_dflash_draft_config: 0-based ids in [0, num_target_layers), and
  set_dflash_layers_to_capture: capture before layer id + 1;
- this repository's speculators -> z-lab converter (dflash_trt.models.config, written independently).
"""
import json

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.models.config import DrafterConfig
from dflash_trt.presets.catalog import get_preset
from dflash_trt.stacks.layer_ids import layer_ids_by_stack, speculators_to_zlab
from dflash_trt.stacks.sglang import sglang_launch
from dflash_trt.stacks.trtllm.serve_config import trtllm_serve_config
from dflash_trt.stacks.vllm.launch import vllm_launch, vllm_speculative_config

QWEN_DRAFTER = get_preset("qwen3-8b").drafter_config()  # z-lab format, block 16, ids [1, 9, 17, 25, 33]


def test_qwen3_8b_ids_in_every_convention():
    zlab = QWEN_DRAFTER["dflash_config"]["target_layer_ids"]
    ids = layer_ids_by_stack(zlab, num_target_layers=36)
    assert ids["zlab"] == ids["trtllm"] == [1, 9, 17, 25, 33]
    assert ids["speculators"] == [2, 10, 18, 26, 34]        # speculators' own converter test
    assert ids["vllm"] == [2, 10, 18, 26, 34]               # vLLM adds 1 to dflash target_layer_ids
    assert ids["sglang"] == [1, 9, 17, 25, 33]              # SGLang reads the 0-based ids as they are
    assert speculators_to_zlab(ids["speculators"]) == zlab


def test_speculators_ids_round_trip_through_independent_converter():
    """Our +1 agrees with the repository's speculators -> z-lab config converter."""
    zlab = [1, 9, 17, 25, 33]
    spec_cfg = {
        "speculators_model_type": "dflash", "block_size": 16, "mask_token_id": 151669,
        "aux_hidden_state_layer_ids": layer_ids_by_stack(zlab, 36)["speculators"],
        "transformer_layer_config": {k: QWEN_DRAFTER[k] for k in
                                     ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
    }
    assert DrafterConfig.from_dict(spec_cfg).target_layer_ids == zlab


def test_out_of_range_ids_are_refused():
    with pytest.raises(DFlashError, match="outside the target's 30 layers"):
        layer_ids_by_stack([1, 30], num_target_layers=30)
    with pytest.raises(DFlashError, match="embedding output"):
        speculators_to_zlab([0, 3])


def test_trtllm_serve_config_carries_drafter_settings_and_parallelism():
    tcfg = get_preset("qwen3-8b").config()
    cfg = trtllm_serve_config(target_cfg=tcfg, drafter_path="drafter", block_size=16, mask_token_id=151669,
                              zlab_ids=[1, 9, 17, 25, 33], tp=4, ep=1, pp=1, kv_cache="fp8", arch="hopper")
    spec = cfg["speculative_config"]
    assert spec == {"decoding_type": "DFlash", "speculative_model": "drafter", "max_draft_len": 15,
                    "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert cfg["tensor_parallel_size"] == 4 and cfg["kv_cache_config"]["dtype"] == "fp8"
    assert "moe_config" not in cfg  # dense target


def test_trtllm_serve_config_moe_backend_per_arch():
    tcfg = get_preset("gpt-oss-120b").config()
    kw = dict(target_cfg=tcfg, drafter_path="d", block_size=10, mask_token_id=200000, zlab_ids=[1, 9, 17, 25, 33],
              tp=8, ep=2, pp=1, kv_cache="fp8")
    assert trtllm_serve_config(arch="blackwell", **kw)["moe_config"] == {"backend": "TRTLLM"}
    assert trtllm_serve_config(arch="hopper", **kw)["moe_config"] == {"backend": "TRITON"}
    assert trtllm_serve_config(arch="blackwell", **kw)["moe_expert_parallel_size"] == 2


# vLLM's SpeculativeConfig fields (vllm/config/speculative.py) that our JSON may use: vLLM
# rejects unknown keys, so the layer ids and mask token must NOT be in --speculative-config.
VLLM_SPEC_FIELDS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"}


def test_vllm_speculative_config_only_uses_vllm_fields():
    spec = vllm_speculative_config(drafter_path="drafter", block_size=16, tp=2)
    assert set(spec) <= VLLM_SPEC_FIELDS
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 15  # as speculators' converter


def test_vllm_launch_holds_converted_ids_and_valid_command():
    v = vllm_launch(target_path="target", drafter_path="drafter", block_size=16, zlab_ids=[1, 9, 17, 25, 33],
                    tp=2, ep=1, pp=1, kv_cache="fp8")
    assert v["eagle_aux_hidden_state_layer_ids"] == [2, 10, 18, 26, 34]
    argv = v["argv"]
    assert argv[:3] == ["vllm", "serve", "target"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == v["speculative_config"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"


def test_sglang_launch_holds_zero_based_ids_and_capture_points():
    g = sglang_launch(target_path="target", drafter_path="drafter", block_size=10, zlab_ids=[1, 9, 17, 25, 33],
                      tp=8, ep=2, pp=1, kv_cache="fp8")
    assert g["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert g["capture_before_layer"] == [2, 10, 18, 26, 34]
    a = g["argv"]
    assert a[a.index("--speculative-algorithm") + 1] == "DFLASH"
    assert a[a.index("--speculative-dflash-block-size") + 1] == "10"
    assert a[a.index("--ep-size") + 1] == "2" and a[a.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_each_stacks_dflash_rules():
    from dflash_trt.stacks import CONFIG_STACKS as STACKS
    from dflash_trt.stacks import get

    assert [s for s in STACKS if get(s).layout_problems(tp=8, pp=1, block_size=16)] == []
    assert [s for s in STACKS if get(s).layout_problems(tp=1, pp=2, block_size=16)] == ["sglang"]
    assert "pp_size == 1" in get("sglang").layout_problems(tp=1, pp=2, block_size=16)[0]
    # each pinned engine's DFlash loader takes an FP8 drafter in its own layout (engines.json drafter_quant;
    # tests/test_drafter_quant.py checks the layouts and the refusals)
    assert [s for s in STACKS if get(s).drafter_quant_problem("fp8")] == []


def test_kv_cache_dtype_names_per_stack():
    tcfg = get_preset("qwen3-8b").config()
    kw = dict(target_path="t", drafter_path="d", block_size=16, zlab_ids=[1, 9, 17, 25, 33], tp=1, ep=1, pp=1,
              kv_cache="fp8")
    t = trtllm_serve_config(target_cfg=tcfg, drafter_path="d", block_size=16, mask_token_id=1,
                            zlab_ids=[1, 9, 17, 25, 33], tp=1, ep=1, pp=1, kv_cache="fp8", arch="hopper")
    v, g = vllm_launch(**kw)["argv"], sglang_launch(**kw)["argv"]
    assert t["kv_cache_config"]["dtype"] == "fp8"
    assert v[v.index("--kv-cache-dtype") + 1] == "fp8" and g[g.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_max_attention_window_only_for_sliding_layers():
    from dflash_trt.stacks.trtllm.serve_config import max_attention_window

    gpt = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 128}
    assert max_attention_window(gpt, 8192) == [128, 8192, 128, 8192]
    assert max_attention_window(get_preset("qwen3-8b").config(), 8192) is None


def test_profiles_follow_nvidias_curated_configs():
    from dflash_trt.stacks.trtllm.profiles import curated_layout, profile_settings
    gptoss = get_preset("gpt-oss-120b").config()
    # examples/configs/curated/gpt-oss-120b-{latency,throughput}.yaml @ 65b31db1b401
    lat = profile_settings("latency", gptoss, 10)
    assert (lat["max_batch_size"], lat["max_num_tokens"], lat["enable_attention_dp"], lat["stream_interval"]) == \
        (64, 16384, False, 20)
    thr = profile_settings("throughput", gptoss, 10)
    assert (thr["max_batch_size"], thr["max_num_tokens"], thr["enable_attention_dp"]) == (720, 16384, True)
    assert thr["attention_dp_config"] == {"enable_balance": True, "batching_wait_iters": 50, "timeout_iters": 1}
    assert curated_layout("throughput", gptoss) == (2, 2) and curated_layout("latency", gptoss) == (8, 1)
    # llama-3.3-70b.yaml's max_num_tokens 2048 cannot hold one DFlash step of 1024 sequences of block 10
    llama = profile_settings("throughput", {"architectures": ["LlamaForCausalLM"]}, 10)
    assert llama["max_batch_size"] == 1024 and llama["max_num_tokens"] == 10240
    # no curated config: our defaults
    qwen = profile_settings("latency", get_preset("qwen3-8b").config(), 16)
    assert (qwen["max_batch_size"], qwen["max_num_tokens"]) == (64, 8192) and "no curated config" in qwen["source"]
    with pytest.raises(DFlashError, match="--profile 'fast'"):
        profile_settings("fast", gptoss, 10)


def test_the_drafter_attention_backend_per_gpu_family():
    from dflash_trt.stacks.trtllm.profiles import drafter_attention_backend, profile_settings
    tcfg = get_preset("gpt-oss-120b").config()
    kw = dict(target_cfg=tcfg, drafter_path="d", block_size=10, mask_token_id=200000, zlab_ids=[1, 9, 17, 25, 33],
              tp=2, ep=2, pp=1, kv_cache="fp8")
    for arch, backend in (("hopper", "FA4"), ("blackwell", "TRTLLM")):
        cfg = trtllm_serve_config(arch=arch, profile=profile_settings("throughput", tcfg, 10),
                                  drafter_attention_backend=drafter_attention_backend(arch), **kw)
        assert cfg["speculative_config"]["attention_backend"] == backend
        assert cfg["enable_attention_dp"] is True and cfg["stream_interval"] == 20
        assert cfg["max_batch_size"] == cfg["cuda_graph_config"]["max_batch_size"] == 720
