"""Planner shapes (plan/shapes.ModelShape) of the target families the planner has no hand-written
parameter groups for, read from transformers' own model of the config: built on the meta device (no
memory), every parameter's shape counted into the planner's groups by its name. Covers any decoder
transformers 5.24 has a causal-LM class for: DeepSeek-V3 / Kimi K2 (MLA), GLM-5 (MLA + DSA indexer),
MiniMax-M2, Qwen3-Next and Qwen3.5/3.6 (GatedDeltaNet + full attention, MoE), Gemma 4, ...

KV cache per token, per layer, as each family stores it:
- MLA (a config with kv_lora_rank): the compressed latent, kv_lora_rank + qk_rope_head_dim values,
  one copy per GPU (not split by TP): ModelShape carries it as one "KV head" of half that width
  (kv_bytes_per_token multiplies by 2 for K and V).
- Linear-attention layers (layer_types "linear_attention"): no per-token KV (a fixed recurrent state
  per sequence, not counted); only the attention layers count.
- Otherwise num_key_value_heads x head_dim for K and V; where these differ by layer (Gemma 4: its
  full-attention layers have their own KV heads and head_dim, transformers' per_layer_config), each
  layer's own, carried as ModelShape.kv_per_layer.
Left out: GLM-5's DSA indexer key cache (index_head_dim per token), the recurrent states.
"""
from __future__ import annotations

import math

from dflash_trt.errors import DFlashError


def _hf_model_on_meta(cfg: dict, name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mt = cfg.get("model_type")
    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version", "quantization_config",
                                                      "auto_map", "architectures")}
    try:
        hf = AutoConfig.for_model(mt, **kw)
        hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        with torch.device("meta"):
            return hf, AutoModelForCausalLM.from_config(hf)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DFlashError(f"{name}: config.json model_type {mt!r}: transformers cannot build this family "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def meta_shape_fields(cfg: dict, name: str) -> tuple[dict, list[dict]]:
    """(shapes.ModelShape fields, its shapes.Group fields, one dict each) of `cfg`, from
    transformers' model of it (see the module docstring). Plain dicts: planner builds the objects."""
    hf, model = _hf_model_on_meta(cfg, name)
    H, L, V = hf.hidden_size, hf.num_hidden_layers, hf.vocab_size
    nh = hf.num_attention_heads
    E = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None) or \
        getattr(hf, "num_local_experts", None) or 0
    k = getattr(hf, "num_experts_per_tok", None) or getattr(hf, "top_k_experts", None) or 0   # Gemma 4: top_k_experts
    sizes = {"embed": 0, "lm_head": 0, "experts": 0, "router": 0, "dense": 0, "small": 0}
    linears = {"experts": 0, "dense": 0}
    for pname, p in model.state_dict().items():   # parameters and persistent buffers (e_score_correction_bias)
        n = math.prod(p.shape)
        if "embed_tokens" in pname:
            sizes["embed"] += n
        elif pname.startswith("lm_head"):
            if not getattr(hf, "tie_word_embeddings", False):   # a tied head is the embedding, listed once
                sizes["lm_head"] += n
        elif ".experts." in pname:
            sizes["experts"] += n
            # fused [E, ...] tensors: one Linear per expert each (gate_up counts as gate + up)
            linears["experts"] += (p.shape[0] if p.dim() == 3 else 1) * (2 if "gate_up" in pname else 1)
        elif any(s in pname for s in (".mlp.gate.", ".router", "shared_expert_gate", "block_sparse_moe.gate.")):
            sizes["router"] += n
        elif p.dim() == 2 and "conv1d" not in pname:
            sizes["dense"] += n
            linears["dense"] += 1
        else:
            sizes["small"] += n
    groups = [{"name": "embed", "elements": sizes["embed"], "split": "tp", "quantizable": False}]
    if sizes["lm_head"]:
        groups.append({"name": "lm_head", "elements": sizes["lm_head"], "split": "tp", "quantizable": False})
    groups.append({"name": "dense", "elements": sizes["dense"], "split": "tp", "quantizable": True,
                   "linears": linears["dense"]})
    if sizes["experts"]:
        groups.append({"name": "experts", "elements": sizes["experts"], "split": "tp", "quantizable": True,
                       "linears": linears["experts"], "expert": True, "active_fraction": k / E if E else 1.0})
    groups += [{"name": g, "elements": sizes[g], "split": "rep", "quantizable": False}
               for g in ("router", "small") if sizes[g]]

    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * L)
    attn_types = [t for t in types if t != "linear_attention"]

    kv_per_layer = None
    if getattr(hf, "kv_lora_rank", None):
        kv_heads, head_dim = 1, math.ceil((hf.kv_lora_rank + hf.qk_rope_head_dim) / 2)
    elif getattr(hf, "per_layer_config", None) is not None:   # heterogeneous layers: read each one's
        kv_per_layer = [(getattr(c, "num_key_value_heads", None) or nh, getattr(c, "head_dim", None) or H // nh)
                        for c, t in zip(_layer_configs(hf, L), types) if t != "linear_attention"]
        kv_heads, head_dim = kv_per_layer[0]
        if len(set(kv_per_layer)) == 1:
            kv_per_layer = None
    else:
        kv_heads = getattr(hf, "num_key_value_heads", None) or nh
        head_dim = getattr(hf, "head_dim", None) or H // nh
    sliding = getattr(hf, "sliding_window", None) if "sliding_attention" in attn_types else None
    inter = getattr(hf, "moe_intermediate_size", None) if E else getattr(hf, "intermediate_size", None)
    fields = {"name": name, "model_type": cfg.get("model_type"), "hidden": H, "layers": len(attn_types), "heads": nh,
              "kv_heads": kv_heads, "head_dim": head_dim, "vocab": V, "intermediate": inter or hf.intermediate_size,
              "experts": E, "experts_per_token": k, "layer_types": attn_types, "sliding_window": sliding,
              "kv_per_layer": kv_per_layer}
    return fields, groups


def _layer_configs(hf, layers: int) -> list:
    """Each layer's config of a heterogeneous transformers config (per_layer_config)."""
    view = hf.per_layer_config
    return [view[i] for i in range(layers)]
