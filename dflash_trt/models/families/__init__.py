"""The target families the CPU reference runtime runs, looked up by config.json `model_type`.

A family is one module with `build(cfg: dict, dtype, max_len) -> nn.Module`. The model it returns
has TargetModel's interface (models/target.py), which runtime/decode.py drives:

    forward(tokens [T], start, capture=(), all_logits=False) -> (logits, features)
        tokens at positions [start, start+T); features = the captured decoder layers' outputs
        (HF hidden_states[i + 1]) concatenated. A later call with a smaller `start` discards what
        came after it (a rejected draft): O(1) for a KV cache; a family with a recurrent state
        keeps what it needs to restore the state at any position of its last forward.
    setup_cache(max_len), embed(tokens), logits(h), lm_head_weight(), cache_bytes_per_position()
    attributes: cfg (the config.json dict), hf (its transformers config), dtype, vocab_size,
        hidden_size, num_layers, max_len
    optional: state_name(checkpoint tensor name) -> the model's name, or None for a tensor it does
        not load (load_target and check apply it: a multimodal wrapper's text decoder)

Parameter names are Hugging Face's, so checkpoints load as they are (models/weights.load_strict),
and each family is tested against transformers in float64 (tests/test_family_*.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType

# model_type -> module. One module may serve several model types (one decoder, config switches).
RUNTIME_FAMILIES: dict[str, str] = {
    "llama": "dflash_trt.models.target",
    "qwen3": "dflash_trt.models.target",
    "gpt_oss": "dflash_trt.models.target",
    # hybrid Gated DeltaNet / gated attention (the multimodal qwen3_5 / qwen3_5_moe run their text decoder)
    "qwen3_next": "dflash_trt.models.families.qwen3_hybrid",
    "qwen3_5": "dflash_trt.models.families.qwen3_hybrid",
    "qwen3_5_text": "dflash_trt.models.families.qwen3_hybrid",
    "qwen3_5_moe": "dflash_trt.models.families.qwen3_hybrid",
    "qwen3_5_moe_text": "dflash_trt.models.families.qwen3_hybrid",
    # MLA (DeepSeek-V3 layout; GLM-5 adds the DSA indexer)
    "deepseek_v3": "dflash_trt.models.families.mla",
    "kimi_k25": "dflash_trt.models.families.mla",      # its text decoder (a deepseek_v3)
    "glm_moe_dsa": "dflash_trt.models.families.mla",
    # Gemma 4 (the multimodal gemma4 runs its text decoder) and MiniMax-M2
    "minimax_m2": "dflash_trt.models.families.minimax_m2",
    "gemma4_text": "dflash_trt.models.families.gemma4",
    "gemma4": "dflash_trt.models.families.gemma4",       # its text decoder (Gemma 4 as released)
}


def family_module(model_type: str | None) -> ModuleType | None:
    """The runtime module of a model_type, or None where the CPU runtime does not run it."""
    name = RUNTIME_FAMILIES.get(model_type or "")
    return importlib.import_module(name) if name else None
