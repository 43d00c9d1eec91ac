"""`dflash-trt quantize`: a Hugging Face checkpoint -> ModelOpt-style unified HF checkpoint
(FP8 or NVFP4 weights, optional FP8 KV cache), streaming tensor by tensor. DESIGN.md §5.

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
from dflash_trt.io import formats
from dflash_trt.io.atomic import atomic_output_dir, disk_error, write_text
from dflash_trt.io.checkpoint import (
    CheckpointReader,
    Progress,
    ShardedWriter,
    TensorSpec,
    check_finite,
    check_finite_blocks,
    check_shapes,
    load_config,
)
from dflash_trt.quant.calibrate import LayerCalibrator, layer_tensors, load_calib_samples

FORMATS = ("fp8", "nvfp4")
MODELOPT_VERSION = "0.47.0"   # the ModelOpt release whose export format we reproduce

# Modules ModelOpt leaves unquantized by default (its *_DEFAULT_CFG), as module-name globs.
DEFAULT_EXCLUDE = ("*lm_head*", "*embed_tokens*", "*router*", "*mlp.gate", "*block_sparse_moe.gate",
                   "*shared_expert_gate", "*output_layer*", "*vision*", "*visual*", "*multi_modal_projector*")
# Fused groups: modules that share one input (and so one input_scale, and for NVFP4 one
# weight_scale_2), because the runtime runs them as one GEMM.
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
GROUP_IN_MEMORY_BYTES = 256 * 2**20  # fused groups up to this size are read once, else twice


def check_format_for_arch(fmt: str, arch: str) -> None:
    """For the build stage: NVFP4 needs Blackwell tensor cores (sm_100/sm_103/sm_120)."""
    if fmt == "nvfp4" and arch.lower() in ("hopper", "sm_90", "sm90", "h100", "h200", "ampere", "ada"):
        raise DFlashError(f"--arch {arch}: NVFP4 weights need Blackwell (sm_100/sm_103/sm_120) FP4 tensor cores; "
                          "quantize with --format fp8 for Hopper")


def check_format_for_model(fmt: str, cfg: dict) -> None:
    if cfg.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (cfg.get("architectures") or []):
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


def plan_linears(reader: CheckpointReader, fmt: str, exclude: list[str], cfg: dict) -> tuple[dict[str, Linear], list[str]]:
    """Which 2-D weights get quantized (keyed by weight tensor name), and the excluded modules
    (ModelOpt lists the Linear / Embedding modules it left unquantized)."""
    patterns = list(DEFAULT_EXCLUDE) + list(exclude)
    gpt_oss = cfg.get("model_type") == "gpt_oss"
    linears, excluded = {}, []
    for name in reader.keys():
        dtype, shape = reader.meta(name)
        if gpt_oss and name.endswith("_blocks"):  # MXFP4 experts: kept as they are
            module = name.rpartition(".")[0]
            if module not in excluded:
                excluded.append(module)
            continue
        if not name.endswith(".weight") or len(shape) != 2 or not dtype.is_floating_point or dtype.itemsize == 1:
            continue
        module = name[: -len(".weight")]
        if any(fnmatch.fnmatchcase(module, p) for p in patterns) or (gpt_oss and ".self_attn." not in module):
            excluded.append(module)
            continue
        if fmt == "nvfp4" and shape[1] % formats.NVFP4_BLOCK:
            raise DFlashError(f"{reader.file_of(name)}: tensor {name!r} has {shape[1]} input features, not a "
                              f"multiple of {formats.NVFP4_BLOCK}; exclude it with --exclude '{module}'")
        parent, _, leaf = module.rpartition(".")
        group = f"{parent}.{FUSED[leaf]}" if leaf in FUSED else module
        linears[name] = Linear(module, dtype, tuple(shape), group)
    if "lm_head.weight" not in reader and "lm_head" not in excluded and cfg.get("tie_word_embeddings", False):
        excluded.insert(0, "lm_head")  # tied: the module exists in the model though the tensor does not
    return linears, excluded


def _output_specs(reader, linears, fmt, calibrated_modules, kv_names) -> list[TensorSpec]:
    specs = []
    for name in reader.keys():
        dtype, shape = reader.meta(name)
        lin = linears.get(name)
        if lin is None:
            specs.append(TensorSpec(name, dtype, tuple(shape)))
            continue
        m = lin.module
        out, inp = shape
        if fmt == "fp8":
            specs += [TensorSpec(name, torch.float8_e4m3fn, (out, inp)), TensorSpec(m + ".weight_scale", torch.float32, ())]
        else:
            specs += [TensorSpec(name, torch.uint8, (out, inp // 2)),
                      TensorSpec(m + ".weight_scale", torch.float8_e4m3fn, (out, inp // formats.NVFP4_BLOCK)),
                      TensorSpec(m + ".weight_scale_2", torch.float32, ())]
        if m in calibrated_modules:
            specs.append(TensorSpec(m + ".input_scale", torch.float32, ()))
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


def _input_scale(amax: float, fmt: str) -> torch.Tensor:
    a = torch.tensor(amax, dtype=torch.float32)
    return formats.fp8_scale_from_amax(a) if fmt == "fp8" else formats.nvfp4_global_scale(a)


def quantize_checkpoint(model: str | Path, out: str | Path, fmt: str, kv_cache: str | None = None,
                        calib: str | Path | None = None, calib_samples: int = 64, exclude: list[str] = (),
                        max_shard_bytes: int = 5 * 2**30, progress: bool = True,
                        allow_pickle: bool = False) -> QuantizeReport:
    t0 = time.time()
    model, out = Path(model), Path(out)
    if fmt not in FORMATS:
        raise DFlashError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if kv_cache not in (None, "fp8"):
        raise DFlashError(f"--kv-cache {kv_cache!r}: only fp8 is supported")
    cfg = load_config(model)
    check_format_for_model(fmt, cfg)
    if out.resolve() == model.resolve():
        raise DFlashError(f"--out {out}: must differ from --model (the input is read while the output is written)")
    with CheckpointReader(model, allow_pickle=allow_pickle) as reader:
        check_shapes(reader, cfg, model / "config.json")
        linears, excluded = plan_linears(reader, fmt, list(exclude), cfg)
        if not linears:
            raise DFlashError(f"{model}: no Linear weights to quantize (all excluded?)")
        is_drafter = "DFlashDraftModel" in (cfg.get("architectures") or [])

        not_calibrated: list[str] = []
        attn_modules = sorted({lin.module.rpartition(".")[0] for lin in linears.values()
                               if lin.module.endswith(".self_attn.k_proj")})
        kv_names = [n for a in attn_modules for n in (a + ".k_proj.k_scale", a + ".v_proj.v_scale")] \
            if kv_cache == "fp8" else []
        cal, n_samples = None, 0
        if calib is not None:
            if is_drafter:
                raise DFlashError(f"{model}: --calib is for targets; a DFlash drafter's activations come from its "
                                  "target (quantize the drafter without --calib: weights only)")
            samples = load_calib_samples(calib, model, calib_samples)
            n_samples = len(samples)
            cal = LayerCalibrator(reader, cfg, samples)
            # every quantized Linear inside a decoder layer gets an input_scale
            calibrated_modules = {lin.module for lin in linears.values() if _layer_index(lin.module) is not None}
        else:
            calibrated_modules = set()
            not_calibrated.append("input_scale (activation scales): not written; consumers quantize activations "
                                  "dynamically or need --calib FILE.jsonl")
            if kv_cache == "fp8":
                not_calibrated.append("k_scale/v_scale (FP8 KV cache): set to 1.0, TensorRT-LLM's default, not calibrated")

        specs = _output_specs(reader, linears, fmt, calibrated_modules, kv_names)
        groups: dict[str, list[str]] = {}
        for name, lin in linears.items():
            groups.setdefault(lin.group, []).append(name)

        with atomic_output_dir(out) as tmp, \
                Progress(reader.total_bytes, len(reader), f"quantize {fmt}" + (" + calibrate" if cal else ""),
                         progress) as bar:
            writer = ShardedWriter(tmp, specs, max_shard_bytes, metadata={"producer": "dflash-trt"})
            try:
                done: set[str] = set()
                input_amax: dict[str, float] = {}
                if cal is not None:
                    # One read per weight: layer i is loaded, calibrated (its inputs come from
                    # layers < i only), quantized with the scales just measured, written, dropped.
                    for i in range(cal.num_layers):
                        tensors = layer_tensors(reader, i)
                        cal.step(i, tensors)
                        res = cal.result
                        group_amax: dict[str, float] = {}   # fused groups share the max, as in ModelOpt
                        for n in tensors:
                            lin = linears.get(n)
                            if lin is not None and lin.module in res.input_amax:
                                group_amax[lin.group] = max(group_amax.get(lin.group, 0.0), res.input_amax[lin.module])
                        for n in tensors:
                            lin = linears.get(n)
                            if lin is not None and lin.module in calibrated_modules:
                                if lin.group not in group_amax:
                                    raise DFlashError(f"calibration recorded no input for {lin.module}")
                                input_amax[lin.module] = group_amax[lin.group]
                        a = f"model.layers.{i}.self_attn"
                        if kv_cache == "fp8" and a in attn_modules:
                            writer.write(a + ".k_proj.k_scale", formats.fp8_scale_from_amax(res.k_amax[a]))
                            writer.write(a + ".v_proj.v_scale", formats.fp8_scale_from_amax(res.v_amax[a]))
                        def load_layer(n, slot=None, blocks=False, check=True, tensors=tensors):
                            return tensors[n], *_checked_amax(n, tensors[n], None, blocks, check)
                        _write_tensors(list(tensors), load_layer, linears, groups, fmt, input_amax, writer, bar, done)
                        del tensors
                elif kv_cache == "fp8":
                    for n in kv_names:
                        writer.write(n, torch.tensor(1.0))
                rest = [n for n in reader.keys() if n not in done]
                _write_tensors(rest, _streaming_loader(reader), linears, groups, fmt, input_amax, writer, bar, done)
                files = writer.close()
                disk_wait = writer.disk_wait_seconds
            except BaseException:
                writer.abort()
                raise
            hfq = hf_quant_config(fmt, kv_cache, excluded)
            out_cfg = dict(cfg)
            out_cfg["quantization_config"] = config_quantization_section(hfq)
            write_text(tmp / "hf_quant_config.json", json.dumps(hfq, indent=4))
            write_text(tmp / "config.json", json.dumps(out_cfg, indent=4))
            _copy_side_files(model, tmp)
            bytes_out = sum(s.nbytes for s in specs)
    return QuantizeReport(out=str(out), format=fmt, kv_cache=kv_cache, quantized_modules=len(linears),
                          copied_tensors=len(reader) - len(linears), exclude_modules=excluded,
                          bytes_in=reader.total_bytes, bytes_out=bytes_out, files=files,
                          calibrated=calib is not None, calibration_samples=n_samples,
                          not_calibrated=not_calibrated, seconds=round(time.time() - t0, 3),
                          disk_wait_seconds=round(disk_wait, 3))


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


def _streaming_loader(reader: CheckpointReader):
    """load(name, slot, blocks, check) -> (tensor, amax, block amax or None), a zero-copy view
    of the checkpoint (reader.view), checked for NaN / Inf (the pass that finds amax; skipped
    with check=False, for a tensor checked before); with `blocks`, the max of each NVFP4 block
    from the same pass. The view is valid until the next load into the same slot, which
    releases its pages; callers use one slot per tensor they hold at the same time."""
    held: dict[str, str] = {}

    def load(n, slot="copy", blocks=False, check=True):
        prev = held.pop(slot, None)
        if prev is not None:
            reader.release(prev)
        t = reader.view(n)
        held[slot] = n
        return t, *_checked_amax(n, t, reader.file_of(n), blocks, check)
    load.nbytes = reader.nbytes
    return load


def _write_tensors(names, load, linears, groups, fmt, input_amax, writer, bar, done: set) -> None:
    """Copy or quantize `names` (quantized ones with their whole fused group)."""
    for name in names:
        if name in done:
            continue
        lin = linears.get(name)
        if lin is None:
            t, _, _ = load(name)
            writer.write(name, t)
            bar.update(t.numel() * t.element_size())
            done.add(name)
            continue
        members = groups[lin.group]
        _quantize_group(load, members, linears, fmt, input_amax, writer, bar)
        done.update(members)


def _quantize_group(load, members, linears, fmt, input_amax, writer, bar) -> None:
    """Quantize one fused group (or a lone Linear). Streaming from disk, the group's tensors are
    held together when small; larger groups are read twice (amax pass, then quantize pass) to
    bound memory. NVFP4 needs the group's amax before any member is encoded (shared scale 2)."""
    nbytes = getattr(load, "nbytes", None)
    cache = {} if nbytes is None or sum(nbytes(n) for n in members) <= GROUP_IN_MEMORY_BYTES else None

    blocks = fmt == "nvfp4"

    def get(n, check=True):
        if cache is not None and n in cache:
            return cache.pop(n)
        return load(n, f"group{members.index(n)}" if cache is not None else "group", blocks, check)

    global_scale, block_amax = None, {}
    if fmt == "nvfp4":
        amax = torch.zeros((), dtype=torch.float32)
        for n in members:
            t, a, block_amax[n] = get(n)
            amax = torch.maximum(amax, a)
            if cache is not None:
                cache[n] = (t, a, block_amax[n])
            del t
        global_scale = formats.nvfp4_global_scale(amax)
    for n in members:
        w, amax, _ = get(n, check=not blocks)   # NVFP4: checked, and block maxima kept, above
        m = linears[n].module
        if fmt == "fp8":
            scale = formats.fp8_scale_from_amax(amax)
            writer.write(n, formats.fp8_quantize(w, scale))
            writer.write(m + ".weight_scale", scale)
        else:
            packed, bscale, gscale = formats.nvfp4_quantize(w, global_scale=global_scale, out=writer.out_buffer(n),
                                                            block_amax=block_amax.pop(n, None),
                                                            scales_out=writer.out_buffer(m + ".weight_scale"))
            writer.write(n, packed)
            writer.write(m + ".weight_scale", bscale)
            writer.write(m + ".weight_scale_2", gscale.reshape(()))
        if m in input_amax:
            writer.write(m + ".input_scale", _input_scale(input_amax[m], fmt))
        bar.update(w.numel() * w.element_size())
        del w


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
