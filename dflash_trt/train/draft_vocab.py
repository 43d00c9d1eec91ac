"""Make a drafter's draft vocabulary (models/draft_vocab.py) from the target's own predictions.

One teacher-forced target pass per text gives the target's greedy next token at every position;
those tokens and the text's own are what the target emits in that domain. The default corpus is the
source of the training split's standard-library modules (train/prompts.py TRAIN_MODULES; never the
held-out ones), the domain the embedded drafter was trained for.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import sys
import warnings

import torch
from tqdm import tqdm

from dflash_trt.train.prompts import TRAIN_MODULES


def stdlib_texts() -> list[tuple[str, str]]:
    """(name, source) of every TRAIN_MODULES module whose source is readable."""
    out = []
    for name in TRAIN_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append((name, inspect.getsource(importlib.import_module(name))))
        except (ImportError, OSError, TypeError):
            continue
    return out


@torch.no_grad()
def count_target_tokens(pair, texts: list[tuple[str, str]], tokens_per_text: int = 1024,
                        progress: bool = True) -> tuple[collections.Counter, int]:
    """Token counts over the texts' first `tokens_per_text` tokens and the target's greedy prediction
    at each of them; and the number of positions seen."""
    counts: collections.Counter = collections.Counter()
    positions = 0
    pair.target.setup_cache(tokens_per_text)
    for _, text in tqdm(texts, desc="draft vocab", unit="text", disable=not progress, file=sys.stderr):
        ids = pair.tokenizer(text)["input_ids"][:tokens_per_text]
        if not ids:
            continue
        logits, _ = pair.target(torch.tensor(ids), 0, all_logits=True)
        counts.update(ids)
        counts.update(logits.argmax(-1).tolist())
        positions += len(ids)
    return counts, positions


def choose(counts: collections.Counter, always: list[int], max_size: int | None) -> list[int]:
    """The most frequent tokens (at most max_size, ties by id), plus `always` (e.g. stop tokens)."""
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return sorted(set(ranked[:max_size] if max_size else ranked) | set(always))
