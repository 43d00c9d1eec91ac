"""What K = 0 costs on vLLM-CPU, with our plugin's K = 0 and with vLLM's own (issue 50, item 2, first part).

The embedded pair in a bundle built for vLLM (`build --arch hopper --gpu h200 --quant none --stacks vllm`),
served by vLLM's CPU build four ways, at each concurrency level:

- always:      the bundle as built, K = block size - 1 at every batch size;
- never:       the same argv without --speculative-config (vLLM's plain AR);
- k0:          num_speculative_tokens_per_batch_size [[1, 1, K], [2, max, 0]]: K alone, none from 2 requests
               on, with our plugin's K = 0 (the drafter's context K/V only: assets/vllm_plugin);
- k0-upstream: the same schedule with vLLM's own K = 0 (DFLASH_TRT_VLLM_K0=upstream: the drafter's whole
               forward over the bonus token, every step).

Each served by `vllm serve --enforce-eager` and swept by bench_adaptive.serve_and_sweep (the endpoint
bench's client: greedy, --ignore-eos, at least c requests per level, the server's spec-decode
counters). Modes interleaved, a rotated order per repeat; medians, with the host's CPU and its load
average (a shared machine) in the report. Token identity: each mode's greedy ids against "never".

    python bench/bench_kzero.py --json                          # c 1,4; 2 repeats: ~20 min on 2 shared cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from bench_adaptive import cli, heldout, log, serve_and_sweep

MODES = ("always", "never", "k0", "k0-upstream")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, help="a bundle built with --stacks vllm --quant none (default: build one)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES), help="a subset of " + ", ".join(MODES))
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
    with tempfile.TemporaryDirectory(prefix="bench-kzero-") as tmp:
        tmp = Path(tmp)
        bundle = a.bundle
        if bundle is None:
            bundle = tmp / "bundle"
            cli("build", "--arch", "hopper", "--gpu", "h200", "--quant", "none", "--stacks", "vllm", "--out", str(bundle))
        k = json.loads((bundle / "configs" / "vllm-speculative-config.json").read_text())["num_speculative_tokens"]
        ranges = [(1, 1, k), (2, max(levels[-1], 2), 0)]
        k0 = bundle_with_draft_schedule(bundle, tmp / "k0", ds.DraftSchedule(
            max_k=k, acceptance_lengths=[1.0] * (k + 1), levels=[], ranges=ranges, assumptions=[]))
        bundles = {"always": bundle, "never": bundle, "k0": k0, "k0-upstream": k0}
        prompts = heldout(a.prompts)
        tok = load_pair(bundle / "target", None, dtype="float32").tokenizer
        identity_ids = [encode_prompt(tok, p) for p in prompts]
        modes = tuple(m for m in MODES if m in a.modes.split(","))
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        loads = []
        for r in range(a.repeats):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                loads.append(os.getloadavg()[0])
                log(f"repeat {r + 1}/{a.repeats}: {mode} (load {loads[-1]:.2f})")
                os.environ.pop("DFLASH_TRT_VLLM_K0", None)
                if mode == "k0-upstream":
                    os.environ["DFLASH_TRT_VLLM_K0"] = "upstream"   # the plugin leaves vLLM's own K = 0
                runs[mode].append(serve_and_sweep(bundles[mode], mode, tmp / f"{mode}-{r}",
                                                  prompts, levels, a.max_new_tokens, identity_ids if r == 0 else [],
                                                  a.threads))
                loads.append(os.getloadavg()[0])
    report = summarize(a, runs, levels, ranges, loads)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for row in report["levels"]:
            print(f"c={row['concurrency']}: " + ", ".join(f"{m} {row[m]['tokens_per_s_median']:.1f} tok/s"
                                                          for m in runs) + f"; over never: {row['over_never']}")
    return 0


def summarize(a, runs, levels, ranges, loads) -> dict:
    rows = []
    for c in levels:
        row = {"concurrency": c}
        for m in runs:
            lv = [run["levels"][c] for run in runs[m]]
            row[m] = {"tokens_per_s": [x["tokens_per_s"] for x in lv],
                      "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in lv),
                      "k_per_draft": statistics.median(x["k_per_draft"] for x in lv),
                      "draft_tokens_per_output_token": statistics.median(x["draft_tokens_per_output_token"] or 0
                                                                         for x in lv)}
        if "never" in runs:
            row["over_never"] = {m: row[m]["tokens_per_s_median"] / row["never"]["tokens_per_s_median"] for m in runs}
        rows.append(row)
    ar = runs["never"][0]["token_ids"] if "never" in runs else None
    return {"command": " ".join(["python", "bench/bench_kzero.py", *sys.argv[1:]]), "cpu": cpu_name(),
            "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            "k0_ranges": [list(r) for r in ranges], "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
            "repeats": a.repeats, "vllm_env": str(Path(os.environ.get("DFLASH_TRT_VLLM_ENV", "default"))),
            "token_identical_to_vllm_ar": {m: runs[m][0]["token_ids"] == ar for m in runs},
            "levels": rows}


if __name__ == "__main__":
    raise SystemExit(main())
