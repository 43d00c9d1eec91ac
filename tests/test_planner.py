"""Capacity planner: parameter counts against transformers' own models (built on the meta device,
no weights) and the published gpt-oss figures; weight bytes by format against the checkpoint
formats' tensor shapes; KV bytes per token computed by hand; layouts and their reasons."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import catalog, get_hardware
from dflash_trt.plan import cost, planner

from helpers import run_cli


def preset(name):
    return planner.target_configs(name)


def hf_param_count(cfg: dict) -> int:
    """transformers' model for the config, on the meta device: the independent oracle."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = {k: v for k, v in cfg.items() if k != "quantization_config"}
    hc = AutoConfig.for_model(c.pop("model_type"), **c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hc)
    return sum(p.numel() for p in model.parameters())


def test_gpt_oss_120b_published_figures():
    _, cfg, dcfg = preset("gpt-oss-120b")
    p = planner.plan(cfg, dcfg, "dgx-b300", target_name="gpt-oss-120b")
    # OpenAI's model card: 116.8 B total, 5.1 B active per token (within 2%).
    assert abs(p.total_params / 116.8e9 - 1) < 0.02
    assert abs(p.active_params / 5.1e9 - 1) < 0.02
    # By hand from config.json: per layer attention (q/k/v/o + biases + sinks), router (+bias),
    # 128 experts of gate_up [2I, H] + down [H, I] + biases, 2 norms; embed + lm_head + final norm.
    H, I, E, L, V = 2880, 2880, 128, 36, 201088
    attn = H * 4096 * 2 + H * 512 * 2 + 4096 + 512 * 2 + H + 64
    layer = attn + H * E + E + E * (3 * H * I + 2 * I + H) + 2 * H
    assert p.total_params == L * layer + 2 * V * H + H == 116_829_156_672
    active = L * (attn + H * E + E + 4 * (3 * H * I + 2 * I + H) + 2 * H) + V * H + H
    assert p.active_params == active


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b", "qwen3-8b", "llama-3.1-8b", "smollm2-135m"])
def test_total_params_match_transformers(name):
    _, cfg, _ = preset(name)
    assert planner.target_shape(cfg, name).total_params == hf_param_count(cfg)


@pytest.mark.parametrize("name", ["qwen3-8b", "gpt-oss-120b"])
def test_drafter_params_match_the_reference_drafter(name):
    from dflash_trt.models.config import DrafterConfig
    from dflash_trt.models.drafter import DFlashDrafter

    _, _, dcfg = preset(name)
    with torch.device("meta"):
        ref = DFlashDrafter(DrafterConfig.from_dict(dcfg), max_len=64)
    assert planner.drafter_shape(dcfg).total_params == sum(p.numel() for p in ref.parameters())


def test_gpt_oss_120b_drafter_matches_published_size():
    _, _, dcfg = preset("gpt-oss-120b")
    n = planner.drafter_shape(dcfg).total_params
    assert abs(n / 0.78e9 - 1) < 0.02                               # "about 0.78 B parameters"
    assert abs(cost.weight_bytes(planner.drafter_shape(dcfg), "none") / 2**30 - 1.46) < 0.01   # "1.46 GiB"


def test_mxfp4_weight_bytes_follow_the_checkpoint_tensors():
    _, cfg, _ = preset("gpt-oss-120b")
    H, I, E, L = 2880, 2880, 128, 36
    # gate_up_proj_blocks uint8 [E, 2I, H/32, 16] + scales [E, 2I, H/32]; down_proj [E, H, I/32, 16] + scales
    experts = L * (E * 2 * I * (H // 32) * 17 + E * H * (I // 32) * 17)
    bf16 = 2 * (planner.target_shape(cfg).total_params - L * E * 3 * H * I)
    assert cost.weight_bytes(planner.target_shape(cfg), "mxfp4") == experts + bf16


def test_nvfp4_and_fp8_weight_bytes_by_hand():
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
    s = planner.target_shape(cfg)
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)      # q,o + k,v + gate,up,down per layer
    other = 2 * 100 * 64 + 2 * 2 * 64 + 64                        # embed, lm_head, norms
    n_linear = 2 * 7
    assert cost.weight_bytes(s, "none") == 2 * (linear + other)
    assert cost.weight_bytes(s, "fp8") == linear + 8 * n_linear + 2 * other
    # NVFP4: two E2M1 values per byte + one FP8 scale per 16 values, fp32 scale_2 and input_scale
    assert cost.weight_bytes(s, "nvfp4") == linear // 2 + linear // 16 + 8 * n_linear + 2 * other


def test_kv_bytes_per_token_by_hand():
    _, cfg, dcfg = preset("qwen3-8b")
    p = planner.plan(cfg, dcfg, "hgx-h200", quant="fp8", kv_cache="bf16", max_seq_len=8192)
    # Qwen3-8B: 36 layers × (K + V) × 8 KV heads × 128 × 2 bytes; drafter 5 layers alike.
    assert p.kv_bytes_per_token["target"] == 36 * 2 * 8 * 128 * 2 == 147456
    assert p.kv_bytes_per_token["drafter"] == 5 * 2 * 8 * 128 * 2 == 20480
    # gpt-oss-120b with FP8 KV and no max_attention_window: TensorRT-LLM sizes all 36 layers for
    # the whole sequence, sliding-window layers included.
    _, cfg, dcfg = preset("gpt-oss-120b")
    p = planner.plan(cfg, dcfg, "dgx-b300")
    assert p.quant == {"target": "mxfp4", "kv_cache": "fp8", "drafter": "none"}
    assert p.kv_bytes_per_token["target"] == 36 * 2 * 8 * 64 == 36864
    assert "target_sliding_window" not in p.kv_bytes_per_token
    assert p.kv_bytes_per_token["drafter"] == 8 * 2 * 8 * 64 == 8192
    # With per-layer windows [128, 131072] (repeated: sliding, full, ...): 18 layers keep 128 + block.
    p = planner.plan(cfg, dcfg, "dgx-b300", max_attention_window=[128, 131072])
    assert p.kv_bytes_per_token["target"] == 18 * 2 * 8 * 64 == 18432
    assert p.kv_bytes_per_token["target_sliding_window"] == {"layers": 18, "tokens_kept": [128 + 10],
                                                             "bytes_per_token": 18432}


def test_kv_tokens_of_one_layout_by_hand():
    _, cfg, dcfg = preset("qwen3-8b")
    p = planner.plan(cfg, dcfg, "hgx-h200", quant="fp8", kv_cache="fp8", max_seq_len=8192, tp=1)
    (lay,) = p.layouts
    assert (lay.tp, lay.ep, lay.replicas) == (1, 1, 8)
    per_tok = (36 + 5) * 2 * 8 * 128 * 1                 # fp8 target + drafter, one GPU holds all heads
    fixed = lay.weights_bytes_per_gpu + lay.drafter_bytes_per_gpu + lay.activation_bytes_per_gpu + 3 * 2**30
    budget = int((143771 * 2**20 - fixed) * 0.9)        # the H200's own total: 143,771 MiB
    assert lay.kv_tokens == budget // per_tok
    assert lay.kv_sequences == budget // (8192 * per_tok)
    assert lay.max_sequences == min(lay.kv_sequences, 128)             # max_batch_size
    # KV heads are split by tp, and duplicated past 8 KV heads.
    assert cost.kv_bytes_per_token(planner.target_shape(cfg), "fp8", tp=4) == 36 * 2 * 2 * 128
    assert cost.kv_bytes_per_token(planner.target_shape(cfg), "fp8", tp=16) == 36 * 2 * 1 * 128


def test_layouts_ranked_and_rejections_explained():
    _, cfg, dcfg = preset("gpt-oss-120b")
    p = planner.plan(cfg, dcfg, "hgx-h100", quant="none")       # BF16 gpt-oss: ~218 GiB of weights
    assert (p.chosen.tp, p.chosen.ep, p.chosen.replicas) == (8, 1, 1)
    tp1 = [l for l in p.layouts if l.tp == 1]
    assert tp1 and not tp1[0].fits and tp1[0].reason.startswith("does not fit: weights")
    assert all(l.fits for l in p.layouts[: sum(l.fits for l in p.layouts)])   # fitting ones first
    # The 9-head embedded target only splits 1 way.
    _, cfg, _ = preset("smollm2-135m")
    p = planner.plan(cfg, None, "dgx-b200")
    assert [(l.tp, l.fits) for l in p.layouts][0] == (1, True)
    assert any("does not divide the 9 attention heads" in l.reason for l in p.layouts)


def test_objectives():
    _, cfg, dcfg = preset("gpt-oss-120b")
    lat = planner.plan(cfg, dcfg, "dgx-b300", objective="latency")
    thr = planner.plan(cfg, dcfg, "dgx-b300", objective="throughput")
    assert (lat.chosen.tp, lat.chosen.ep) == (8, 1)             # TensorRT-LLM's latency recipe: TP8 / EP1
    best = max(l.max_sequences * l.replicas for l in thr.layouts if l.fits)
    assert thr.chosen.max_sequences * thr.chosen.replicas == best
    # Two DGX B300 nodes: a replica inside one NVLink domain beats TP 16 across nodes for latency.
    two = planner.plan(cfg, dcfg, "dgx-b300", nodes=2)
    assert (two.chosen.tp, two.chosen.replicas) == (8, 2)
    assert not next(l for l in two.layouts if l.tp == 16).within_nvlink_domain


def test_tp_sizes_are_powers_of_two():
    _, cfg, dcfg = preset("qwen3-8b")
    p = planner.plan(cfg, dcfg, "dgx-b200", nodes=3)             # 24 GPUs
    assert sorted({l.tp for l in p.layouts}) == [1, 2, 4, 8]
    assert (p.chosen.tp, p.chosen.replicas) == (8, 3)
    _, cfg, _ = preset("smollm2-135m")
    with pytest.raises(DFlashError, match="powers of two"):
        planner.plan(cfg, None, "dgx-b200", nodes=3, tp=3)


def test_impossible_formats_are_refused():
    _, cfg, dcfg = preset("qwen3-8b")
    with pytest.raises(DFlashError, match="no FP4 tensor cores"):
        planner.plan(cfg, dcfg, "hgx-h200", quant="nvfp4")
    assert planner.plan(cfg, dcfg, "hgx-h200").quant["target"] == "fp8"          # auto on Hopper
    assert planner.plan(cfg, dcfg, "dgx-b200").quant["target"] == "nvfp4"        # auto on Blackwell
    _, cfg, _ = preset("gpt-oss-120b")
    with pytest.raises(DFlashError, match="MXFP4 experts only"):
        planner.plan(cfg, None, "dgx-b300", quant="nvfp4")
    with pytest.raises(DFlashError, match="max-seq-len"):
        planner.plan(cfg, None, "dgx-b300", max_seq_len=10**7)


def test_hardware_catalog():
    c = catalog()
    assert set(c) == {"dgx-b300", "dgx-b200", "gb200-nvl72", "hgx-h200", "hgx-h100"}
    b300 = get_hardware("dgx-b300")
    assert (b300.memory_bytes, b300.sm, b300.gpus_per_node, b300.fp4) == (288e9, "sm_103", 8, True)
    # The planner sizes against what the GPU reports (nvidia-smi memory.total, MiB), shown in GiB.
    assert get_hardware("hgx-h100").reported_memory_bytes == 81559 * 2**20
    p = planner.plan(preset("qwen3-8b")[1], None, "hgx-h100")
    assert p.gpu_memory_bytes == 81559 * 2**20 and "8 GPUs of 79.6 GiB" in planner.format_plan(p)
    assert b300.nvlink_bytes_per_s == 1.8e12
    assert not get_hardware("hgx-h200").fp4 and get_hardware("hgx-h200").fp8
    assert get_hardware("gb200-nvl72").nvlink_domain_gpus == 72
    with pytest.raises(DFlashError, match="unknown hardware"):
        get_hardware("dgx-a100")


def test_plan_cli_json():
    code, out, _ = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("total_params", "active_params", "weights_bytes_per_gpu", "kv_bytes_per_token", "layouts", "chosen"):
        assert key in d
    assert set(d["kv_bytes_per_token"]) >= {"target", "drafter"}
    assert set(d["weights_bytes_per_gpu"]) >= {"target", "drafter"}
    for lay in d["layouts"]:
        assert {"tp", "ep", "replicas", "fits", "kv_tokens", "reason"} <= set(lay)
    assert d["chosen"] == d["layouts"][0]
    assert d["weights_bytes_per_gpu"]["target"] == d["chosen"]["weights_bytes_per_gpu"]


def test_plan_cli_folder_and_errors(tmp_path):
    _, cfg, dcfg = preset("qwen3-8b")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(dcfg))
    code, out, _ = run_cli("plan", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                           "--hardware", "hgx-h100", "--max-seq-len", "4096")
    assert code == 0 and "chosen: tp 8" in out and "drafter d:" in out
    code, _, err = run_cli("plan", "--target", "qwen3-8b", "--hardware", "hgx-h100", "--quant", "nvfp4")
    assert code == 1 and err.startswith("error: --quant nvfp4") and "Traceback" not in err
    code, _, err = run_cli("plan", "--target", str(tmp_path / "missing"), "--hardware", "hgx-h100")
    assert code == 1 and "neither a preset" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{nope")
    code, _, err = run_cli("plan", "--target", str(tmp_path / "bad"), "--hardware", "hgx-h100")
    assert code == 1 and "invalid JSON" in err


def test_sliding_window_saving_by_hand():
    """gpt-oss-120b TP 8 on B300 (FP8 KV): 1 KV head per GPU. With max_attention_window the 18
    windowed layers hold 128 + 10 tokens per sequence, the 18 others and the drafter's 8 grow with it."""
    _, cfg, dcfg = preset("gpt-oss-120b")
    lay = planner.plan(cfg, dcfg, "dgx-b300", tp=8, ep=1, max_attention_window=[128, 131072]).layouts[0]
    per_layer = 2 * 1 * 64 * 1
    per_tok = 18 * per_layer + 8 * per_layer
    per_seq = 32768 * per_tok + 18 * per_layer * (128 + 10)
    assert lay.kv_bytes_per_token_per_gpu == per_tok
    assert lay.kv_sequences == lay.kv_budget_bytes_per_gpu // per_seq
    full = planner.plan(cfg, dcfg, "dgx-b300", tp=8, ep=1).layouts[0]
    assert full.kv_sequences == full.kv_budget_bytes_per_gpu // (32768 * (36 + 8) * per_layer)
    assert lay.kv_sequences > 1.6 * full.kv_sequences


def test_max_batch_size_caps_concurrency_so_throughput_prefers_replicas():
    _, cfg, dcfg = preset("qwen3-8b")
    # Without a real cap the KV cache decides: one TP 8 replica holds the most sequences. (Without
    # the drafter: its draft-context buffer, per rank, is a cap of its own, tested below.)
    free = planner.plan(cfg, None, "dgx-b300", objective="throughput", max_batch_size=100000)
    assert (free.chosen.tp, free.chosen.replicas) == (8, 1)
    # TensorRT-LLM's max_batch_size 128 caps each replica: 8 × TP 1 gives more batch slots.
    capped = planner.plan(cfg, dcfg, "dgx-b300", objective="throughput", max_batch_size=128)
    assert all(l.max_sequences <= 128 for l in capped.layouts)
    assert (capped.chosen.tp, capped.chosen.replicas) == (1, 8)
    assert "max_batch_size; the KV cache holds" in next(l for l in capped.layouts if l.tp == 8).reason


@pytest.mark.parametrize("args,message", [
    (["--nodes", "1000000000"], "--nodes 1000000000: must be in [1, 1024]"),
    (["--nodes", "0"], "--nodes 0: must be in [1, 1024]"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0: must be in [1, 16]"),
    (["--gpus-per-node", "1000"], "--gpus-per-node 1000: must be in [1, 16]"),
    (["--max-batch-size", "0"], "max_batch_size 0"),
    (["--max-attention-window", "128,x"], "--max-attention-window '128,x'"),
])
def test_plan_counts_are_bounded(args, message):
    code, out, err = run_cli("plan", "--target", "qwen3-8b", "--hardware", "dgx-b300", *args)
    assert code == 1 and message in err and not out and "Traceback" not in err


def test_the_draft_context_buffer_per_rank():
    """gpt-oss-120b on a DGX B300 at the default layout (TP 8, the latency profile's max_batch_size
    64): the buffer TensorRT-LLM's DFlashWorker allocates per rank (64 x 32768 x (2880 bf16 + int64
    position)) and the budget PR #19466 checks it against, formula by formula."""
    from dflash_trt.stacks.trtllm.budget import GIB
    _, cfg, dcfg = preset("gpt-oss-120b")
    p = planner.plan(cfg, dcfg, "dgx-b300", profile="latency", kv_fraction=0.85)
    c = p.chosen
    assert (c.tp, c.ep, c.max_batch_size, c.attention_dp) == (8, 1, 64, False)
    assert c.draft_context_bytes_per_gpu == 64 * (32768 * (2880 * 2 + 8) + 16)
    free = planner.get_hardware("dgx-b300").reported_memory_bytes - c.weights_bytes_per_gpu - c.drafter_bytes_per_gpu - 4 * GIB
    assert c.draft_context_budget_bytes_per_gpu == int(0.70 * (1 - 0.85) * free)
    assert "DFlash draft context 11.3 GiB per rank (budget 27.0 GiB), max_batch_size 64" in planner.format_plan(p)


def test_a_pinned_max_batch_size_over_the_draft_context_budget_does_not_fit():
    _, cfg, dcfg = preset("gpt-oss-120b")
    free = planner.plan(cfg, dcfg, "dgx-b300", tp=8, ep=1, max_batch_size=512)
    assert free.chosen.max_batch_size < 512 and "(not 512): the DFlash draft context" in free.chosen.reason
    pinned = planner.plan(cfg, dcfg, "dgx-b300", tp=8, ep=1, max_batch_size=512, batch_pinned=True)
    assert pinned.chosen is None
    assert "DFlash draft-context buffer 90.1 GiB per rank" in pinned.layouts[0].reason
    assert f"max_batch_size {free.chosen.max_batch_size} fits" in pinned.layouts[0].reason


def test_the_throughput_profile_picks_the_curated_layout_with_attention_dp():
    """gpt-oss-120b-throughput.yaml: TP 2 x EP 2 with attention DP; each rank holds whole KV heads
    and schedules its own batch, so a replica holds tp x the per-rank sequences."""
    _, cfg, dcfg = preset("gpt-oss-120b")
    p = planner.plan(cfg, dcfg, "dgx-b300", profile="throughput")
    c = p.chosen
    assert (c.tp, c.ep, c.attention_dp, p.objective) == (2, 2, True, "throughput")
    shape = planner.target_shape(cfg)
    assert c.kv_bytes_per_token_per_gpu == cost.kv_bytes_per_token(shape, "fp8", 1) + cost.kv_bytes_per_token(
        planner.drafter_shape(dcfg), "fp8", 1)
    assert c.max_sequences == 2 * min(c.kv_sequences // 2, c.max_batch_size)
    assert c.max_batch_size < 720 and "attention DP" in c.reason
