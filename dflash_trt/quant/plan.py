"""The quantization plan (`quantize`'s first stage): which Linears are quantized and in which fused
groups, what is left unquantized and how hf_quant_config lists it, every output tensor's name,
dtype and shape, and the two config files: all decided from the headers, before any weight is read.
quant/quantize.py then streams the weights through it."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.shards import TensorSpec
from dflash_trt.models.families import family, family_of_config
from dflash_trt.quant.linear import HF_EXPORT, MODELOPT_VERSION, linear_specs

# Modules ModelOpt 0.47 leaves unquantized by default (its *_DEFAULT_CFG and default_disabled_quantizers.yaml),
# as module-name globs (`*linear_attn.in_proj_b*` also covers Qwen3-Next's fused in_proj_ba).
DEFAULT_EXCLUDE = ("*lm_head*", "*embed_tokens*", "*router*", "*mlp.gate", "*block_sparse_moe.gate",
                   "*shared_expert_gate", "*output_layer*", "*vision*", "*visual*", "*multi_modal_projector*",
                   "*linear_attn.conv1d*", "*self_attention.conv1d*", "*linear_attn.in_proj_a*",
                   "*linear_attn.in_proj_b*", "*mixer.conv1d*", "mtp.*", "*embed_vision*")
# Fused groups: modules that share one input (and so one input_scale, and for NVFP4 one
# weight_scale_2), because the runtime runs them as one GEMM.
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# MoE experts: ModelOpt 0.47's _QuantFusedExperts gives an expert's gate and up ONE weight quantizer (transformers
# >= 5 fuses them), so for FP8 they share weight_scale too (tests/test_families.py). w1/w3: MiniMax / Mixtral's.
EXPERT_FUSED = {"gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}
# Other Linears that read one input (ModelOpt's preprocess_linear_fusion finds them by their shared input; here
# by name, per layer): MLA's (and GLM-5's DSA indexer's) projections of the hidden state and of the q LoRA;
# GatedDeltaNet's input projections. Measured against ModelOpt 0.47's NVFP4 export: tests/test_families.py.
SHARED_INPUT = {
    "self_attn.q_a_proj": "self_attn.hidden_in", "self_attn.kv_a_proj_with_mqa": "self_attn.hidden_in",
    "self_attn.indexer.wk": "self_attn.hidden_in", "self_attn.indexer.weights_proj": "self_attn.hidden_in",
    "self_attn.q_b_proj": "self_attn.q_lora_in", "self_attn.indexer.wq_b": "self_attn.q_lora_in",
    "linear_attn.in_proj_qkv": "linear_attn.in", "linear_attn.in_proj_z": "linear_attn.in",
}


# Exclusions ModelOpt 0.47's export lists otherwise than by module name (tests/test_family_gemma4_minimax.py):
# a Linear inside a router module as the router's prefix wildcard (Gemma 4: "model.layers.N.router*"). What a
# family leaves unlisted is its row's unlisted_excluded.
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
    """Fused 3-D experts (Gemma 4: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) read as the
    per-expert matrices ModelOpt 0.47 exports (experts.{e}.gate_proj / up_proj / down_proj), zero-copy."""
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
    i = _layer_index(module)
    key = SHARED_INPUT.get(module.split(".", 3)[3]) if i is not None else None
    return f"model.layers.{i}.{key}" if key else None


def keep_in_fp32_patterns(cfg: dict) -> list[str]:
    """Module names transformers keeps in float32 for this family whatever the load dtype (the causal-LM
    class's `_keep_in_fp32_modules_strict`): ModelOpt's export writes them float32, so ours does too."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(cfg.get("model_type")))]
    except (KeyError, ValueError):   # a family transformers does not know, or no causal-LM class
        return []
    return list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])


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
        if unmeasured := sorted({lin.module for lin in linears.values()} - set(measured)):
            raise DFlashError(f"{reader.folder}: no activation amax measured for {unmeasured[0]}"
                              + (f" (and {len(unmeasured) - 1} more)" if len(unmeasured) > 1 else ""))
        calibrated_modules = {lin.module for lin in linears.values()}
    hf_quant = hf_quant_config(fmt, kv_cache, excluded)
    # transformers' own match (modeling_utils: a pattern is a dotted run of whole name components)
    patterns = "|".join(map(re.escape, keep_in_fp32_patterns(cfg)))
    fp32 = [n for n in reader.keys() if n not in linears and patterns and re.search(rf"(^|\.)({patterns})($|\.)", n)
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


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
