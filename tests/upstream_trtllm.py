"""TensorRT-LLM's contract for the files our bundle hands it, written down from its source (no
TensorRT-LLM wheel with DFlash exists on PyPI, and it needs a GPU). Each model and rule names the
upstream file and commit it was read from (repository NVIDIA/TensorRT-LLM):

  LLM_ARGS   tensorrt_llm/llmapi/llm_args.py              @ 0004396720054fd8e205cbf616f21f0b57c6b412
  LLM_ARGS_NEW  the same file @ fcd3f31682808ae56118ae43c1d7864a3a945e6f: DecodingBaseConfig.max_concurrency /
             draft_len_schedule, their validators (the draft schedule, stacks/trtllm/serve_config.py)
  INTERFACE  tensorrt_llm/_torch/speculative/interface.py @ 00b6d5a25c30b4382d24fbdf52956d601b3ffd24
  RC         DFlashDecodingConfig of release 1.4.0rc1 (the newest whose reference page was read:
             https://nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference/DFlashDecodingConfig.html;
             1.4.0rc4's API index exists, its DFlash page was not in the stored docs), and
             BaseLlmArgs / TorchLlmArgs / AttentionDpConfig as stored (llm_args.py @ fcd3f31682808ae5,
             the newest stored copy, and earlier ones)
  DFLASH     tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4
  LLMAPI_PB  triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @ 0a71057313ec0626527e164a8fc0205c5822e2f5
  LLMAPI_PY  triton_backend/all_models/llmapi/tensorrt_llm/1/model.py   @ 044a90d209e380c95e23e8ae42f3583fa05ada78

Upstream's config classes derive from StrictBaseModel (extra="forbid"), so an unknown key is a
load-time error there; the models below forbid extras too. Only the fields our files use, and
the ones next to them, are listed: a field we start writing must be added here from the source.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator, model_validator

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412"
LLM_ARGS_NEW = "tensorrt_llm/llmapi/llm_args.py@fcd3f31682808ae56118ae43c1d7864a3a945e6f"
# SpeculativeDecodingMode.support_dynamic_draft_len() includes is_dflash(): DFlash runs the schedule
INTERFACE = "tensorrt_llm/_torch/speculative/interface.py@00b6d5a25c30b4382d24fbdf52956d601b3ffd24"
DFLASH = "tensorrt_llm/_torch/models/modeling_dflash.py@009d8fa431bd3de92245aab80f8b57dc70da1ac4"
LLMAPI_PB = "triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt@0a71057313ec0626527e164a8fc0205c5822e2f5"
LLMAPI_PY = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d209e380c95e23e8ae42f3583fa05ada78"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # LLM_ARGS: class StrictBaseModel


class DFlashDecodingConfig(Strict):
    """LLM_ARGS: DecodingBaseConfig fields + class DFlashDecodingConfig."""
    # DecodingBaseConfig
    max_draft_len: NonNegativeInt | None = None
    max_total_draft_tokens: int | None = None
    speculative_model: str | None = None  # validation_alias speculative_model | speculative_model_dir
    # LLM_ARGS_NEW (DecodingBaseConfig; types as on RC's reference page): above max_concurrency no speculation;
    # draft_len_schedule {largest batch size: draft length}, 0 above the largest key
    max_concurrency: PositiveInt | None = None
    draft_len_schedule: dict[int, int] | None = None
    load_format: str | None = None
    acceptance_rate_window_size: NonNegativeInt | None = None
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    use_rejection_sampling: bool = False
    enable_penalty: bool = False
    # DFlashDecodingConfig
    # RC (1.4.0rc1): new beside DecodingBaseConfig's fields
    moe_backend: Literal["AUTO", "CUTLASS", "CUTEDSL", "CUTEDSL_FC12", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA",
                         "TRITON", "MARLIN", "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"] | None = None
    allow_advanced_sampling: bool = False
    advanced_sampling_mode: str = "FULL"   # AdvancedSamplingMode (an enum; FULL is its default)
    spec_dec_variant: PositiveInt | None = None
    # DFlashDecodingConfig
    decoding_type: Literal["DFlash"] = "DFlash"
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    context_recompute_tail: int | None = 0                            # RC
    # RC: FA4 added (the SM90 drafter path, PR #18553); 0004396 had VANILLA | TRTLLM
    attention_backend: Literal["VANILLA", "TRTLLM", "FA4"] = "VANILLA"
    # RC: skip the draft-context buffer budget check (PR #19466; stacks/trtllm/budget.py models it)
    skip_ctx_buffer_budget_check: bool = False

    @field_validator("draft_len_schedule")
    @classmethod
    def _schedule(cls, v, info):
        # LLM_ARGS_NEW: DecodingBaseConfig.validate_draft_len_schedule_and_sort
        if v is None:
            return v
        for batch_size, draft_len in v.items():
            if batch_size < 1:
                raise ValueError(f"draft_len_schedule: batch size threshold must be >= 1, got {batch_size}")
            if draft_len < 0:
                raise ValueError(f"draft_len_schedule: draft length must be >= 0, got {draft_len}")
        max_draft_len = info.data.get("max_draft_len")
        smallest = min(v)
        if max_draft_len is not None and v[smallest] != max_draft_len:
            raise ValueError(f"draft_len_schedule[{smallest}] must equal max_draft_len because it is the smallest "
                             f"batch-size key. Got schedule[{smallest}]={v[smallest]}, but max_draft_len={max_draft_len}.")
        if max_draft_len is not None and any(d > max_draft_len for d in v.values()):
            raise ValueError("draft_len_schedule: all draft lengths must be <= max_draft_len")
        return dict(sorted(v.items()))

    @model_validator(mode="after")
    def _one_control(self):
        # LLM_ARGS_NEW: validate_max_concurrency_and_draft_len_schedule_mutually_exclusive
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _draft_len(self):
        # DFlash drafts max_draft_len tokens per step (tokens_per_gen_step = max_draft_len + 1);
        # the other drafting configs of LLM_ARGS (Eagle, NGram, SA, DraftTarget, MTP) raise
        # "max_draft_len must be > 0"; at this commit DFlash's own class does not check it, so 0
        # would silently mean "no speculation": we hold our files to the same > 0 rule.
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for DFlash")
        return self


class KvCacheConfig(Strict):
    """LLM_ARGS: class KvCacheConfig (the fields used and a few beside them)."""
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[PositiveInt] | None = Field(default=None, min_length=1)
    free_gpu_memory_fraction: float | None = Field(default=0.9, ge=0, le=1)
    host_cache_size: int | None = None
    enable_partial_reuse: bool = True
    tokens_per_block: int = 32
    # `dtype: str`; the values its description and telemetry categories list
    dtype: Literal["auto", "float16", "bfloat16", "float32", "fp8", "fp8_ds_mla", "nvfp4"] = "auto"


class CudaGraphConfig(Strict):
    """LLM_ARGS: BaseCudaGraphConfig + DecodeCudaGraphConfig."""
    batch_sizes: list[int] | None = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False
    mode: Literal["decode"] = "decode"


class MoeConfig(Strict):
    """LLM_ARGS: class MoeConfig."""
    # RC adds CUTEDSL_FC12 (DFlashDecodingConfig.moe_backend takes MoeConfig's values)
    backend: Literal["AUTO", "CUTLASS", "CUTEDSL", "CUTEDSL_FC12", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON", "MARLIN",
                     "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"] = "AUTO"
    max_num_tokens: int | None = None


class AttentionDpConfig(Strict):
    """llm_args.py (stored versions): class AttentionDpConfig(StrictBaseModel)."""
    enable_balance: bool = False
    timeout_iters: int = 50
    batching_wait_iters: int = 10
    enable_kv_cache_aware_routing: bool = False     # newest stored copy (fcd3f31)
    kv_cache_routing_load_balance_weight: float = 1.0

    @model_validator(mode="after")
    def _non_negative(self):
        if self.enable_balance and (self.batching_wait_iters < 0 or self.timeout_iters < 0):
            raise ValueError("attention_dp_config.batching_wait_iters / timeout_iters must be >= 0 with enable_balance")
        return self


class TorchLlmArgs(Strict):
    """LLM_ARGS: BaseLlmArgs (extra="forbid") fields we write, plus TorchLlmArgs' cuda_graph_config
    and moe_config. `model` is trtllm-serve's positional argument / model.yaml's `model`."""
    model: str | None = None
    backend: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    moe_expert_parallel_size: int | None = None
    moe_tensor_parallel_size: int | None = None
    enable_attention_dp: bool = False
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    speculative_config: DFlashDecodingConfig | None = None
    max_batch_size: int | None = 2048
    max_input_len: int | None = 1024
    max_seq_len: int | None = None
    max_beam_width: int | None = 1
    max_num_tokens: int | None = 8192
    cuda_graph_config: CudaGraphConfig | None = None
    moe_config: MoeConfig | None = None
    # TorchLlmArgs.enable_iter_perf_stats (bool, default False): read in the stored llm_args.py
    # versions of the index (e.g. TorchLlmArgs "enable_iter_perf_stats: bool = Field(default=False,
    # description='Enable iteration performance statistics.')"), not in the 0004396 pages read
    enable_iter_perf_stats: bool = False
    # BaseLlmArgs.return_perf_metrics (bool, default False, status prototype): read in the stored llm_args.py
    # versions ("return_perf_metrics: bool = Field(default=False, description=\"Return perf metrics.\")");
    # openai_server.py mounts /prometheus/metrics only when it is set
    return_perf_metrics: bool = False
    # BaseLlmArgs.num_postprocess_workers (int, default 0), TorchLlmArgs.stream_interval (int, default 1),
    # attention_dp_config: the keys NVIDIA's curated gpt-oss configs set (serving_profiles.py)
    num_postprocess_workers: int = 0
    stream_interval: PositiveInt = 1
    attention_dp_config: AttentionDpConfig | None = None

    @model_validator(mode="after")
    def _dflash_backend(self):
        # DFlashDecodingConfig.supports_backend: backend == "pytorch"
        if self.speculative_config is not None and self.backend not in (None, "pytorch"):
            raise ValueError(f"DFlash supports only the pytorch backend, not {self.backend!r}")
        return self


def drafter_loader_problems(drafter_dir: Path) -> list[str]:
    """DFLASH (modeling_dflash.py @ 7c7504c08f1f): DFlashForCausalLM.load_weights takes fc.weight as is
    into `nn.Linear(..., dtype=fc.weight.dtype)`, and _build_fused_kv_buffers slices qkv_proj.weight
    raw into F.linear; neither reads a *_scale tensor. So fc and q/k/v must be plain floating weights:
    an FP8 or packed NVFP4 tensor there, or a scale beside one, is a load-time failure or a silently
    wrong weight. The other Linears belong to the draft backbone, built with the drafter folder's
    hf_quant_config.json: quantized only with one (ModelOpt FP8 / NVFP4) and, those being static
    W8A8 / W4A4, with an input_scale. Returns what breaks the rules, by tensor name."""
    import json
    import re

    from safetensors import safe_open

    hf_quant = Path(drafter_dir) / "hf_quant_config.json"
    algo = json.loads(hf_quant.read_text())["quantization"]["quant_algo"] if hf_quant.is_file() else None
    raw = re.compile(r"^(fc|layers\.\d+\.self_attn\.[qkv]_proj)\.")
    problems = []
    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in sorted(names):
                dtype = st.get_slice(name).get_dtype()
                quantized = name.endswith(("_scale", "_scale_2")) or dtype.startswith("F8") or dtype == "U8"
                if raw.match(name) and quantized:
                    problems.append(f"{name}: {dtype}, read raw by the DFlash loader (fc / fused context K/V), "
                                    "which drops its scales")
                elif quantized and algo not in ("FP8", "NVFP4"):
                    problems.append(f"{name}: {dtype} without a ModelOpt FP8 / NVFP4 hf_quant_config.json")
                elif name.endswith(".weight_scale") and name[: -len("weight_scale")] + "input_scale" not in names:
                    problems.append(f"{name[: -len('.weight_scale')]}: no input_scale for the static quantized Linear")
    return problems


# LLMAPI_PB: the llmapi model's tensors, (name, data_type, dims, optional)
LLMAPI_INPUTS = [
    ("text_input", "TYPE_STRING", [-1], False),
    ("image_url", "TYPE_STRING", [-1], True),
    ("streaming", "TYPE_BOOL", [1], True),
    ("sampling_param_best_of", "TYPE_INT32", [1], True),
    ("sampling_param_temperature", "TYPE_FP32", [1], True),
    ("sampling_param_top_k", "TYPE_INT32", [1], True),
    ("sampling_param_top_p", "TYPE_FP32", [1], True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_presence_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_max_tokens", "TYPE_INT32", [1], True),
    ("sampling_param_stop", "TYPE_STRING", [-1], True),
    ("sampling_param_seed", "TYPE_UINT64", [1], True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", [1], True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_stop_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("stop", "TYPE_BOOL", [1], True),
    ("lora_id", "TYPE_UINT64", [1], True),
    ("lora_name", "TYPE_STRING", [1], True),
    ("lora_path", "TYPE_STRING", [1], True),
    ("lora_ckpt_source", "TYPE_STRING", [1], True),
]
LLMAPI_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("stop_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("kv_cache_reused_block", "TYPE_INT32", [-1]),
    ("kv_cache_missed_block", "TYPE_INT32", [-1]),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [-1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [-1]),
    ("kv_cache_hit_rate", "TYPE_FP32", [-1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_scheduled_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("last_token_time_ns", "TYPE_INT64", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
]
# LLMAPI_PY: `_create_response` puts `output.text` (the whole text so far) into every streamed
# response, not the delta; and SamplingParams gets best_of (default 1), exclude_input_from_output
# (False) and return_perf_metrics (False) by default (helpers.get_sampling_params_from_request).
LLMAPI_STREAMS = "cumulative"
