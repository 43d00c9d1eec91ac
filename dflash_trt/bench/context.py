"""`bench --context-buckets`: the same prompts padded with real text to a context length each.

Acceptance and speed move with context (attention over a long context costs the verify pass more than
the draft, and the drafter reads the target's features over all of it), so a schedule needs them per
context length, measured. Each prompt of a bucket is real text followed by the prompt, one user message:
the text is the source of Python's own `argparse` module (about 100,000 characters; code ahead of code
questions, as a coding assistant's long context is; repeated for buckets beyond it). Every machine that
runs us has it, so a bucket is the same text everywhere for a Python version.

A bucket's length counts the prompt's tokens as the target sees them (chat template included): our
runtime counts with the target's tokenizer, an endpoint with the server's own usage.prompt_tokens.
"""
from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from functools import lru_cache

from dflash_trt.errors import DFlashError


@lru_cache(maxsize=1)
def _filler() -> str:
    return inspect.getsource(argparse)


def padded(prompt: str, chars: int) -> str:
    """`prompt` after the first `chars` characters of the filler (cycled), cut before a word."""
    if chars <= 0:
        return prompt
    text = _filler()
    text = (text * (chars // len(text) + 1))[:chars]
    return text[:max(text.rfind(" "), text.rfind("\n")) + 1] + "\n" + prompt


def parse_counts(text: str, option: str, what: str, example: str) -> list[int]:
    """`option`'s comma-separated positive integers, sorted, each once; else one line naming the option."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise DFlashError(f"{option} {text!r}: a comma-separated list of {what}, e.g. {example}")
    return sorted(dict.fromkeys(counts))


def parse_buckets(text: str) -> list[int]:
    return parse_counts(text, "--context-buckets", "context lengths in tokens", "512,2048,8192")


def pad_to(prompt: str, tokens: int, count_tokens: Callable[[str], int]) -> tuple[str, int]:
    """(text, its token count): `prompt` padded to at most `tokens` tokens, within 1 % or 8 tokens.
    count_tokens is a server round trip for an endpoint, so this calls it a handful of times, not a
    bisection's worth: tokens grow with characters almost linearly, and each step rescales on the last
    count (secant), keeping the longest text that fits."""
    base = count_tokens(prompt)
    if base > tokens:
        raise DFlashError(f"context bucket {tokens}: the prompt alone has {base} tokens")
    best, chars, n = (prompt, base), 4 * (tokens - base), base
    for _ in range(8):
        text = padded(prompt, chars)
        n = count_tokens(text)
        if n <= tokens and n > best[1]:
            best = (text, n)
        if tokens - max(8, tokens // 100) <= n <= tokens:
            break
        chars = max(1, int(chars * (tokens - base - 2) / max(n - base, 1)))
    return best


def measure_buckets(buckets: list[int], prompts: list[str], count_tokens: Callable[[str], int],
                    measure: Callable[[list[str]], dict], say: Callable[[str], None], room: int | None = None
                    ) -> list[dict]:
    """One report per bucket: `measure` of the prompts padded to it (or to the `room` a window leaves, said
    once), with the bucket asked for and the mean tokens the padded prompts have."""
    reports = []
    for bucket in buckets:
        if room is not None and bucket > room:
            say(f"context bucket {bucket}: the window leaves {room} tokens for a prompt (less --max-new-tokens "
                f"and a block); measured at {room}")
        say(f"context bucket {bucket}: padding {len(prompts)} prompts")
        rows = [pad_to(p, bucket if room is None else min(bucket, room), count_tokens) for p in prompts]
        reports.append({"context_tokens_requested": bucket, "context_tokens": sum(n for _, n in rows) / len(rows),
                        **measure([text for text, _ in rows])})
    return reports
