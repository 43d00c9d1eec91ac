"""`dflash-trt quantize`: a Hugging Face checkpoint -> ModelOpt-style unified HF checkpoint
(FP8 or NVFP4 weights, optional FP8 KV cache), streaming tensor by tensor. docs/formats.md.

Pipeline: validate (headers, shapes vs config.json) -> plan every output tensor (name, dtype,
shape) -> stream: read one tensor (or one fused group, when small), check it is finite,
quantize, write it at its planned offset -> config files -> atomic rename. With --calib, decoder
layers are taken in order instead: layer i is read once, run over the calibration prompts
(its input scales depend only on layers < i), quantized with the scales just measured, written
and dropped. Peak memory is about one tensor (or one small fused group) plus temporaries
bounded by the codecs' row chunking, whatever the model size.

The bytes are ModelOpt's (tests/test_quantize.py compares with `export_hf_checkpoint`):
- FP8: weight = e4m3(w / s) with s = amax(w)/448 per tensor; input_scale = amax(x)/448, shared
  (max) across a fused group (q/k/v; gate/up), as ModelOpt's `preprocess_linear_fusion` does.
- NVFP4: weight_scale_2 = amax/(6*448) shared across the fused group; per-16 E4M3 block scales;
  input_scale = amax(x)/(6*448) shared across the group.
- KV cache FP8: k_scale / v_scale = amax(K or V after RoPE)/448.
"""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_has_fp4, arch_sms, catalog
from dflash_trt.io import formats
from dflash_trt.io.atomic import atomic_output_dir, disk_error, refuse_inside, write_text
from dflash_trt.io.checkpoint import (
    CheckpointReader,
    Progress,
    ShardedWriter,
    TensorSpec,
    check_finite,
    check_finite_blocks,
    load_config,
)
from dflash_trt.models.check import require_checkpoint_config
from dflash_trt.models.families import family, family_of_config
from dflash_trt.models.shapes import check_shapes
from dflash_trt.quant.calibrate import CalibrationResult, LayerCalibrator, layer_tensors, load_calib_samples
from dflash_trt.quant.linear import (
    FORMATS,
    HF_EXPORT,
    MODELOPT_VERSION,
    linear_specs,
    per_tensor_scale,
    quantize_linear,
)

# Modules ModelOpt leaves unquantized by default (its *_DEFAULT_CFG), as module-name globs.
# Hybrid / linear-attention families (Qwen3-Next, Qwen3.5/3.6 GatedDeltaNet) as nvidia-modelopt 0.47's
# modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml: the conv1d and the small a/b (ba)
# projections stay bf16 (`*linear_attn.in_proj_b*` also covers Qwen3-Next's fused in_proj_ba), as do
# Mamba mixers' conv1d and MTP heads.
DEFAULT_EXCLUDE = ("*lm_head*", "*embed_tokens*", "*router*", "*mlp.gate", "*block_sparse_moe.gate",
                   "*shared_expert_gate", "*output_layer*", "*vision*", "*visual*", "*multi_modal_projector*",
                   "*linear_attn.conv1d*", "*self_attention.conv1d*", "*linear_attn.in_proj_a*",
                   "*linear_attn.in_proj_b*", "*mixer.conv1d*", "mtp.*", "*embed_vision*")
# Fused groups: modules that share one input (and so one input_scale, and for NVFP4 one
# weight_scale_2), because the runtime runs them as one GEMM.
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# MoE experts: transformers >= 5 holds each MoE layer's experts as one fused gate_up tensor (and saves them
# per expert), so ModelOpt 0.47's _QuantFusedExperts gives an expert's gate and up ONE weight quantizer:
# for FP8 they share weight_scale too (measured against its export: tests/test_families.py). w1/w3 are
# MiniMax / Mixtral's names for gate/up.
EXPERT_FUSED = {"gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}
# Other Linears that read one input (ModelOpt's preprocess_linear_fusion finds them by their shared
# input; here by name, per layer): MLA's down-projections of the hidden state (DeepSeek-V3, Kimi K2,
# GLM-5, whose DSA indexer's wk / weights_proj read it too) and of the q LoRA (q_b_proj, the
# indexer's wq_b); GatedDeltaNet's input projections (Qwen3.5/3.6: in_proj_qkv + in_proj_z).
# Measured against ModelOpt 0.47's NVFP4 export: tests/test_families.py.
SHARED_INPUT = {
    "self_attn.q_a_proj": "self_attn.hidden_in", "self_attn.kv_a_proj_with_mqa": "self_attn.hidden_in",
    "self_attn.indexer.wk": "self_attn.hidden_in", "self_attn.indexer.weights_proj": "self_attn.hidden_in",
    "self_attn.q_b_proj": "self_attn.q_lora_in", "self_attn.indexer.wq_b": "self_attn.q_lora_in",
    "linear_attn.in_proj_qkv": "linear_attn.in", "linear_attn.in_proj_z": "linear_attn.in",
}


# Exclusions ModelOpt 0.47's export writes otherwise than the plain module list, where transformers'
# module is not the nn.Linear / nn.Embedding the checkpoint stores (measured against its export:
# tests/test_family_gemma4_minimax.py). A subclass of nn.Embedding gets no quantizer, so it is not
# listed (Gemma 4's Gemma4TextScaledWordEmbedding); a Linear inside a router module is summarized as
# the router's prefix wildcard (Gemma 4's Gemma4TextRouter.proj -> "model.layers.N.router*", by
# quant_utils._prefix_wildcard_summarize_exclude_modules).
# Which modules a family leaves unlisted is its row's unlisted_excluded (models/families: Gemma 4).
LISTED_AS_PREFIX = {"*.router.proj": ".proj"}


def _listed_exclusion(module: str, model_type: str | None) -> str | None:
    """How hf_quant_config's exclude_modules names an unquantized module (None: not at all)."""
    if any(fnmatch.fnmatchcase(module, p) for p in family(model_type).unlisted_excluded):
        return None
    for pattern, tail in LISTED_AS_PREFIX.items():
        if fnmatch.fnmatchcase(module, pattern):
            return module[: -len(tail)] + "*"
    return module


def split_fused_experts(reader: CheckpointReader) -> None:
    """Fused 3-D experts as transformers >= 5 saves a family it has no per-expert conversion for
    (Gemma 4: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) read as the per-expert
    matrices ModelOpt 0.47's _QuantFusedExperts exports: experts.{e}.gate_proj / up_proj (the first
    and last I rows of gate_up) / down_proj. Zero-copy (CheckpointReader.split)."""
    for name in list(reader.keys()):
        if not name.endswith(".experts.gate_up_proj"):
            continue
        base, down = name[: -len("gate_up_proj")], name[: -len("gate_up_proj")] + "down_proj"
        shape = reader.meta(name)[1]
        # (gpt-oss's bf16 layout, [E, H, 2I] and [E, I, H], is not this one: its experts stay as stored)
        if len(shape) != 3 or shape[1] % 2 or down not in reader or reader.meta(down)[1] != (shape[0], shape[2],
                                                                                            shape[1] // 2):
            continue
        E, I, H = shape[0], shape[1] // 2, shape[2]
        reader.split(name, [(f"{base}{e}.{p}.weight", (I, H)) for e in range(E) for p in ("gate_proj", "up_proj")])
        reader.split(down, [(f"{base}{e}.down_proj.weight", (H, I)) for e in range(E)])


def _shared_input_group(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        key = SHARED_INPUT.get(".".join(parts[3:]))
        return f"model.layers.{parts[2]}.{key}" if key else None
    return None


def keep_in_fp32_patterns(cfg: dict) -> list[str]:
    """Module names transformers keeps in float32 for this family whatever the load dtype (the
    causal-LM class's `_keep_in_fp32_modules_strict`; e.g. DeepSeek-V3 / GLM-5's router `gate.weight`
    and `e_score_correction_bias`; the non-strict list applies to float16 loads only). ModelOpt's
    export writes the model transformers loaded, so those tensors come out float32: ours do too."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(cfg.get("model_type")))]
    except (KeyError, ValueError):   # a family transformers does not know, or no causal-LM class
        return []
    return list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])


def _keeps_fp32(name: str, patterns: list[str]) -> bool:
    # transformers' own match (modeling_utils: a pattern is a dotted run of whole name components)
    return bool(patterns) and re.search(rf"(^|\.)({'|'.join(map(re.escape, patterns))})($|\.)", name) is not None
GROUP_IN_MEMORY_BYTES = 256 * 2**20  # fused groups up to this size are read once, else twice


def check_format_for_arch(fmt: str, arch: str) -> None:
    """For the build stage: NVFP4 needs FP4 tensor cores; the hardware catalog says which
    architectures have them. `arch` names an architecture, a GPU or an SM (blackwell, h200,
    sm_90); one the catalog does not list (ampere, ada) has none."""
    if fmt == "nvfp4" and not arch_has_fp4(_catalog_arch(arch)):
        fp4 = "/".join(f"sm_{sm}" for a, sms in arch_sms().items() if arch_has_fp4(a) for sm in sms)
        raise DFlashError(f"--arch {arch}: NVFP4 weights need Blackwell ({fp4}) FP4 tensor cores; "
                          "quantize with --format fp8 for Hopper")


def _catalog_arch(name: str) -> str:
    """The catalog architecture of an architecture, GPU id or SM name; the name itself if unlisted."""
    name = name.lower()
    for hw in catalog().values():
        if name in (hw.arch, hw.gpu, hw.sm, hw.sm.replace("_", "")):
            return hw.arch
    return name


def check_format_for_model(fmt: str, cfg: dict) -> None:
    if family_of_config(cfg).mxfp4_experts:
        if fmt == "nvfp4":
            raise DFlashError("gpt-oss: --format nvfp4 refused: its experts ship as MXFP4, which TensorRT-LLM serves "
                              "as they are (MXFP4 experts + FP8 KV cache); re-quantizing them to NVFP4 would only add "
                              "error. Keep the checkpoint as is, or use --format fp8 (attention only, experts kept MXFP4)")


@dataclass
class Linear:
    module: str                 # e.g. model.layers.3.self_attn.q_proj
    dtype: torch.dtype
    shape: tuple[int, int]
    group: str                  # fused-group key (the module itself when not fused)


@dataclass
class QuantizeReport:
    out: str
    format: str
    kv_cache: str | None
    quantized_modules: int
    copied_tensors: int
    exclude_modules: list[str]
    bytes_in: int
    bytes_out: int
    files: list[str]
    calibrated: bool
    calibration_samples: int
    not_calibrated: list[str] = field(default_factory=list)
    seconds: float = 0.0
    disk_wait_seconds: float = 0.0   # of `seconds`, waiting for the disk to take the output

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class QuantizePlan:
    """Everything decided before any weight is read: what is quantized, every output tensor, the configs."""
    fmt: str
    kv_cache: str | None
    linears: dict[str, Linear]        # weight tensor name -> the Linear it belongs to
    groups: dict[str, list[str]]      # fused-group key -> its weight tensor names
    excluded: list[str]               # modules left unquantized (hf_quant_config's exclude_modules)
    calibrated_modules: set[str]      # modules that get an input_scale
    attn_modules: list[str]           # "model.layers.{i}.self_attn" whose k_proj is quantized
    kv_names: list[str]               # their k_scale / v_scale tensors (--kv-cache fp8)
    specs: list[TensorSpec]           # every output tensor, in file order
    hf_quant: dict                    # hf_quant_config.json
    config: dict                      # config.json: the input's, with quantization_config
    not_calibrated: list[str]         # what the output lacks without --calib (for the report)
    keep_fp32: set[str] = field(default_factory=set)   # unquantized tensors written float32 (keep_in_fp32_patterns)

    @property
    def bytes_out(self) -> int:
        return sum(s.nbytes for s in self.specs)


def plan_quantization(reader: CheckpointReader, cfg: dict, fmt: str, kv_cache: str | None, exclude: list[str],
                      calibrated: bool, measured: set[str] | None = None) -> QuantizePlan:
    """`measured`: the modules whose activation maxima were measured elsewhere (a drafter's, with its
    target: runtime/drafter_calibration.py); each quantized one gets an input_scale."""
    linears, excluded = plan_linears(reader, fmt, exclude, cfg)
    if not linears:
        raise DFlashError(f"{reader.folder}: no Linear weights to quantize (all excluded?)")
    groups: dict[str, list[str]] = {}
    for name, lin in linears.items():
        groups.setdefault(lin.group, []).append(name)
    attn_modules = sorted({lin.module.rpartition(".")[0] for lin in linears.values()
                           if lin.module.endswith(".self_attn.k_proj")})
    kv_names = [n for a in attn_modules for n in (a + ".k_proj.k_scale", a + ".v_proj.v_scale")] \
        if kv_cache == "fp8" else []
    # with --calib, every quantized Linear inside a decoder layer gets an input_scale
    calibrated_modules = {lin.module for lin in linears.values() if _layer_index(lin.module) is not None} \
        if calibrated else set()
    if measured is not None:
        unmeasured = sorted({lin.module for lin in linears.values()} - set(measured))
        if unmeasured:
            raise DFlashError(f"{reader.folder}: no activation amax measured for {unmeasured[0]}"
                              + (f" (and {len(unmeasured) - 1} more)" if len(unmeasured) > 1 else ""))
        calibrated_modules = {lin.module for lin in linears.values()}
    hf_quant = hf_quant_config(fmt, kv_cache, excluded)
    fp32 = [n for n in reader.keys() if n not in linears and _keeps_fp32(n, keep_in_fp32_patterns(cfg))
            and reader.meta(n)[0].is_floating_point]
    return QuantizePlan(fmt, kv_cache, linears, groups, excluded, calibrated_modules, attn_modules, kv_names,
                        specs=_output_specs(reader, linears, fmt, calibrated_modules, kv_names, set(fp32)),
                        hf_quant=hf_quant, keep_fp32=set(fp32),
                        config=dict(cfg, quantization_config=config_quantization_section(hf_quant)),
                        not_calibrated=[] if calibrated or measured is not None else _not_calibrated(kv_cache))


def _not_calibrated(kv_cache: str | None) -> list[str]:
    out = ["input_scale (activation scales): not written; consumers quantize activations dynamically or need "
           "--calib FILE.jsonl"]
    if kv_cache == "fp8":
        out.append("k_scale/v_scale (FP8 KV cache): set to 1.0, TensorRT-LLM's default, not calibrated")
    return out


def plan_linears(reader: CheckpointReader, fmt: str, exclude: list[str], cfg: dict) -> tuple[dict[str, Linear], list[str]]:
    """Which 2-D weights get quantized (keyed by weight tensor name), and the excluded modules
    (ModelOpt lists the Linear / Embedding modules it left unquantized)."""
    patterns = list(DEFAULT_EXCLUDE) + list(exclude)
    mxfp4_experts = family(cfg.get("model_type")).mxfp4_experts   # kept as they are; only attention quantized
    linears, excluded = {}, []
    for name in reader.keys():
        dtype, shape = reader.meta(name)
        if mxfp4_experts and name.endswith("_blocks"):  # MXFP4 experts: kept as they are
            module = name.rpartition(".")[0]
            if module not in excluded:
                excluded.append(module)
            continue
        if name.endswith(".conv1d.weight") and len(shape) == 3:
            excluded.append(name[: -len(".weight")])   # ModelOpt lists a Conv1d it leaves unquantized
            continue
        if not name.endswith(".weight") or len(shape) != 2 or not dtype.is_floating_point or dtype.itemsize == 1:
            continue
        module = name[: -len(".weight")]
        if any(fnmatch.fnmatchcase(module, p) for p in patterns) or (mxfp4_experts and ".self_attn." not in module):
            listed = _listed_exclusion(module, cfg.get("model_type"))
            if listed is not None and listed not in excluded:
                excluded.append(listed)
            continue
        if fmt == "nvfp4" and shape[1] % formats.NVFP4_BLOCK:
            raise DFlashError(f"{reader.file_of(name)}: tensor {name!r} has {shape[1]} input features, not a "
                              f"multiple of {formats.NVFP4_BLOCK}; exclude it with --exclude '{module}'")
        parent, _, leaf = module.rpartition(".")
        fused = EXPERT_FUSED if ".experts." in module else FUSED
        group = f"{parent}.{fused[leaf]}" if leaf in fused else (_shared_input_group(module) or module)
        linears[name] = Linear(module, dtype, tuple(shape), group)
    if "lm_head.weight" not in reader and "lm_head" not in excluded and cfg.get("tie_word_embeddings", False):
        excluded.insert(0, "lm_head")  # tied: the module exists in the model though the tensor does not
    return linears, excluded


def _output_specs(reader, linears, fmt, calibrated_modules, kv_names, keep_fp32=frozenset()) -> list[TensorSpec]:
    specs = []
    for name in reader.keys():
        dtype, shape = reader.meta(name)
        lin = linears.get(name)
        if lin is None:
            specs.append(TensorSpec(name, torch.float32 if name in keep_fp32 else dtype, tuple(shape)))
        else:
            specs += linear_specs(HF_EXPORT, lin.module, fmt, *shape, input_scale=lin.module in calibrated_modules)
    specs += [TensorSpec(n, torch.float32, ()) for n in kv_names]
    return specs


def hf_quant_config(fmt: str, kv_cache: str | None, exclude_modules: list[str]) -> dict:
    q = {"quant_algo": "FP8" if fmt == "fp8" else "NVFP4", "kv_cache_quant_algo": "FP8" if kv_cache == "fp8" else None}
    if fmt == "nvfp4":
        q["group_size"] = formats.NVFP4_BLOCK
    q["exclude_modules"] = exclude_modules
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": q}


def config_quantization_section(hf_quant: dict) -> dict:
    """config.json's `quantization_config` (the compressed-tensors-style form ModelOpt writes
    next to hf_quant_config.json; vLLM and SGLang read this one)."""
    q = hf_quant["quantization"]
    bits = {"FP8": 8, "NVFP4": 4}[q["quant_algo"]]
    scheme = {"dynamic": False, "num_bits": bits, "type": "float"}
    if q["quant_algo"] == "NVFP4":
        scheme["group_size"] = q["group_size"]
    out = {"config_groups": {"group_0": {"input_activations": dict(scheme), "weights": dict(scheme), "targets": ["Linear"]}},
           "ignore": list(q["exclude_modules"]), "quant_algo": q["quant_algo"]}
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = dict(hf_quant["producer"])
    out["quant_method"] = "modelopt"
    return out


def quantize_checkpoint(model: str | Path, out: str | Path, fmt: str, kv_cache: str | None = None,
                        calib: str | Path | None = None, calib_samples: int = 64, exclude: list[str] = (),
                        max_shard_bytes: int = 5 * 2**30, progress: bool = True,
                        allow_pickle: bool = False, input_amax: dict[str, float] | None = None) -> QuantizeReport:
    """`input_amax`: activation maxima measured elsewhere, {module: amax} (a DFlash drafter's, measured
    with its target by runtime/drafter_calibration.py): every quantized Linear gets input_scale from the
    max over its fused group, as with --calib."""
    t0 = time.time()
    if input_amax is not None and calib is not None:
        raise DFlashError("quantize: pass either --calib (a target's own calibration) or measured activation "
                          "maxima, not both")
    model, out = Path(model), Path(out)
    if fmt not in FORMATS:
        raise DFlashError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if kv_cache not in (None, "fp8"):
        raise DFlashError(f"--kv-cache {kv_cache!r}: only fp8 is supported")
    cfg = load_config(model)
    require_checkpoint_config(model)
    check_format_for_model(fmt, cfg)
    refuse_inside(out, "--out", ("--model", model), ("--calib", calib))
    with CheckpointReader(model, allow_pickle=allow_pickle) as reader:
        check_shapes(reader, cfg, model / "config.json")
        split_fused_experts(reader)
        plan = plan_quantization(reader, cfg, fmt, kv_cache, list(exclude), calibrated=calib is not None,
                                 measured=set(input_amax) if input_amax is not None else None)
        cal = None
        if calib is not None:
            if "DFlashDraftModel" in (cfg.get("architectures") or []):
                raise DFlashError(f"{model}: --calib is for targets; a DFlash drafter's activations come from its "
                                  "target (quantize the drafter without --calib: weights only)")
            cal = LayerCalibrator(reader, cfg, load_calib_samples(calib, model, calib_samples))
        with atomic_output_dir(out) as tmp, \
                Progress(reader.total_bytes, len(reader), f"quantize {fmt}" + (" + calibrate" if cal is not None else ""),
                         progress) as bar:
            files, disk_wait = _write_weights(plan, reader, cal, tmp, max_shard_bytes, bar,
                                              _group_max(plan, input_amax) if input_amax is not None else None)
            write_text(tmp / "hf_quant_config.json", json.dumps(plan.hf_quant, indent=4))
            write_text(tmp / "config.json", json.dumps(plan.config, indent=4))
            _copy_side_files(model, tmp)
    return QuantizeReport(out=str(out), format=fmt, kv_cache=kv_cache, quantized_modules=len(plan.linears),
                          copied_tensors=len(reader) - len(plan.linears), exclude_modules=plan.excluded,
                          bytes_in=reader.total_bytes, bytes_out=plan.bytes_out, files=files,
                          calibrated=cal is not None or input_amax is not None,
                          calibration_samples=cal.result.samples if cal else 0,
                          not_calibrated=plan.not_calibrated, seconds=round(time.time() - t0, 3),
                          disk_wait_seconds=round(disk_wait, 3))


def _group_max(plan: QuantizePlan, amax: dict[str, float]) -> dict[str, float]:
    """Module -> the activation amax its input_scale comes from, as ModelOpt 0.47's export does: NVFP4
    takes the max over the fused group (preprocess_linear_fusion), FP8 keeps each Linear's own
    (requantize_resmooth_fused_llm_layers skips FP8 groups; the engines take the max when they fuse).
    A drafter's q_proj reads only the block while k/v read the context too, so the two differ there."""
    if plan.fmt == "fp8":
        return {lin.module: float(amax[lin.module]) for lin in plan.linears.values()}
    group: dict[str, float] = {}
    for lin in plan.linears.values():
        group[lin.group] = max(group.get(lin.group, 0.0), float(amax[lin.module]))
    return {lin.module: group[lin.group] for lin in plan.linears.values()}


def _write_weights(plan: QuantizePlan, reader: CheckpointReader, cal: LayerCalibrator | None, folder: Path,
                   max_shard_bytes: int, bar: Progress, measured_amax: dict[str, float] | None = None
                   ) -> tuple[list[str], float]:
    """Every planned tensor into `folder`'s shards: with calibration, the decoder layers first
    (the calibrated pass), then whatever is left, streamed. Returns (files, disk wait seconds)."""
    writer = ShardedWriter(folder, plan.specs, max_shard_bytes, metadata={"producer": "dflash-trt"})
    try:
        done: set[str] = set()
        input_amax: dict[str, float] = dict(measured_amax or {})
        if cal is not None:
            _write_calibrated_layers(plan, reader, cal, writer, bar, done, input_amax)
        elif plan.kv_cache == "fp8":
            for n in plan.kv_names:
                writer.write(n, torch.tensor(1.0))
        rest = [n for n in reader.keys() if n not in done]
        _write_tensors(rest, StreamingLoader(reader), plan, input_amax, writer, bar, done)
        files = writer.close()
    except BaseException:
        writer.abort()
        raise
    return files, writer.disk_wait_seconds


# ----------------------------------------------------------------------------------------------
# the calibrated pass

def _write_calibrated_layers(plan: QuantizePlan, reader: CheckpointReader, cal: LayerCalibrator,
                             writer: ShardedWriter, bar: Progress, done: set[str], input_amax: dict[str, float]) -> None:
    """One read per weight: layer i is loaded, calibrated (its inputs come from layers < i only),
    quantized with the scales just measured, written, dropped. Fills `done` and `input_amax`."""
    for i in range(cal.num_layers):
        tensors = layer_tensors(reader, i)
        cal.step(i, tensors)
        input_amax.update(_group_input_amax(plan, tensors, cal.result))
        a = f"model.layers.{i}.self_attn"
        if plan.kv_cache == "fp8" and a in plan.attn_modules:
            writer.write(a + ".k_proj.k_scale", formats.fp8_scale_from_amax(cal.result.k_amax[a]))
            writer.write(a + ".v_proj.v_scale", formats.fp8_scale_from_amax(cal.result.v_amax[a]))
        _write_tensors(list(tensors), LayerLoader(tensors), plan, input_amax, writer, bar, done)
        del tensors


def _group_input_amax(plan: QuantizePlan, tensors: dict[str, torch.Tensor], res: CalibrationResult) -> dict[str, float]:
    """Module -> the input amax its input_scale comes from: the max over its fused group, as in ModelOpt."""
    group_amax: dict[str, float] = {}
    for n in tensors:
        lin = plan.linears.get(n)
        if lin is not None and lin.module in res.input_amax:
            group_amax[lin.group] = max(group_amax.get(lin.group, 0.0), res.input_amax[lin.module])
    out = {}
    for n in tensors:
        lin = plan.linears.get(n)
        if lin is not None and lin.module in plan.calibrated_modules:
            if lin.group not in group_amax:
                raise DFlashError(f"calibration recorded no input for {lin.module}")
            out[lin.module] = group_amax[lin.group]
    return out


# ----------------------------------------------------------------------------------------------
# loading: both passes read tensors through a loader, `load(name, slot, blocks, check)` ->
# (tensor, amax, block amax or None): amax from the NaN / Inf check (skipped with check=False, for
# a tensor checked before), and with `blocks` the max of each NVFP4 block, from the same pass.

class StreamingLoader:
    """Zero-copy views of the checkpoint (reader.view). A view is valid until the next load into
    the same slot, which releases its pages: callers use one slot per tensor they hold at the
    same time, so resident memory stays at those tensors."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.held: dict[str, str] = {}   # slot -> the tensor viewed in it

    def load(self, name: str, slot: str = "copy", blocks: bool = False, check: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        prev = self.held.pop(slot, None)
        if prev is not None:
            self.reader.release(prev)
        t = self.reader.view(name)
        self.held[slot] = name
        return t, *_checked_amax(name, t, self.reader.file_of(name), blocks, check)

    def fits_in_memory(self, names: list[str]) -> bool:
        """Whether a fused group is small enough to hold whole (a larger one is read twice)."""
        return sum(self.reader.nbytes(n) for n in names) <= GROUP_IN_MEMORY_BYTES


class LayerLoader:
    """A decoder layer's tensors, already in memory (read once, for calibration): slots do not apply."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def load(self, name: str, slot: str | None = None, blocks: bool = False, check: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        t = self.tensors[name]
        return t, *_checked_amax(name, t, None, blocks, check)

    def fits_in_memory(self, names: list[str]) -> bool:
        return True


# ----------------------------------------------------------------------------------------------
# writing (both passes)

def _write_tensors(names: list[str], loader: StreamingLoader | LayerLoader, plan: QuantizePlan,
                   input_amax: dict[str, float], writer: ShardedWriter, bar: Progress, done: set[str]) -> None:
    """Copy or quantize `names` (a quantized one with its whole fused group), skipping those done."""
    for name in names:
        if name in done:
            continue
        lin = plan.linears.get(name)
        if lin is None:
            t, _, _ = loader.load(name)
            writer.write(name, t.float() if name in plan.keep_fp32 else t)
            bar.update(t.numel() * t.element_size())
            done.add(name)
            continue
        members = plan.groups[lin.group]
        _quantize_group(loader, members, plan, input_amax, writer, bar)
        done.update(members)


def _quantize_group(loader: StreamingLoader | LayerLoader, members: list[str], plan: QuantizePlan,
                    input_amax: dict[str, float], writer: ShardedWriter, bar: Progress) -> None:
    """Quantize one fused group (or a lone Linear). Its tensors are held together when small
    (one slot each); a larger group goes through one slot, and where the group shares one scale
    is read twice (amax pass, then quantize pass) to bound memory: the shared scale (NVFP4's
    weight_scale_2, FP8's over an expert's gate + up) is needed before any member is encoded.
    Other FP8 groups scale each member on its own."""
    hold = loader.fits_in_memory(members)
    slots = [f"group{i}" if hold else "group" for i in range(len(members))]
    if plan.fmt == "fp8" and not (len(members) > 1 and ".experts." in members[0]):
        for n, slot in zip(members, slots):
            w, amax, _ = loader.load(n, slot)
            _write_linear(n, w, per_tensor_scale("fp8", amax), None, plan, input_amax, writer, bar)
        return
    blocks = plan.fmt == "nvfp4"   # NVFP4 also keeps each member's block maxima from the check pass
    held, block_amax = {}, {}
    amax = torch.zeros((), dtype=torch.float32)
    for n, slot in zip(members, slots):
        t, a, block_amax[n] = loader.load(n, slot, blocks=blocks)
        amax = torch.maximum(amax, a)
        if hold:
            held[n] = t
        del t
    scale = per_tensor_scale(plan.fmt, amax)
    for n, slot in zip(members, slots):
        w = held.pop(n) if hold else loader.load(n, slot, check=False)[0]   # checked (block maxima kept) above
        _write_linear(n, w, scale, block_amax.pop(n), plan, input_amax, writer, bar)
        del w


def _write_linear(name: str, w: torch.Tensor, scale: torch.Tensor, block_amax: torch.Tensor | None, plan: QuantizePlan,
                  input_amax: dict[str, float], writer: ShardedWriter, bar: Progress) -> None:
    m = plan.linears[name].module
    out = scales_out = None
    if plan.fmt == "nvfp4":   # encoded straight into the writer's buffers, which go to disk uncopied
        out, scales_out = writer.out_buffer(name), writer.out_buffer(f"{m}.{HF_EXPORT.scale}")
    for n, t in quantize_linear(HF_EXPORT, m, w, plan.fmt, scale, input_amax.get(m), out=out,
                                scales_out=scales_out, block_amax=block_amax):
        writer.write(n, t)
    bar.update(w.numel() * w.element_size())


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _checked_amax(name: str, t: torch.Tensor, file, blocks: bool, check: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(amax, block amax or None) from the one NaN / Inf check pass; (None, None) without it."""
    if not check:
        return None, None
    if blocks:
        return check_finite_blocks(name, t, file)
    return check_finite(name, t, file), None


_WEIGHT_FILE = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt)$|^model\.safetensors\.index\.json$|"
                          r"^pytorch_model\.bin\.index\.json$|^config\.json$|^hf_quant_config\.json$")


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, license...: everything but weights and configs."""
    for p in sorted(src.iterdir()):
        if p.is_file() and not _WEIGHT_FILE.search(p.name):
            try:
                shutil.copy2(p, dst / p.name)
            except OSError as e:
                raise disk_error(dst / p.name, "a copied file", e) from None
