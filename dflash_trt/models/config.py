"""DFlash drafter configuration: the z-lab `config.json` format, and conversion from the
vLLM speculators format (docs/formats.md).

The config.json is kept as read (`raw`) and written back unchanged, so a load → save round trip
is byte-compatible with the z-lab file apart from JSON whitespace.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json

# Fields a z-lab drafter config.json must carry (the Qwen3 decoder-block fields we use).
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: the middle layer for a 1-layer drafter, else evenly spaced in [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    attention_bias: bool = False
    hidden_act: str = "silu"
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "DrafterConfig":
        if d.get("speculators_model_type") == "dflash":
            d = zlab_config_from_speculators(d, source)
        missing = [k for k in REQUIRED_FIELDS if k not in d]
        if missing:
            raise DFlashError(f"{source}: missing field(s) {', '.join(missing)} in the drafter config")
        dcfg = d.get("dflash_config") or {}
        block_size = d.get("block_size", dcfg.get("block_size"))
        if block_size is None:
            raise DFlashError(f"{source}: missing field block_size (top level or dflash_config.block_size)")
        mask = dcfg.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise DFlashError(f"{source}: missing field dflash_config.mask_token_id")
        n_layers = d["num_hidden_layers"]
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            if "num_target_layers" not in d:
                raise DFlashError(f"{source}: no dflash_config.target_layer_ids and no num_target_layers to derive them")
            ids = default_target_layer_ids(d["num_target_layers"], n_layers)
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
            rope_scaling=d.get("rope_scaling"), max_position_embeddings=d.get("max_position_embeddings", 32768),
            block_size=int(block_size), mask_token_id=int(mask), target_layer_ids=[int(i) for i in ids],
            num_target_layers=d.get("num_target_layers"), attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"), raw=d,
        )

    def to_dict(self) -> dict:
        """The z-lab config.json: `raw` with our (possibly edited) fields written over it."""
        d = dict(self.raw)
        d.setdefault("architectures", ["DFlashDraftModel"])
        d.setdefault("model_type", "qwen3")
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "max_position_embeddings", "attention_bias", "hidden_act", "block_size"):
            d[k] = getattr(self, k)
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        d.setdefault("layer_types", ["full_attention"] * self.num_hidden_layers)
        dcfg = dict(d.get("dflash_config") or {})
        dcfg["mask_token_id"] = self.mask_token_id
        dcfg["target_layer_ids"] = list(self.target_layer_ids)
        d["dflash_config"] = dcfg
        return d


def zlab_config_from_speculators(d: dict, source: str = "config.json") -> dict:
    """vLLM speculators DFlash config → z-lab config. speculators counts hidden-state *indices*
    (0 = embeddings), so its `aux_hidden_state_layer_ids` are z-lab's decoder-layer ids + 1."""
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashError(f"{source}: speculators config without transformer_layer_config")
    for k in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if k not in d:
            raise DFlashError(f"{source}: speculators config missing field {k}")
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    out.update({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": d["block_size"],
        "dflash_config": {"mask_token_id": d["mask_token_id"],
                          "target_layer_ids": [int(i) - 1 for i in d["aux_hidden_state_layer_ids"]]},
    })
    out.setdefault("vocab_size", d.get("draft_vocab_size"))
    return out


def load_drafter_config(folder: str | Path) -> DrafterConfig:
    path = Path(folder) / "config.json"
    return DrafterConfig.from_dict(read_json(path), str(path))
