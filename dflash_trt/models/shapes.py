"""The tensor shapes config.json implies for a Hugging Face decoder checkpoint, checked against the
safetensors headers before anything is read (check, quantize, convert). What a family changes is its row
(models/families.family), never a branch on its name here.
"""
from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.models.config import decoder_config
from dflash_trt.models.families import family


def layer_attention_dims(c: dict, layer: int) -> tuple[int | None, int | None]:
    """(head_dim, num_key_value_heads) of one decoder layer's attention, from a config.json dict."""
    nh = c.get("num_attention_heads")
    hd = c.get("head_dim") or (c["hidden_size"] // nh if nh and c.get("hidden_size") else None)
    nkv = c.get("num_key_value_heads") or nh
    return family(c.get("model_type")).layer_attention_dims(c, layer, hd, nkv)


def expected_shape(name: str, cfg: dict) -> tuple[int, ...] | None:
    """The shape config.json implies for a standard HF decoder tensor, or None if not known."""
    c = decoder_config(cfg)
    H = c.get("hidden_size")
    nh = c.get("num_attention_heads")
    if H is None or nh is None:
        return None
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or H // nh
    inter = c.get("intermediate_size")
    V = c.get("vocab_size")
    E = c.get("num_local_experts") or c.get("num_experts")
    base = name.removeprefix("model.")
    parts = base.split(".")
    if base in ("embed_tokens.weight",) or name == "lm_head.weight":
        return (V, H)
    if base == "norm.weight":
        return (H,)
    if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    tail = ".".join(parts[2:])
    L = c.get("num_hidden_layers", 1 << 30)
    if int(parts[1]) >= L:
        # DeepSeek-V3 / GLM-5 store num_nextn_predict_layers multi-token-prediction layers after the last one
        if int(parts[1]) < L + (c.get("num_nextn_predict_layers") or 0):
            return None
        return ()  # a layer that config.json does not have: never fits
    fam = family(c.get("model_type"))
    hd, nkv = layer_attention_dims(c, int(parts[1]))
    if inter:
        inter = fam.layer_intermediate_size(c, int(parts[1]), inter)
    table = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_proj.bias": (nh * hd,), "self_attn.k_proj.bias": (nkv * hd,),
        "self_attn.v_proj.bias": (nkv * hd,), "self_attn.o_proj.bias": (H,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
    }
    if c.get("kv_lora_rank"):   # MLA: per-head query of qk_nope + qk_rope dims, values of v_head_dim
        qd = nh * ((c.get("qk_nope_head_dim") or 0) + (c.get("qk_rope_head_dim") or 0))
        table.update({"self_attn.q_proj.weight": (qd, H), "self_attn.o_proj.weight": (H, nh * (c.get("v_head_dim") or hd))})
    if fam.q_proj_with_gate:
        table.update({"self_attn.q_proj.weight": (2 * nh * hd, H), "self_attn.q_proj.bias": (2 * nh * hd,)})
    if fam.qk_norm_over_all_heads:
        table.update({"self_attn.q_norm.weight": (nh * hd,), "self_attn.k_norm.weight": (nkv * hd,)})
    if not E and inter:
        table.update({"mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                      "mlp.down_proj.weight": (H, inter)})
    if E:
        table.update(fam.expert_tensor_shapes(H=H, nh=nh, E=E, inter=inter))
    return table.get(tail)


def check_shapes(reader: CheckpointReader, cfg: dict, config_path: str | Path = "config.json") -> None:
    """Raise on the first tensor whose shape does not fit config.json."""
    for name in reader.keys():
        want = expected_shape(name, cfg)
        if want is None:
            continue
        got = reader.meta(name)[1]
        if got != want:
            raise DFlashError(f"{reader.file_of(name)}: tensor {name!r} has shape {list(got)} but "
                              f"{config_path} implies {list(want)}")
