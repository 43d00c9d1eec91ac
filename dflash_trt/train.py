"""Training a DFlash drafter for a (small) target: the public recipe (DESIGN.md §4).

    prompts ──target generates──▶ responses (JSONL) ──target forward──▶ cached features (bf16)
            ──▶ random anchors, masked blocks, per-anchor attention, decayed CE ──▶ z-lab drafter

Data: the target's own (greedy) answers, so the labels are exactly the tokens the target emits at
decode time. The target is frozen, so its hidden states at the chosen layers are computed once and
cached on disk; a training step then only runs the drafter and the (frozen) lm_head.

A block = [anchor token, MASK × (B-1)] at positions anchor..anchor+B-1 sees the context strictly
before its anchor and its own block (bidirectionally), never other blocks; slot k predicts the
token at anchor+k, weighted exp(-(k-1)/γ), as z-lab and SpecForge train it.

Run folder (--out DIR): DIR/drafter (the z-lab checkpoint, bfloat16, rewritten at every save),
DIR/state (fp32 weights + AdamW moments as safetensors, step and RNG as JSON: what --resume
reads), DIR/features (the cached target features), DIR/log.jsonl (loss and τ per log step).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_trt.errors import DFlashError
from dflash_trt.prompts import chat_ids, read_jsonl


# ------------------------------------------------------------------------------------ data
def generate_responses(target_dir: str | Path, prompts: list[str], out_path: str | Path, *,
                       max_new_tokens: int = 192, batch_size: int = 16, progress: bool = True,
                       threads: int | None = None) -> Path:
    """Answer each prompt with the target (greedy, chat template) and append rows
    `{"prompt", "prompt_ids", "output_ids"}` to out_path. Resumable: prompts already in the file
    are skipped. Uses transformers' batched generate (left padding): this is data, not the product."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    out_path = Path(out_path)
    done = {r["prompt"] for r in read_jsonl(out_path)} if out_path.exists() else set()
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    if not todo:
        return out_path
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    encoded = sorted(((p, chat_ids(tok, p)) for p in todo), key=lambda x: len(x[1]))  # less padding
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(0).shuffle(batches)  # a mix of lengths early, so the progress rate is honest
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="generating responses", unit="prompt", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with open(out_path, "a") as f, torch.no_grad():
        for batch in batches:
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            gen = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            for (prompt, ids), row in zip(batch, gen[:, width:].tolist()):
                row = _strip_after_eos(row, eos)
                f.write(json.dumps({"prompt": prompt, "prompt_ids": ids, "output_ids": row}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return out_path


def _strip_after_eos(row: list[int], eos) -> list[int]:
    stops = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(row):
        if t in stops:
            return row[: i + 1]  # keep the end token: drafting it is part of decoding
    return row
