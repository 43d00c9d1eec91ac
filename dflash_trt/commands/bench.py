"""`bench`: tau and wall-clock speed-up of DFlash against AR, before a rollout."""
from __future__ import annotations

import json

import click

from dflash_trt.bench.context import measure_buckets, parse_buckets
from dflash_trt.commands import THREADS, FiniteFloatRange, pair_options


@click.command("bench")
@pair_options
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help='JSONL of {"prompt": ...} lines (default: the embedded held-out prompts).')
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--block-size", type=click.IntRange(2, 64), help="Draft block size (default: the drafter's).")
@click.option("--temperature", type=FiniteFloatRange(0), default=0.0, show_default=True)
@click.option("--limit", type=click.IntRange(1), help="Use only the first N prompts.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="auto: float32 for a quantized target (the exact values its engine's GEMMs multiply by), else "
                   "bfloat16 where the CPU has native bf16 (AMX / AVX512-BF16), else float32.")
@click.option("--threads", type=THREADS, help="torch threads (default: torch's choice).")
@click.option("--fused/--no-fused", default=True, show_default=True, help="Fused KV-injection path.")
@click.option("--full-draft-vocab", is_flag=True,
              help="Draft from the whole vocabulary even if the drafter has a draft_vocab.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the full JSON report on stdout.")
@click.option("--context-buckets", metavar="N1,N2,...",
              help="Measure at each context length: every prompt padded with real text (Python's argparse source, "
                   "code) to N tokens as the target counts them, up to its window less --max-new-tokens; one report "
                   "per bucket (tau and speed by context). Our runtime and --endpoint alike.")
@click.option("--endpoint", metavar="URL",
              help="Measure a served OpenAI-compatible endpoint (trtllm-serve, vllm serve, SGLang, Triton's OpenAI "
                   "frontend) instead of our CPU runtime: streaming /v1/completions, the server's own spec-decode "
                   "counters from its /metrics.")
@click.option("--concurrency", default="1,2,4", show_default=True, metavar="C1,C2,...",
              help="--endpoint: the concurrency levels to sweep.")
@click.option("--model", "model_name", metavar="NAME", help="--endpoint: the served model (default: the one /v1/models lists).")
@click.option("--metrics-url", metavar="URL", help="--endpoint: the Prometheus page (default: found on the endpoint).")
@click.option("--ignore-eos", is_flag=True, help="--endpoint: ask the server to decode every --max-new-tokens.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="--endpoint: one short request before the sweep, not counted.")
@click.option("--gpus", type=click.IntRange(1), default=1, show_default=True,
              help="--endpoint: GPUs behind the endpoint (tokens/s per GPU on the plot and against the plan).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="--endpoint: draw tokens/s per GPU against tokens/s per user (the axes of plan --plot) as PNG.")
@click.option("--plan-bundle", type=click.Path(file_okay=False), metavar="DIR",
              help="--endpoint: overlay the plan of this bundle (plan --bundle) and give measured / plan.")
@click.option("--synthetic-acceptance", "synthetic", metavar="RATES|TAU",
              help="--endpoint: a capacity sweep at an ASSUMED acceptance, as NVIDIA's Dynamo recipes run one: the "
                   "vLLM server accepts drafts by its synthetic rejection sampler (per-position rates, or the "
                   "geometric rates through a mean acceptance length TAU); the report and plot are labelled "
                   "synthetic, and the server's counters must show those rates (else a one-line error naming the "
                   "--speculative-config fields to serve it with).")
@click.pass_context
def bench_cmd(ctx, target, drafter, bundle, prompts_file, max_new_tokens, block_size, temperature, limit, dtype, threads,
              fused, full_draft_vocab, as_json, context_buckets, endpoint, concurrency, model_name, metrics_url,
              ignore_eos, warmup, gpus, plot_file, plan_bundle, synthetic):
    """Run DFlash and plain AR decoding on the same prompts in one process, interleaved, and
    report tau (mean tokens per target pass, bonus included), the wall-clock speed-up, tokens/s,
    losslessness (greedy: every output token-identical to AR), the acceptance histogram and the
    per-block cost split (draft / verify / inject / bookkeeping).

    With --endpoint URL it measures a served OpenAI-compatible endpoint instead: a sweep of
    --concurrency levels, streaming, tokens/s (total and per user), TTFT, ITL and the acceptance
    length the server's own spec-decode counters give over each level; per request and per prompt
    category too where the engine returns it (vLLM started with --per-request-spec-decode-metrics
    summary). --synthetic-acceptance sweeps capacity at an assumed acceptance instead of the drafter's.

    \b
    Examples:
      dflash-trt bench --limit 5
      dflash-trt bench --target DIR --drafter DIR --prompts my.jsonl --max-new-tokens 256 --json
      dflash-trt bench --bundle engines/smollm2-135m-blackwell-nvfp4 --json   # what the engines load
      dflash-trt bench --limit 4 --context-buckets 512,2048,8192           # tau and speed by context
      dflash-trt bench --endpoint http://localhost:8000 --concurrency 1,2,4,8 --plot speed.png --json
      dflash-trt bench --endpoint http://localhost:8000 --synthetic-acceptance 4.4 --concurrency 1,8,64
      dflash-trt bench --endpoint http://localhost:8000 --context-buckets 512,8192 --concurrency 1,4 --limit 4
    """
    from dflash_trt.errors import DFlashError

    runtime_only = ("target", "drafter", "bundle", "block_size", "temperature", "dtype", "threads", "fused", "full_draft_vocab")
    endpoint_only = ("concurrency", "model_name", "metrics_url", "ignore_eos", "warmup", "gpus", "plot_file",
                     "plan_bundle", "synthetic")
    given = [n for n in (runtime_only if endpoint else endpoint_only)
             if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]
    if given:
        opt = "--" + given[0].removesuffix("_name").removesuffix("_file").replace("_", "-")
        raise DFlashError(f"{opt} measures our CPU runtime; it does not apply to --endpoint" if endpoint
                          else f"{opt} applies to --endpoint URL only")
    buckets = parse_buckets(context_buckets) if context_buckets else None
    if endpoint:
        return _bench_endpoint(endpoint, prompts_file, limit, max_new_tokens, concurrency, model_name, metrics_url,
                               ignore_eos, warmup, gpus, plot_file, plan_bundle, as_json, synthetic, buckets)
    _bench_runtime(target, drafter, bundle, prompts_file, max_new_tokens, block_size, temperature, limit, dtype,
                   threads, fused, full_draft_vocab, as_json, buckets)


def _bench_runtime(target, drafter, bundle, prompts_file, max_new_tokens, block_size, temperature, limit, dtype,
                   threads, fused, full_draft_vocab, as_json, buckets) -> None:
    """bench on our CPU runtime: DFlash and AR interleaved on the same prompts (at each context bucket)."""
    import torch

    from dflash_trt.bench.endpoint import read_prompts
    from dflash_trt.bench.runtime import format_buckets, format_table, run_bench
    from dflash_trt.bundle.served import pair_folders
    from dflash_trt.models.weights import holds_quantized_weights
    from dflash_trt.presets.catalog import resolve_drafter, resolve_target
    from dflash_trt.runtime.pair import MAX_BLOCK, MAX_CONTEXT, context_limit, encode_prompt, load_pair

    if threads:
        torch.set_num_threads(threads)
    prompts = [row["prompt"] for row in read_prompts(prompts_file)][:limit]
    target, drafter = pair_folders(bundle, target, drafter)
    # the runtime's positions (4096 by default) grown to the longest bucket; the target's window still bounds it
    max_len = min(MAX_CONTEXT, max(4096, max(buckets or [0]) + max_new_tokens + (block_size or MAX_BLOCK) + 1))
    pair = load_pair(resolve_target(target), resolve_drafter(drafter, target), dtype, max_len=max_len,
                     draft_vocab=not full_draft_vocab)
    def measure(texts: list[str]) -> dict:
        return run_bench(pair, texts, max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature,
                         fused_inject=fused, progress=True)
    if buckets is None:
        report = measure(prompts)
    else:
        room = context_limit(pair)[0] - (block_size or pair.drafter.config.block_size) - 1 - max_new_tokens
        reports = measure_buckets(buckets, prompts, lambda text: len(encode_prompt(pair.tokenizer, text)), measure,
                                  _say, room)
        report = {"context_buckets": reports, "cpu": reports[0]["cpu"]}
    report["threads"] = torch.get_num_threads()
    report["dtype"] = str(pair.target.dtype).removeprefix("torch.")
    report["target"], report["drafter"] = str(pair.target_dir), str(pair.drafter_dir)
    report["target_quantized"] = holds_quantized_weights(pair.target_dir)
    vocab = pair.drafter.draft_vocab
    report["draft_vocab_size"] = len(vocab) if vocab is not None else pair.target.vocab_size
    if as_json:
        click.echo(json.dumps(report, indent=2))
    elif buckets is None:
        click.echo(format_table(report))
    else:
        click.echo(format_buckets(report["context_buckets"]))


def _say(line: str) -> None:
    click.echo(line, err=True)


def _bench_endpoint(endpoint, prompts_file, limit, max_new_tokens, concurrency, model_name, metrics_url, ignore_eos,
                    warmup, gpus, plot_file, plan_bundle, as_json, synthetic=None, buckets=None):
    from dflash_trt.bench import endpoint as eb
    from dflash_trt.errors import DFlashError

    levels = eb.parse_concurrency(concurrency)
    if plot_file and not plot_file.lower().endswith(".png"):
        raise DFlashError(f"--plot {plot_file}: the plot is written as PNG; name the file *.png")
    rows = eb.read_prompts(prompts_file)[:limit]
    bench = eb.EndpointBench(endpoint, model=model_name, metrics_url=metrics_url, max_new_tokens=max_new_tokens,
                             ignore_eos=ignore_eos, warmup=warmup, progress=_say,
                             synthetic=synthetic)
    bench.connect()
    planned, note = eb.bundle_plan(plan_bundle) if plan_bundle else (None, None)
    if note:
        click.echo(f"note: {note}", err=True)
    click.echo(f"bench --endpoint {bench.base}: model {bench.model}, engine {bench.engine or 'unknown'}, "
               f"{len(rows)} prompts x {max_new_tokens} tokens, concurrency {','.join(map(str, levels))}", err=True)
    if buckets:
        if plot_file or plan_bundle or synthetic:
            raise DFlashError("--context-buckets: measures the drafter by context; --plot, --plan-bundle and "
                              "--synthetic-acceptance are for a sweep without it")
        # a bucket past the server's window: its own one-line HTTP 400 from count_tokens
        reports = measure_buckets(buckets, [r["prompt"] for r in rows], bench.count_tokens, lambda texts: bench.run(
            levels, [{**row, "prompt": text} for text, row in zip(texts, rows, strict=True)]), _say)
        click.echo(json.dumps({"context_buckets": reports}, indent=2) if as_json else "\n".join(
            f"context {r['context_tokens']:.0f} tokens (bucket {r['context_tokens_requested']}):\n"
            + eb.format_report(r) for r in reports))
        return
    report = bench.run(levels, rows)
    report["gpus"] = gpus
    speed_report = None
    if plan_bundle:
        report["plan"], report["plan_note"] = None, note
        if planned is not None:
            speed_report, tau_source = eb.plan_prediction(planned, eb.sweep_acceptance(report))
            eb.attach_plan(report, speed_report, gpus, tau_source)
    if plot_file:
        eb.plot_endpoint(report, plot_file, speed_report, gpus)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(eb.format_report(report) + (f"\nplot: {plot_file}" if plot_file else ""))
