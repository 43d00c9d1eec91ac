"""The target families the CPU reference runtime runs, looked up by config.json `model_type`.

A family is one module with `build(cfg: dict, dtype, max_len) -> nn.Module`. The model it returns
has TargetShell's interface (models/shell.py: the shell every family subclasses), which
runtime/decode.py drives:

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

from types import ModuleType

from dflash_trt.models.families import dense, gemma4, minimax_m2, mla, qwen3_hybrid

# model_type -> module. One module may serve several model types (one decoder, config switches).
FAMILIES: dict[str, ModuleType] = {
    "llama": dense,
    "qwen3": dense,
    "gpt_oss": dense,
    # hybrid Gated DeltaNet / gated attention (the multimodal qwen3_5 / qwen3_5_moe run their text decoder)
    "qwen3_next": qwen3_hybrid,
    "qwen3_5": qwen3_hybrid,
    "qwen3_5_text": qwen3_hybrid,
    "qwen3_5_moe": qwen3_hybrid,
    "qwen3_5_moe_text": qwen3_hybrid,
    # MLA (DeepSeek-V3 layout; GLM-5 adds the DSA indexer)
    "deepseek_v3": mla,
    "kimi_k25": mla,      # its text decoder (a deepseek_v3)
    "glm_moe_dsa": mla,
    # Gemma 4 (the multimodal gemma4 runs its text decoder) and MiniMax-M2
    "minimax_m2": minimax_m2,
    "gemma4_text": gemma4,
    "gemma4": gemma4,       # its text decoder (Gemma 4 as released)
}
# model_type -> the name of its module (quant/calibrate compares it with a layer class's __module__)
RUNTIME_FAMILIES: dict[str, str] = {mt: m.__name__ for mt, m in FAMILIES.items()}


def family_module(model_type: str | None) -> ModuleType | None:
    """The runtime module of a model_type, or None where the CPU runtime does not run it."""
    return FAMILIES.get(model_type or "")
