"""make-tiny, check, generate: the foundation commands."""
from __future__ import annotations

import json

import click

from dflash_trt.commands import BUNDLE_PAIR_OPTION, SEED, FiniteFloatRange, pair_options
from dflash_trt.errors import DFlashError


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


@click.command("make-tiny")
@click.option("--arch", type=click.Choice(["llama", "qwen3", "gpt-oss"]), required=True, help="Model family.")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Target folder to write.")
@click.option("--drafter-out", type=click.Path(file_okay=False), help="Also write a matching random drafter here.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--block-size", type=click.IntRange(2, 64), default=8, show_default=True, help="Drafter block size.")
@click.option("--no-mxfp4", is_flag=True, help="gpt-oss: store experts dense instead of MXFP4.")
@click.option("--drafter-kind", type=click.Choice(["dflash", "dflash2", "dflash-swa"]), default="dflash",
              show_default=True, help="dflash2: a DFlash2 drafter (conv + candidate selector, sliding window); "
              "dflash-swa: a DFlash drafter with causal sliding-window layers.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def make_tiny_cmd(arch, out, drafter_out, seed, block_size, no_mxfp4, drafter_kind, as_json):
    """Write a tiny random target of a real family, with a working tokenizer, and a matching
    random DFlash drafter. Real config fields and tensor names, a few layers: for smoke tests
    of a deployment, for tests and benchmarks.

    \b
    Example:
      dflash-trt make-tiny --arch qwen3 --out tiny/target --drafter-out tiny/drafter
      dflash-trt generate --target tiny/target --drafter tiny/drafter -p "hello"
      dflash-trt make-tiny --arch qwen3 --out t --drafter-out d2 --drafter-kind dflash2 --block-size 16
    """
    from dflash_trt.models.tiny import make_tiny

    s = make_tiny(arch, out, drafter_out, seed=seed, mxfp4=not no_mxfp4, block_size=block_size,
                  drafter_kind=drafter_kind)
    if as_json:
        emit_json(s)
    else:
        click.echo(f"wrote tiny {arch} target to {s['target']}" + (f" and drafter to {s['drafter']}" if drafter_out else ""))


@click.command("check")
@click.option("--target", type=click.Path(), help="Target folder, preset name or hub id (org/name; found in the "
              "Hugging Face cache or downloaded). Default: the embedded target.")
@click.option("--drafter", type=click.Path(), help="DFlash drafter folder or hub id (default: the preset's drafter).")
@BUNDLE_PAIR_OPTION
@click.option("--scan/--no-scan", default=True, show_default=True,
              help="Read every weight once (streaming, bounded memory) and report NaN / Inf tensors.")
@click.option("--json", "as_json", is_flag=True)
def check_cmd(target, drafter, bundle, scan, as_json):
    """Validate a (target, drafter) pair without loading it: each config's types and ranges
    (heads divide hidden_size, layer_types per layer, block_size 2..64, ...), hidden sizes,
    target_layer_ids (sorted, unique, inside the target's depth), mask_token_id inside the
    vocabulary, vocab / tokenizer sizes, tensor shapes and dtypes from the headers, and (--scan)
    NaN / Inf weights. `generate`, `bench` and `build` refuse what this refuses, with the same
    message. Exit 1 if any problem is found.

    \b
    Example:
      dflash-trt check --target tiny/target --drafter tiny/drafter --json
      dflash-trt check --bundle engines/smollm2-135m-blackwell-nvfp4
    """
    from dflash_trt.bundle.served import pair_folders
    from dflash_trt.models.check import check_pair
    from dflash_trt.presets.catalog import resolve_drafter, resolve_target

    target, drafter = pair_folders(bundle, target, drafter)
    tdir = resolve_target(target)
    ddir = resolve_drafter(drafter, target)
    report = check_pair(tdir, ddir, scan=scan)
    if as_json:
        emit_json(report)
    elif report.get("runtime_note"):
        click.echo(report["runtime_note"], err=True)
    if not as_json and report["ok"]:
        click.echo(f"ok: block_size {report['block_size']}, mask_token_id {report['mask_token_id']}, "
                   f"target_layer_ids {report['target_layer_ids']}")
    elif not as_json:
        for p in report["problems"]:
            click.echo(f"problem: {p}", err=True)
    if not report["ok"]:
        raise DFlashError(f"check: {len(report['problems'])} problem(s) with the pair {tdir} + {ddir}")


@click.command("generate")
@pair_options
@click.option("--prompt", "-p", required=True, help="User message (rendered with the chat template if any).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=FiniteFloatRange(0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--block-size", type=click.IntRange(2, 64), help="Draft block size (default: the drafter's).")
@click.option("--mode", type=click.Choice(["dflash", "ar"]), default="dflash", show_default=True,
              help="ar = plain autoregressive decoding of the target (the baseline).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float64", "bfloat16"]), default="auto", show_default=True,
              help="auto: float32 for a quantized target (the exact values its engine's GEMMs multiply by), else "
                   "bfloat16 where the CPU has native bf16 (AMX / AVX512-BF16), else float32.")
@click.option("--raw", is_flag=True, help="Feed the prompt as raw text, without the chat template.")
@click.option("--allow-pickle", is_flag=True,
              help="Accept .bin/.pt pickle weights (loaded with torch.load(weights_only=True)); refused otherwise.")
@click.option("--allow-nonfinite", is_flag=True, help="Load weights holding NaN / Inf (refused otherwise).")
@click.option("--fused/--no-fused", default=True, show_default=True, help="Fused KV-injection path.")
@click.option("--json", "as_json", is_flag=True)
def generate_cmd(target, drafter, bundle, prompt, max_new_tokens, temperature, top_k, top_p, seed, block_size, mode,
                 dtype, raw, allow_pickle, allow_nonfinite, fused, as_json):
    """Generate text with lossless DFlash speculative decoding (or plain AR with --mode ar).

    Greedy output is token-identical to --mode ar; with --temperature > 0 speculative sampling
    keeps the target's distribution exactly. tau = mean tokens per target pass (bonus included).

    \b
    Examples:
      dflash-trt generate -p "Write a Python function that reverses a list"
      dflash-trt generate -p "hello" --mode ar --json
      dflash-trt generate --target tiny/target --drafter tiny/drafter -p "hi" --temperature 0.8 --seed 3
      dflash-trt generate --bundle engines/smollm2-135m-blackwell-nvfp4 -p "hello"   # the served NVFP4 target
    """
    from dflash_trt.bundle.served import pair_folders
    from dflash_trt.presets.catalog import resolve_drafter, resolve_target
    from dflash_trt.runtime.pair import generate, load_pair

    target, drafter = pair_folders(bundle, target, drafter)
    tdir = resolve_target(target)
    ddir = resolve_drafter(drafter, target) if mode == "dflash" else None
    pair = load_pair(tdir, ddir, dtype, allow_pickle=allow_pickle, allow_nonfinite=allow_nonfinite)
    res = generate(pair, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, block_size=block_size, mode=mode, chat=not raw, fused_inject=fused)
    out = {"text": res.text, "token_ids": res.token_ids, "tau": res.tau, "blocks": res.blocks,
           "accepted_per_block": res.accepted_per_block, "seconds": res.seconds, "tokens_per_s": res.tokens_per_s,
           "dtype": str(pair.target.dtype).removeprefix("torch.")}
    if as_json:
        emit_json(out)
        return
    click.echo(res.text)
    tau = f"tau {res.tau:.2f} over {res.blocks} blocks, " if res.tau is not None else ""
    click.echo(f"[{mode}] {len(res.token_ids)} tokens, {tau}{res.seconds:.2f} s, {res.tokens_per_s:.1f} tok/s", err=True)

