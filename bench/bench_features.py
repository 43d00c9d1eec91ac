"""The labelling pass of train/features.py on the embedded SmolLM2-135M: labelled positions per
second with one sequence per forward against packed forwards (the same sequences, the same
threads), the shards' bytes on disk per million tokens, and the process memory that reading every
sequence's features back costs (RssAnon: process memory; RssFile: page cache of the memory-mapped
shards, which the kernel may evict).

    dflash-trt corpus --out c.jsonl --max-rows 48
    python bench/bench_features.py c.jsonl [--sequences 48] [--pack 0,2048] [--threads 1] > features.json
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
from dflash_trt.train.data import Sequences, load_sequences
from dflash_trt.train.features import label_sequences


def _rss() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f)
    return int(st["RssAnon"].split()[0]) * 1024, int(st["RssFile"].split()[0]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a data JSONL (e.g. `dflash-trt corpus` rows)")
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--pack", default="0,2048", help="pack_tokens values to time (0: one sequence per forward)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    tdir = resolve_target(None)
    data, _ = load_sequences(a.data, AutoTokenizer.from_pretrained(str(tdir)))
    off = data.offsets[: a.sequences + 1]
    data = Sequences(data.tokens[: int(off[-1])], off, data.prompt_lens[: a.sequences])
    out = {"sequences": len(data), "positions": int(off[-1]), "threads": a.threads, "dtype": "bfloat16"}
    for pack in (int(x) for x in a.pack.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            label_sequences(tdir, data, [1, 8, 14, 20, 27], Path(tmp), progress=False, dtype=torch.bfloat16, topk=8,
                            pack_tokens=pack)
            dt = time.perf_counter() - t
            disk = sum(f.stat().st_size for f in Path(tmp).rglob("*.safetensors"))
            a0, f0 = _rss()
            for i in range(len(data)):
                data.features[data.seq(i)].float().sum()
            a1, f1 = _rss()
            out[f"pack_{pack}"] = {"seconds": dt, "positions_per_s": out["positions"] / dt, "disk_bytes": disk,
                                   "disk_bytes_per_M_tokens": disk / out["positions"] * 1e6,
                                   "anon_rss_growth_reading_all": a1 - a0, "file_rss_growth_reading_all": f1 - f0}
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
