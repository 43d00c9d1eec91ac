"""`--profile latency|throughput`: TensorRT-LLM settings from NVIDIA's curated configs, per model
family (NVIDIA/TensorRT-LLM examples/configs/curated/, mapped to architectures by its lookup.yaml
@ fae9ea3f4a35), and the drafter attention backend each GPU family runs.

A family without a curated config keeps our defaults (max_batch_size 64, max_num_tokens 8192, no
attention DP) for latency; throughput then turns on attention DP only. DFlash needs more tokens per
step than plain decoding (every sequence verifies `block` tokens), so max_num_tokens is raised to
max_batch_size x block where a curated value is smaller.
"""
from __future__ import annotations

from dflash_trt.errors import DFlashError

PROFILES = ("latency", "throughput")

# architecture -> profile -> settings (tp / ep: the curated layout; the planner ranks it first)
CURATED: dict[str, dict[str, dict]] = {
    "GptOssForCausalLM": {
        "latency": {"source": "examples/configs/curated/gpt-oss-120b-latency.yaml @ 65b31db1b401",
                    "tp": 8, "ep": 1, "enable_attention_dp": False, "max_batch_size": 64, "max_num_tokens": 16384,
                    "stream_interval": 20, "num_postprocess_workers": 4},
        "throughput": {"source": "examples/configs/curated/gpt-oss-120b-throughput.yaml @ 65b31db1b401",
                       "tp": 2, "ep": 2, "enable_attention_dp": True, "max_batch_size": 720, "max_num_tokens": 16384,
                       "stream_interval": 20, "num_postprocess_workers": 4,
                       "attention_dp_config": {"enable_balance": True, "batching_wait_iters": 50, "timeout_iters": 1}},
    },
    "Qwen3MoeForCausalLM": {
        "throughput": {"source": "examples/configs/curated/qwen3.yaml @ 62e51e522c15 (Qwen/Qwen3-30B-A3B)",
                       "tp": 1, "ep": 1, "enable_attention_dp": True, "max_batch_size": 161, "max_num_tokens": 1160},
    },
    "LlamaForCausalLM": {
        "throughput": {"source": "examples/configs/curated/llama-3.3-70b.yaml @ 7df4b7998b4b "
                                 "(nvidia/Llama-3.3-70B-Instruct-FP8)",
                       "enable_attention_dp": False, "max_batch_size": 1024, "max_num_tokens": 2048},
    },
}
DEFAULTS = {"latency": {"source": "dflash-trt defaults (no curated config for this family)",
                        "enable_attention_dp": False, "max_batch_size": 64, "max_num_tokens": 8192},
            "throughput": {"source": "dflash-trt defaults + attention DP (no curated config for this family)",
                           "enable_attention_dp": True, "max_batch_size": 64, "max_num_tokens": 8192}}

# The drafter's attention backend (DFlashDecodingConfig.attention_backend, VANILLA | TRTLLM | FA4
# at 1.4.0rc1) each GPU family runs. The default VANILLA is the plain PyTorch path.
DRAFTER_ATTENTION_BACKEND = {
    # PR #18553 ("DFlash draft latency"): "FA4 targets SM90 only, so FA4 is not tested on B200"
    "hopper": ("FA4", "NVIDIA/TensorRT-LLM PR #18553: the FA4 drafter attention path targets SM90"),
    # PR #18553: TestQwen3_6_35B_A3B::test_nvfp4_dflash validates TRTLLM and VANILLA on B200; PR #19466:
    # over the draft-context budget TRTLLM warns where VANILLA and FA4 raise
    "blackwell": ("TRTLLM", ("NVIDIA/TensorRT-LLM PR #18553: TRTLLM and VANILLA validated on B200 "
                             "(test_nvfp4_dflash); TRTLLM is the fused attention backend")),
}


def profile_settings(profile: str, target_cfg: dict, block_size: int, max_batch_size: int | None = None) -> dict:
    """The profile's TensorRT-LLM settings for this target (without tp / ep, which the bundle fixes)."""
    if profile not in PROFILES:
        raise DFlashError(f"--profile {profile!r}: choose {' or '.join(PROFILES)}")
    archs = target_cfg.get("architectures") or []
    family = next((CURATED[a] for a in archs if a in CURATED), {})
    s = dict(family.get(profile) or DEFAULTS[profile])
    if max_batch_size is not None:
        if max_batch_size < 1:
            raise DFlashError(f"--max-batch-size {max_batch_size}: must be at least 1")
        s["max_batch_size"] = max_batch_size
    s["max_num_tokens"] = max(s["max_num_tokens"], s["max_batch_size"] * block_size)
    return s


def curated_layout(profile: str, target_cfg: dict) -> tuple[int, int] | None:
    """(tp, ep) of the family's curated config for this profile, if it names one."""
    archs = target_cfg.get("architectures") or []
    s = next((CURATED[a].get(profile) for a in archs if a in CURATED), None) or {}
    return (s["tp"], s["ep"]) if "tp" in s else None


def drafter_attention_backend(arch: str) -> str:
    return DRAFTER_ATTENTION_BACKEND[arch][0] if arch in DRAFTER_ATTENTION_BACKEND else "VANILLA"
