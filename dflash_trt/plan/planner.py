"""Capacity planner: per-GPU memory of a (target, drafter) pair on a node type, and the
TP / EP / replica layouts that fit, ranked — from the models' config.json alone (no weights).

Memory per GPU of one layout (each term the cost model's, plan/cost.py, which the speed model reads too):

    weights (by format)  +  drafter weights (BF16)  +  activations  +  runtime reserve
    + KV pool = FREE_GPU_MEMORY_FRACTION × what is left        (TensorRT-LLM's kv_cache_config default)

The drafter is BF16, or FP8 (attention and MLP linears) when the bundle says so.

Weights by format, bytes per element of a quantized linear layer's weight:
    BF16 2 · FP8 1 (+ fp32 weight/input scales) · NVFP4 0.5 + 1/16 (FP8 scale per 16 elements,
    + fp32 global and input scales) · MXFP4 0.5 + 1/32 (E8M0 scale per 32 elements; gpt-oss experts).
Kept in BF16 whatever the format (docs/formats.md): embeddings, lm_head, routers, norms, biases,
attention sinks, and all of gpt-oss outside its experts.

Tensor parallel splits (TensorRT-LLM's mapping): q / o and MLPs by tp; k / v by tp with KV heads
duplicated when tp exceeds them (ceil(kv_heads / tp) heads per GPU); experts by tp in total
(ep ranks hold E/ep experts, each split over moe_tp = tp/ep); embedding and lm_head by vocab.
Norms, routers and biases are replicated.

KV cache per token: every layer keeps 2 · kv_heads · head_dim values per token of context; a layer keeps at
most window + block tokens per sequence only under per-layer windows (kv_cache_config.max_attention_window,
repeated over the layers as TensorRT-LLM does). The drafter's cache holds the projected target features of
every context token (docs/decode-loop.md), so it grows with context too. Activations are a rough upper bound
(stated below), not a measurement. Windows, the max_batch_size cap and the GPU memory figure: docs/deploy.md
(Capacity planning).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import Hardware, get_hardware
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.families import family, ships_mxfp4
from dflash_trt.plan.cost import kv_bytes_per_token, weight_bytes
from dflash_trt.plan.family_shapes import meta_shape_fields

# the layout search's stage (plan/layouts.py); Layout and GIB are the planner's names for its callers too
from dflash_trt.plan.layouts import GIB, RANKING, Layout, Sizing, _candidate_layouts, _evaluate
from dflash_trt.plan.shapes import Group, ModelShape
from dflash_trt.presets.catalog import FIGURES_KEY, PRESETS, resolve_drafter
from dflash_trt.stacks.trtllm.profiles import PROFILES, curated_layout, profile_settings

# TensorRT-LLM's default kv_cache_config.free_gpu_memory_fraction: the share of the memory left
# after weights and activations that becomes the KV pool.
FREE_GPU_MEMORY_FRACTION = 0.9
DEFAULT_MAX_NUM_TOKENS = 8192    # TensorRT-LLM's default max_num_tokens
DEFAULT_MAX_BATCH_SIZE = 128
DEFAULT_MAX_SEQ_LEN_CAP = 32768
# Bounds of the counts a user gives (the Helm chart's gpu.count ≤ 16 per pod; 1024 nodes is far
# past any one model's deployment and keeps the layout search instant).
MAX_NODES = 1024
MAX_GPUS_PER_NODE = 16

QUANT_FORMATS = ("auto", "none", "fp8", "nvfp4", "mxfp4")
KV_FORMATS = ("auto", "fp8", "bf16")

# A quantized drafter (build --drafter-quant): its decoder Linears in ModelOpt FP8 / NVFP4, fc kept bf16
# (drafter_shape: fc is not quantizable), as SGLang's DFlash loader takes it; TensorRT-LLM's also keeps
# q/k/v bf16 (engines.json drafter_quant), which this counts as quantized.
DRAFTER_QUANT_FORMATS = ("none", "fp8", "nvfp4", "int8")

# Which model types the planner sizes by hand, and how, is each family's row (models/families.family:
# hand_sized, experts, qk_norm, ...); any other family is sized from transformers' model (family_shapes.py).


# ---------------------------------------------------------------------------------------------
# Model shapes and parameter groups


def _attention_groups(layers, hidden, heads, kv_heads, head_dim, bias, qk_norm, sinks) -> list[Group]:
    q = heads * head_dim
    kv = kv_heads * head_dim
    groups = [
        Group("attn_qo", layers * 2 * hidden * q, "tp", True, linears=2 * layers),
        Group("attn_kv", layers * 2 * hidden * kv, "kv", True, linears=2 * layers, kv_heads=kv_heads),
    ]
    small = 0
    if bias:
        small += layers * (q + 2 * kv + hidden)
    if qk_norm:
        small += layers * 2 * head_dim
    if sinks:
        small += layers * heads
    if small:
        groups.append(Group("attn_small", small, "rep", False))
    return groups


def target_shape(cfg: dict, name: str = "target") -> ModelShape:
    """Parameter groups of a Hugging Face decoder-only config (dense Llama / Qwen / Mistral, or
    MoE gpt-oss / Qwen3-MoE / Mixtral)."""
    mt = cfg.get("model_type")
    fam = family(mt)
    if not fam.hand_sized:
        # any other family: its parameter groups from transformers' model of the config (plan/family_shapes.py)
        fields, groups = meta_shape_fields(cfg, name)
        return ModelShape(**fields, native_format=native_format(cfg), groups=[Group(**g) for g in groups])
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if k not in cfg:
            raise DFlashError(f"{name}: config.json has no field {k}")
    H, L, nh, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["vocab_size"]
    kvh = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    E = (cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if fam.experts else 0
    k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0
    inter = cfg.get(fam.expert_width_key)
    if inter is None:
        raise DFlashError(f"{name}: config.json has no field intermediate_size")
    layer_types = cfg.get("layer_types") or ["full_attention"] * L
    sliding = cfg.get("sliding_window") if "sliding_attention" in layer_types else None

    groups = [Group("embed", V * H, "tp", False)]
    if not cfg.get("tie_word_embeddings", False):
        groups.append(Group("lm_head", V * H, "tp", False))
    groups += _attention_groups(L, H, nh, kvh, hd, bool(cfg.get("attention_bias", False)),
                                qk_norm=fam.qk_norm, sinks=fam.attention_sinks)
    groups.append(Group("norms", L * 2 * H + H, "rep", False))
    if E:
        moe_layers = L
        dense_layers = 0
        if fam.sparse_moe_layers:
            step = cfg.get("decoder_sparse_step", 1) or 1
            only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
            dense_layers = L - moe_layers
        frac = k / E
        groups.append(Group("experts", moe_layers * E * 3 * H * inter, "tp", True,
                            linears=moe_layers * E * 2, expert=True, active_fraction=frac))
        groups.append(Group("router", moe_layers * (H * E + (E if fam.expert_biases else 0)), "rep", False))
        if fam.expert_biases:  # gate_up bias [E, 2I] and down bias [E, H]
            groups.append(Group("expert_bias", moe_layers * E * (2 * inter + H), "rep", False,
                                active_fraction=frac))
        if dense_layers:
            groups.append(Group("mlp", dense_layers * 3 * H * cfg["intermediate_size"], "tp", True,
                                linears=3 * dense_layers))
    else:
        groups.append(Group("mlp", L * 3 * H * inter, "tp", True, linears=3 * L))
        if cfg.get("mlp_bias"):
            groups.append(Group("mlp_bias", L * (2 * inter + H), "rep", False))
    return ModelShape(name=name, model_type=mt, hidden=H, layers=L, heads=nh, kv_heads=kvh, head_dim=hd,
                      vocab=V, intermediate=inter, experts=E, experts_per_token=k, layer_types=layer_types,
                      sliding_window=sliding, native_format=native_format(cfg), groups=groups)


def drafter_shape(cfg: dict, name: str = "drafter") -> ModelShape:
    """Parameter groups of a z-lab DFlash drafter (docs/formats.md): fc [H, n_feat·H], hidden_norm,
    norm, Qwen3 decoder blocks; no embedding and no lm_head (it borrows the target's)."""
    d = _figures(cfg, name) if FIGURES_KEY in cfg else DrafterConfig.from_dict(cfg, name)
    H, L = d.hidden_size, d.num_hidden_layers
    groups = [Group("fc", d.n_features * H * H, "tp", False), Group("norms", 2 * H + L * 2 * H, "rep", False)]
    groups += _attention_groups(L, H, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
                                d.attention_bias, qk_norm=True, sinks=False)
    groups.append(Group("mlp", L * 3 * H * d.intermediate_size, "tp", True, linears=3 * L))
    layer_types = cfg.get("layer_types") or ["full_attention"] * L
    return ModelShape(name=name, model_type="dflash", hidden=H, layers=L, heads=d.num_attention_heads,
                      kv_heads=d.num_key_value_heads, head_dim=d.head_dim, vocab=d.vocab_size,
                      intermediate=d.intermediate_size, layer_types=layer_types,
                      sliding_window=cfg.get("sliding_window") if "sliding_attention" in layer_types else None,
                      groups=groups, has_embedding=False)


def _figures(cfg: dict, name: str) -> SimpleNamespace:
    """The fields drafter_shape reads, from a preset's published figures (presets/catalog.drafter_figures): not a
    config.json, so not held to the drafter config's rules (a mask token, say, it may not give)."""
    ints = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size")
    for k in ints:
        if not isinstance(cfg.get(k), int) or cfg[k] < 1:
            raise DFlashError(f"{name}: published drafter figures have no positive integer {k}")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise DFlashError(f"{name}: published drafter figures have no target_layer_ids")
    return SimpleNamespace(**{k: cfg[k] for k in ints}, n_features=len(ids), attention_bias=False)


def native_format(cfg: dict) -> str:
    """The weight format a checkpoint ships in, from its quantization_config."""
    if ships_mxfp4(cfg):
        return "mxfp4"
    q = cfg.get("quantization_config") or {}
    algo = str(q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or "").upper()
    return {"FP8": "fp8", "NVFP4": "nvfp4"}.get(algo, "none")


# ---------------------------------------------------------------------------------------------
# Formats


def resolve_quant(shape: ModelShape, hw: Hardware, quant: str) -> str:
    """The target's weight format. `auto` follows `dflash-trt build`: MXFP4 kept for gpt-oss, an
    already-quantized checkpoint kept as is, else NVFP4 on Blackwell and FP8 on Hopper."""
    if quant not in QUANT_FORMATS:
        raise DFlashError(f"--quant {quant!r}: choose one of {', '.join(QUANT_FORMATS)}")
    if quant == "auto":
        quant = shape.native_format if shape.native_format != "none" else "nvfp4" if hw.fp4 else "fp8"
    mxfp4_experts = shape.native_format == "mxfp4"
    if mxfp4_experts and quant in ("fp8", "nvfp4"):
        raise DFlashError(f"--quant {quant}: TensorRT-LLM serves gpt-oss with its MXFP4 experts only "
                          "(no FP8 / NVFP4 weight path); use --quant mxfp4 (the default) or none")
    if quant == "mxfp4" and not mxfp4_experts:
        raise DFlashError(f"--quant mxfp4: only gpt-oss ships MXFP4 experts; {shape.name} "
                          f"(model_type {shape.model_type}) takes none, fp8 or nvfp4")
    if quant == "nvfp4" and not hw.fp4:
        raise DFlashError(f"--quant nvfp4: {hw.name} ({hw.sm}) has no FP4 tensor cores; NVFP4 needs "
                          "Blackwell (sm_100/sm_103); use --quant fp8")
    if quant == "fp8" and not hw.fp8:
        raise DFlashError(f"--quant fp8: {hw.name} ({hw.sm}) has no FP8 tensor cores")
    return quant


def resolve_kv(quant: str, kv: str, hw: Hardware) -> str:
    if kv not in KV_FORMATS:
        raise DFlashError(f"--kv-cache {kv!r}: choose one of {', '.join(KV_FORMATS)}")
    if kv == "auto":
        kv = "fp8" if quant != "none" and hw.fp8 else "bf16"
    return kv


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass
class Plan:
    target: str
    drafter: str | None
    hardware: str
    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int      # per GPU, as the GPU reports it
    quant: dict
    max_seq_len: int
    max_num_tokens: int
    max_batch_size: int
    kv_fraction: float
    max_attention_window: list[int] | None
    block_size: int
    objective: str
    profile: str | None
    total_params: int
    active_params: int
    drafter_params: int
    weights_bytes: dict
    weights_bytes_per_gpu: dict
    kv_bytes_per_token: dict
    layouts: list[Layout]

    @property
    def chosen(self) -> Layout | None:
        return self.layouts[0] if self.layouts and self.layouts[0].fits else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chosen"] = asdict(self.chosen) if self.chosen else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """A plan from its to_dict() (plan/record.py: the plan a bundle carries)."""
        fields = {k: v for k, v in d.items() if k not in ("chosen", "layouts")}
        return cls(**fields, layouts=[Layout(**lay) for lay in d["layouts"]])


def plan(target_cfg: dict, drafter_cfg: dict | None, hardware: str | Hardware, *, target_name: str = "target",
         drafter_name: str | None = None, quant: str = "auto", kv_cache: str = "auto",
         drafter_quant: str = "none", max_seq_len: int | None = None, nodes: int = 1, gpus_per_node: int | None = None,
         max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
         objective: str = "latency", tp: int | None = None, ep: int | None = None,
         kv_fraction: float = FREE_GPU_MEMORY_FRACTION, max_attention_window: list[int] | None = None,
         profile: str | None = None, attention_dp: bool | None = None, batch_pinned: bool = False) -> Plan:
    """Evaluate every TP / EP / replica layout of `nodes` nodes of `hardware`, ranked.

    Ranking (fitting layouts first): objective "latency" prefers a replica inside one NVLink
    domain, then the widest TP (fewest weight bytes read per GPU per step), then EP 1 (the
    TensorRT-LLM latency recipe), then the most KV tokens; "throughput" prefers the most concurrent
    sequences over all replicas, then the narrowest TP, then the widest EP. `tp` / `ep` restrict
    the search to those values (a bundle whose model repository fixes them); `kv_fraction` is
    kv_cache_config.free_gpu_memory_fraction, `max_attention_window` its per-layer windows
    (None: every layer holds the whole sequence). `profile` (latency | throughput) follows NVIDIA's
    curated config of the target's family (stacks/trtllm/profiles.py): it sets the objective, the
    max_batch_size / max_num_tokens when not given, attention DP, and ranks the curated TP / EP
    first where it fits; `attention_dp` overrides the profile's (a bundle's serving config)."""
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
    gpn = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    _check_options(kv_fraction, objective, nodes, gpn, max_batch_size, max_num_tokens)
    target = target_shape(target_cfg, target_name)
    drafter = drafter_shape(drafter_cfg, drafter_name or "drafter") if drafter_cfg else None
    if drafter and drafter.hidden != target.hidden:
        raise DFlashError(f"{drafter_name}: drafter hidden_size {drafter.hidden} != target hidden_size "
                          f"{target.hidden} ({target_name})")
    fmt = resolve_quant(target, hw, quant)
    kv = resolve_kv(fmt, kv_cache, hw)
    if drafter_quant not in DRAFTER_QUANT_FORMATS:
        raise DFlashError(f"--drafter-quant {drafter_quant!r}: expected one of {', '.join(DRAFTER_QUANT_FORMATS)}")
    if drafter_quant == "nvfp4" and not hw.fp4:
        raise DFlashError(f"--drafter-quant nvfp4: {hw.name} ({hw.sm}) has no FP4 tensor cores; use fp8")
    if drafter_quant == "fp8" and not hw.fp8:
        raise DFlashError(f"--drafter-quant fp8: {hw.name} ({hw.sm}) has no FP8 tensor cores")
    max_seq_len = _max_seq_len(target_cfg, max_seq_len, target_name)
    block = _block_size(drafter_cfg)
    preferred = None
    if profile is not None:
        if profile not in PROFILES:
            raise DFlashError(f"--profile {profile!r}: choose {' or '.join(PROFILES)}")
        ps = profile_settings(profile, target_cfg, block)
        objective = profile
        max_batch_size = ps["max_batch_size"] if max_batch_size == DEFAULT_MAX_BATCH_SIZE else max_batch_size
        max_num_tokens = (max(ps["max_num_tokens"], max_batch_size * block) if max_num_tokens == DEFAULT_MAX_NUM_TOKENS
                          else max_num_tokens)
        attention_dp = ps["enable_attention_dp"] if attention_dp is None else attention_dp
        preferred = curated_layout(profile, target_cfg)
    s = Sizing(target, drafter, hw, gpn, nodes * gpn, fmt, drafter_quant, kv, max_seq_len, max_num_tokens,
               min(max_num_tokens, max_batch_size * block), block, kv_fraction, max_batch_size,
               layer_windows(target.layers, max_attention_window, max_seq_len, block),
               drafter_cfg=drafter_cfg, attention_dp=bool(attention_dp), preferred=preferred, batch_pinned=batch_pinned)

    layouts = [_evaluate(s, t, e) for t, e in _candidate_layouts(s, nodes, tp, ep)]
    layouts.sort(key=RANKING[objective])
    if preferred:   # a stable second sort would undo the preference: rank the curated layout first where it fits
        layouts.sort(key=lambda lay: (not lay.fits, (lay.tp, lay.ep) != preferred))

    ref = next((l for l in layouts if l.fits), max(layouts, key=lambda l: l.tp))  # the per-GPU weights reported
    return Plan(
        target=target_name, drafter=drafter_name if drafter else None, hardware=hw.name, nodes=nodes,
        gpus_per_node=gpn, gpu_memory_bytes=hw.reported_memory_bytes,
        quant={"target": fmt, "kv_cache": kv, "drafter": drafter_quant}, max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens, max_batch_size=max_batch_size, kv_fraction=kv_fraction,
        max_attention_window=list(max_attention_window) if max_attention_window else None, block_size=block,
        objective=objective, profile=profile,
        total_params=target.total_params, active_params=target.active_params,
        drafter_params=drafter.total_params if drafter else 0,
        weights_bytes={"target": weight_bytes(target, fmt), "drafter": weight_bytes(drafter, drafter_quant) if drafter else 0},
        weights_bytes_per_gpu={"tp": ref.tp, "ep": ref.ep, "target": ref.weights_bytes_per_gpu,
                               "drafter": ref.drafter_bytes_per_gpu},
        kv_bytes_per_token=_kv_bytes_per_token(target, drafter, kv, s.windows), layouts=layouts,
    )


def check_nodes(nodes: int) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise DFlashError(f"--nodes {nodes}: must be in [1, {MAX_NODES}]")


def _check_options(kv_fraction: float, objective: str, nodes: int, gpus_per_node: int, max_batch_size: int,
                   max_num_tokens: int) -> None:
    if not 0 < kv_fraction <= 1:
        raise DFlashError(f"free_gpu_memory_fraction {kv_fraction}: must be in (0, 1]")
    if objective not in RANKING:
        raise DFlashError(f"--objective {objective!r}: choose latency or throughput")
    check_nodes(nodes)
    if not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:
        raise DFlashError(f"--gpus-per-node {gpus_per_node}: must be in [1, {MAX_GPUS_PER_NODE}]")
    if max_batch_size < 1 or max_num_tokens < 1:
        raise DFlashError(f"max_batch_size {max_batch_size} / max_num_tokens {max_num_tokens}: must be at least 1")


def parse_windows(text: str) -> list[int]:
    """--max-attention-window "128,32768" → [128, 32768]."""
    try:
        windows = [int(w) for w in text.split(",")]
    except ValueError:
        windows = []
    if not windows or any(not 1 <= w <= 10**7 for w in windows) or len(windows) > 1024:
        raise DFlashError(f"--max-attention-window {text!r}: expected comma-separated token counts in [1, 10000000]")
    return windows


def layer_windows(layers: int, max_attention_window: list[int] | None, max_seq_len: int,
                  block: int) -> list[int | None]:
    """Tokens each target layer keeps per sequence: min(window + block, max_seq_len) where
    TensorRT-LLM's kv_cache_config.max_attention_window gives a window (its list is repeated over
    the layers when shorter), None (the whole sequence) elsewhere or without the setting."""
    if not max_attention_window:
        return [None] * layers
    if any(not isinstance(w, int) or w < 1 for w in max_attention_window):
        raise DFlashError(f"max_attention_window {max_attention_window}: windows must be positive integers")
    out: list[int | None] = []
    for i in range(layers):
        kept = max_attention_window[i % len(max_attention_window)] + block
        out.append(kept if kept < max_seq_len else None)
    return out


def _max_seq_len(target_cfg: dict, max_seq_len: int | None, target_name: str) -> int:
    """--max-seq-len, checked against the target's max_position_embeddings (default: that, capped)."""
    max_pos = target_cfg.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LEN_CAP
    if max_seq_len is None:
        max_seq_len = min(max_pos, DEFAULT_MAX_SEQ_LEN_CAP)
    if max_seq_len < 1 or max_seq_len > max_pos:
        raise DFlashError(f"--max-seq-len {max_seq_len}: must be in [1, {max_pos}] "
                          f"(max_position_embeddings of {target_name})")
    return max_seq_len


def _block_size(drafter_cfg: dict | None) -> int:
    """The drafter's block size (top level or in dflash_config); 1 without a drafter."""
    d = drafter_cfg or {}
    return int(d.get("block_size") or (d.get("dflash_config") or {}).get("block_size") or 1)


def _kv_bytes_per_token(target: ModelShape, drafter: ModelShape | None, kv: str, windows: list[int | None]) -> dict:
    """Plan.kv_bytes_per_token: KV bytes per token of context of each model (unsplit); the
    target's windowed layers apart, when the serving config sets max_attention_window."""
    full = sum(w is None for w in windows)
    d = {"target": kv_bytes_per_token(target, kv, layers=full),
         "drafter": kv_bytes_per_token(drafter, kv) if drafter else 0, "format": kv}
    if full < len(windows):
        kept = sorted({w for w in windows if w is not None})
        d["target_sliding_window"] = {"layers": len(windows) - full, "tokens_kept": kept,
                                      "bytes_per_token": kv_bytes_per_token(target, kv, layers=len(windows) - full)}
    return d


# ---------------------------------------------------------------------------------------------
# Inputs


def target_configs(target: str) -> tuple[str, dict, dict | None]:
    """--target NAME|DIR → (name, config.json, the preset's drafter config or None)."""
    if target in PRESETS:
        p = PRESETS[target]
        dcfg = p.drafter_plan_config()
        if dcfg is None and p.drafter_hf_id is None:    # the embedded pair: our drafter ships in the package
            dcfg = read_json(resolve_drafter(None, target) / "config.json")
        return target, p.config(), dcfg
    path = Path(target)
    if path.is_dir():
        return path.name, read_json(path / "config.json"), None
    raise DFlashError(f"--target {target!r}: neither a preset ({', '.join(sorted(PRESETS))}) nor a folder with config.json")


def drafter_config(folder: str) -> tuple[str, dict]:
    path = Path(folder)
    if not path.is_dir():
        raise DFlashError(f"--drafter {folder}: not a folder")
    return path.name, read_json(path / "config.json")


def merged_rows(layouts: list[Layout]) -> list[tuple[int, list[int], Layout]]:
    """(rank of the first, eps, the first layout) of consecutive ranked layouts equal in all but ep."""
    out: list[tuple[int, list[int], Layout]] = []
    for i, l in enumerate(layouts, 1):
        if out and asdict(replace(out[-1][2], ep=l.ep)) == asdict(l):
            out[-1][1].append(l.ep)
        else:
            out.append((i, [l.ep], l))
    return out


def format_plan(p: Plan) -> str:
    """A human-readable report of a plan."""
    gb = lambda b: f"{b / GIB:,.1f} GiB"
    lines = [
        (f"target {p.target}: {p.total_params / 1e9:.2f} B parameters, {p.active_params / 1e9:.2f} B active per token; "
         f"weights {gb(p.weights_bytes['target'])} as {p.quant['target']}"),
        (f"drafter {p.drafter}: {p.drafter_params / 1e9:.3f} B parameters, {gb(p.weights_bytes['drafter'])} "
         f"{'bf16' if p.quant['drafter'] == 'none' else p.quant['drafter']}, "
         f"block {p.block_size}") if p.drafter else "drafter: none given (plain decoding figures)",
        f"KV cache ({p.quant['kv_cache']}): target {p.kv_bytes_per_token['target']:,} B/token"
        + (f" + windowed layers {p.kv_bytes_per_token['target_sliding_window']['bytes_per_token']:,} B/token up to "
           f"{max(p.kv_bytes_per_token['target_sliding_window']['tokens_kept'])} tokens (max_attention_window)"
           if "target_sliding_window" in p.kv_bytes_per_token else "")
        + f"; drafter {p.kv_bytes_per_token['drafter']:,} B/token",
        (f"hardware {p.hardware}: {p.nodes} node(s) × {p.gpus_per_node} GPUs of {gb(p.gpu_memory_bytes)}; "
         f"max_seq_len {p.max_seq_len}, max_batch_size {p.max_batch_size}, objective {p.objective}"),
        "",
        f"{'rank':>5} {'tp':>3} {'ep':>7} {'repl':>4} {'weights/GPU':>12} {'KV tokens':>12} {'seqs/repl':>9}  reason",
    ]
    groups = merged_rows(p.layouts)
    for first, eps, l in groups:
        last = first + len(eps) - 1
        rank = (f"{first}" if last == first else f"{first}-{last}") if l.fits else "-"
        lines.append(f"{rank:>5} {l.tp:>3} {'/'.join(map(str, eps)):>7} {l.replicas:>4} "
                     f"{gb(l.weights_bytes_per_gpu) if l.weights_bytes_per_gpu else '':>12} {l.kv_tokens:>12,} "
                     f"{l.max_sequences:>9,}  {l.reason}")
    if len(groups) < len(p.layouts):
        lines.append("(rows of one tp that differ only in ep, with the same figures, are one row: ep 1/2/...; --json "
                     "lists each)")
    c = p.chosen
    lines.append("")
    if c:
        lines.append(f"chosen: tp {c.tp}, ep {c.ep}, {c.replicas} replica(s); per GPU: weights "
                     f"{gb(c.weights_bytes_per_gpu)} + drafter {gb(c.drafter_bytes_per_gpu)} + activations "
                     f"{gb(c.activation_bytes_per_gpu)} + runtime {gb(c.runtime_reserve_bytes)}, KV pool "
                     f"{gb(c.kv_budget_bytes_per_gpu)} ({c.kv_bytes_per_token_per_gpu:,} B/token per GPU)"
                     + (f"; DFlash draft context {gb(c.draft_context_bytes_per_gpu)} per rank (budget "
                        f"{gb(c.draft_context_budget_bytes_per_gpu)}), max_batch_size {c.max_batch_size}"
                        if c.draft_context_bytes_per_gpu else "")
                     + (", attention DP" if c.attention_dp else ""))
    else:
        lines.append("chosen: nothing fits")
    return "\n".join(lines)
