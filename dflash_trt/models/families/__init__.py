"""The target families the CPU reference runtime runs, looked up by config.json `model_type`.

A family is one module with `TRAITS` (model_type -> family.Family; docs/families.md) and
`build(cfg: dict, dtype, max_len) -> nn.Module`, listed once in RUNTIME_MODULES below. The model it
returns subclasses TargetShell (models/shell.py), which runtime/decode.py drives:

    forward(tokens [T], start, capture=(), all_logits=False) -> (logits, features)
        tokens at positions [start, start+T); features = the captured decoder layers' outputs
        (HF hidden_states[i + 1]) concatenated. A later call with a smaller `start` discards what
        came after it (a rejected draft).
    optional: state_name(checkpoint tensor name) -> the model's name, or None for a tensor it does
        not load (a multimodal wrapper's text decoder)

Parameter names are Hugging Face's, so checkpoints load as they are, and each family is tested against
transformers in float64 (tests/test_family_*.py).
"""
from __future__ import annotations

from types import ModuleType

from dflash_trt.models.families import dense, gemma4, minimax_m2, mla, planned, qwen3_hybrid
from dflash_trt.models.families.family import PLAIN, Family

# The families the CPU runtime runs, in this order. One module may serve several model types (one decoder,
# config switches): its TRAITS name them. Hybrid Gated DeltaNet / gated attention (the multimodal qwen3_5 /
# qwen3_5_moe run their text decoder); MLA (DeepSeek-V3 layout; GLM-5 adds the DSA indexer; Kimi K2.5's text
# decoder is a deepseek_v3); MiniMax-M2; Gemma 4 (the multimodal gemma4 runs its text decoder).
RUNTIME_MODULES: tuple[ModuleType, ...] = (dense, qwen3_hybrid, mla, minimax_m2, gemma4)
# model_type -> module
FAMILIES: dict[str, ModuleType] = {mt: m for m in RUNTIME_MODULES for mt in m.TRAITS}
# model_type -> the name of its module (quant/calibrate compares it with a layer class's __module__)
RUNTIME_FAMILIES: dict[str, str] = {mt: m.__name__ for mt, m in FAMILIES.items()}
# model_type -> what the pipeline asks of it (family.py): the runtime's families and the planner's own
TRAITS: dict[str, Family] = {mt: f for m in (*RUNTIME_MODULES, planned) for mt, f in m.TRAITS.items()}


def family_module(model_type: str | None) -> ModuleType | None:
    """The runtime module of a model_type, or None where the CPU runtime does not run it."""
    return FAMILIES.get(model_type or "")


def family(model_type: str | None) -> Family:
    """What the pipeline asks of a model_type (a plain decoder's answers where no family names it)."""
    return TRAITS.get(model_type or "", PLAIN)


def family_of_config(cfg: dict) -> Family:
    """family() of a config.json, by model_type, else by the `architectures` a family names."""
    if cfg.get("model_type") in TRAITS:
        return TRAITS[cfg["model_type"]]
    archs = set(cfg.get("architectures") or [])
    return next((f for f in TRAITS.values() if archs & set(f.architectures)), PLAIN)


def ships_mxfp4(cfg: dict) -> bool:
    """Its experts ship as MXFP4 (gpt-oss): its quantization_config or its family's row says so. They are kept
    as they are (TensorRT-LLM serves them only so: no FP8 / NVFP4 weight path)."""
    method = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower()
    return method == "mxfp4" or family_of_config(cfg).mxfp4_experts


__all__ = ["FAMILIES", "RUNTIME_FAMILIES", "RUNTIME_MODULES", "TRAITS", "Family", "family", "family_module",
           "family_of_config",
           "ships_mxfp4"]
