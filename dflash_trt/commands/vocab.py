"""draft-vocab: give a drafter a draft vocabulary (the tokens it proposes from)."""
from __future__ import annotations

import json
import os

import click


@click.command("draft-vocab")
@click.option("--target", type=click.Path(), help="Target folder or preset (default: embedded SmolLM2-135M).")
@click.option("--drafter", type=click.Path(file_okay=False), required=True,
              help="DFlash drafter folder: draft_vocab.json is written into it.")
@click.option("--corpus", type=click.Path(dir_okay=False),
              help='JSONL of {"text": ...} lines in the serving domain (default: the source of the training '
                   "split's standard-library modules).")
@click.option("--tokens-per-text", type=click.IntRange(16, 8192), default=1024, show_default=True,
              help="Tokens of each text the target reads.")
@click.option("--max-size", type=click.IntRange(1), help="Keep at most this many tokens (most frequent first).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def draft_vocab_cmd(target, drafter, corpus, tokens_per_text, max_size, dtype, as_json):
    """Write DRAFTER/draft_vocab.json: the tokens the target emits in a domain, from one
    teacher-forced target pass per text (its greedy prediction at every position, and the text's own
    tokens). The CPU runtime then computes draft logits over those tokens only, which cuts the draft
    step's largest cost (the lm_head over the drafted rows) by the vocabulary ratio. Lossless either
    way: the target verifies over its whole vocabulary; compare tau with `bench --full-draft-vocab`.

    \b
    Example:
      dflash-trt draft-vocab --drafter my-drafter
      dflash-trt bench --drafter my-drafter                      # tau, speed-up with it
      dflash-trt bench --drafter my-drafter --full-draft-vocab   # and without
    """
    from dflash_trt.io.jsonio import read_jsonl
    from dflash_trt.models.draft_vocab import write_draft_vocab
    from dflash_trt.presets.catalog import resolve_target
    from dflash_trt.runtime.pair import load_pair
    from dflash_trt.train.draft_vocab import choose, count_target_tokens, stdlib_texts

    if corpus:
        texts = [(f"{corpus}:{i}", row["text"]) for i, row in enumerate(read_jsonl(corpus, require="text"), 1)]
        source = f"target predictions on {len(texts)} texts of {os.path.basename(corpus)}"
    else:
        texts = stdlib_texts()
        source = f"target predictions on the source of {len(texts)} training-split stdlib modules"
    pair = load_pair(resolve_target(target), None, dtype)
    counts, positions = count_target_tokens(pair, texts, tokens_per_text)
    ids = choose(counts, pair.stop_ids, max_size)
    path = write_draft_vocab(drafter, ids, pair.target.vocab_size,
                             f"{source}, first {tokens_per_text} tokens each ({positions} positions)")
    summary = {"file": str(path), "tokens": len(ids), "vocab_size": pair.target.vocab_size, "positions": positions,
               "fraction_of_vocab": len(ids) / pair.target.vocab_size}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"wrote {path}: {len(ids)} of {pair.target.vocab_size} tokens "
                   f"({100 * summary['fraction_of_vocab']:.1f}%), from {positions} positions")
