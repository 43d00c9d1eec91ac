"""`tune`: re-plan a bundle's draft length from the acceptance its replica really served."""
from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_trt.commands import FiniteFloatRange
from dflash_trt.errors import DFlashError


@click.command("tune")
@click.option("--bundle", "bundle_dir", required=True, type=click.Path(file_okay=False),
              help="The bundle the replica serves (its manifest gives the served schedule and the cost model).")
@click.option("--endpoint", metavar="URL",
              help="The serving replica (vllm serve): /metrics scraped at the start and the end of --window, its "
                   "running-requests gauge read in between.")
@click.option("--prometheus", metavar="URL",
              help="A Prometheus that scrapes the replicas: its HTTP query API over the last --window.")
@click.option("--selector", default="", metavar='LABEL="VALUE",...',
              help='--prometheus: the series to read, e.g. namespace="llm",service="dflash-trt".')
@click.option("--window", default="60s", show_default=True, metavar="DURATION",
              help="How long to watch (--endpoint) or how far back to read (--prometheus): 90s, 15m, 6h, ...")
@click.option("--min-drafts", type=click.IntRange(1), default=400, show_default=True,
              help="Refuse below this many drafts in the window (400: the first position's acceptance within "
                   "2.5 points, one standard error).")
@click.option("--step-cost", "step_cost", type=click.Path(dir_okay=False), metavar="FILE.json",
              help='The cost model as measured step times {"step_seconds": {"tokens": seconds}} (one step of c '
                   "sequences drafting K costs t(c(K+1))); default: the speed model of the bundle's GPU node.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="The new bundle revision (a new folder): configs and manifest re-written, models linked.")
@click.option("--values-out", type=click.Path(dir_okay=False), metavar="FILE.yaml",
              help="Where the values diff for `helm upgrade` goes (default: OUT/helm-upgrade-values.yaml beside "
                   "the revision, not inside it).")
@click.option("--min-gain", type=FiniteFloatRange(0, 1), default=0.01, show_default=True,
              help="Keep the served K at a concurrency where the re-planned K is predicted to gain less than this "
                   "share of tokens/s per user (no churn for a tie).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON on stdout.")
@click.option("--every", type=FiniteFloatRange(0.1), help="--endpoint: seconds between gauge reads (default: "
              "window / 20, 0.5 to 5).")
def tune_cmd(bundle_dir, endpoint, prometheus, selector, window, min_drafts, step_cost, out, values_out, min_gain,
             as_json, every):
    """Read the acceptance per draft position that a serving replica really had over a window, and
    the concurrency it ran at; re-plan the draft length K for every concurrency from that acceptance
    and the bundle's cost model; write a new bundle revision whose configs carry the new schedule, and
    the values diff to roll it out with `helm upgrade`.

    The engine's own counters are read: vLLM's vllm:spec_decode_num_drafts,
    vllm:spec_decode_num_accepted_tokens_per_pos{position} and vllm:num_requests_running. Too few
    drafts in the window (--min-drafts) is a refusal, with the count. The summary says which K
    changed at which concurrency, the predicted tokens/s per user, and (vLLM) where speculation
    should be off altogether: a K of 0 in vLLM is not plain decoding (the speculative path stays on).

    \b
    Examples:
      dflash-trt tune --bundle engines/b --endpoint http://pod:8000 --window 10m --out engines/b-r2
      dflash-trt tune --bundle engines/b --prometheus http://prometheus:9090 --window 6h \\
          --selector 'namespace="llm"' --out engines/b-r2 --json
      dflash-trt tune --bundle cpu-bundle --endpoint http://127.0.0.1:8000 --step-cost cost.json --out r2
    \b
    Then: copy OUT onto the bundle volume and
      helm upgrade RELEASE deploy/helm/dflash-trt --reuse-values -f OUT.helm-upgrade-values.yaml
    """
    from dflash_trt.bundle.package import write_revision
    from dflash_trt.deploy import revision, values
    from dflash_trt.io.manifest import Manifest
    from dflash_trt.models.config import load_drafter_config
    from dflash_trt.plan import tune

    _check_sources(endpoint, prometheus, selector, every, out)
    bundle = Path(bundle_dir)
    m = Manifest.read(bundle)
    stack = _tuned_stack(m)
    max_k = m.drafter.block_size - 1   # the drafted tokens of a block
    cost = tune.step_cost_table(step_cost) if step_cost else \
        tune.bundle_step_cost(m, load_drafter_config(bundle / "drafter").raw, values.plan_for_bundle(bundle))
    seconds = tune.parse_window(window)
    log = (lambda line: click.echo(f"  {line}", err=True)) if not as_json else None
    if endpoint:
        click.echo(f"tune: watching {tune.metrics_url(endpoint)} for {seconds:.0f} s", err=True)
        w = tune.read_endpoint(endpoint, seconds, every_s=every, stack=stack, progress=log)
    else:
        w = tune.read_prometheus(prometheus, seconds, selector=selector, stack=stack)
    before = tune.served_schedule(m, max_k + 1)
    acc = tune.survival_from_window(w, max_k, tune.served_ranges(bundle, before, stack), min_drafts=min_drafts)
    r = tune.replan(before, w, acc, cost, max_k, min_gain=min_gain)
    new_m = write_revision(bundle, Path(out), revision.tune_change(r))
    values_path = Path(values_out) if values_out else Path(str(Path(out)) + ".helm-upgrade-values.yaml")
    diff = revision.values_diff(bundle, Path(out), values_path)
    changed = new_m.revision.changed
    if as_json:
        return click.echo(json.dumps(r.to_dict() | {"revision": str(out), "changed_files": changed, "values_diff": diff,
                                                    "values_file": str(values_path),
                                                    "revision_record": new_m.to_dict()["revision"]}, indent=2))
    click.echo(tune.format_retune(r))
    click.echo(f"revision: {out} ({len(changed)} files changed: "
               f"{', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''})")
    click.echo(f"helm upgrade values: {values_path} ({', '.join(diff) or 'no value changes'})")


def _check_sources(endpoint, prometheus, selector, every, out) -> None:
    if bool(endpoint) == bool(prometheus):
        raise DFlashError("tune: pass one of --endpoint URL (watch a replica) or --prometheus URL (read its history)")
    if selector and not prometheus:
        raise DFlashError("--selector applies to --prometheus only")
    if every and not endpoint:
        raise DFlashError("--every applies to --endpoint only")
    if Path(out).exists() and any(Path(out).iterdir()):   # before watching the window
        raise DFlashError(f"--out {out}: exists and is not empty")


def _tuned_stack(m) -> str:
    """The bundle's served stack whose per-position acceptance tune reads (its Stack.tune_reader)."""
    from dflash_trt.plan import tune

    served = m.served_stacks
    stack = next((s for s in served if tune.reader(s)), None)
    if stack is None:
        raise DFlashError(f"tune: the bundle serves {', '.join(served)}; tune reads per-position acceptance from vLLM "
                          "only (the one engine exporting it) - build the bundle with --stacks vllm")
    return stack
