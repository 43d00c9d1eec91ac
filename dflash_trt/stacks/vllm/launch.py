"""vLLM's DFlash launch: configs/vllm.json (`vllm serve ... --speculative-config`) and the same
engine as vLLM's (Async)EngineArgs keys for Triton's vllm model. Rules read from vllm 0.33.0
(PyPI wheel): vllm/config/speculative.py, vllm/engine/arg_utils.py.
"""
from __future__ import annotations

import json
import shlex

from dflash_trt.stacks.layer_ids import zlab_to_vllm

CHECKED_AGAINST = "vllm 0.33.0 (PyPI wheel): vllm/config/speculative.py"
KV_CACHE_FP8 = "fp8"   # --kv-cache-dtype
# What vLLM drafts from: its DFlash drafter reads config.json and *.safetensors only (not our
# draft_vocab.json); a vocabulary it does read is EAGLE-3's draft_vocab_size + d2t (stacks/vllm/drafter.py).
VLLM_FULL_VOCAB = ("vLLM drafts over the full vocabulary: it reads the drafter's config.json and *.safetensors, "
                   "not draft_vocab.json (lossless either way: the target verifies every token)")
VLLM_DRAFT_VOCAB = ("vLLM drafts over the draft vocabulary ({n} tokens): {path} holds the drafter with "
                    "draft_vocab_size and d2t, vLLM's own form of it (stacks/vllm/drafter.py)")


def vllm_speculative_config(*, drafter_path: str, block_size: int, tp: int) -> dict:
    """The JSON value of `vllm serve --speculative-config`. vLLM takes the layer ids and the mask
    token from the drafter's config.json, so they are not (and may not be) keys here."""
    cfg = {"method": "dflash", "model": drafter_path, "num_speculative_tokens": block_size - 1}
    if tp > 1:
        cfg["draft_tensor_parallel_size"] = tp
    return cfg


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
        args += ["--kv-cache-dtype", KV_CACHE_FP8]
    argv = ["vllm", "serve", target_path, *args, "--speculative-config", json.dumps(spec, separators=(",", ":"))]
    spec_anywhere = json.dumps({**spec, "model": f"${{BUNDLE}}/{drafter_path}"}, separators=(",", ":"))
    anywhere = (f'vllm serve "${{BUNDLE}}/{target_path}" {shlex.join(args)} --speculative-config '
                + '"' + spec_anywhere.replace('"', '\\"') + '"')
    # the same engine, as vLLM's (Async)EngineArgs keys: Triton's vllm model.json (stacks/tritonserver/repo.py)
    engine_args = {"model": target_path, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                   **({"dtype": dtype} if dtype else {}), **({"enable_expert_parallel": True} if ep > 1 else {}),
                   **({"kv_cache_dtype": KV_CACHE_FP8} if kv_cache == "fp8" else {}),
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


def vllm_drafter_problems(dcfg) -> list[str]:
    """vllm/model_executor/models/qwen3_dflash2.py DFlash2Qwen3DecoderLayer / DFlash2Qwen3Model read
    int(draft_config["conv_kernel_size"]) etc. from hf_config.dflash_config only (KeyError otherwise)."""
    if dcfg.kind != "dflash2":
        return []
    dc = dcfg.raw.get("dflash_config") if isinstance(dcfg.raw.get("dflash_config"), dict) else {}
    missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in dc]
    if missing:
        return [(f"vLLM's DFlash2 (qwen3_dflash2.py) reads {', '.join(missing)} from dflash_config only; "
                 "this drafter sets them at the top level")]
    return []


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
