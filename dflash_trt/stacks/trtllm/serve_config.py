"""TensorRT-LLM's DFlash serving config: the YAML of `trtllm-serve <target> --config` (LLM-API
arguments; the same keys go into Triton's llmapi model.yaml), by TensorRT-LLM's own rules
(tests/upstream_trtllm.py holds the contract; docs/layer-ids.md the layer numbering), and the draft
schedule in DFlashDecodingConfig's own controls (trtllm_draft_schedule, its sources cited above it).
"""
from __future__ import annotations

from dflash_trt.stacks.base import non_causal_windowed

CHECKED_AGAINST = ("NVIDIA/TensorRT-LLM main: tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412, "
                   "tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4")
# KvCacheConfig.dtype names ("auto", "fp8", ...)
KV_CACHE_FP8 = "fp8"
# kv_cache_config.free_gpu_memory_fraction we write (NVIDIA's curated configs use 0.9): what the KV
# pool leaves is where TensorRT-LLM puts the DFlash draft-context buffer (stacks/trtllm/budget.py).
TRTLLM_KV_FRACTION = 0.85


def max_attention_window(target_cfg: dict, max_seq_len: int) -> list[int] | None:
    """TensorRT-LLM KvCacheConfig.max_attention_window, one entry per layer, for targets with
    per-layer sliding windows (gpt-oss: layer_types "sliding_attention" + sliding_window)."""
    types, window = target_cfg.get("layer_types"), target_cfg.get("sliding_window")
    if not types or not window or "sliding_attention" not in types:
        return None
    return [min(int(window), max_seq_len) if t == "sliding_attention" else max_seq_len for t in types]


def trtllm_serve_config(*, target_cfg: dict, drafter_path: str, block_size: int, mask_token_id: int,
                        zlab_ids: list[int], tp: int, ep: int, pp: int, kv_cache: str, arch: str,
                        max_batch_size: int = 64, max_seq_len: int | None = None, profile: dict | None = None,
                        drafter_attention_backend: str | None = None) -> dict:
    """The YAML given to `trtllm-serve <target> --config trtllm-serve.yaml` (LLM-API arguments;
    the same keys go into Triton's llmapi model.yaml). `profile`: profiles.profile_settings
    (NVIDIA's curated latency / throughput settings); `drafter_attention_backend`: VANILLA, TRTLLM
    or FA4 (profiles.DRAFTER_ATTENTION_BACKEND per GPU family)."""
    profile = profile or {}
    max_batch_size = profile.get("max_batch_size", max_batch_size)
    max_seq_len = max_seq_len or min(int(target_cfg.get("max_position_embeddings", 8192)), 32768)
    kv_cfg = {"free_gpu_memory_fraction": TRTLLM_KV_FRACTION, "dtype": KV_CACHE_FP8 if kv_cache == "fp8" else "auto"}
    if window := max_attention_window(target_cfg, max_seq_len):
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
        # mounts the Prometheus page /prometheus/metrics with the spec-decode counters (Stack.metrics)
        "return_perf_metrics": True,
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
    if target_cfg.get("num_local_experts") or target_cfg.get("num_experts"):
        # TensorRT-LLM's curated gpt-oss configs: TRTLLM MoE kernels on Blackwell, Triton's on Hopper.
        cfg["moe_config"] = {"backend": "TRTLLM" if arch == "blackwell" else "TRITON"}
    return cfg


# Its draft-length controls (Stack.draft_schedule_*), read from the source: DecodingBaseConfig.max_concurrency
# (PositiveInt: no speculation above it) and draft_len_schedule ({largest batch size: length}, 0 above the
# largest key; validate_draft_len_schedule_and_sort: keys >= 1, lengths in [0, max_draft_len], the smallest key's
# length == max_draft_len; the two mutually exclusive). support_dynamic_draft_len() includes is_dflash(), so each
# DFlash step drafts runtime_draft_len from the schedule (speculative/utils.py get_draft_len_for_batch_size).
DRAFT_SCHEDULE_SOURCE = ("NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py @ fcd3f31682808ae5 (DecodingBaseConfig."
                         "max_concurrency, draft_len_schedule and their validators), tensorrt_llm/_torch/speculative/"
                         "interface.py @ 00b6d5a25c30b438 (support_dynamic_draft_len includes DFlash), release "
                         "1.4.0rc1 DFlashDecodingConfig reference page")


def trtllm_draft_schedule(ranges: list[tuple[int, int, int]]) -> tuple[dict, str | None]:
    """(speculative_config fields, None) for a schedule's ranges (first, last, k), or ({}, why TensorRT-LLM's
    control cannot say it). A cutoff (the full draft, then none) is max_concurrency; anything else is
    draft_len_schedule keyed by each range's last concurrency (the trailing k = 0 range is implicit: above the
    largest key TensorRT-LLM drafts 0). max_draft_len is the first range's k: the validator wants the smallest
    key's length to equal it, and every other length at most it."""
    ks = [k for _, _, k in ranges]
    if ks[0] == 0:
        return {}, "the schedule drafts nothing even at concurrency 1 (max_draft_len must be > 0): serve without DFlash"
    if max(ks) > ks[0]:
        return {}, (f"the schedule drafts {ks[0]} at concurrency 1 and {max(ks)} later; TensorRT-LLM's "
                    "draft_len_schedule needs its smallest key at max_draft_len and every length at most that "
                    "(llm_args.py validate_draft_len_schedule_and_sort)")
    body = ranges[:-1] if ks[-1] == 0 else ranges
    fields: dict = {"max_draft_len": ks[0]}
    if ks[-1] == 0 and all(k == ks[0] for _, _, k in body):
        fields["max_concurrency"] = body[-1][1]
    else:
        fields["draft_len_schedule"] = {last: k for _, last, k in body}
    return fields, None


def trtllm_drafter_options(dcfg) -> dict:
    """Keys added to TensorRT-LLM's speculative_config for this drafter. DFlashDecodingConfig
    .attention_backend ("VANILLA" | "TRTLLM", default VANILLA; tests/upstream_trtllm.py): the TRTLLM
    drafter backend is rejected for non-causal sliding-window layers (NVIDIA/TensorRT-LLM#19159,
    "non-causal SWA is unsupported"), so such drafters pin VANILLA (FlashAttention with a symmetric
    window, NVIDIA/TensorRT-LLM#17935)."""
    return {"attention_backend": "VANILLA"} if non_causal_windowed(dcfg) else {}
