"""Weights for the CPU runtime: whole state dicts read through the validating streaming reader
(io.checkpoint refuses truncated files, bad offsets and pickles), quantized checkpoints read back
as the float values they encode, and a strict load into a module."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.formats import mxfp4_decode


def read_state_dict(folder: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        return {name: r.get(name) for name in r.keys()}


# The quantized-weight formats a checkpoint's Linear may be stored in, as data: the stored weight's dtype,
# the side tensors next to `{module}.weight` that carry its scales, and the decode to the values the
# engine's kernel multiplies by (io/formats.py). One entry (and one decode function) per format.
@dataclass(frozen=True)
class WeightFormat:
    name: str
    weight_dtype: torch.dtype          # how the quantized `.weight` is stored
    scales: tuple[str, ...]            # side tensors `{module}.{suffix}`, all present
    decode: Callable[..., torch.Tensor]  # (weight, *scales, dtype) -> the float weight
    stored_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = tuple   # of an [out, in] weight
    scale_shapes: Callable[[tuple[int, ...]], tuple[tuple[int, ...], ...]] = lambda shape: ((),)   # of `scales`
    decoded_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = tuple   # stored_shape's inverse


def _nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt NVFP4: w = (e2m1 * weight_scale (E4M3, per 16 inputs)) * weight_scale_2 (fp32), in that
    order, as the GEMM applies them: the block scale inside the block-scaled MMA (the product is exact
    in fp32), the global scale once, in the epilogue. (formats.nvfp4_dequantize multiplies the two scales
    first, which can differ from this in the last bit.)"""
    codes = formats.e2m1_decode(formats.unpack_nibbles(packed), torch.float32)
    n = codes.shape[-1]
    blocks = codes.reshape(*codes.shape[:-1], n // formats.NVFP4_BLOCK, formats.NVFP4_BLOCK)
    w = (blocks * block_scales.to(torch.float32).unsqueeze(-1)) * global_scale.float()
    return w.reshape(*packed.shape[:-1], n).to(dtype)


def _int8_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors INT8 W8A8 (vLLM's `--drafter-quant int8`): w = int8 * float32(weight_scale), one
    scale per output channel ([out, 1]), as vLLM's int8 kernel applies it (io/compressed_tensors.py)."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


WEIGHT_FORMATS: tuple[WeightFormat, ...] = (
    WeightFormat("nvfp4", torch.uint8, ("weight_scale", "weight_scale_2"), _nvfp4,
                 lambda shape: (*shape[:-1], shape[-1] // 2),   # two E2M1 codes a byte
                 lambda shape: ((*shape[:-1], shape[-1] // formats.NVFP4_BLOCK), ()),
                 lambda shape: (*shape[:-1], shape[-1] * 2)),
    # ModelOpt FP8 (quant_algo FP8): w = e4m3 * weight_scale, one fp32 scale per tensor
    WeightFormat("fp8", torch.float8_e4m3fn, ("weight_scale",), formats.fp8_dequantize),
    WeightFormat("int8", torch.int8, ("weight_scale",), _int8_per_channel,
                 scale_shapes=lambda shape: ((*shape[:-1], 1),)),
)
# tensors that scale activations or the KV cache: nothing to decode into a weight
ACTIVATION_SCALES = ("input_scale", "k_scale", "v_scale")


def weight_format(reader: CheckpointReader, name: str) -> WeightFormat | None:
    """The format `name` (a `{module}.weight`) is stored in; None: a plain float tensor."""
    if not name.endswith(".weight"):
        return None
    m, dtype = name[: -len(".weight")], reader.meta(name)[0]
    return next((f for f in WEIGHT_FORMATS if dtype == f.weight_dtype
                 and all(f"{m}.{s}" in reader for s in f.scales)), None)


def scale_tensors(reader: CheckpointReader) -> set[str]:
    """The tensors that hold no weight of the model: each quantized weight's scales (WEIGHT_FORMATS)
    and the activation / KV-cache scales (ACTIVATION_SCALES)."""
    side = {f"{n[: -len('.weight')]}.{s}" for n in reader.keys() if (f := weight_format(reader, n)) for s in f.scales}
    return side | {n for n in reader.keys() if n.endswith(tuple("." + s for s in ACTIVATION_SCALES))}


def quantized_weights(reader: CheckpointReader) -> dict[str, WeightFormat]:
    """`{module}.weight` -> its format, for every weight stored quantized."""
    return {n: f for n in reader.keys() if (f := weight_format(reader, n)) is not None}


def format_problems(reader: CheckpointReader, shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """What stops a quantized weight from being decoded, by tensor: a weight in a quantized dtype without
    its format's scales; with `shapes` (weight name -> the [out, in] shape the config implies), a scale of
    the wrong shape. `check` reports these; the loader refuses the first."""
    p = []
    quantized = quantized_weights(reader)
    dtypes = {f.weight_dtype for f in WEIGHT_FORMATS}
    for name in reader.keys():
        dtype = reader.meta(name)[0]
        fmt = quantized.get(name)
        if fmt is None and name.endswith(".weight") and dtype in dtypes:
            p.append(f"{reader.file_of(name)}: tensor {name!r} is {dtype} without the scales of a known format "
                     f"({'; '.join(f.name + ': ' + ' + '.join(f.scales) for f in WEIGHT_FORMATS)})")
        elif fmt is not None and shapes is not None and name in shapes:
            m = name[: -len(".weight")]
            for suffix, want in zip(fmt.scales, fmt.scale_shapes(tuple(shapes[name]))):
                got = tuple(reader.meta(f"{m}.{suffix}")[1])
                if got != tuple(want):
                    p.append(f"{reader.file_of(f'{m}.{suffix}')}: tensor {m}.{suffix} has shape {list(got)}, "
                             f"{fmt.name} of a {list(shapes[name])} weight implies {list(want)}")
    return p


def dequantized_state_dict(folder: str | Path, dtype: torch.dtype | None = torch.float32,
                           allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as the model's float weights: each quantized weight (WEIGHT_FORMATS, e.g.
    ModelOpt FP8 / NVFP4) decoded in float32 to exactly the values the engine's GEMM multiplies by,
    then cast to `dtype`; its scales and the activation / KV-cache scales dropped; the other tensors
    as stored (floating ones cast to `dtype`; dtype None: quantized weights stay float32, the rest as
    stored). A plain checkpoint reads back unchanged. What the CPU reference runtime loads, so it runs
    the quantized model an engine serves (the target of a bundle, a quantized drafter)."""
    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        if problems := format_problems(r):
            raise DFlashError(problems[0])
        side = scale_tensors(r)
        quantized = quantized_weights(r)
        out = {}
        for name in r.keys():
            if name in side:
                continue
            t = r.get(name)
            if (fmt := quantized.get(name)) is not None:
                m = name[: -len(".weight")]
                t = fmt.decode(t, *(r.get(f"{m}.{s}") for s in fmt.scales), torch.float32)
                t = t.to(dtype) if dtype is not None else t
            elif t.is_floating_point() and dtype is not None:
                t = t.to(dtype)
            out[name] = t
    return out


def holds_quantized_weights(folder: str | Path, allow_pickle: bool = False) -> bool:
    """Whether a checkpoint stores any weight in a WEIGHT_FORMATS format (headers only)."""
    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        return bool(quantized_weights(r))


def dequantize_mxfp4(state: dict) -> dict:
    """gpt-oss MXFP4 experts (`*_blocks` [E, out, in/32, 16] + `*_scales`) → dense [E, in, out]."""
    out = {}
    for k, v in state.items():
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            dense = mxfp4_decode(v, state[base + "_scales"])  # [E, out, in]
            out[base] = dense.transpose(1, 2).contiguous()
        elif not k.endswith("_scales"):
            out[k] = v
    return out


def load_strict(model: nn.Module, state: dict, folder: Path) -> None:
    """Copy `state` into `model`, refusing a missing, unexpected or mis-shaped tensor by name."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise DFlashError(f"{folder}: tensor {missing[0]} missing from the checkpoint"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise DFlashError(f"{folder}: unexpected tensor {unexpected[0]} for this config")
    for k, t in expected.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise DFlashError(f"{folder}: tensor {k} has shape {tuple(state[k].shape)}, "
                              f"config implies {tuple(t.shape)}")
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(state[k].to(t.dtype))
