"""`dflash-trt quantize`: a Hugging Face checkpoint -> ModelOpt-style unified HF checkpoint
(FP8 or NVFP4 weights, optional FP8 KV cache), streaming tensor by tensor. docs/formats.md.

Pipeline: validate -> plan every output tensor (quant/plan.py) -> stream: read one tensor (or one small
fused group), check it is finite, quantize, write it at its planned offset -> configs -> atomic rename.
With --calib, layer i is read once, calibrated (its inputs depend only on layers < i), quantized and
dropped. Peak memory is about one tensor plus bounded temporaries, whatever the model size. The bytes
are ModelOpt's (tests/test_quantize.py compares with `export_hf_checkpoint`), scales shared across a
fused group (q/k/v; gate/up) as its `preprocess_linear_fusion` does.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats
from dflash_trt.io.atomic import atomic_output_dir, disk_error, refuse_inside, write_text
from dflash_trt.io.checkpoint import CheckpointReader, check_finite, check_finite_blocks, load_config
from dflash_trt.io.shards import Progress, ShardedWriter
from dflash_trt.models.check import require_checkpoint_config
from dflash_trt.models.shapes import check_shapes
from dflash_trt.quant.calibrate import CalibrationResult, LayerCalibrator, layer_tensors, load_calib_samples
from dflash_trt.quant.linear import (
    FORMATS,
    HF_EXPORT,
    per_tensor_scale,
    quantize_linear,
)
from dflash_trt.quant.plan import QuantizePlan, check_format_for_model, plan_quantization, split_fused_experts

GROUP_IN_MEMORY_BYTES = 256 * 2**20  # fused groups up to this size are read once, else twice


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
            copy_side_files(model, tmp)
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


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, license...: everything but weights and configs."""
    for p in sorted(src.iterdir()):
        if p.is_file() and not _WEIGHT_FILE.search(p.name):
            try:
                shutil.copy2(p, dst / p.name)
            except OSError as e:
                raise disk_error(dst / p.name, "a copied file", e) from None
