"""The drafter as vLLM must read it when it drafts from a draft vocabulary (models/draft_vocab.py).

vLLM reads a DFlash drafter's config.json and *.safetensors only, not our draft_vocab.json, so it would draft
over the whole vocabulary, whose other logits a drafter trained over the draft vocabulary never trained:
vLLM accepted less than our runtime on the same pair (tests/test_vllm.py). vLLM's own form of a draft
vocabulary is EAGLE-3's, which its DFlash drafter implements (vllm 0.32.0
vllm/model_executor/models/qwen3_dflash.py): `draft_vocab_size` in config.json sizes the drafter's own
lm_head, `d2t` maps draft row i to target token i + d2t[i], and a checkpoint's `lm_head.weight` is kept
(vllm/v1/spec_decode/llm_base_proposer.py `_maybe_share_lm_head`). So this folder is the bundle's drafter/
(hard-linked) plus draft_vocab.safetensors (the target's lm_head rows of the draft tokens, and d2t) and a
config.json with `draft_vocab_size`: the argmax is then over the same tokens as our runtime's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader, load_config
from dflash_trt.io.shards import save_safetensors
from dflash_trt.models.draft_vocab import read_draft_vocab

SHARD = "draft_vocab.safetensors"


def target_lm_head_name(reader: CheckpointReader, target_cfg: dict) -> str:
    """The tensor the target's logits come from: lm_head.weight, or the embeddings when tied."""
    for name in ("lm_head.weight", "model.embed_tokens.weight") if not target_cfg.get("tie_word_embeddings") \
            else ("model.embed_tokens.weight", "lm_head.weight"):
        if name in reader:
            return name
    raise DFlashError(f"{reader.folder}: no lm_head.weight or model.embed_tokens.weight (the target's output head)")


def write_vllm_drafter(drafter: Path, source_drafter: Path, target: Path, out: Path) -> bool:
    """Write `out` (the vLLM form of `drafter`) when the drafter has a draft vocabulary; False
    (nothing written) when it has none: then the bundle's drafter/ is what vLLM reads.
    source_drafter: the folder holding draft_vocab.json; target: an unquantized target checkpoint."""
    import torch

    target_cfg = load_config(target)
    ids = read_draft_vocab(source_drafter, int(target_cfg["vocab_size"]))
    if ids is None:
        return False
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(drafter).iterdir()):
        if f.suffix == ".safetensors" or f.name in ("model.safetensors.index.json",):
            os.link(f, out / f.name)
    with CheckpointReader(target) as r:
        name = target_lm_head_name(r, target_cfg)
        rows = r.get_rows(name, ids).contiguous()
    # d2t: draft row i -> target id i + d2t[i] (EAGLE-3's offsets, as vLLM adds them)
    d2t = (ids - torch.arange(len(ids), dtype=torch.int64)).contiguous()
    save_safetensors({"lm_head.weight": rows, "d2t": d2t}, out / SHARD,
                     metadata={"format": "pt", "source": f"rows of the target's {name} for draft_vocab.json"})
    (out / SHARD).chmod(0o644)  # save_file leaves 0600; the bundle's files are world-readable
    index = out / "model.safetensors.index.json"
    if index.is_file():  # a sharded drafter: the index must name the new tensors too
        idx = json.loads(index.read_text())
        index.unlink()  # a hard link to drafter/'s index: replace, never write through it
        idx["weight_map"] |= {"lm_head.weight": SHARD, "d2t": SHARD}
        index.write_text(json.dumps(idx, indent=2) + "\n")
    cfg = load_config(drafter)
    cfg["draft_vocab_size"] = len(ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return True
