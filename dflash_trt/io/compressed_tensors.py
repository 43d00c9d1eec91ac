"""The drafter in compressed-tensors' INT8 W8A8 form (`--drafter-quant int8`): the quantized format
vLLM-CPU has kernels for on every x86 CPU (docs/quantized-drafters.md says why this scheme).

The format is compressed-tensors 0.17.0's preset INT8_W8A8 (what llmcompressor's "W8A8" writes):
weights int8 symmetric per output channel (`{m}.weight` int8 [out, in], `{m}.weight_scale` [out, 1]
in the checkpoint's float dtype, no zero point), activations int8 per token, dynamic. The arithmetic
is the quantizer's, operation for operation, in the stored dtype, because the bytes must equal the
library's own export (tests/test_vllm_qdrafter.py): llmcompressor's min-max observer, then
calculate_qparams (scale = max(|min|, |max|) / 127.5, a zero scale replaced by the dtype's eps), then
round half to even, clamped to [-128, 127]. vLLM's CPU kernel sees the weight q_w * float32(s_w),
which models/weights.py's int8 row decodes.
"""
from __future__ import annotations

import re

import torch

from dflash_trt.errors import DFlashError

COMPRESSED_TENSORS_VERSION = "0.17.0"
INT8_MIN, INT8_MAX = -128, 127
# The drafter's Linears that stay in float, as patterns of vLLM's module names (its DFlash drafter
# names them model.fc, model.layers.N..., lm_head: vllm/model_executor/models/qwen3_dflash.py).
# fc: vLLM builds it with the draft quant_config (DFlashQwen3Model.__init__), so it must be listed;
# it reads the target's hidden states, whose outlier channels a per-token int8 grid would flatten.
# A checkpoint name ("fc", what llmcompressor's export lists) would not match "model.fc" in vLLM's
# compressed_tensors/utils.py should_ignore_layer, and vLLM would then expect an int8 fc.
# lm_head: the draft-vocabulary head (rows of the target's own), unquantized like the target's.
IGNORED_MODULES = ["re:(.*\\.)?fc$", "lm_head"]
QUANTIZED_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _args(strategy: str, dynamic: bool) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            "observer": None if dynamic else "memoryless_minmax", "observer_kwargs": {}}


# as ModelCompressor.update_config writes it (compressors/model_compressors/model_compressor.py)
QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args("channel", False),
                                  "input_activations": _args("token", True), "output_activations": None,
                                  "format": "int-quantized"}},
    "format": "int-quantized",
    "global_compression_ratio": None,
    "ignore": IGNORED_MODULES,
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "transform_config": {},
    "version": COMPRESSED_TENSORS_VERSION,
}


def is_quantized_linear(name: str) -> bool:
    """A drafter tensor this scheme stores as int8 (the decoder layers' attention and MLP weights)."""
    return bool(QUANTIZED_LINEAR.search(name))


def int8_weight_scale(w: torch.Tensor) -> torch.Tensor:
    """[out, 1] per-channel scale in w's dtype: min-max observer + calculate_qparams (module doc)."""
    lo = torch.clamp(torch.amin(w, dim=-1, keepdim=True), max=0)
    hi = torch.clamp(torch.amax(w, dim=-1, keepdim=True), min=0)
    scale = torch.max(lo.abs(), hi.abs()) / (float(INT8_MAX - INT8_MIN) / 2)
    return torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)


def int8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes round(w / scale), clamped (compressed-tensors `_quantize`, in w's dtype)."""
    return torch.clamp(torch.round(w / scale), INT8_MIN, INT8_MAX).to(torch.int8)


def quantize_int8_w8a8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A drafter state dict in this form: each quantized Linear's weight -> int8 weight +
    weight_scale; every other tensor as it is."""
    out = {}
    for name, t in state.items():
        if is_quantized_linear(name):
            if not t.is_floating_point() or t.dim() != 2:
                raise DFlashError(f"{name}: expected a float [out, in] weight to quantize, "
                                  f"got {t.dtype} {tuple(t.shape)}")
            scale = int8_weight_scale(t)
            out[name] = int8_quantize(t, scale).contiguous()
            out[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
        else:
            out[name] = t
    return out


def is_int8_w8a8(cfg: dict) -> bool:
    """config.json of a checkpoint in this form (its quantization_config)."""
    q = cfg.get("quantization_config") or {}
    return q.get("quant_method") == "compressed-tensors" and q.get("format") == "int-quantized"
