"""One quantized Linear's tensors, as NVIDIA ModelOpt's two exporters write them: the unified
Hugging Face checkpoint (`quantize`) and the TensorRT-LLM checkpoint (`convert`). Both encode the same
way (io/formats.py), a fused group sharing its scales (callers compute them over the group); the
exporters differ only in names, scalar shapes and the FP8 division's dtype: `LinearExport`'s data.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.io import formats
from dflash_trt.io.shards import TensorSpec

MODELOPT_VERSION = "0.47.0"   # the ModelOpt release whose export formats we reproduce
FORMATS = ("fp8", "nvfp4")


@dataclass(frozen=True)
class LinearExport:
    """How one exporter names and shapes a quantized Linear's tensors (after `{module}.`)."""
    scale: str                          # FP8: the per-tensor scale; NVFP4: the E4M3 block scales
    scale_2: str                        # NVFP4's global scale
    input_scale: str                    # the activation scale, from calibration
    fp8_scalar_shape: tuple[int, ...]   # FP8's scalars; NVFP4's are 0-dim in both exporters
    fp8_divide_dtype: torch.dtype | None  # formats.fp8_quantize's compute_dtype

    def scalar_shape(self, fmt: str) -> tuple[int, ...]:
        return self.fp8_scalar_shape if fmt == "fp8" else ()


HF_EXPORT = LinearExport("weight_scale", "weight_scale_2", "input_scale", (), None)
TRTLLM_EXPORT = LinearExport("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
                             (1,), torch.float32)


def per_tensor_scale(fmt: str, amax: float | torch.Tensor) -> torch.Tensor:
    """FP8's per-tensor scale amax/448, or NVFP4's global scale amax/(6*448): for a weight (or a
    fused group of weights) and for an activation alike. An fp32 scalar."""
    return formats.fp8_scale_from_amax(amax) if fmt == "fp8" else formats.nvfp4_global_scale(amax)


def linear_specs(export: LinearExport, module: str, fmt: str, out_features: int, in_features: int,
                 input_scale: bool) -> list[TensorSpec]:
    """The tensors `quantize_linear` gives for a [out_features, in_features] weight, in its order."""
    scalar = export.scalar_shape(fmt)
    if fmt == "fp8":
        specs = [TensorSpec(f"{module}.weight", torch.float8_e4m3fn, (out_features, in_features)),
                 TensorSpec(f"{module}.{export.scale}", torch.float32, scalar)]
    else:
        specs = [TensorSpec(f"{module}.weight", torch.uint8, (out_features, in_features // 2)),
                 TensorSpec(f"{module}.{export.scale}", torch.float8_e4m3fn,
                            (out_features, in_features // formats.NVFP4_BLOCK)),
                 TensorSpec(f"{module}.{export.scale_2}", torch.float32, scalar)]
    if input_scale:
        specs.append(TensorSpec(f"{module}.{export.input_scale}", torch.float32, scalar))
    return specs


def quantize_linear(export: LinearExport, module: str, w: torch.Tensor, fmt: str, scale: torch.Tensor,
                    input_amax: float | None = None, *, out: torch.Tensor | None = None,
                    scales_out: torch.Tensor | None = None, block_amax: torch.Tensor | None = None
                    ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for weight `w` of `module`: the encoded weight, its scale(s) and, given the
    calibrated `input_amax`, its input scale. `scale` is `per_tensor_scale` of the weight's (or its
    fused group's) amax. NVFP4 only: `out` / `scales_out` are buffers to encode into (a writer's),
    `block_amax` the block maxima from the NaN-check pass (see formats.nvfp4_quantize)."""
    scalar = export.scalar_shape(fmt)
    if fmt == "fp8":
        tensors = [(f"{module}.weight", formats.fp8_quantize(w, scale, export.fp8_divide_dtype)),
                   (f"{module}.{export.scale}", scale.reshape(scalar))]
    else:
        packed, block_scales, global_scale = formats.nvfp4_quantize(w, global_scale=scale, out=out, block_amax=block_amax,
                                                                    scales_out=scales_out)
        tensors = [(f"{module}.weight", packed), (f"{module}.{export.scale}", block_scales),
                   (f"{module}.{export.scale_2}", global_scale.reshape(scalar))]
    if input_amax is not None:
        tensors.append((f"{module}.{export.input_scale}", per_tensor_scale(fmt, input_amax).reshape(scalar)))
    return tensors
