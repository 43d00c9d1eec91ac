"""`build --drafter-quant int8`: the drafter as a compressed-tensors INT8 W8A8 checkpoint (the
format: io/compressed_tensors.py), the quantized scheme vLLM-CPU runs on any x86 CPU.

Quantized: each decoder layer's q/k/v/o and gate/up/down projections. Kept as stored (and named in
`ignore`): fc (vLLM builds it with the draft quant_config), the norms, vLLM's draft-vocabulary lm_head
rows. Side files (draft_vocab.json, MODEL_CARD.md) are copied.
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io import compressed_tensors
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.checkpoint import CheckpointReader, load_config
from dflash_trt.io.shards import save_safetensors
from dflash_trt.quant.quantize import copy_side_files


def write_int8_drafter(src: str | Path, out: str | Path) -> Path:
    """Write `src` (a bf16 / fp32 DFlash drafter folder) to `out` in INT8 W8A8 form; one
    model.safetensors (a drafter is small), config.json with its quantization_config."""
    import torch

    src, out = Path(src), Path(out)
    cfg = load_config(src)
    if cfg.get("quantization_config"):
        raise DFlashError(f"{src}/config.json: the drafter is already quantized "
                          f"({cfg['quantization_config'].get('quant_method')}); --drafter-quant int8 needs a float one")
    with CheckpointReader(src) as r:
        state = {name: r.get(name) for name in r.keys()}
    if not any(compressed_tensors.is_quantized_linear(n) for n in state):
        raise DFlashError(f"{src}: no layers.N.self_attn / mlp projection weights to quantize")
    with torch.no_grad():
        quantized = compressed_tensors.quantize_int8_w8a8(state)
    cfg["quantization_config"] = compressed_tensors.QUANTIZATION_CONFIG
    with atomic_output_dir(out) as tmp:
        copy_side_files(src, tmp)
        save_safetensors(quantized, tmp / "model.safetensors",
                         metadata={"format": "pt", "quantized_by": "dflash-trt (compressed-tensors int8 w8a8)"})
        (tmp / "model.safetensors").chmod(0o644)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
