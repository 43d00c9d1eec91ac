"""`check`: is this (target, drafter) pair consistent? Reads configs and tensor headers only."""
from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.drafter import DFlashDrafter

MAX_BLOCK = 64


def check_pair(target_dir: str | Path, drafter_dir: str | Path) -> dict:
    """Every problem found, each a line naming the field. Never raises for a bad pair."""
    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    problems: list[str] = []
    report = {"ok": False, "problems": problems, "target_layer_ids": None, "block_size": None, "mask_token_id": None}
    try:
        tcfg = read_json(target_dir / "config.json")
    except DFlashError as e:
        problems.append(str(e))
        tcfg = None
    try:
        dpath = drafter_dir / "config.json"
        dcfg = DrafterConfig.from_dict(read_json(dpath), str(dpath))
    except DFlashError as e:
        problems.append(str(e))
        dcfg = None
    if dcfg is not None:
        report.update(target_layer_ids=dcfg.target_layer_ids, block_size=dcfg.block_size,
                      mask_token_id=dcfg.mask_token_id)
        if not 2 <= dcfg.block_size <= MAX_BLOCK:
            problems.append(f"drafter block_size = {dcfg.block_size}: must be between 2 and {MAX_BLOCK}")
        if dcfg.num_attention_heads % dcfg.num_key_value_heads:
            problems.append(f"drafter num_attention_heads = {dcfg.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads = {dcfg.num_key_value_heads}")
        problems += _check_drafter_tensors(drafter_dir, dcfg)
    if tcfg is not None and dcfg is not None:
        problems += _check_against_target(target_dir, tcfg, dcfg)
    report["ok"] = not problems
    return report


def _check_against_target(target_dir: Path, t: dict, d: DrafterConfig) -> list[str]:
    p = []
    for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if k not in t:
            p.append(f"target config.json: missing field {k}")
    if p:
        return p
    if t["hidden_size"] != d.hidden_size:
        p.append(f"hidden_size: drafter {d.hidden_size} != target {t['hidden_size']} (the drafter must match its target)")
    L = t["num_hidden_layers"]
    bad = [i for i in d.target_layer_ids if not 0 <= i < L]
    if bad:
        p.append(f"dflash_config.target_layer_ids {bad} out of range for a target with {L} layers (valid 0..{L - 1})")
    if d.num_target_layers is not None and d.num_target_layers != L:
        p.append(f"num_target_layers = {d.num_target_layers} but the target has num_hidden_layers = {L}")
    V = t["vocab_size"]
    if not 0 <= d.mask_token_id < V:
        p.append(f"dflash_config.mask_token_id = {d.mask_token_id} outside the target vocabulary (0..{V - 1})")
    if d.vocab_size != V:
        p.append(f"vocab_size: drafter {d.vocab_size} != target {V}")
    tok_len = _tokenizer_size(target_dir)
    if tok_len is not None and tok_len > V:
        p.append(f"tokenizer has {tok_len} tokens but target vocab_size is {V}")
    return p


def _tokenizer_size(folder: Path) -> int | None:
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    tok = read_json(path)
    ids = list((tok.get("model") or {}).get("vocab", {}).values()) + [a["id"] for a in tok.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def _check_drafter_tensors(folder: Path, d: DrafterConfig) -> list[str]:
    try:
        with CheckpointReader(folder) as r:
            metas = {k.removeprefix("model."): r.meta(k) for k in r.keys()}
    except DFlashError as e:
        return [str(e)]
    import torch

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(d, max_len=1).state_dict().items()}
    p = []
    for k, shape in expected.items():
        if k not in metas:
            p.append(f"drafter tensor {k} missing")
        elif tuple(metas[k][1]) != shape:
            p.append(f"drafter tensor {k} has shape {tuple(metas[k][1])}, config implies {shape}")
        elif not metas[k][0].is_floating_point:
            p.append(f"drafter tensor {k} has dtype {metas[k][0]}, expected a floating-point dtype")
    return p[:20]
