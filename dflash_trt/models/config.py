"""DFlash drafter configuration: the z-lab `config.json` format, and conversion from the vLLM
speculators format (docs/formats.md); and the rules every config.json we read must meet, as data
(COMMON_FIELDS, TARGET_FIELDS, DRAFTER_FIELDS) plus the relations between fields (`_relations`).
`check` reports every problem; everything that loads a model refuses the first one, before any
allocation. The config.json is kept as read (`raw`) and written back unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json

# Fields a z-lab drafter config.json must carry (the Qwen3 decoder-block fields we use).
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
TARGET_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# Stated maximums: far above every published model (largest hidden 16384, vocab 262144, 128
# layers, 10M context), low enough that a typo cannot ask for terabytes before a check runs.
MAX_BLOCK = 64                 # draft block size (z-lab drafters: 8-16)
MAX_HIDDEN = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 4096
LAYER_TYPES = ("full_attention", "sliding_attention")


def target_layer_types() -> tuple[str, ...]:
    """The layer types a target config may list: transformers' own ALLOWED_LAYER_TYPES (linear_attention,
    indexed_attention, ...). A drafter's stay LAYER_TYPES: the only ones a DFlash drafter layer can be."""
    try:
        from transformers.configuration_utils import ALLOWED_LAYER_TYPES
    except ImportError:
        return LAYER_TYPES
    return tuple(ALLOWED_LAYER_TYPES)


@dataclass(frozen=True)
class Field:
    """One config field: its JSON type and inclusive range. Null counts as absent."""
    name: str
    kind: str                  # "int" | "float" | "bool" | "str" | "dict" | "int_list" | "str_list" | "ids"
    lo: float | None = None
    hi: float | None = None


def _ints(name, lo, hi):
    return Field(name, "int", lo, hi)


COMMON_FIELDS = (
    _ints("hidden_size", 1, MAX_HIDDEN), _ints("num_hidden_layers", 1, MAX_LAYERS),
    _ints("num_attention_heads", 1, MAX_HEADS), _ints("num_key_value_heads", 1, MAX_HEADS),
    _ints("head_dim", 2, MAX_HEAD_DIM), _ints("intermediate_size", 1, MAX_INTERMEDIATE),
    _ints("vocab_size", 1, MAX_VOCAB), _ints("max_position_embeddings", 1, MAX_CONTEXT),
    Field("rms_norm_eps", "float", 1e-12, 0.5), Field("rope_theta", "float", 1.0, 1e12),
    Field("rope_scaling", "dict"), Field("rope_parameters", "dict"), Field("attention_bias", "bool"),
    Field("tie_word_embeddings", "bool"), Field("hidden_act", "str"), Field("layer_types", "str_list"),
    _ints("sliding_window", 1, MAX_CONTEXT), Field("architectures", "str_list"), Field("model_type", "str"),
    Field("quantization_config", "dict"), Field("dtype", "str"), Field("torch_dtype", "str"),
    Field("use_sliding_window", "bool"), Field("attention_dropout", "float", 0.0, 1.0),
    Field("eos_token_id", "ids", 0, MAX_VOCAB - 1), Field("bos_token_id", "ids", 0, MAX_VOCAB - 1),
    Field("pad_token_id", "ids", 0, MAX_VOCAB - 1),
)
TARGET_FIELDS = COMMON_FIELDS + (
    Field("mlp_bias", "bool"), Field("text_config", "dict"), _ints("num_experts", 1, MAX_EXPERTS),
    _ints("num_local_experts", 1, MAX_EXPERTS), _ints("num_experts_per_tok", 1, MAX_EXPERTS),
)
# DFlash2's fields (z-lab/dflash dflash/model.py `_draft_value`: dflash_config first, then the top level).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
MAX_CONV_TAPS = 64             # conv taps run over the block's own positions (z-lab: 2)
DRAFTER_FIELDS = COMMON_FIELDS + (
    _ints("block_size", 2, MAX_BLOCK), _ints("num_target_layers", 1, MAX_LAYERS), Field("dflash_config", "dict"),
    _ints("dflash_config.block_size", 2, MAX_BLOCK), _ints("dflash_config.mask_token_id", 0, MAX_VOCAB - 1),
    _ints("mask_token_id", 0, MAX_VOCAB - 1), Field("dflash_config.target_layer_ids", "int_list", 0, MAX_LAYERS - 1),
    Field("is_causal", "bool"), Field("dflash_config.causal", "bool"), Field("dflash_config.use_swa", "bool"),
    _ints("dflash_config.swa_window_size", 1, MAX_CONTEXT),
    *[_ints(f"{pre}{k}", 1, hi) for pre in ("", "dflash_config.") for k, hi in (
        ("conv_kernel_size", MAX_CONV_TAPS), ("conv_group_size", MAX_HIDDEN), ("selector_rank", MAX_HIDDEN),
        ("selector_top_k", MAX_VOCAB))],
    *[Field(f"{pre}{k}", "float", lo, hi) for pre in ("", "dflash_config.") for k, lo, hi in (
        ("input_embedding_scale", 1e-6, 1e6), ("output_multiplier", 1e-6, 1e6), ("final_logit_softcapping", 0.0, 1e6))],
)
DRAFTER_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
# A DFlash drafter's decoder layers are Qwen3's: the model_type of its config.json (z-lab's; the engines load it so)
DRAFTER_MODEL_TYPE = "qwen3"


def drafter_identity(kind: str = "dflash") -> dict:
    """The config.json fields that say a drafter of this kind is one: its architecture and model_type."""
    return {"architectures": [next(a for a, k in DRAFTER_ARCHITECTURES.items() if k == kind)],
            "model_type": DRAFTER_MODEL_TYPE}
# dflash_config keys upstream reads that change what the drafter computes and that the CPU
# runtime does not implement: refused by name rather than silently dropped.
UNSUPPORTED_DRAFTER_KEYS = {
    "dflash_config.attention_sink_bias": "per-head attention sinks in the drafter (vLLM qwen3_dflash.py "
                                         "DFlashQwen3DecoderLayer)",
    "add_swa_attention_sink_bias": "per-head attention sinks in the drafter (vLLM qwen3_dflash.py)",
    "dflash_config.attention_value_scale": "a scale on the drafter's V (vLLM qwen3_dflash.py DFlashQwen3Attention)",
    "dflash_config.sample_from_anchor": "drafting from the anchor position (vLLM speculators algos.py update_dflash)",
}


def _get(d: dict, name: str):
    for part in name.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_problem(f: Field, v) -> str | None:
    """Why `v` does not fit `f`, or None. ("ids": a token id or a list of them.)"""
    if f.kind == "ids":
        f = Field(f.name, "int_list" if isinstance(v, list) else "int", f.lo, f.hi)
    if f.kind == "int" or f.kind == "int_list":
        items = v if f.kind == "int_list" else [v]
        if f.kind == "int_list" and not isinstance(v, list):
            return "must be a list of integers"
        if not all(_is_int(i) for i in items):
            return "must be a list of integers" if f.kind == "int_list" else "must be an integer"
        bad = [i for i in items if (f.lo is not None and i < f.lo) or (f.hi is not None and i > f.hi)]
        if bad:
            return f"must be between {f.lo} and {f.hi}" if f.kind == "int" else \
                f"has {_short(bad[0])}; each id must be between {f.lo} and {f.hi}"
    elif f.kind == "float":
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not math.isfinite(v):
            return "must be a finite number"
        if not f.lo <= v <= f.hi:
            return f"must be between {f.lo:g} and {f.hi:g}"
    elif f.kind == "str_list":
        if not (isinstance(v, list) and all(isinstance(i, str) for i in v)):
            return "must be a list of strings"
    elif not isinstance(v, {"bool": bool, "str": str, "dict": dict}[f.kind]):
        return {"bool": "must be true or false", "str": "must be a string", "dict": "must be an object"}[f.kind]
    return None


def _field_problems(d: dict, fields, required, source: str, what: str) -> list[str]:
    missing = [k for k in required if _get(d, k) is None]
    p = [f"{source}: missing field(s) {', '.join(missing)} in the {what} config"] if missing else []
    for f in fields:
        v = _get(d, f.name)
        why = None if v is None else _type_problem(f, v)
        if why:
            p.append(f"{source}: {f.name} = {_short(v)}: {why}")
    return list(dict.fromkeys(p))


def _relations(d: dict, source: str) -> list[str]:
    """Relations between fields (each checked only where its fields are valid)."""
    p = []
    ok = lambda k: _is_int(d.get(k)) and d[k] >= 1  # noqa: E731
    H, nh, L = d.get("hidden_size"), d.get("num_attention_heads"), d.get("num_hidden_layers")
    if ok("hidden_size") and ok("num_attention_heads") and d.get("head_dim") is None and H % nh:
        p.append(f"{source}: num_attention_heads = {nh} does not divide hidden_size = {H} (and no head_dim is given)")
    if ok("num_attention_heads") and ok("num_key_value_heads") and nh % d["num_key_value_heads"]:
        p.append(f"{source}: num_key_value_heads = {d['num_key_value_heads']} does not divide "
                 f"num_attention_heads = {nh}")
    hd = d.get("head_dim")
    if d.get("head_dim") is None and ok("hidden_size") and ok("num_attention_heads"):
        hd = H // nh
    if _is_int(hd) and hd >= 1 and hd % 2:
        p.append(f"{source}: head_dim = {hd}: must be even (rotary embeddings rotate pairs of dimensions)")
    types = d.get("layer_types")
    if isinstance(types, list) and all(isinstance(t, str) for t in types):
        if ok("num_hidden_layers") and len(types) != L:
            p.append(f"{source}: layer_types has {len(types)} entries but num_hidden_layers = {L}")
        allowed = LAYER_TYPES if isinstance(d.get("dflash_config"), dict) else target_layer_types()
        bad = sorted(set(types) - set(allowed))
        if bad:
            p.append(f"{source}: layer_types has {_short(bad[0])}; expected "
                     + (' or '.join(allowed) if len(allowed) < 4 else f"one of {', '.join(allowed)}"))
        drafter = isinstance(d.get("dflash_config"), dict)   # the drafter's windows: layer_attention
        if "sliding_attention" in types and d.get("sliding_window") is None and not drafter:
            p.append(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
    if ok("num_local_experts") and ok("num_experts_per_tok") and d["num_experts_per_tok"] > d["num_local_experts"]:
        p.append(f"{source}: num_experts_per_tok = {d['num_experts_per_tok']} exceeds num_local_experts = "
                 f"{d['num_local_experts']}")
    return p


def decoder_config(cfg: dict) -> dict:
    """The decoder's fields: a multimodal config keeps them in text_config."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def target_config_problems(cfg: dict, source: str = "config.json") -> list[str]:
    """Every rule a target config.json breaks (empty: it is usable), one line each naming the field."""
    c = decoder_config(cfg)
    return _field_problems(c, TARGET_FIELDS, TARGET_REQUIRED, source, "target") + _relations(c, source)


def drafter_config_problems(d: dict, source: str = "config.json") -> list[str]:
    """Every rule a z-lab drafter config.json breaks, with the relations between its ids and sizes."""
    p = _field_problems(d, DRAFTER_FIELDS, REQUIRED_FIELDS, source, "drafter") + _relations(d, source)
    dc = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    if d.get("block_size", dc.get("block_size")) is None:
        p.append(f"{source}: missing field block_size (top level or dflash_config.block_size)")
    mask = dc.get("mask_token_id", d.get("mask_token_id"))
    if mask is None:
        p.append(f"{source}: missing field dflash_config.mask_token_id")
    elif _is_int(mask) and _is_int(d.get("vocab_size")) and d["vocab_size"] >= 1 and not 0 <= mask < d["vocab_size"]:
        p.append(f"{source}: dflash_config.mask_token_id = {mask} outside the target vocabulary (the drafter's "
                 f"vocab_size = {d['vocab_size']}, its target's: valid 0..{d['vocab_size'] - 1})")
    ids = dc.get("target_layer_ids")
    n_t = d.get("num_target_layers")
    what = "dflash_config.target_layer_ids"
    if ids is None:
        if n_t is None:
            p.append(f"{source}: no dflash_config.target_layer_ids and no num_target_layers to derive them")
        elif _is_int(n_t) and n_t >= 1 and _is_int(d.get("num_hidden_layers")) and d["num_hidden_layers"] >= 1:
            ids = default_target_layer_ids(n_t, d["num_hidden_layers"])
            what = f"target_layer_ids (derived from num_target_layers = {n_t}; set dflash_config.target_layer_ids)"
    if isinstance(ids, list) and all(_is_int(i) for i in ids):
        if not ids:
            p.append(f"{source}: {what} is empty; the drafter needs at least one target layer")
        elif len(set(ids)) != len(ids):
            p.append(f"{source}: {what} {ids} has a repeated id; ids must be unique")
        elif ids != sorted(ids):
            p.append(f"{source}: {what} {ids} is not in ascending order")
        if _is_int(n_t) and n_t >= 1 and any(i >= n_t for i in ids):
            p.append(f"{source}: {what} {[i for i in ids if i >= n_t]} out of range for num_target_layers = {n_t} "
                     f"(valid 0..{n_t - 1})")
    p += _dflash_problems(d, source)
    return list(dict.fromkeys(p))


def draft_value(d: dict, name: str, default=None):
    """A drafter field as z-lab reads it (dflash/model.py `_draft_value`): dflash_config first, then the top
    level. (vLLM's DFlash2 reads conv_* / selector_* from dflash_config only.)"""
    dc = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    v = dc.get(name)
    return d.get(name, default) if v is None else v


def drafter_kind(d: dict) -> str:
    """"dflash" or "dflash2", by the architecture upstream (vLLM, z-lab/dflash) dispatches on."""
    archs = d.get("architectures") if isinstance(d.get("architectures"), list) else []
    return "dflash2" if "DFlash2DraftModel" in archs else "dflash"


def qwen3_window_and_types(d: dict) -> tuple[int | None, list[str] | None]:
    """sliding_window and layer_types as transformers' Qwen3Config holds them, which z-lab, vLLM and SGLang
    all read a drafter through: sliding_window is dropped unless use_sliding_window is true, and absent
    layer_types are derived (sliding for layers >= max_window_layers when a window remains)."""
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    types = d.get("layer_types") if isinstance(d.get("layer_types"), list) else None
    if types is None and _is_int(d.get("num_hidden_layers")):
        mwl = d.get("max_window_layers") if _is_int(d.get("max_window_layers")) else 28
        types = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
                 for i in range(d["num_hidden_layers"])]
    return window, types


def layer_attention(d: dict) -> list[tuple[int | None, bool]]:
    """(sliding window or None, causal) of each drafter layer, resolved as vLLM 0.32.0 does
    (vllm/model_executor/models/qwen3_dflash.py `_resolve_layer_attention` and `_dflash_layer_causal`):

    - causal: top-level `is_causal` if set, else `dflash_config.causal` if set, else
      layer_types[i] == "sliding_attention" (no layer_types: non-causal);
    - sliding: layer_types[i] == "sliding_attention"; without layer_types, or with `dflash_config.use_swa`
      and no sliding layer listed, every layer is sliding iff `dflash_config.use_swa`;
    - window: `dflash_config.swa_window_size`, else the top-level `sliding_window`.

    z-lab/dflash reads a subset, and every config it writes resolves the same both ways. A window of w lets
    a query at position p see keys with |p - k| < w (causal: p - w < k <= p), as z-lab and vLLM agree.
    Raises DFlashError for a sliding layer without a window."""
    dc = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    L = d["num_hidden_layers"]
    hf_window, types = qwen3_window_and_types(d)
    use_swa = bool(dc.get("use_swa", False))
    any_sliding = bool(types) and "sliding_attention" in types
    out = []
    for i in range(L):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == "sliding_attention"
        window = None
        if sliding:
            window = dc.get("swa_window_size", hf_window)
            if window is None:
                why = (" (sliding_window is set but use_sliding_window is not true: transformers' Qwen3Config, "
                       "which every stack reads the drafter with, drops it)") if d.get("sliding_window") else ""
                raise DFlashError(f"config.json: drafter layer {i} is sliding-window attention but neither "
                                  f"dflash_config.swa_window_size nor sliding_window is set{why}")
        causal = next((bool(v) for v in (d.get("is_causal"), dc.get("causal")) if v is not None),
                      bool(types) and types[i] == "sliding_attention")
        out.append((int(window) if window is not None else None, causal))
    return out


def _dflash_problems(d: dict, source: str) -> list[str]:
    """DFlash2's fields, the attention variants, and the keys the runtime refuses by name."""
    p = []
    for key, what in UNSUPPORTED_DRAFTER_KEYS.items():
        v = _get(d, key)
        if v not in (None, False) and not (key.endswith("value_scale") and v == 1.0):
            p.append(f"{source}: {key} = {_short(v)}: the CPU runtime does not implement {what}")
    if drafter_kind(d) == "dflash2":
        missing = [k for k in DFLASH2_FIELDS if draft_value(d, k) is None]
        if missing:
            p.append(f"{source}: a DFlash2DraftModel needs dflash_config.{', dflash_config.'.join(missing)} "
                     "(z-lab/dflash DFlash2DraftModel, vLLM qwen3_dflash2.py)")
        H, g = d.get("hidden_size"), draft_value(d, "conv_group_size")
        if _is_int(H) and _is_int(g) and g >= 1 and H % g:
            p.append(f"{source}: conv_group_size = {g} does not divide hidden_size = {H}")
        V, k = d.get("vocab_size"), draft_value(d, "selector_top_k")
        if _is_int(V) and _is_int(k) and k > V:
            p.append(f"{source}: selector_top_k = {k} exceeds vocab_size = {V}")
    elif any(draft_value(d, k) is not None for k in DFLASH2_FIELDS):
        have = [k for k in DFLASH2_FIELDS if draft_value(d, k) is not None]
        p.append(f"{source}: {', '.join(have)} set but architectures is not DFlash2DraftModel; upstream would load "
                 "it as a DFlash (1) drafter and drop them")
    types = d.get("layer_types")
    reported = isinstance(types, list) and len(types) != d.get("num_hidden_layers")
    if _is_int(d.get("num_hidden_layers")) and d["num_hidden_layers"] >= 1 and not reported:
        try:
            layer_attention(d)
        except DFlashError as e:
            p.append(str(e).replace("config.json:", f"{source}:", 1))
    return p


def raise_first(problems: list[str]) -> None:
    """Raise the first problem (what `check` would print first), counting the others."""
    if problems:
        more = f" (and {len(problems) - 1} more problem(s); `dflash-trt check` lists them)" if len(problems) > 1 else ""
        raise DFlashError(problems[0] + more)


def require_target_config(cfg: dict, source: str = "config.json") -> dict:
    raise_first(target_config_problems(cfg, source))
    return cfg


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
    kind: str = "dflash"                   # "dflash" | "dflash2" (drafter_kind)
    layer_attention: list = field(default_factory=list)   # per layer (window | None, causal): layer_attention()
    # DFlash2 (z-lab/dflash dflash/model.py DFlash2DraftModel; vLLM qwen3_dflash2.py)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # both kinds in z-lab's reference (vLLM applies them to DFlash2 only): see DFlashDrafter
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def plain_attention(self) -> bool:
        """Every layer non-causal and unwindowed (DFlash as first published; the fused paths assume it)."""
        return all(w is None and not c for w, c in self.layer_attention)

    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "DrafterConfig":
        """Validated (drafter_config_problems): the first broken rule is raised."""
        if d.get("speculators_model_type") == "dflash":
            d = zlab_config_from_speculators(d, source)
        raise_first(drafter_config_problems(d, source))
        dcfg = d.get("dflash_config") or {}
        block_size = d.get("block_size", dcfg.get("block_size"))
        mask = dcfg.get("mask_token_id", d.get("mask_token_id"))
        n_layers = d["num_hidden_layers"]
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(d["num_target_layers"], n_layers)
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
            # transformers >= 5 writes RoPE as rope_parameters {rope_theta, rope_type, ...} (the DFlash2 fixture does)
            rms_norm_eps=d.get("rms_norm_eps") or 1e-6,
            rope_theta=d.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rope_scaling=d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            max_position_embeddings=d.get("max_position_embeddings") or 32768,
            block_size=int(block_size), mask_token_id=int(mask), target_layer_ids=[int(i) for i in ids],
            num_target_layers=d.get("num_target_layers"), attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act") or "silu", kind=drafter_kind(d), layer_attention=layer_attention(d),
            **{k: int(draft_value(d, k, 0)) for k in DFLASH2_FIELDS},
            **{k: float(draft_value(d, k, 1.0)) for k in ("input_embedding_scale", "output_multiplier")},
            final_logit_softcapping=(float(draft_value(d, "final_logit_softcapping"))
                                     if draft_value(d, "final_logit_softcapping") else None),
            raw=d,
        )

    def to_dict(self) -> dict:
        """The z-lab config.json: `raw` with our (possibly edited) fields written over it."""
        d = dict(self.raw)
        for k, v in drafter_identity(self.kind).items():
            d.setdefault(k, v)
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "max_position_embeddings", "attention_bias", "hidden_act", "block_size"):
            d[k] = getattr(self, k)
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        d.setdefault("layer_types", qwen3_window_and_types(d)[1])   # as transformers would derive them
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
    aux = d["aux_hidden_state_layer_ids"]
    if not (isinstance(aux, list) and all(_is_int(i) for i in aux)):
        raise DFlashError(f"{source}: aux_hidden_state_layer_ids = {_short(aux)}: must be a list of integers")
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    out.update({
        **drafter_identity(), "block_size": d["block_size"],
        "dflash_config": {"mask_token_id": d["mask_token_id"],
                          "target_layer_ids": [i - 1 for i in aux]},
    })
    out.setdefault("vocab_size", d.get("draft_vocab_size"))
    return out


def load_drafter_config(folder: str | Path) -> DrafterConfig:
    path = Path(folder) / "config.json"
    return DrafterConfig.from_dict(read_json(path), str(path))
