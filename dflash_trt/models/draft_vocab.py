"""The draft vocabulary: the tokens a drafter proposes from, when a drafter folder has one.

Why: on a CPU the draft step's largest cost is the target's lm_head over the drafted rows; drafting
from the few thousand tokens the target emits in the domain cuts it by the vocabulary ratio. Lossless:
the target verifies over its full vocabulary (only tau can change: `bench --full-draft-vocab`).

File `draft_vocab.json` beside the drafter's config.json (serving stacks ignore it):

    {"format": "dflash-trt-draft-vocab", "version": 1, "vocab_size": 49152,
     "token_ids": [0, 1, 2, ...], "source": "how it was made"}

token_ids: sorted, unique, in [0, vocab_size); vocab_size: the target's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_write_text
from dflash_trt.io.jsonio import read_json

FILE = "draft_vocab.json"
FORMAT = "dflash-trt-draft-vocab"


def read_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The drafter folder's draft vocabulary as sorted token ids (int64), or None without the file.
    vocab_size: the target's; a file made for another vocabulary is refused."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    d = read_json(path)
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != 1:
        raise DFlashError(f"{path}: not a dflash-trt draft vocabulary (format {FORMAT!r}, version 1)")
    if d.get("vocab_size") != vocab_size:
        raise DFlashError(f"{path}: vocab_size {d.get('vocab_size')!r} does not match the target's {vocab_size}")
    ids = d.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise DFlashError(f"{path}: token_ids must be a non-empty list of integers")
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise DFlashError(f"{path}: token_ids must be sorted, unique and in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def write_draft_vocab(folder: str | Path, token_ids: list[int], vocab_size: int, source: str) -> Path:
    ids = sorted({int(i) for i in token_ids})
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise DFlashError(f"draft vocabulary: token ids must be in [0, {vocab_size})")
    path = Path(folder) / FILE
    body = {"format": FORMAT, "version": 1, "vocab_size": vocab_size, "source": source, "token_ids": ids}
    return atomic_write_text(path, json.dumps(body) + "\n")   # a reader never sees half a file

