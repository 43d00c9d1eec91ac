"""`dflash-trt convert`: a Hugging Face Llama / Qwen3 checkpoint -> TensorRT-LLM checkpoint
(`config.json` + `rank{N}.safetensors`) for the TensorRT engine path (TensorRT-LLM <= 1.2).
DESIGN.md §6. The layout is the one ModelOpt's `export_tensorrt_llm_checkpoint` writes
(tests/test_convert.py compares tensors byte for byte).

One pass over the input: every HF tensor is read once and its slice for each rank is written
straight into that rank's file (all rank files are open at once, each a streaming writer), so
memory stays at about one tensor (one fused q/k/v or gate/up group) whatever the model size.

Per rank r of tp:
- q/k/v -> attention.qkv = [q_r; k_r; v_r] (heads split on dim 0; when kv heads < tp each rank
  gets a copy of kv head r*kv//tp); o_proj -> attention.dense (split on dim 1).
- gate_proj -> mlp.fc, up_proj -> mlp.gate (dim 0); down_proj -> mlp.proj (dim 1).
- embed_tokens -> transformer.vocab_embedding, lm_head -> lm_head: vocabulary padded with zero
  rows to a multiple of tp, split on dim 0. Norms are replicated; Qwen3's q_norm / k_norm become
  attention.q_layernorm / k_layernorm.
- FP8: weights_scaling_factor per fused GEMM (max over q/k/v, and over gate/up, since both run
  with one scale in the engine), activation_scaling_factor from calibration, KV-cache
  k/v/kv_cache_scaling_factor = max(amax/448, 1) (ModelOpt's clamp for FP8 KV caches).
- NVFP4: weights_scaling_factor_2 shared the same way, E4M3 block scales per rank slice.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats
from dflash_trt.io.atomic import atomic_output_dir, write_text
from dflash_trt.io.checkpoint import (
    CheckpointReader,
    Progress,
    ShardedWriter,
    TensorSpec,
    check_finite,
    check_shapes,
    load_config,
)
from dflash_trt.io.direct_io import DirectWriter
from dflash_trt.quant.calibrate import calibrate, load_calib_samples

# TensorRT-LLM maps Qwen3ForCausalLM to its QWenForCausalLM; qwen_type "qwen3" turns on the q/k norms.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QUANTS = ("none", "fp8", "nvfp4")
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


def _kv_slice(w: torch.Tensor, g: Geometry, r: int) -> torch.Tensor:
    """Rank r's kv heads: a split when kv_heads >= tp, else one duplicated head."""
    heads = w.reshape(g.kv_heads, g.head_dim, *w.shape[1:])
    if g.kv_heads >= g.tp:
        n = g.kv_heads // g.tp
        return heads[r * n:(r + 1) * n].reshape(-1, *w.shape[1:])
    return heads[r * g.kv_heads // g.tp].reshape(-1, *w.shape[1:])


def _split(w: torch.Tensor, tp: int, r: int, dim: int) -> torch.Tensor:
    return torch.chunk(w, tp, dim=dim)[r].contiguous()


def _pad_vocab(w: torch.Tensor, g: Geometry) -> torch.Tensor:
    if w.shape[0] == g.vocab_padded:
        return w
    return torch.cat([w, w.new_zeros(g.vocab_padded - w.shape[0], *w.shape[1:])])


def trtllm_config(cfg: dict, g: Geometry, dtype: torch.dtype, quant: str, kv_cache: str | None, pp: int) -> dict:
    mt = cfg.get("model_type")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    c = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "architecture": ARCHITECTURES[mt],
        "dtype": _DTYPE_NAMES[dtype],
        "logits_dtype": "float16" if dtype == torch.bfloat16 else _DTYPE_NAMES[dtype],
        "num_hidden_layers": g.layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "hidden_size": g.hidden,
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "vocab_size": g.vocab,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "head_size": g.head_dim,
        "intermediate_size": g.inter,
        "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False,   # lm_head is always written (a copy when tied)
        "residual_mlp": False,
        "bias": bool(cfg.get("attention_bias", False)),
        "rotary_pct": 1.0,
        "rank": 0,
        "decoder": {"llama": "llama", "qwen3": "qwen"}[mt],
        "rmsnorm": True,
        "lm_head_bias": False,
        # ModelOpt 0.47 under transformers 5 loses rope_theta (moved into rope_parameters) and
        # writes no rotary_base, so TensorRT-LLM would fall back to 10000: we always write it.
        "rotary_base": rope_theta,
    }
    if rope_scaling:
        c["rotary_scaling"] = rope_scaling
    if mt == "qwen3":
        # ModelOpt 0.47 omits qwen_type, so TensorRT-LLM would build Qwen (v1) without the q/k
        # norms: we write it.
        c["qwen_type"] = "qwen3"
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
    cfg = load_config(model)
    mt = cfg.get("model_type")
    if mt == "gpt_oss":
        raise DFlashError("gpt-oss: TensorRT-LLM has no engine (TensorRT) checkpoint layout for it; serve it with "
                          "the PyTorch backend straight from the Hugging Face folder (trtllm-serve <dir>, see "
                          "`dflash-trt build`), optionally after `dflash-trt quantize --kv-cache fp8`")
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
        plan = _plan(reader, cfg, g, quant, kv_cache, dtype)
        specs_by_rank = [[TensorSpec(n, dt, shp) for n, (dt, shp) in plan.items()] for _ in range(tp)]
        with atomic_output_dir(out) as tmp, Progress(reader.total_bytes, len(reader), f"convert tp{tp}", progress) as bar:
            io = DirectWriter()
            writers = [ShardedWriter(tmp, specs_by_rank[r], max_shard_bytes=1 << 62, prefix=f"rank{r}",
                                     metadata={"producer": "dflash-trt"}, io=io) for r in range(tp)]
            try:
                _write_all(reader, cfg, g, quant, kv_cache, calib_res, writers, bar)
                files = [f for w in writers for f in w.close()]
            except BaseException:
                for w in writers:
                    w.abort()
                raise
            finally:
                io.close()
            write_text(tmp / "config.json", json.dumps(trtllm_config(cfg, g, dtype, quant, kv_cache, pp), indent=4))
            bytes_out = sum(s.nbytes for sp in specs_by_rank for s in sp)
    return ConvertReport(str(out), ARCHITECTURES[mt], tp, pp, quant, kv_cache, files, bytes_out,
                         calib is not None, [], round(time.time() - t0, 3))


def _linear_specs(name: str, out: int, inp: int, dtype, quant: str, with_act: bool) -> dict:
    if quant == "none":
        return {name + ".weight": (dtype, (out, inp))}
    # ModelOpt writes FP8 scalars as [1] tensors and NVFP4 scalars as 0-dim ones: so do we.
    scalar = (1,) if quant == "fp8" else ()
    if quant == "fp8":
        d = {name + ".weight": (torch.float8_e4m3fn, (out, inp)), name + ".weights_scaling_factor": (torch.float32, scalar)}
    else:
        d = {name + ".weight": (torch.uint8, (out, inp // 2)),
             name + ".weights_scaling_factor": (torch.float8_e4m3fn, (out, inp // formats.NVFP4_BLOCK)),
             name + ".weights_scaling_factor_2": (torch.float32, scalar)}
    if with_act:
        d[name + ".activation_scaling_factor"] = (torch.float32, scalar)
    return d


def _plan(reader, cfg, g: Geometry, quant, kv_cache, dtype) -> dict:
    """Per-rank output tensors (identical for every rank): name -> (dtype, shape)."""
    tp = g.tp
    q_r = g.heads // tp * g.head_dim
    kv_r = (g.kv_heads // tp if g.kv_heads >= tp else 1) * g.head_dim
    p: dict = {"transformer.vocab_embedding.weight": (dtype, (g.vocab_padded // tp, g.hidden)),
               "lm_head.weight": (dtype, (g.vocab_padded // tp, g.hidden)),
               "transformer.ln_f.weight": (dtype, (g.hidden,))}
    for i in range(g.layers):
        t = f"transformer.layers.{i}"
        p[f"{t}.input_layernorm.weight"] = (dtype, (g.hidden,))
        p[f"{t}.post_layernorm.weight"] = (dtype, (g.hidden,))
        p.update(_linear_specs(f"{t}.attention.qkv", q_r + 2 * kv_r, g.hidden, dtype, quant, quant != "none"))
        if f"model.layers.{i}.self_attn.q_proj.bias" in reader:
            p[f"{t}.attention.qkv.bias"] = (dtype, (q_r + 2 * kv_r,))
        p.update(_linear_specs(f"{t}.attention.dense", g.hidden, g.heads * g.head_dim // tp, dtype, quant, quant != "none"))
        if f"model.layers.{i}.self_attn.q_norm.weight" in reader:
            p[f"{t}.attention.q_layernorm.weight"] = (dtype, (g.head_dim,))
            p[f"{t}.attention.k_layernorm.weight"] = (dtype, (g.head_dim,))
        if kv_cache == "fp8":
            for k in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
                p[f"{t}.attention.{k}"] = (torch.float32, (1,))
        p.update(_linear_specs(f"{t}.mlp.fc", g.inter // tp, g.hidden, dtype, quant, quant != "none"))
        p.update(_linear_specs(f"{t}.mlp.gate", g.inter // tp, g.hidden, dtype, quant, quant != "none"))
        p.update(_linear_specs(f"{t}.mlp.proj", g.hidden, g.inter // tp, dtype, quant, quant != "none"))
    return p


def _read(reader, name):
    t = reader.get(name)
    check_finite(name, t, reader.file_of(name))
    return t


def _write_all(reader, cfg, g: Geometry, quant, kv_cache, calib, writers, bar) -> None:
    tp = g.tp

    def seen(*names):
        bar.update(sum(reader.nbytes(n) for n in names), len(names))

    def put(r, name, t):
        writers[r].write(name, t.contiguous())

    scalar = (1,) if quant == "fp8" else ()

    def act_scale(modules):
        amax = max(calib.input_amax[m] for m in modules)
        a = torch.tensor(amax, dtype=torch.float32)
        s = formats.fp8_scale_from_amax(a) if quant == "fp8" else formats.nvfp4_global_scale(a)
        return s.reshape(scalar)

    def put_linear(r, name, w_r, qparams, modules):
        """w_r: this rank's slice; qparams: scales computed on the whole (unsplit) GEMM."""
        if quant == "none":
            put(r, name + ".weight", w_r)
            return
        if quant == "fp8":
            put(r, name + ".weight", formats.fp8_quantize(w_r, qparams, torch.float32))
            put(r, name + ".weights_scaling_factor", qparams.reshape(1))
        else:
            packed, bs, gs = formats.nvfp4_quantize(w_r, global_scale=qparams)
            put(r, name + ".weight", packed)
            put(r, name + ".weights_scaling_factor", bs)
            put(r, name + ".weights_scaling_factor_2", gs.reshape(scalar))
        put(r, name + ".activation_scaling_factor", act_scale(modules))

    def scale_for(*ws):
        amax = torch.stack([w.abs().amax().float() for w in ws]).max()
        if quant == "fp8":
            return formats.fp8_scale_from_amax(amax)
        if quant == "nvfp4":
            return formats.nvfp4_global_scale(amax)
        return None

    # embeddings, lm_head, final norm
    emb = _pad_vocab(_read(reader, "model.embed_tokens.weight"), g)
    for r in range(tp):
        put(r, "transformer.vocab_embedding.weight", _split(emb, tp, r, 0))
    seen("model.embed_tokens.weight")
    if "lm_head.weight" in reader:
        head = _pad_vocab(_read(reader, "lm_head.weight"), g)
        seen("lm_head.weight")
    else:
        head = emb   # tied: TensorRT-LLM engines get their own copy
    for r in range(tp):
        put(r, "lm_head.weight", _split(head, tp, r, 0))
    del emb, head
    norm = _read(reader, "model.norm.weight")
    for r in range(tp):
        put(r, "transformer.ln_f.weight", norm)
    seen("model.norm.weight")

    for i in range(g.layers):
        h, t = f"model.layers.{i}", f"transformer.layers.{i}"
        for src, dst in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_layernorm")):
            w = _read(reader, f"{h}.{src}.weight")
            for r in range(tp):
                put(r, f"{t}.{dst}.weight", w)
            seen(f"{h}.{src}.weight")
        qn, kn, vn = (f"{h}.self_attn.{x}_proj" for x in "qkv")
        wq, wk, wv = (_read(reader, n + ".weight") for n in (qn, kn, vn))
        s = scale_for(wq, wk, wv)
        for r in range(tp):
            qkv = torch.cat([_split(wq, tp, r, 0), _kv_slice(wk, g, r), _kv_slice(wv, g, r)])
            put_linear(r, f"{t}.attention.qkv", qkv, s, (qn, kn, vn))
        seen(qn + ".weight", kn + ".weight", vn + ".weight")
        del wq, wk, wv
        if f"{qn}.bias" in reader:
            bq, bk, bv = (_read(reader, n + ".bias") for n in (qn, kn, vn))
            for r in range(tp):
                put(r, f"{t}.attention.qkv.bias", torch.cat([_split(bq, tp, r, 0), _kv_slice(bk, g, r), _kv_slice(bv, g, r)]))
            seen(qn + ".bias", kn + ".bias", vn + ".bias")
        on = f"{h}.self_attn.o_proj"
        wo = _read(reader, on + ".weight")
        s = scale_for(wo)
        for r in range(tp):
            put_linear(r, f"{t}.attention.dense", _split(wo, tp, r, 1), s, (on,))
        seen(on + ".weight")
        del wo
        if f"{h}.self_attn.q_norm.weight" in reader:
            for src, dst in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
                w = _read(reader, f"{h}.self_attn.{src}.weight")
                for r in range(tp):
                    put(r, f"{t}.attention.{dst}.weight", w)
                seen(f"{h}.self_attn.{src}.weight")
        if kv_cache == "fp8":
            a = f"{h}.self_attn"
            ks = torch.clamp(torch.tensor(calib.k_amax[a], dtype=torch.float32) / formats.FP8_E4M3_MAX, min=1.0).reshape(1)
            vs = torch.clamp(torch.tensor(calib.v_amax[a], dtype=torch.float32) / formats.FP8_E4M3_MAX, min=1.0).reshape(1)
            for r in range(tp):
                put(r, f"{t}.attention.k_cache_scaling_factor", ks)
                put(r, f"{t}.attention.v_cache_scaling_factor", vs)
                put(r, f"{t}.attention.kv_cache_scaling_factor", torch.maximum(ks, vs))
        gn, un, dn = (f"{h}.mlp.{x}_proj" for x in ("gate", "up", "down"))
        wg, wu = _read(reader, gn + ".weight"), _read(reader, un + ".weight")
        s = scale_for(wg, wu)
        for r in range(tp):
            put_linear(r, f"{t}.mlp.fc", _split(wg, tp, r, 0), s, (gn, un))
            put_linear(r, f"{t}.mlp.gate", _split(wu, tp, r, 0), s, (gn, un))
        seen(gn + ".weight", un + ".weight")
        del wg, wu
        wd = _read(reader, dn + ".weight")
        s = scale_for(wd)
        for r in range(tp):
            put_linear(r, f"{t}.mlp.proj", _split(wd, tp, r, 1), s, (dn,))
        seen(dn + ".weight")
        del wd
