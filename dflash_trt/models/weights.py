"""Weights for the CPU runtime: whole state dicts read through the validating streaming reader
(io.checkpoint refuses truncated files, bad offsets and pickles), quantized checkpoints read back
as the float values they encode, and a strict load into a module."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.io import compressed_tensors, formats
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.formats import mxfp4_decode


def read_state_dict(folder: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        return {name: r.get(name) for name in r.keys()}


def dequantized_state_dict(folder: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A quantized (FP8 / NVFP4, ModelOpt-style) checkpoint read back as plain float weights,
    scales dropped: what the CPU reference runtime needs to run a quantized model (e.g. to
    measure the tau an FP8 drafter costs). Unquantized tensors are returned as stored."""
    with CheckpointReader(folder) as r:
        keys = set(r.keys())
        out = {}
        for name in r.keys():
            if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")):
                continue
            t = r.get(name)
            m = name[: -len(".weight")] if name.endswith(".weight") else None
            if m and m + ".weight_scale_2" in keys:
                t = formats.nvfp4_dequantize(t, r.get(m + ".weight_scale"), r.get(m + ".weight_scale_2"), dtype)
            elif m and m + ".weight_scale" in keys:
                t = formats.fp8_dequantize(t, r.get(m + ".weight_scale"), dtype)
            elif t.is_floating_point():
                t = t.to(dtype)
            out[name] = t
    return out


def int8_w8a8_dequantized_state_dict(folder: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A compressed-tensors INT8 W8A8 checkpoint (`build --drafter-quant int8`, vLLM's form) read
    back as the weights vLLM's int8 kernel applies: int8 codes times their float32 scales
    (io/compressed_tensors.py). The activations' int8 rounding is not in the weights: see
    models/drafter.py emulate_int8_activations."""
    return compressed_tensors.dequantize_int8_w8a8(read_state_dict(folder), dtype)


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
