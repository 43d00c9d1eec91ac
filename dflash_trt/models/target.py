"""Loading a target: config.json -> its family's runtime model (models/families) with the checkpoint's
tensors in it; TargetModel is the interface every family's model has (models/shell.TargetShell).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import require_target_config
from dflash_trt.models.families import FAMILIES, family_module
from dflash_trt.models.shell import TargetShell as TargetModel
from dflash_trt.models.weights import dequantize_mxfp4, dequantized_state_dict, load_strict

SUPPORTED = tuple(FAMILIES)   # the model types the CPU runtime runs (models/families)

__all__ = ["SUPPORTED", "TargetModel", "build_target", "load_target", "stop_token_ids"]


def build_target(cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096) -> TargetModel:
    """The runtime's model of a target config (any family of models/families)."""
    module = family_module(cfg.get("model_type"))
    if module is None:
        raise DFlashError(f"config.json: model_type {cfg.get('model_type')!r} is not supported by the CPU runtime "
                          f"(supported: {', '.join(SUPPORTED)})")
    return module.build(cfg, dtype=dtype, max_len=max_len)


def load_target(folder: str | Path, dtype: torch.dtype = torch.float32, max_len: int = 4096,
                allow_pickle: bool = False) -> TargetModel:
    folder = Path(folder)
    cfg = require_target_config(read_json(folder / "config.json"), str(folder / "config.json"))
    if "model_type" not in cfg:
        raise DFlashError(f"{folder / 'config.json'}: missing field model_type")
    model = build_target(cfg, dtype=dtype, max_len=max_len)
    # a quantized target (a bundle's target/: ModelOpt FP8 / NVFP4, gpt-oss MXFP4 experts) is read back as the
    # values the engines' GEMMs multiply by, so the runtime decodes the model the engines serve
    state = dequantize_mxfp4(dequantized_state_dict(folder, None, allow_pickle=allow_pickle))
    if (rename := getattr(model, "state_name", None)) is not None:   # a family whose checkpoint wraps its decoder
        state = {n: t for name, t in state.items() if (n := rename(name)) is not None}
    if getattr(model, "tied", False):
        state.pop("lm_head.weight", None)
    load_strict(model, state, folder)
    return model.eval()


def stop_token_ids(folder: str | Path) -> list[int]:
    """End-of-sequence ids, from generation_config.json when present (as HF generate does)."""
    folder = Path(folder)
    src = folder / "generation_config.json"
    path = src if src.exists() else folder / "config.json"
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise DFlashError(f"{path}: eos_token_id = {eos!r:.60}: must be a token id or a list of token ids")
    return list(ids)
