"""`dflash-trt convert`: a Hugging Face Llama / Qwen3 checkpoint -> TensorRT-LLM checkpoint
(`config.json` + `rank{N}.safetensors`) for the TensorRT engine path (TensorRT-LLM <= 1.2); the layout
ModelOpt's `export_tensorrt_llm_checkpoint` writes (docs/formats.md has the tensor table; tests/test_convert.py
compares tensors byte for byte).

One pass over the input: every HF tensor is read once and its slice for each rank is written straight
into that rank's file (all rank files open at once, each a streaming writer), so memory stays at about one
tensor (one fused q/k/v or gate/up group) whatever the model size. The layout is data (MODEL_LAYOUT,
LAYER_LAYOUT: HF tensors to TensorRT-LLM ones, how each rank's part is taken, which are quantized
Linears); planning and writing are loops over it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats
from dflash_trt.io.atomic import atomic_output_dir, refuse_inside, write_text
from dflash_trt.io.checkpoint import CheckpointReader, check_finite, load_config
from dflash_trt.io.direct_io import DirectWriter
from dflash_trt.io.shards import Progress, ShardedWriter, TensorSpec
from dflash_trt.models.check import require_checkpoint_config
from dflash_trt.models.shapes import check_shapes
from dflash_trt.quant.calibrate import CalibrationResult, calibrate, load_calib_samples
from dflash_trt.quant.linear import (
    FORMATS,
    MODELOPT_VERSION,
    TRTLLM_EXPORT,
    linear_specs,
    per_tensor_scale,
    quantize_linear,
)

# TensorRT-LLM's engine checkpoint layout per family it has one for (one row each): its architecture, the
# `decoder` of its rank config, and keys ModelOpt 0.47 omits that we write (qwen_type: without it TensorRT-LLM
# would build Qwen (v1), without the q/k norms).
ENGINE_LAYOUTS = {
    "llama": {"architecture": "LlamaForCausalLM", "decoder": "llama", "extra": {}},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "decoder": "qwen", "extra": {"qwen_type": "qwen3"}},
}
ARCHITECTURES = {mt: row["architecture"] for mt, row in ENGINE_LAYOUTS.items()}
QUANTS = ("none", *FORMATS)
_PYTORCH_BACKEND = ("serve it with the PyTorch backend straight from the Hugging Face folder (trtllm-serve <dir>, "
                    "see `dflash-trt build`), optionally after `dflash-trt quantize")
# model_type -> why convert refuses it: families TensorRT-LLM serves only from the HF / ModelOpt checkpoint.
# Gated DeltaNet hybrids, read in NVIDIA/TensorRT-LLM: the legacy path's tensorrt_llm/models/qwen/config.py
# @373970a88b18 (QWenConfig.from_hugging_face asserts qwen_type in qwen, qwen2, qwen2_moe, qwen2_llava_onevision,
# qwen2_vl, qwen2_audio, qwen3, qwen3_moe); the PyTorch backend's loader for them,
# tensorrt_llm/_torch/models/checkpoints/hf/qwen3_next_weight_mapper.py @ff5ca3359ab1 (Qwen3NextForCausalLM;
# qwen3_5_weight_mapper.py @da259e7dc656 and qwen3_5_moe_weight_mapper.py @891c11e483f7 beside it).
_HYBRID = ("TensorRT-LLM has no engine (TensorRT) checkpoint layout for the Gated DeltaNet hybrids (its legacy "
           "QWenConfig takes qwen, qwen2(_moe/_vl/_audio), qwen3, qwen3_moe only); " + _PYTORCH_BACKEND + "`")
# MLA, read in NVIDIA/TensorRT-LLM: TensorRT-LLM <= 1.2's MODEL_MAP
# (tensorrt_llm/models/__init__.py @02267d3d4fd886c3ad036f6580beb0847eac6e4b) has no GptOss,
# DeepseekV3, Kimi-K2.5 or GlmMoeDsa architecture; its one MLA layout, DeepseekV2ForCausalLM
# (tensorrt_llm/models/deepseek_v2/convert.py @65b31db1b401d3752b8ebe7c29093cbfb6af04b7), routes by
# softmax (topk_method greedy / group_limited_greedy), reads yarn rope_scaling unconditionally and
# has no e_score_correction_bias nor DSA indexer: not DeepSeek-V3's sigmoid + bias routing, not GLM-5.
_MLA = ("TensorRT-LLM has no engine (TensorRT) checkpoint layout for it (its only MLA layout is DeepSeek-V2's: "
        "softmax routing, no e_score_correction_bias, no DSA indexer); " + _PYTORCH_BACKEND + "`")
NO_ENGINE_LAYOUT = {
    "gpt_oss": "gpt-oss: TensorRT-LLM has no engine (TensorRT) checkpoint layout for it; " + _PYTORCH_BACKEND
               + " --kv-cache fp8`",
    **{mt: f"{mt}: {_HYBRID}" for mt in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")},
    "deepseek_v3": f"DeepSeek-V3 (MLA): {_MLA}",
    "kimi_k25": f"Kimi K2.5 (DeepSeek-V3 MLA): {_MLA}",
    "glm_moe_dsa": f"GLM-5 (MLA + DSA): {_MLA}",
    # Gemma 4 and MiniMax-M2: the legacy MODEL_MAP (tensorrt_llm/models/__init__.py @02267d3d4fd8) stops at
    # Gemma3ForCausalLM (tensorrt_llm/models/gemma/config.py @9df6d722b020: GEMMA, GEMMA2, GEMMA3_ARCHITECTURE)
    # and has no MiniMax; the PyTorch backend serves both: tensorrt_llm/_torch/models/modeling_gemma4.py
    # @7d4944038513 (its HF loader checkpoints/hf/gemma4_weight_mapper.py @7ed07f0691df) and
    # modeling_minimaxm2.py @9c8b74e8a640 (register_auto_model("MiniMaxM2ForCausalLM")).
    **{mt: f"{mt}: TensorRT-LLM has no engine (TensorRT) checkpoint layout for Gemma 4 (its legacy path stops at "
           f"Gemma 3); {_PYTORCH_BACKEND}`" for mt in ("gemma4", "gemma4_text")},
    "minimax_m2": "minimax_m2: TensorRT-LLM has no engine (TensorRT) checkpoint layout for MiniMax-M2; "
                  + _PYTORCH_BACKEND + "`",
}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class Geometry:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tp: int

    @property
    def vocab_padded(self) -> int:
        return math.ceil(self.vocab / self.tp) * self.tp


def _geometry(cfg: dict, tp: int) -> Geometry:
    try:
        g = Geometry(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                     cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                     cfg["intermediate_size"], cfg["vocab_size"], tp)
    except KeyError as e:
        raise DFlashError(f"config.json: missing field {e.args[0]}") from None
    if g.heads % tp:
        raise DFlashError(f"--tp {tp}: num_attention_heads {g.heads} is not divisible by it")
    if g.kv_heads >= tp and g.kv_heads % tp:
        raise DFlashError(f"--tp {tp}: num_key_value_heads {g.kv_heads} is not divisible by it")
    if g.kv_heads < tp and tp % g.kv_heads:
        raise DFlashError(f"--tp {tp}: must be a multiple of num_key_value_heads {g.kv_heads} to duplicate kv heads")
    if g.inter % tp:
        raise DFlashError(f"--tp {tp}: intermediate_size {g.inter} is not divisible by it")
    return g


# ----------------------------------------------------------------------------------------------
# the HF -> TensorRT-LLM layout

@dataclass(frozen=True)
class Row:
    """TensorRT-LLM tensors made from HF ones, read together: trt[k] from hf[k], except for
    split "qkv", whose sources are concatenated into its one output."""
    hf: tuple[str, ...]
    trt: tuple[str, ...]
    split: str              # rank r's part: see _rank_parts
    kind: str = "tensor"    # "tensor": copied; "linear": quantized with --quant, all of hf sharing one
                            # weight scale and one activation scale (one GEMM in the engine);
                            # "kv_scales": FP8 KV-cache scales from calibration (hf: the attention)
    optional: bool = False  # only where the checkpoint has hf[0]


# Names under model. / transformer.; in the order of TensorRT-LLM's files.
MODEL_LAYOUT = (
    Row(("model.embed_tokens.weight", "lm_head.weight"), ("transformer.vocab_embedding.weight", "lm_head.weight"),
        "vocab"),
    Row(("model.norm.weight",), ("transformer.ln_f.weight",), "all"),
)
# Tied embeddings: lm_head is the embedding matrix, and TensorRT-LLM engines get their own copy.
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
# Names under model.layers.{i}. / transformer.layers.{i}.
LAYER_LAYOUT = (
    Row(("input_layernorm.weight",), ("input_layernorm.weight",), "all"),
    Row(("post_attention_layernorm.weight",), ("post_layernorm.weight",), "all"),
    Row(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), ("attention.qkv.weight",),
        "qkv", "linear"),
    Row(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), ("attention.qkv.bias",),
        "qkv", optional=True),
    Row(("self_attn.o_proj.weight",), ("attention.dense.weight",), "cols", "linear"),
    Row(("self_attn.q_norm.weight", "self_attn.k_norm.weight"),   # Qwen3
        ("attention.q_layernorm.weight", "attention.k_layernorm.weight"), "all", optional=True),
    Row(("self_attn",), ("attention.k_cache_scaling_factor", "attention.v_cache_scaling_factor",
                         "attention.kv_cache_scaling_factor"), "all", "kv_scales"),
    Row(("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("mlp.fc.weight", "mlp.gate.weight"), "rows", "linear"),
    Row(("mlp.down_proj.weight",), ("mlp.proj.weight",), "cols", "linear"),
)


def _layout(reader: CheckpointReader, g: Geometry, kv_cache: str | None) -> list[Row]:
    """This checkpoint's rows, with full names: optional ones where present, KV scales with --kv-cache fp8."""
    rows = [replace(row, hf=tuple(n if n in reader else TIED.get(n, n) for n in row.hf)) for row in MODEL_LAYOUT]
    for i in range(g.layers):
        h, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        for row in LAYER_LAYOUT:
            if (row.kind == "kv_scales" and kv_cache != "fp8") or (row.optional and h + row.hf[0] not in reader):
                continue
            rows.append(replace(row, hf=tuple(h + n for n in row.hf), trt=tuple(t + n for n in row.trt)))
    return rows


def _rank_parts(row: Row, tensors: list[torch.Tensor], g: Geometry, r: int) -> list[torch.Tensor]:
    """Rank r's part of each of the row's outputs, from its HF tensors (in row.hf order):
    "rows" / "cols": dim 0 / 1 in tp equal chunks; "vocab": dim 0, the vocabulary padded to a
    multiple of tp when read; "qkv": q by attention heads, k and v by kv heads (one duplicated
    head per rank when fewer than tp), concatenated; "all": replicated."""
    if row.split == "qkv":
        q, k, v = tensors
        return [torch.cat([_split(q, g.tp, r, 0), _kv_slice(k, g, r), _kv_slice(v, g, r)])]
    if row.split == "all":
        return [t.contiguous() for t in tensors]
    return [_split(t, g.tp, r, 1 if row.split == "cols" else 0) for t in tensors]


def _kv_slice(w: torch.Tensor, g: Geometry, r: int) -> torch.Tensor:
    """Rank r's kv heads: a split when kv_heads >= tp, else one duplicated head."""
    heads = w.reshape(g.kv_heads, g.head_dim, *w.shape[1:])
    if g.kv_heads >= g.tp:
        n = g.kv_heads // g.tp
        return heads[r * n:(r + 1) * n].reshape(-1, *w.shape[1:])
    return heads[r * g.kv_heads // g.tp].reshape(-1, *w.shape[1:])


def _split(w: torch.Tensor, tp: int, r: int, dim: int) -> torch.Tensor:
    return torch.chunk(w, tp, dim=dim)[r].contiguous()


def trtllm_config(cfg: dict, g: Geometry, dtype: torch.dtype, quant: str, kv_cache: str | None, pp: int) -> dict:
    mt = cfg.get("model_type")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    c = {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "architecture": ARCHITECTURES[mt],
        "dtype": _DTYPE_NAMES[dtype], "logits_dtype": "float16" if dtype == torch.bfloat16 else _DTYPE_NAMES[dtype],
        "num_hidden_layers": g.layers, "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
        "hidden_size": g.hidden, "norm_epsilon": cfg.get("rms_norm_eps", 1e-6), "vocab_size": g.vocab,
        "max_position_embeddings": cfg.get("max_position_embeddings"), "hidden_act": cfg.get("hidden_act", "silu"),
        "use_parallel_embedding": True, "embedding_sharding_dim": 0, "head_size": g.head_dim,
        "intermediate_size": g.inter, "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False,   # lm_head is always written (a copy when tied)
        "residual_mlp": False, "bias": bool(cfg.get("attention_bias", False)), "rotary_pct": 1.0, "rank": 0,
        "decoder": ENGINE_LAYOUTS[mt]["decoder"], "rmsnorm": True, "lm_head_bias": False,
        # ModelOpt 0.47 under transformers 5 loses rope_theta (moved into rope_parameters) and
        # writes no rotary_base, so TensorRT-LLM would fall back to 10000: we always write it.
        "rotary_base": rope_theta,
    }
    if rope_scaling:
        c["rotary_scaling"] = rope_scaling
    c.update(ENGINE_LAYOUTS[mt]["extra"])
    c["mapping"] = {"world_size": g.tp * pp, "tp_size": g.tp, "pp_size": pp}
    q: dict = {"quant_algo": {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}[quant],
               "kv_cache_quant_algo": "FP8" if kv_cache == "fp8" else None}
    if quant == "nvfp4":
        q["group_size"] = formats.NVFP4_BLOCK
    if quant != "none":
        q["exclude_modules"] = ["lm_head"]
    c["quantization"] = q
    return c


@dataclass
class ConvertReport:
    out: str
    architecture: str
    tp: int
    pp: int
    quant: str
    kv_cache: str | None
    files: list[str]
    bytes_out: int
    calibrated: bool
    not_calibrated: list[str]
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def convert_checkpoint(model: str | Path, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                       quant: str = "none", kv_cache: str | None = None, calib: str | Path | None = None,
                       calib_samples: int = 64, progress: bool = True) -> ConvertReport:
    t0 = time.time()
    model, out = Path(model), Path(out)
    refuse_inside(out, "--out", ("--model", model), ("--calib", calib))
    cfg = load_config(model)
    require_checkpoint_config(model)
    mt = cfg.get("model_type")
    _check_options(model, mt, tp, pp, ep, quant, kv_cache, calib)
    g = _geometry(cfg, tp)
    with CheckpointReader(model) as reader:
        check_shapes(reader, cfg, model / "config.json")
        if cfg.get("quantization_config"):
            raise DFlashError(f"{model / 'config.json'}: already quantized ({cfg['quantization_config'].get('quant_method')}); "
                              "convert takes the unquantized checkpoint")
        dtype = reader.meta("model.layers.0.self_attn.q_proj.weight")[0]
        if dtype not in _DTYPE_NAMES:
            raise DFlashError(f"{reader.file_of('model.layers.0.self_attn.q_proj.weight')}: weights are {dtype}, expected bf16/fp16/fp32")
        calib_res = None
        if calib is not None:
            calib_res = calibrate(reader, cfg, load_calib_samples(calib, model, calib_samples), progress=progress)
        rows = _layout(reader, g, kv_cache)
        specs = _plan(reader, rows, g, quant, dtype)   # every rank's, alike
        with atomic_output_dir(out) as tmp, Progress(reader.total_bytes, len(reader), f"convert tp{tp}", progress) as bar:
            io = DirectWriter()
            writers = [ShardedWriter(tmp, specs, max_shard_bytes=1 << 62, prefix=f"rank{r}",
                                     metadata={"producer": "dflash-trt"}, io=io) for r in range(tp)]
            try:
                for row in rows:
                    _write_row(reader, row, g, quant, calib_res, writers, bar)
                files = [f for w in writers for f in w.close()]
            except BaseException:
                for w in writers:
                    w.abort()
                raise
            finally:
                io.close()
            write_text(tmp / "config.json", json.dumps(trtllm_config(cfg, g, dtype, quant, kv_cache, pp), indent=4))
    return ConvertReport(str(out), ARCHITECTURES[mt], tp, pp, quant, kv_cache, files, tp * sum(s.nbytes for s in specs),
                         calib is not None, [], round(time.time() - t0, 3))


def _check_options(model: Path, mt: str | None, tp: int, pp: int, ep: int, quant: str, kv_cache: str | None,
                   calib) -> None:
    if mt in NO_ENGINE_LAYOUT:
        raise DFlashError(NO_ENGINE_LAYOUT[mt])
    if mt not in ARCHITECTURES:
        raise DFlashError(f"{model / 'config.json'}: model_type {mt!r} is not supported by convert "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    if quant not in QUANTS:
        raise DFlashError(f"--quant {quant!r}: expected one of {', '.join(QUANTS)}")
    if pp != 1:
        raise DFlashError("--pp: only 1 is supported (pipeline parallelism is not used for these targets)")
    if ep != 1:
        raise DFlashError(f"--ep {ep}: {mt} is a dense model (no experts to slice)")
    if tp < 1:
        raise DFlashError("--tp must be >= 1")
    if kv_cache not in (None, "fp8"):
        raise DFlashError(f"--kv-cache {kv_cache!r}: only fp8 is supported")
    if (quant != "none" or kv_cache) and calib is None:
        raise DFlashError(f"--quant {quant}" + (" --kv-cache fp8" if kv_cache else "") + ": TensorRT-LLM engines use static "
                          "activation / KV scales; give calibration prompts with --calib FILE.jsonl")


def _plan(reader: CheckpointReader, rows: list[Row], g: Geometry, quant: str, dtype: torch.dtype) -> list[TensorSpec]:
    """One rank's output tensors, in file order."""
    specs = []
    for row in rows:
        if row.kind == "kv_scales":
            specs += [TensorSpec(n, torch.float32, (1,)) for n in row.trt]
            continue
        # the shapes are what the slicing gives: run it on shape-only (meta) tensors
        metas = [_prepared(torch.empty(reader.meta(n)[1], device="meta"), row, g) for n in row.hf]
        for name, part in zip(row.trt, _rank_parts(row, metas, g, 0)):
            if row.kind == "linear" and quant != "none":
                specs += linear_specs(TRTLLM_EXPORT, name.removesuffix(".weight"), quant, *part.shape, input_scale=True)
            else:
                specs.append(TensorSpec(name, dtype, tuple(part.shape)))
    return specs


def _read(reader: CheckpointReader, name: str, row: Row, g: Geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the HF tensor as its row slices it, its amax from the NaN / Inf check)."""
    t = reader.get(name)
    amax = check_finite(name, t, reader.file_of(name))
    return _prepared(t, row, g), amax


def _prepared(t: torch.Tensor, row: Row, g: Geometry) -> torch.Tensor:
    """A source as its row slices it: the vocabulary padded with zero rows to a multiple of tp for "vocab"."""
    if row.split != "vocab" or t.shape[0] == g.vocab_padded:
        return t
    return torch.cat([t, t.new_zeros(g.vocab_padded - t.shape[0], *t.shape[1:])])


def _write_row(reader: CheckpointReader, row: Row, g: Geometry, quant: str, calib: CalibrationResult | None,
               writers: list[ShardedWriter], bar: Progress) -> None:
    """Read the row's HF tensors once (each checked for NaN / Inf) and write every rank's part."""
    if row.kind == "kv_scales":
        _write_kv_scales(row, calib, writers)
        return
    read = {n: _read(reader, n, row, g) for n in dict.fromkeys(row.hf)}   # once each (tied embeddings)
    tensors = [read[n][0] for n in row.hf]
    scale = act_amax = None
    if row.kind == "linear" and quant != "none":
        # one scale for the fused GEMM, from the whole (unsplit) weights and all of its inputs
        scale = per_tensor_scale(quant, torch.stack([amax for _, amax in read.values()]).max())
        act_amax = max(calib.input_amax[n.removesuffix(".weight")] for n in read)
    for r, writer in enumerate(writers):
        for name, part in zip(row.trt, _rank_parts(row, tensors, g, r)):
            if scale is None:
                writer.write(name, part)
                continue
            for n, t in quantize_linear(TRTLLM_EXPORT, name.removesuffix(".weight"), part, quant, scale, act_amax):
                writer.write(n, t)
    bar.update(sum(reader.nbytes(n) for n in read), len(read))


def _write_kv_scales(row: Row, calib: CalibrationResult, writers: list[ShardedWriter]) -> None:
    """k / v / kv_cache_scaling_factor = max(amax/448, 1): ModelOpt's clamp for FP8 KV caches."""
    a = row.hf[0]
    ks = torch.clamp(torch.tensor(calib.k_amax[a], dtype=torch.float32) / formats.FP8_E4M3_MAX, min=1.0).reshape(1)
    vs = torch.clamp(torch.tensor(calib.v_amax[a], dtype=torch.float32) / formats.FP8_E4M3_MAX, min=1.0).reshape(1)
    for writer in writers:
        for name, t in zip(row.trt, (ks, vs, torch.maximum(ks, vs))):
            writer.write(name, t)
