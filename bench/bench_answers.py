"""The target's answers per second: vLLM's batched generation (in its own environment,
$DFLASH_TRT_VLLM_ENV; train/vllm_answers.py) against transformers' generate, on the same prompts,
and how many greedy answers agree token for token. Embedded SmolLM2-135M.

    DFLASH_TRT_VLLM_ENV=/path/to/vllm-venv python bench/bench_answers.py [--prompts 32] \\
        [--max-new-tokens 64] [--dtype float32] > answers.json

The vLLM run prints its generation-only rate and its engine start on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt.presets.catalog import resolve_target
from dflash_trt.train.data import generate_responses
from dflash_trt.train.prompts import build_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tdir = resolve_target(None)
    prompts = [r["prompt"] for r in build_prompts("train", seed=7)][: a.prompts]
    report, answers = {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "dtype": a.dtype}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("vllm", "hf"):
            out = Path(tmp) / f"{engine}.jsonl"
            t = time.perf_counter()
            generate_responses(tdir, prompts, out, max_new_tokens=a.max_new_tokens, batch_size=len(prompts),
                               progress=False, threads=a.threads, dtype=a.dtype, engine=engine)
            dt = time.perf_counter() - t
            report[engine] = {"seconds_incl_load": dt, "answers_per_s_incl_load": len(prompts) / dt}
            answers[engine] = {r["prompt"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
    report["identical_answers"] = sum(answers["vllm"][p] == answers["hf"][p] for p in prompts)
    report["answer_tokens_vllm"] = sum(len(v) for v in answers["vllm"].values())
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
