"""`adapt`: fine-tune a bundle's drafter on the traffic it serves; write a revision only when it wins."""
from __future__ import annotations

import json

import click

from dflash_trt.commands import SEED, THREADS, FiniteFloatRange
from dflash_trt.errors import DFlashError

DEFAULT_MIN_GAIN = 0.10   # adapt.py DEFAULT_MIN_GAIN (kept here so --help does not import torch)


@click.command("adapt")
@click.option("--bundle", "bundle_dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The bundle whose drafter to adapt (its served target labels and gates).")
@click.option("--traffic", "traffic", required=True, multiple=True, type=click.Path(exists=True),
              help="OpenAI request bodies, JSONL (.gz too), /v1/chat/completions and /v1/completions rows mixed; a "
                   "folder: its *.jsonl[.gz] in name order. Repeat for several.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The new bundle revision (a new folder).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Answers, training and gate figures; the same command again continues it (default: OUT.run).")
@click.option("--held-out", type=FiniteFloatRange(0.01, 0.9), default=0.2, show_default=True,
              help="Share of the distinct prompts held out for the gate, chosen by a hash of each prompt (stable).")
@click.option("--steps", type=click.IntRange(0), default=1000, show_default=True,
              help="Fine-tuning steps (defaults: adapt.py AdaptSettings, measured there).")
@click.option("--lr", type=FiniteFloatRange(0, 1, min_open=True), default=6e-4, show_default=True)
@click.option("--blocks-per-step", type=click.IntRange(1, 4096), default=32, show_default=True)
@click.option("--labels", type=click.Choice(["teacher-forced", "data"]), default="teacher-forced", show_default=True,
              help="As train-drafter's: the target's prediction at each position, or the answer's next token.")
@click.option("--distill", type=click.IntRange(0, 64), default=8, show_default=True, metavar="K",
              help="KL to the target's top-K distribution beside the CE (0: off).")
@click.option("--max-new-tokens", type=click.IntRange(8, 4096), default=128, show_default=True,
              help="Length of the gate's decodes.")
@click.option("--answer-tokens", type=click.IntRange(8, 4096), help="Length of the target's answers to the train "
              "part (the training data)  [default: twice --max-new-tokens]")
@click.option("--min-gain", type=FiniteFloatRange(0, 10), default=DEFAULT_MIN_GAIN, show_default=True,
              help="Write the revision only when held-out tau rises by at least this share (docs/adapt.md).")
@click.option("--max-bad-rows", type=click.IntRange(0), help="Refuse when more traffic rows than this are skipped.")
@click.option("--answer-engine", type=click.Choice(["auto", "vllm", "hf"]), default="auto", show_default=True,
              help="Who answers the train prompts (train-drafter's --answer-engine).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@click.option("--threads", type=THREADS, default=2, show_default=True, help="torch CPU threads.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--verbose", is_flag=True, help="Show a skipped row's text in its line (it is user data).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON (passed or refused).")
def adapt_cmd(bundle_dir, traffic, out, run_dir, held_out, steps, lr, blocks_per_step, labels, distill,
              max_new_tokens, answer_tokens, min_gain, max_bad_rows, answer_engine, dtype, threads, seed, verbose,
              as_json):
    """Fine-tune the bundle's drafter on logged requests: the target answers the train part of the traffic,
    the drafter trains FROM its own weights and config, then a gate decodes the held-out part with the
    bundle's served target, old drafter against new: tau, acceptance per position, speed-up, token
    identity to plain decoding. Only a new drafter at least --min-gain better is written, as a revision
    of the bundle (the one packager; `verify` checks it); otherwise exit 1 with the figures, OUT untouched.

    \b
    Examples:
      dflash-trt adapt --bundle engines/b --traffic logs/requests.jsonl.gz --out engines/b-adapted
      dflash-trt adapt --bundle engines/b --traffic logs/ --out engines/b-r2 --min-gain 0.05 --json
      dflash-trt adapt --bundle engines/b --traffic logs/ --out engines/b-r2 --steps 900   # continues OUT.run
      torchrun --nproc-per-node 8 -m dflash_trt.cli adapt --bundle /data/b --traffic /data/logs --out /data/b-r2
      dflash-trt deploy-train --adapt-bundle /data/b --traffic /data/logs --out deploy/adapt ...  # a Job
    \b
    A row is {"messages": [...]} or {"prompt": "..."}; other fields (response, choices) are ignored.
    Bad rows get one line each (FILE:LINE: why, no prompt text unless --verbose) and are skipped.
    """
    from dflash_trt.adapt import AdaptSettings, adapt

    s = AdaptSettings(held_out=held_out, steps=steps, lr=lr, blocks_per_step=blocks_per_step, labels=labels,
                      distill_k=distill, max_new_tokens=max_new_tokens, answer_tokens=answer_tokens, min_gain=min_gain,
                      max_bad_rows=max_bad_rows, answer_engine=answer_engine, dtype=dtype, threads=threads, seed=seed,
                      verbose=verbose)
    r = adapt(bundle_dir, list(traffic), out, s, run_dir=run_dir)
    if r is None:   # a torchrun rank other than 0
        return
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2))
    else:
        click.echo(_summary(r))
    if not r.gate.passed:
        raise DFlashError(f"adapt: gate refused, nothing written to {out}: {r.gate.why()}")


def _summary(r) -> str:
    g = r.gate
    rows = [(f"{what} drafter", f"tau {f.tau:.3f}, speed-up {f.speedup:.2f}x, lossless {f.lossless}, acceptance "
             + " ".join(f"{a:.2f}" for a in f.acceptance)) for what, f in (("old", g.before), ("new", g.after))]
    return "\n".join([f"traffic: {r.traffic.rows} rows, {len(r.traffic.train)} train, {len(r.traffic.held_out)} "
                      f"held out, {len(r.traffic.skipped)} skipped",
                      f"training: {r.training['step']} steps, logged loss {r.training['logged_loss_first'] or 0:.3f} "
                      f"-> {r.training['logged_loss_last'] or 0:.3f}, {r.training['train_seconds']:.0f} s",
                      *(f"{a}: {b}" for a, b in rows),
                      f"gate: {g.why()}" + (f" (paired standard error {g.paired_se:.1%})" if g.paired_se else ""),
                      f"revision: {r.revision}" if r.revision else "revision: not written",
                      f"took {r.seconds:.0f} s; run folder {r.run_dir}"])
