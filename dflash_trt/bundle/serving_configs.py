"""Serving configurations for the three stacks that run DFlash natively: TensorRT-LLM
(`trtllm-serve --config`), vLLM (`--speculative-config`) and SGLang (launch arguments).

The one thing that silently goes wrong between stacks is the numbering of the target layers
whose hidden states feed the drafter (docs/layer-ids.md). A wrong id does not fail: it only drops
acceptance. So every convention is one function below, each pinned to the code that defines it:

- z-lab / TensorRT-LLM: `dflash_config.target_layer_ids`, 0-based decoder-layer OUTPUTS
  (feature i = HF `hidden_states[i + 1]`). TensorRT-LLM's `DFlashDecodingConfig.target_layer_ids`
  takes the same numbers (docs/layer-ids.md).
- vllm-project/speculators: `aux_hidden_state_layer_ids` count hidden-state indices, 0 = the
  embeddings, so they are z-lab + 1 (speculators `convert/dflash` converter and its test
  `tests/unit/convert/test_dflash_converter.py`: [1,9,17,25,33] -> [2,10,18,26,34]).
- vLLM: reads the drafter's config.json. `get_eagle3_aux_layers_from_config`
  (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) takes `eagle_aux_hidden_state_layer_ids`
  as they are, else `[i + 1 for i in dflash_config.target_layer_ids]` ("Add 1 to convert DFlash's
  aux layer id semantics"); its target models collect the aux state at the ENTRY of layer idx.
  So the ids vLLM runs with are z-lab + 1.
- SGLang: `parse_dflash_draft_config` (python/sglang/srt/speculative/dflash_utils.py) reads the
  0-based `dflash_config.target_layer_ids` and checks 0 <= id < num_target_layers; the target's
  `set_dflash_layers_to_capture` then captures "before layer id + 1". So SGLang expects the
  z-lab numbers in the config (a speculators-format id maps to it with -1); the capture points
  it derives are listed separately as `capture_before_layer`.
"""
from __future__ import annotations

import json
import shlex

from dflash_trt.errors import DFlashError

# ------------------------------------------------------------------------ each stack's rules
# The versions every rule below was read from (tests/upstream_contract.py holds the full
# contract; tests/test_stack_conformance.py runs vLLM's and SGLang's own code on our files).
STACKS = ("trtllm", "vllm", "sglang")
STACK_NAMES = {"trtllm": "TensorRT-LLM", "vllm": "vLLM", "sglang": "SGLang"}
CHECKED_AGAINST = {
    "trtllm": "NVIDIA/TensorRT-LLM main: tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412, "
              "tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4",
    "vllm": "vllm 0.33.0 (PyPI wheel): vllm/config/speculative.py",
    "sglang": "sglang 0.5.23 (PyPI wheel): sglang/srt/arg_groups/speculative_hook.py, sglang/srt/models/dflash.py",
}
# KV-cache dtype names: TensorRT-LLM KvCacheConfig.dtype ("auto", "fp8", ...); vLLM --kv-cache-dtype
# ("fp8"); SGLang --kv-cache-dtype choices ("fp8_e4m3", "fp8_e5m2", ...; no bare "fp8").
KV_CACHE_FP8 = {"trtllm": "fp8", "vllm": "fp8", "sglang": "fp8_e4m3"}
# Why a stack cannot load an FP8 drafter (vLLM can: its DFlash drafter builds every linear,
# fc included, with the draft quant_config: vllm/model_executor/models/qwen3_dflash.py).
FP8_DRAFTER_REFUSED = {
    "trtllm": "TensorRT-LLM's DFlash drafter loader (DFlashForCausalLM.load_weights, "
              "tensorrt_llm/_torch/models/modeling_dflash.py) builds fc as torch.nn.Linear in fc.weight's dtype, "
              "drops fc.weight_scale and slices qkv_proj.weight with no scales; nn.Linear(dtype=float8_e4m3fn) "
              "raises NotImplementedError",
    "sglang": "SGLang's DFlash drafter (sglang/srt/models/dflash.py DFlashDraftModel) has "
              "supports_quantization = False and builds fc as a plain Linear",
}


def stack_layout_problems(stack: str, *, tp: int, pp: int, block_size: int) -> list[str]:
    """The stack's DFlash rules this layout breaks (empty: the stack can serve it)."""
    if stack == "trtllm":
        # DFlashDecodingConfig: max_draft_len (NonNegativeInt) = B - 1 drafted tokens per step
        return [] if block_size - 1 > 0 else [f"max_draft_len = {block_size - 1}: must be > 0"]
    if stack == "sglang":
        # sglang/srt/arg_groups/speculative_hook.py _handle_dflash
        out = []
        if pp != 1:
            out.append(f"--pp {pp}: SGLang's _handle_dflash raises \"Currently DFLASH speculative decoding only "
                       "supports pp_size == 1\"")
        if block_size <= 0:
            out.append(f"block size {block_size}: --speculative-dflash-block-size must be positive")
        return out
    if stack == "vllm":
        # vllm/config/speculative.py: num_speculative_tokens Field(gt=0); _verify_and_get_draft_tp
        # accepts 1 or the target's tensor_parallel_size (we write the target's)
        return [] if block_size - 1 > 0 else [f"num_speculative_tokens = {block_size - 1}: must be > 0"]
    raise DFlashError(f"unknown serving stack {stack!r}: expected one of {', '.join(STACKS)}")


def fp8_drafter_problem(stack: str) -> str | None:
    return FP8_DRAFTER_REFUSED.get(stack)


def max_attention_window(target_cfg: dict, max_seq_len: int) -> list[int] | None:
    """TensorRT-LLM KvCacheConfig.max_attention_window, one entry per layer, for targets with
    per-layer sliding windows (gpt-oss: layer_types "sliding_attention" + sliding_window)."""
    types, window = target_cfg.get("layer_types"), target_cfg.get("sliding_window")
    if not types or not window or "sliding_attention" not in types:
        return None
    return [min(int(window), max_seq_len) if t == "sliding_attention" else max_seq_len for t in types]


def zlab_to_speculators(ids: list[int]) -> list[int]:
    return [int(i) + 1 for i in ids]


def speculators_to_zlab(ids: list[int]) -> list[int]:
    out = [int(i) - 1 for i in ids]
    if any(i < 0 for i in out):
        raise DFlashError(f"speculators aux_hidden_state_layer_ids {ids}: 0 is the embedding output, not a decoder layer")
    return out


def zlab_to_vllm(ids: list[int]) -> list[int]:
    """vLLM's aux hidden-state layer ids (what `eagle_aux_hidden_state_layer_ids` must hold)."""
    return [int(i) + 1 for i in ids]


def zlab_to_sglang(ids: list[int]) -> list[int]:
    """SGLang's `dflash_config.target_layer_ids`: the z-lab numbers unchanged."""
    return [int(i) for i in ids]


def sglang_capture_points(ids: list[int]) -> list[int]:
    """The layer indices SGLang's target captures before (`set_dflash_layers_to_capture`)."""
    return [int(i) + 1 for i in ids]


def layer_ids_by_stack(zlab_ids: list[int], num_target_layers: int) -> dict[str, list[int]]:
    ids = [int(i) for i in zlab_ids]
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise DFlashError(f"drafter target_layer_ids {ids}: {bad} outside the target's {num_target_layers} layers")
    return {"zlab": ids, "trtllm": list(ids), "speculators": zlab_to_speculators(ids),
            "vllm": zlab_to_vllm(ids), "sglang": zlab_to_sglang(ids)}


def _is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_local_experts") or cfg.get("num_experts"))


# kv_cache_config.free_gpu_memory_fraction we write (NVIDIA's curated configs use 0.9): what the KV
# pool leaves is where TensorRT-LLM puts the DFlash draft-context buffer (bundle/dflash_budget.py).
TRTLLM_KV_FRACTION = 0.85


def trtllm_serve_config(*, target_cfg: dict, drafter_path: str, block_size: int, mask_token_id: int,
                        zlab_ids: list[int], tp: int, ep: int, pp: int, kv_cache: str, arch: str,
                        max_batch_size: int = 64, max_seq_len: int | None = None, profile: dict | None = None,
                        drafter_attention_backend: str | None = None) -> dict:
    """The YAML given to `trtllm-serve <target> --config trtllm-serve.yaml` (LLM-API arguments;
    the same keys go into Triton's llmapi model.yaml). `profile`: serving_profiles.profile_settings
    (NVIDIA's curated latency / throughput settings); `drafter_attention_backend`: VANILLA, TRTLLM
    or FA4 (serving_profiles.DRAFTER_ATTENTION_BACKEND per GPU family)."""
    profile = profile or {}
    max_batch_size = profile.get("max_batch_size", max_batch_size)
    max_seq_len = max_seq_len or min(int(target_cfg.get("max_position_embeddings", 8192)), 32768)
    kv_cfg = {"free_gpu_memory_fraction": TRTLLM_KV_FRACTION, "dtype": KV_CACHE_FP8["trtllm"] if kv_cache == "fp8" else "auto"}
    window = max_attention_window(target_cfg, max_seq_len)
    if window:
        kv_cfg["max_attention_window"] = window
    cfg = {
        "backend": "pytorch",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "moe_expert_parallel_size": ep,
        "enable_attention_dp": bool(profile.get("enable_attention_dp", False)),
        "max_batch_size": max_batch_size,
        "max_num_tokens": profile.get("max_num_tokens", 8192),
        "max_seq_len": max_seq_len,
        "kv_cache_config": kv_cfg,
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": max_batch_size},
        # iteration stats (waiting requests, KV-cache blocks) for trtllm-serve's /metrics and the
        # Triton model's dflash_* metrics (LLM.get_stats_async)
        "enable_iter_perf_stats": True,
        "speculative_config": {
            "decoding_type": "DFlash",
            "speculative_model": drafter_path,
            # the drafter fills B-1 mask slots per step; the first slot is the last verified token
            "max_draft_len": block_size - 1,
            "mask_token_id": mask_token_id,
            "target_layer_ids": [int(i) for i in zlab_ids],
        },
    }
    if drafter_attention_backend:
        cfg["speculative_config"]["attention_backend"] = drafter_attention_backend
    for key in ("stream_interval", "num_postprocess_workers", "attention_dp_config"):
        if key in profile:
            cfg[key] = profile[key]
    if _is_moe(target_cfg):
        # TensorRT-LLM's curated gpt-oss configs: TRTLLM MoE kernels on Blackwell, Triton's on Hopper.
        cfg["moe_config"] = {"backend": "TRTLLM" if arch == "blackwell" else "TRITON"}
    return cfg


def vllm_speculative_config(*, drafter_path: str, block_size: int, tp: int) -> dict:
    """The JSON value of `vllm serve --speculative-config`. vLLM takes the layer ids and the mask
    token from the drafter's config.json, so they are not (and may not be) keys here."""
    cfg = {"method": "dflash", "model": drafter_path, "num_speculative_tokens": block_size - 1}
    if tp > 1:
        cfg["draft_tensor_parallel_size"] = tp
    return cfg


# What vLLM drafts from: its DFlash drafter reads config.json and *.safetensors only (not our
# draft_vocab.json); a vocabulary it does read is EAGLE-3's draft_vocab_size + d2t (bundle/vllm_drafter.py).
VLLM_FULL_VOCAB = ("vLLM drafts over the full vocabulary: it reads the drafter's config.json and *.safetensors, "
                   "not draft_vocab.json (lossless either way: the target verifies every token)")
VLLM_DRAFT_VOCAB = ("vLLM drafts over the draft vocabulary ({n} tokens): {path} holds the drafter with "
                    "draft_vocab_size and d2t, vLLM's own form of it (bundle/vllm_drafter.py)")


def vllm_launch(*, target_path: str, drafter_path: str, block_size: int, zlab_ids: list[int], tp: int, ep: int,
                pp: int, kv_cache: str, dtype: str | None = None, draft_vocab_size: int | None = None) -> dict:
    """configs/vllm.json. Paths are relative to the bundle root: `argv` runs from there (as
    `dflash-trt serve --engine vllm` runs it); `command_anywhere` runs from any directory with
    BUNDLE set to the bundle's path. dtype: the target checkpoint's (vLLM's "auto" turns a float32
    checkpoint into bfloat16, another model than the one our runtime proves lossless)."""
    spec = vllm_speculative_config(drafter_path=drafter_path, block_size=block_size, tp=tp)
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if dtype:
        args += ["--dtype", dtype]
    if ep > 1:
        args += ["--enable-expert-parallel"]
    if kv_cache == "fp8":
        args += ["--kv-cache-dtype", KV_CACHE_FP8["vllm"]]
    argv = ["vllm", "serve", target_path, *args, "--speculative-config", json.dumps(spec, separators=(",", ":"))]
    spec_anywhere = json.dumps({**spec, "model": f"${{BUNDLE}}/{drafter_path}"}, separators=(",", ":"))
    anywhere = (f'vllm serve "${{BUNDLE}}/{target_path}" {shlex.join(args)} --speculative-config '
                + '"' + spec_anywhere.replace('"', '\\"') + '"')
    # the same engine, as vLLM's (Async)EngineArgs keys: Triton's vllm model.json (bundle/triton_repo.py)
    engine_args = {"model": target_path, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                   **({"dtype": dtype} if dtype else {}), **({"enable_expert_parallel": True} if ep > 1 else {}),
                   **({"kv_cache_dtype": KV_CACHE_FP8["vllm"]} if kv_cache == "fp8" else {}),
                   "speculative_config": spec}
    return {
        "speculative_config": spec,
        "engine_args": engine_args,
        # what vLLM derives from the drafter's dflash_config (z-lab ids + 1); pin them with
        # this key in the drafter config.json if the drafter is ever re-exported without them
        "eagle_aux_hidden_state_layer_ids": zlab_to_vllm(zlab_ids),
        "dtype": dtype or "auto",
        "draft_vocabulary": (VLLM_DRAFT_VOCAB.format(n=draft_vocab_size, path=drafter_path) if draft_vocab_size
                             else VLLM_FULL_VOCAB),
        "paths": "relative to the bundle root: run argv / command from there, or command_anywhere with BUNDLE set",
        "argv": argv,
        "command": shlex.join(argv),
        "command_anywhere": anywhere,
    }


def sglang_launch(*, target_path: str, drafter_path: str, block_size: int, zlab_ids: list[int], tp: int, ep: int,
                  pp: int, kv_cache: str) -> dict:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", target_path,
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter_path,
            "--speculative-dflash-block-size", str(block_size),
            "--tp-size", str(tp), "--pp-size", str(pp)]
    if ep > 1:
        argv += ["--ep-size", str(ep)]
    if kv_cache == "fp8":
        argv += ["--kv-cache-dtype", KV_CACHE_FP8["sglang"]]
    return {
        "argv": argv,
        "command": shlex.join(argv),
        "dflash_config": {"target_layer_ids": zlab_to_sglang(zlab_ids)},
        "capture_before_layer": sglang_capture_points(zlab_ids),
    }


# ------------------------------------------------------------ drafter kinds and attention variants
# DFlash2 drafters and sliding-window / causal drafter layers (models/config.py layer_attention),
# by each stack's own rules. One function per question; build.resolve_stacks and write_configs call them.
def drafter_stack_problems(stack: str, dcfg) -> list[str]:
    """Why `stack` cannot serve this drafter (empty: it can). dcfg: a models.config.DrafterConfig."""
    if stack == "vllm" and dcfg.kind == "dflash2":
        # vllm/model_executor/models/qwen3_dflash2.py DFlash2Qwen3DecoderLayer / DFlash2Qwen3Model read
        # int(draft_config["conv_kernel_size"]) etc. from hf_config.dflash_config only (KeyError otherwise)
        dc = dcfg.raw.get("dflash_config") if isinstance(dcfg.raw.get("dflash_config"), dict) else {}
        missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in dc]
        if missing:
            return [(f"vLLM's DFlash2 (qwen3_dflash2.py) reads {', '.join(missing)} from dflash_config only; "
                     "this drafter sets them at the top level")]
    if stack == "sglang":
        # sglang 0.5.23 sglang/srt/models/dflash.py `_get_dflash_layer_attention_params` and
        # speculative/dflash_utils.py `get_dflash_attention_sliding_window_size` read only is_causal,
        # layer_types and sliding_window (use_swa / swa_window_size only for Nemotron 3.5 drafters;
        # dflash_config.causal never): a drafter whose window or causality lives in those keys would be
        # served with other attention than it was trained with
        dc = dcfg.raw.get("dflash_config") if isinstance(dcfg.raw.get("dflash_config"), dict) else {}
        types = dcfg.raw.get("layer_types") or []
        causal = dcfg.raw.get("is_causal")
        # no layer_types: every layer full and non-causal (is_causal not read on that path)
        sglang_sees = [(dcfg.raw.get("sliding_window") if t == "sliding_attention" else None,
                        bool(causal) if causal is not None else t == "sliding_attention") for t in types] \
            or [(None, False)] * len(dcfg.layer_attention)
        if sglang_sees != [(w, c) for w, c in dcfg.layer_attention]:
            keys = [k for k in ("use_swa", "swa_window_size", "causal") if k in dc]
            names = ", ".join("dflash_config." + k for k in keys)
            return [(f"SGLang 0.5.23 reads a drafter's attention from is_causal / layer_types / sliding_window only "
                     f"(sglang/srt/models/dflash.py); this drafter sets {names}, which SGLang would ignore")]
    return []


def non_causal_windowed(dcfg) -> bool:
    """Any drafter layer both sliding-window and non-causal (the DFlash2 fixture: all of them)."""
    return any(w is not None and not c for w, c in dcfg.layer_attention)


def trtllm_drafter_options(dcfg) -> dict:
    """Keys added to TensorRT-LLM's speculative_config for this drafter. DFlashDecodingConfig
    .attention_backend ("VANILLA" | "TRTLLM", default VANILLA; tests/upstream_trtllm.py): the TRTLLM
    drafter backend is rejected for non-causal sliding-window layers (NVIDIA/TensorRT-LLM#19159,
    "non-causal SWA is unsupported"), so such drafters pin VANILLA (FlashAttention with a symmetric
    window, NVIDIA/TensorRT-LLM#17935)."""
    return {"attention_backend": "VANILLA"} if non_causal_windowed(dcfg) else {}


def sglang_drafter_args(dcfg) -> list[str]:
    """Extra SGLang launch arguments for this drafter. Non-causal sliding-window layers: the
    trtllm_mha draft backend places every query of the block at its last position and so gives
    the earlier ones a window up to block_size - 1 keys too narrow, silently
    (sgl-project/sglang#35209, open). Pin flashinfer, which takes per-layer windows
    (`--speculative-draft-attention-backend`, choices in sglang 0.5.23 arg_groups/choices.py)."""
    return ["--speculative-draft-attention-backend", "flashinfer"] if non_causal_windowed(dcfg) else []


def vllm_drafter_env(dcfg) -> dict:
    """Environment vLLM needs for this drafter: the V2 model runner, for a drafter mixing sliding
    and full layers (vllm/model_executor/models/qwen3_dflash.py _resolve_layer_attention raises
    NotImplementedError "... relaunch with VLLM_USE_V2_MODEL_RUNNER=1") and for DFlash2 (vllm/config/
    vllm.py: V1 "does not support: DFlash candidate-head drafts", which would otherwise draft as
    DFlash (1) silently; auto-selection falls back to V1 whenever any other feature is V2-unsupported);
    vllm 0.32.0. (V2 needs Triton: vLLM's CPU build cannot serve these drafters.)"""
    n = sum(w is not None for w, _ in dcfg.layer_attention)
    need = dcfg.kind == "dflash2" or 0 < n < len(dcfg.layer_attention)
    return {"VLLM_USE_V2_MODEL_RUNNER": "1"} if need else {}


def drafter_attention_summary(dcfg) -> dict:
    """What each stack is told, and what it resolves, about the drafter's attention (manifest)."""
    return {"kind": dcfg.kind, "layers": [{"sliding_window": w, "causal": c} for w, c in dcfg.layer_attention]}
