"""`bench`: tau and wall-clock speed-up of DFlash against AR, before a rollout."""
from __future__ import annotations

import json
from importlib import resources

import click

from dflash_trt.commands import THREADS, FiniteFloatRange


@click.command("bench")
@click.option("--target", type=click.Path(), help="Target folder or preset (default: embedded SmolLM2-135M).")
@click.option("--drafter", type=click.Path(), help="DFlash drafter folder (default: the preset's drafter).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help='JSONL of {"prompt": ...} lines (default: the embedded held-out prompts).')
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--block-size", type=click.IntRange(2, 64), help="Draft block size (default: the drafter's).")
@click.option("--temperature", type=FiniteFloatRange(0), default=0.0, show_default=True)
@click.option("--limit", type=click.IntRange(1), help="Use only the first N prompts.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="auto: bfloat16 where the CPU has native bf16 (AMX / AVX512-BF16), else float32.")
@click.option("--threads", type=THREADS, help="torch threads (default: torch's choice).")
@click.option("--fused/--no-fused", default=True, show_default=True, help="Fused KV-injection path.")
@click.option("--full-draft-vocab", is_flag=True,
              help="Draft from the whole vocabulary even if the drafter has a draft_vocab.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the full JSON report on stdout.")
def bench_cmd(target, drafter, prompts_file, max_new_tokens, block_size, temperature, limit, dtype, threads,
              fused, full_draft_vocab, as_json):
    """Run DFlash and plain AR decoding on the same prompts in one process, interleaved, and
    report tau (mean tokens per target pass, bonus included), the wall-clock speed-up, tokens/s,
    losslessness (greedy: every output token-identical to AR), the acceptance histogram and the
    per-block cost split (draft / verify / inject / bookkeeping).

    \b
    Examples:
      dflash-trt bench --limit 5
      dflash-trt bench --target DIR --drafter DIR --prompts my.jsonl --max-new-tokens 256 --json
    """
    import torch

    from dflash_trt.presets.catalog import resolve_drafter, resolve_target
    from dflash_trt.runtime.bench import format_table, run_bench
    from dflash_trt.runtime.pair import load_pair
    from dflash_trt.train.prompts import read_prompts

    if threads:
        torch.set_num_threads(threads)
    if prompts_file is None:
        prompts_file = str(resources.files("dflash_trt").joinpath("data", "heldout_prompts.jsonl"))
    prompts = read_prompts(prompts_file)[:limit]
    pair = load_pair(resolve_target(target), resolve_drafter(drafter, target), dtype, draft_vocab=not full_draft_vocab)
    report = run_bench(pair, prompts, max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature,
                       fused_inject=fused, progress=True)
    report["threads"] = torch.get_num_threads()
    report["dtype"] = str(pair.target.dtype).removeprefix("torch.")
    vocab = pair.drafter.draft_vocab
    report["draft_vocab_size"] = len(vocab) if vocab is not None else pair.target.vocab_size
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_table(report))
