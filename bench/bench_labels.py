"""Labels per second: the target's own greedy answers (batched generate) against teacher-forced
labels (one forward per sequence, train/data.py) on this CPU, embedded SmolLM2-135M.

Both produce, per response token, the target's greedy choice there; generation also writes the
text, teacher forcing labels text that already exists (and keeps the top-k distribution and the
features in the same pass). Reported: answer tokens per second of generation at two batch sizes,
labelled positions per second of teacher forcing over the very same sequences, and how often the
teacher-forced top-1 equals the generated token (transformers' and our bf16 kernels part at
near-ties, so not always).

    python bench/bench_labels.py [--prompts 64] [--max-new-tokens 64] [--threads 1] > labels.json

Each timing includes loading the target (about a second), as a labelling run does.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt.hardware import cpu
from dflash_trt.presets.catalog import resolve_target
from dflash_trt.runtime.pair import resolve_dtype
from dflash_trt.train.data import generate_responses, load_sequences
from dflash_trt.train.features import label_sequences
from dflash_trt.train.prompts import build_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="per batch size (64: one full batch of 64)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    tdir = resolve_target(None)
    tok = AutoTokenizer.from_pretrained(str(tdir))
    prompts = [r["prompt"] for r in build_prompts("train", seed=7)][: 2 * a.prompts]
    report = {"cpu": cpu(), "threads": a.threads, "dtype": str(resolve_dtype(a.dtype)).removeprefix("torch."),
              "max_new_tokens": a.max_new_tokens, "generate": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, batch in enumerate((16, 64)):   # other prompts for each, so neither reuses a cache
            out = Path(tmp) / f"answers_b{batch}.jsonl"
            t = time.perf_counter()
            generate_responses(tdir, prompts[i * a.prompts:(i + 1) * a.prompts], out, max_new_tokens=a.max_new_tokens,
                               batch_size=batch, progress=False, dtype=a.dtype)
            dt = time.perf_counter() - t
            data, _ = load_sequences(out, tok)
            n = int((data.offsets[1:] - data.offsets[:-1] - data.prompt_lens).sum())
            report["generate"][f"batch_{batch}"] = {"answers": len(data), "answer_tokens": n, "seconds": dt,
                                                    "answers_per_s": len(data) / dt, "answer_tokens_per_s": n / dt}
            files.append(out)
        data, _ = load_sequences(files[1], tok)
        t = time.perf_counter()
        label_sequences(tdir, data, [1, 8, 14, 20, 27], Path(tmp) / "cache", progress=False,
                        dtype=resolve_dtype(a.dtype), topk=8)
        dt = time.perf_counter() - t
    n_pos = int(data.offsets[-1])
    agree, total = 0, 0
    for i in range(len(data)):
        sl, P = data.seq(i), int(data.prompt_lens[i])
        toks, top1 = data.tokens[sl], data.top_ids[sl][:, 0].long()
        agree += int((toks[P:] == top1[P - 1:-1]).sum())
        total += len(toks) - P
    report["teacher_forced"] = {"sequences": len(data), "positions": n_pos, "answer_positions": total,
                                "seconds": dt, "positions_per_s": n_pos / dt,
                                "answer_positions_per_s": total / dt, "top1_equals_generated": agree / total}
    report["answer_labels_ratio_vs_batch_64"] = (total / dt) / report["generate"]["batch_64"]["answer_tokens_per_s"]
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
