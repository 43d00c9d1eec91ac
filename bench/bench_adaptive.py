"""Speculation that adapts to load, measured on a live vLLM-CPU endpoint (issue 33, item 3).

The embedded pair (SmolLM2-135M + our drafter) in a bundle built for vLLM
(`build --arch hopper --gpu h200 --quant none --stacks vllm`), served by vLLM's CPU build three ways:

- always-K: the bundle as built, num_speculative_tokens = block size - 1 at every batch size;
- never:    the same argv without --speculative-config (vLLM's plain AR);
- scheduled: the bundle's configs/vllm.json with num_speculative_tokens_per_batch_size, written by
  the vLLM stack's own writer (BundleContext.draft_schedule) from a schedule planned for THIS CPU.

The schedule (deploy/draft_schedule.choose) comes from
- acceptance: the drafter's acceptance histogram from `dflash-trt bench --json` on the held-out
  prompts (our runtime, float32: vLLM's dtype here), turned into the acceptance at each position;
- cost: one decode step of c sequences drafting K tokens, measured on this CPU with our runtime's
  own forward passes (float32, the threads vLLM gets): the target's verify pass over c(K+1) tokens
  plus the drafter's pass over c(K+1) query tokens, at a context of --context tokens. Why ours and
  not vLLM's per-step times: choose() only needs, at each concurrency, the cost of a K-token step
  relative to the others, and our passes give every (c, K) in a minute from one process, where
  vLLM would need a server per K (its draft length is fixed at start); the served run below is the
  check of that choice. One sequence of c(K+1) tokens stands for c sequences of K+1: the same GEMMs,
  attention (small at this size) over one context instead of c. K = 0 keeps the drafter's pass over
  the bonus token, as vLLM's DFlash does with a scheduled K of 0 (vllm/v1/spec_decode/
  llm_base_proposer.py: it keeps the drafter's KV cache in step); "never" has no drafter at all.

Every mode is served by `vllm serve --enforce-eager` (stacks/vllm/server.py VllmServer; one server
at a time), and swept with `dflash-trt bench --endpoint`'s client (bench/client.py): greedy,
--ignore-eos (every request decodes --max-new-tokens, so a level holds c requests in flight until
its last wave), the same held-out prompts at every level (at least c requests). Per level: tokens/s
and the server's own vllm:spec_decode_* deltas (drafts, draft tokens, accepted), so the draft length
vLLM really used at each concurrency is draft_tokens / drafts, and drafts per output token shows
where it stopped drafting. The modes are interleaved: each repeat serves all three, in a rotated
order; medians over the repeats are reported with the load average. Token identity: every mode's
greedy token ids (non-streamed, return_token_ids) on the prompts, against "never" (vLLM's AR).

    python bench/bench_adaptive.py --json                      # ~35 min on 2 shared cores (load ~8)
    python bench/bench_adaptive.py --repeats 1 --prompts 4 --max-new-tokens 32 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dflash_trt  # noqa: E402,F401  (before torch: its OpenMP wait settings, 10x here beside other jobs)

MODES = ("always", "never", "scheduled")


def log(msg: str) -> None:
    print(f"[bench_adaptive] {msg}", file=sys.stderr, flush=True)


def heldout(n: int) -> list[str]:
    rows = (ROOT / "dflash_trt" / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"] for r in rows if r.strip()][:n]


def cli(*argv: str) -> str:
    res = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise SystemExit(f"dflash-trt {' '.join(argv)} failed (exit {res.returncode})")
    return res.stdout


# ---------------------------------------------------------------------------------- the plan
def acceptance(bundle: Path, prompts: int, max_new: int, from_json: Path | None) -> dict:
    """`dflash-trt bench --json` on the held-out prompts, float32 (or a saved report of it)."""
    if from_json:
        return json.loads(Path(from_json).read_text())
    argv = ["bench", "--json", "--target", str(bundle / "target"), "--drafter", str(bundle / "drafter"),
            "--limit", str(prompts), "--max-new-tokens", str(max_new), "--dtype", "float32"]
    log("$ dflash-trt " + " ".join(argv))
    return json.loads(cli(*argv))


def measure_pass_seconds(bundle: Path, sizes: list[int], context: int, threads: int, repeats: int) -> dict:
    """{n: (target verify seconds, drafter pass seconds)} over n tokens at `context`: the fastest of
    `repeats` (the machine is shared: the minimum is the pass's own cost, the rest is other jobs')."""
    import torch

    from dflash_trt.runtime.decode import DrafterCache, draft, verify
    from dflash_trt.runtime.pair import load_pair
    from dflash_trt.runtime.sampling import SamplingParams

    torch.set_num_threads(threads)
    max_len = context + max(sizes) + 2
    pair = load_pair(bundle / "target", bundle / "drafter", dtype="float32", max_len=max_len)
    target, drafter = pair.target, pair.drafter
    capture = drafter.config.target_layer_ids
    gen = torch.Generator().manual_seed(0)
    vocab = int(target.vocab_size)
    with torch.no_grad():
        target.setup_cache(max_len)
        _, feats = target(torch.randint(0, vocab, (context,), generator=gen), 0, capture)
        cache = DrafterCache(drafter, max_len)
        cache.inject(feats, 0)
        sp = SamplingParams(0.0)
        out = {}
        for n in sizes:
            block = torch.randint(0, vocab, (n,), generator=gen)
            tv, td = [], []
            for _ in range(repeats + 1):        # the first of each size warms its kernels
                t0 = time.perf_counter()
                verify(target, block, context, capture)
                t1 = time.perf_counter()
                draft(target, drafter, cache, int(block[0]), context, n, sp, gen)
                t2 = time.perf_counter()
                tv.append(t1 - t0)
                td.append(t2 - t1)
            out[n] = (min(tv[1:]), min(td[1:]))
    return out


def plan(bundle: Path, accept: dict, concurrencies: list[int], context: int, threads: int, repeats: int):
    from dflash_trt.plan import draft_schedule as ds

    B = int(accept["block_size"])
    survival = ds.survival_from_histogram(accept["acceptance_histogram"], B)
    top = max(concurrencies) * B
    sizes = sorted({1, *(2 ** i for i in range(top.bit_length() + 1) if 2 ** i <= top), top})
    log(f"measuring our target / drafter passes over {sizes} tokens (context {context}, {threads} threads)")
    passes = measure_pass_seconds(bundle, sizes, context, threads, repeats)
    # a CPU pass is flat while reading the weights dominates (a few to some tens of tokens), then
    # grows with the tokens: that knee, against the acceptance, is where drafting stops paying
    from dflash_trt.plan.tune import cost_curve

    curve, used = cost_curve({n: t + d for n, (t, d) in passes.items()})

    def step_seconds(c: int, k: int) -> float:
        return curve(c * (k + 1))

    schedule = ds.choose(survival, step_seconds, concurrencies, assumptions=[
        f"step cost of c sequences drafting K: our runtime's target verify + drafter pass over n = c(K+1) tokens "
        f"at context {context}, float32, {threads} threads, measured on this CPU at n = {', '.join(map(str, used))} "
        f"(fastest of {repeats} each), linear between them",
        "K 0: priced with the drafter's pass over the bonus token, as vLLM's own K 0 runs it (our plugin's K 0 runs "
        "no drafter layer: K 0 is overpriced here)"])
    return schedule, survival, {"step_ms_used": {str(n): round(v * 1e3, 2) for n, v in used.items()},
                                "passes": {str(n): {"target_s": t, "drafter_s": d} for n, (t, d) in passes.items()}}


# ---------------------------------------------------------------------------------- the runs
def serve_and_sweep(bundle: Path, mode: str, work: Path, prompts: list[str], concurrencies: list[int],
                    max_new: int, identity_ids: list[list[int]], threads: int) -> dict:
    from dflash_trt.bench.client import stream_completion
    from dflash_trt.bench.endpoint import EndpointBench
    from dflash_trt.stacks.vllm.server import VllmServer

    srv = VllmServer(bundle, work=work, extra_args=["--enforce-eager"], threads=threads,
                     speculative=(mode != "never"), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    levels, texts = {}, {}
    with srv:
        ids = [srv.complete_ids(p, max_new, ignore_eos=True) for p in identity_ids]
        eb = EndpointBench(srv.url, max_new_tokens=max_new, ignore_eos=True).connect()
        stream_completion(eb.base, eb.model, prompts[0], 8, extra={"ignore_eos": True})   # warm-up
        for c in concurrencies:
            # at least c requests, cycling the prompts (endpoint_bench's own level)
            lv = eb._batch([prompts[i % len(prompts)] for i in range(max(c, len(prompts)))], c)
            texts[c] = [r.text for r in lv.pop("_raw")[2]]
            sd = lv.get("spec_decode") or {}
            drafts, dtoks = sd.get("drafts") or 0.0, sd.get("draft_tokens") or 0.0
            levels[c] = {
                "tokens_per_s": lv["tokens_per_s"], "tokens_per_s_per_user": lv["tokens_per_s_per_user"],
                "output_tokens": lv["output_tokens"], "acceptance_length": lv["acceptance_length"],
                "drafts": drafts, "draft_tokens": dtoks, "accepted": sd.get("accepted_tokens") or 0.0,
                # the K vLLM used when it drafted, and how much it drafted per token it emitted
                "k_per_draft": dtoks / drafts if drafts else 0.0,
                "draft_tokens_per_output_token": dtoks / lv["output_tokens"] if lv["output_tokens"] else None}
            log(f"  {mode} c={c}: {lv['tokens_per_s']:.2f} tok/s, drafts {drafts:.0f}, draft tokens {dtoks:.0f}, "
                f"accepted {levels[c]['accepted']:.0f}, output {lv['output_tokens']} (load {os.getloadavg()[0]:.1f})")
    return {"startup_s": round(srv.startup_s, 1), "levels": levels, "token_ids": ids, "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, help="a bundle built with --stacks vllm --quant none (default: build one)")
    ap.add_argument("--concurrency", default="1,4,16,64",
                    help="levels (wide enough to cross where drafting stops paying on a CPU: the fixed cost of a "
                         "step is high against its per-token cost)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per level (at least c requests)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="times each mode is served (interleaved)")
    ap.add_argument("--identity-prompts", type=int, default=4, help="prompts whose token ids are compared across modes")
    ap.add_argument("--acceptance-prompts", type=int, default=8)
    ap.add_argument("--acceptance-json", type=Path, help="a saved `dflash-trt bench --json` report to plan from")
    ap.add_argument("--context", type=int, default=128, help="context length of the cost measurement")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for our passes and vLLM's")
    ap.add_argument("--cost-repeats", type=int, default=3)
    ap.add_argument("--partial", type=Path, help="rewrite this JSON file with the report so far after every server")
    ap.add_argument("--plan-only", action="store_true", help="print the schedule planned for this CPU and stop")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from dflash_trt.bench.endpoint import parse_concurrency
    from dflash_trt.paths import vllm_env_dir
    from dflash_trt.plan import draft_schedule as ds
    from dflash_trt.runtime.pair import encode_prompt, load_pair
    from dflash_trt.stacks.vllm import bundle_with_draft_schedule
    from dflash_trt.stacks.vllm.server import vllm_env_problem

    problem = vllm_env_problem(vllm_env_dir())
    if problem:
        print(json.dumps({"skipped": problem}))
        return 0
    levels = parse_concurrency(a.concurrency)
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        tmp = Path(tmp)
        bundle = a.bundle
        if bundle is None:
            bundle = tmp / "bundle"
            log("$ dflash-trt build --arch hopper --gpu h200 --quant none --stacks vllm")
            cli("build", "--arch", "hopper", "--gpu", "h200", "--quant", "none", "--stacks", "vllm", "--out", str(bundle))
        accept = acceptance(bundle, a.acceptance_prompts, 128, a.acceptance_json)
        schedule, survival, passes = plan(bundle, accept, levels, a.context, a.threads, a.cost_repeats)
        log(ds.format_schedule(schedule))
        if a.plan_only:
            print(json.dumps({"schedule": schedule.to_dict(), "survival": survival, "step_cost": passes}, indent=2))
            return 0
        scheduled = bundle_with_draft_schedule(bundle, tmp / "scheduled", schedule)
        spec = json.loads((scheduled / "configs" / "vllm-speculative-config.json").read_text())
        bundles = {"always": bundle, "never": bundle, "scheduled": scheduled}
        prompts = heldout(a.prompts)
        tok = load_pair(bundle / "target", None, dtype="float32").tokenizer
        identity_ids = [encode_prompt(tok, p) for p in prompts[:a.identity_prompts]]
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        loads = []
        for r in range(a.repeats):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                loads.append(os.getloadavg()[0])
                log(f"repeat {r + 1}/{a.repeats}: {mode} (load {loads[-1]:.2f})")
                runs[mode].append(serve_and_sweep(bundles[mode], mode, tmp / f"{mode}-{r}", prompts, levels,
                                                  a.max_new_tokens, identity_ids if r == 0 else [], a.threads))
                loads.append(os.getloadavg()[0])
                if a.partial and all(runs.values()):
                    a.partial.write_text(json.dumps(summarize(a, runs, levels, schedule, survival, passes, spec,
                                                              accept, loads), indent=2))
    report = summarize(a, runs, levels, schedule, survival, passes, spec, accept, loads)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for row in report["levels"]:
            print(f"c={row['concurrency']}: K planned {row['k_planned']}, " + ", ".join(
                f"{m} {row[m]['tokens_per_s_median']:.1f} tok/s (K/draft {row[m]['k_per_draft']:.2f})" for m in MODES))
        print("token identical to vLLM AR:", report["token_identical_to_vllm_ar"])
    return 0


def summarize(a, runs, levels, schedule, survival, passes, spec, accept, loads) -> dict:
    """The report over the runs so far: medians per mode and level, identity against "never"."""
    # token ids one request at a time, and the streamed text of every request of every level
    ref, ref_texts = runs["never"][0]["token_ids"], runs["never"][0]["texts"]
    identity = {m: {"token_ids_batch_1": all(run["token_ids"] == ref for run in runs[m] if run["token_ids"]),
                    "texts_every_level": all(run["texts"][c] == ref_texts[c] for run in runs[m] for c in levels)}
                for m in MODES}
    table = []
    for c in levels:
        row = {"concurrency": c, "k_planned": schedule.k_at(c)}
        for m in MODES:
            per = [run["levels"][c] for run in runs[m]]
            row[m] = {"tokens_per_s_median": statistics.median(p["tokens_per_s"] for p in per),
                      "tokens_per_s": [round(p["tokens_per_s"], 2) for p in per],
                      "k_per_draft": statistics.median(p["k_per_draft"] for p in per),
                      "drafts": statistics.median(p["drafts"] for p in per),
                      "draft_tokens_per_output_token": statistics.median(
                          p["draft_tokens_per_output_token"] or 0.0 for p in per),
                      "acceptance_length": statistics.median(p["acceptance_length"] or 1.0 for p in per)}
        best_other = max(row["always"]["tokens_per_s_median"], row["never"]["tokens_per_s_median"])
        row["scheduled_over_best_of_always_never"] = row["scheduled"]["tokens_per_s_median"] / best_other
        table.append(row)
    report = {
        "command": "python bench/bench_adaptive.py " + " ".join(sys.argv[1:]),
        "bundle": str(a.bundle or "built: build --arch hopper --gpu h200 --quant none --stacks vllm"),
        "vllm": "vllm-cpu 0.32.0, vllm serve --enforce-eager", "threads": a.threads,
        "prompts_per_level": a.prompts, "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
        "acceptance": {"source": "dflash-trt bench --json (held-out prompts, float32)", "tau": accept.get("tau"),
                       "histogram": accept["acceptance_histogram"], "survival": survival},
        "step_cost": passes,
        "schedule": schedule.to_dict(),
        "speculative_config_scheduled": spec,
        "levels": table,
        "token_identical_to_vllm_ar": identity,
        "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "runs": {m: [{k: v for k, v in run.items() if k not in ("token_ids", "texts")} for run in runs[m]]
                 for m in MODES},
    }
    return report


if __name__ == "__main__":
    sys.exit(main())
