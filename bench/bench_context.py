"""Speculation by context length, measured (issue 50, items 3 and 4): the embedded pair on our runtime and
on vLLM-CPU, at context buckets, and the K(concurrency, context) schedule those measurements plan.

1. Our runtime (float32): `dflash-trt bench --context-buckets B --json`: tau, speed-up and the acceptance per
   draft position at each bucket (prompts padded with real text: dflash_trt/bench/context.py).
2. vLLM-CPU 0.32.0 (`--enforce-eager`) serving the bundle (`build --arch hopper --gpu h200 --quant none --stacks
   vllm`) two ways, `dflash-trt bench --endpoint URL --context-buckets B --concurrency C --ignore-eos --json`
   against each: never (no --speculative-config) and always (K = block - 1, the bundle as built).
3. The schedule: plan/draft_schedule.choose_by_context with each bucket's acceptance per position (1.) and a
   step cost measured in 2. (one step of c sequences at that context: never's 1 / tok/s/user, always's
   acceptance length / tok/s/user, linear in K between them), written into a copy of the bundle by the vLLM
   stack's own writer (configs/vllm.json: vLLM's batch-size field and our plugin's context entries).
4. The scheduled bundle served and swept the same way; per cell, scheduled / the better static mode.
5. Lossless: one greedy request per bucket, the same token ids from every server (never's are plain AR).

    python bench/bench_context.py --json > context.json      # ~25 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[bench_context] {msg}", file=sys.stderr, flush=True)


def cli(*argv: str) -> str:
    log("$ dflash-trt " + " ".join(argv))
    res = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise SystemExit(f"dflash-trt {' '.join(argv)} failed (exit {res.returncode})")
    return res.stdout


def step_cost(never: dict, always: dict):
    """step_seconds_at(context) for choose_by_context, from the two sweeps' levels at each bucket: K = 0 never's
    step, any K >= 1 always's (vLLM's DFlash drafter runs its whole block whatever K, and verifying K + 1 tokens
    of a few sequences costs what verifying 8 does: a first run that priced K linearly between the two chose
    K 2 at 512 tokens and lost 19-21 % to the better static mode), linear in c between measured levels."""
    def at(ctx: int):
        bucket = min(never, key=lambda b: abs(b - ctx))
        points = sorted(never[bucket])

        def t(c: int, k: int) -> float:
            lo = max([p for p in points if p <= c], default=points[0])
            hi = min([p for p in points if p >= c], default=points[-1])

            def at_c(p):
                lv = always[bucket][p] if k else never[bucket][p]
                return (lv["acceptance_length"] if k else 1) / lv["tokens_per_s_per_user"]
            return at_c(lo) if hi == lo else at_c(lo) + (at_c(hi) - at_c(lo)) * (c - lo) / (hi - lo)
        return t
    return at


def levels_by_bucket(report: dict) -> dict:
    return {round(b["context_tokens_requested"]): {lv["concurrency"]: lv for lv in b["levels"]}
            for b in report["context_buckets"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buckets", default="512,8000")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--keep", type=Path, help="keep the bundles and reports here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from dflash_trt.bench.context import pad_to, parse_buckets
    from dflash_trt.bench.endpoint import read_prompts
    from dflash_trt.plan import draft_schedule as ds
    from dflash_trt.runtime.pair import encode_prompt
    from dflash_trt.stacks.vllm import bundle_with_draft_schedule
    from dflash_trt.stacks.vllm.server import VllmServer

    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-context-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens), "--context-buckets", a.buckets]
    saved = work / "runtime.json"       # --keep DIR of an earlier run: its runtime and static sweeps are reused
    runtime = json.loads(saved.read_text() if saved.is_file() else cli("bench", *common, "--dtype", "float32", "--json"))
    saved.write_text(json.dumps(runtime))
    bundle = work / "bundle"
    if not (bundle / "manifest.json").is_file():
        cli("build", "--arch", "hopper", "--gpu", "h200", "--quant", "none", "--stacks", "vllm", "--out", str(bundle))
    tok = AutoTokenizer.from_pretrained(bundle / "target")
    first = read_prompts(None)[0]["prompt"]
    identity = {b: encode_prompt(tok, pad_to(first, b, lambda t: len(encode_prompt(tok, t)))[0])
                for b in parse_buckets(a.buckets)}

    def serve(name: str, served: Path, speculative: bool = True) -> dict:
        if name != "scheduled" and (work / f"{name}.run.json").is_file():
            run = json.loads((work / f"{name}.run.json").read_text())
            return {**run, "ids": {int(b): ids for b, ids in (run["ids"] or {}).items()}}
        srv = VllmServer(served, work=work / f"vllm-{name}", extra_args=["--enforce-eager"], speculative=speculative,
                         env={"VLLM_CPU_KVCACHE_SPACE": "4"})
        with srv:
            ids = {b: srv.complete_ids(p, a.max_new_tokens, ignore_eos=True) for b, p in identity.items()}
            report = json.loads(cli("bench", "--endpoint", srv.url, *common, "--concurrency", a.concurrency,
                                    "--ignore-eos", "--json"))
        run = {"report": report, "ids": ids, "startup_s": round(srv.startup_s, 1)}
        (work / f"{name}.run.json").write_text(json.dumps(run))
        return run

    never = serve("never", bundle, speculative=False)
    always = serve("always", bundle)
    block = runtime["context_buckets"][0]["block_size"]
    buckets = [(round(b["context_tokens"]), ds.survival_from_histogram(b["acceptance_histogram"], block))
               for b in runtime["context_buckets"]]
    cost = step_cost(levels_by_bucket(never["report"]), levels_by_bucket(always["report"]))
    # the runtime's buckets hold what each was padded to; the endpoint's are keyed by the bucket asked for
    asked = dict(zip((c for c, _ in buckets), parse_buckets(a.buckets)))
    schedule = ds.choose_by_context(buckets, lambda ctx: cost(asked[ctx]), [int(c) for c in a.concurrency.split(",")],
                                    assumptions=["step cost measured on vLLM-CPU: bench/bench_context.py"])
    log(ds.format_schedule(schedule) + "\n" + "\n".join(schedule.assumptions[-len(buckets):]))
    scheduled = serve("scheduled", bundle_with_draft_schedule(bundle, work / "scheduled-bundle", schedule))

    table = []
    for b in parse_buckets(a.buckets):
        for c in [int(x) for x in a.concurrency.split(",")]:
            row = {"bucket": b, "concurrency": c}
            for name, run in (("never", never), ("always", always), ("scheduled", scheduled)):
                lv = levels_by_bucket(run["report"])[b][c]
                row[name] = {"tokens_per_s": lv["tokens_per_s"], "acceptance_length": lv["acceptance_length"]}
            row["scheduled_over_best"] = row["scheduled"]["tokens_per_s"] / max(
                row["never"]["tokens_per_s"], row["always"]["tokens_per_s"])
            row["always_over_never"] = row["always"]["tokens_per_s"] / row["never"]["tokens_per_s"]
            table.append(row)
            log(f"context {b} c={c}: never {row['never']['tokens_per_s']:.1f}, always {row['always']['tokens_per_s']:.1f}"
                f" (acc. len {row['always']['acceptance_length'] or 0:.2f}), scheduled {row['scheduled']['tokens_per_s']:.1f}"
                f" tok/s: scheduled / best {row['scheduled_over_best']:.3f}")
    out = {"cpu": runtime["cpu"], "runtime": [{k: r[k] for k in ("context_tokens_requested", "context_tokens", "tau",
                                                               "speedup", "tokens_per_s_ar", "tokens_per_s_dflash",
                                                               "lossless", "acceptance_histogram")}
                                              for r in runtime["context_buckets"]],
           "schedule": schedule.to_dict(), "table": table,
           "identical_ids": {b: all(run["ids"][b] == never["ids"][b] for run in (always, scheduled) if run["ids"])
                             for b in identity},
           "startup_s": {n: r["startup_s"] for n, r in (("never", never), ("always", always),
                                                        ("scheduled", scheduled))}}
    print(json.dumps(out, indent=2) if a.json else json.dumps(table, indent=2))
    return 0 if all(out["identical_ids"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
