"""Benchmark: streaming NVFP4 quantization of a synthetic bf16 checkpoint.

Builds Llama-shaped bf16 checkpoints (hidden 4096, 32 heads / 8 kv heads, intermediate 14336,
vocab 32000; 8B-sized layers) of two sizes in 1 GB shards, then for each size measures, each in
a fresh subprocess:
  - `cat <shards> > /dev/null` wall time (reading the same bytes), with the checkpoint in the page
    cache (hot), and, where the page cache can be emptied (root), from disk (cold)
  - `dflash-trt quantize --format nvfp4` (library call) wall time and peak RSS, hot and cold
  - optionally ModelOpt's quantize + export of the same checkpoint (whole model in memory), the
    same one-prompt calibration on both sides
  - the time to write the output's bytes alone (O_DIRECT, from memory): the disk's floor
Prints one JSON object (with --json only JSON on stdout). Goals from issue 4: peak RSS <= 1.5 GB
and not growing with size; wall <= 3x cat; >= 2x faster than ModelOpt where it fits.

    .venv/bin/python bench/bench_quantize.py --json --sizes 2,9 --modelopt-sizes 2
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
       "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
CALIB = [{"input_ids": [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 1576, 1095, 29889]}]


def build_checkpoint(folder: Path, layers: int) -> int:
    import torch

    from dflash_trt.io.atomic import atomic_output_dir
    from dflash_trt.io.shards import ShardedWriter, TensorSpec
    from dflash_trt.models.shapes import expected_shape

    cfg = dict(CFG, num_hidden_layers=layers)
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    specs = [TensorSpec(n, torch.bfloat16, expected_shape(n, cfg)) for n in names]
    g = torch.Generator().manual_seed(0)
    with atomic_output_dir(folder) as tmp:
        w = ShardedWriter(tmp, specs, max_shard_bytes=10**9)
        for s in specs:
            if len(s.shape) == 1:
                t = torch.ones(s.shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(s.shape, dtype=torch.bfloat16)
                for r in range(0, s.shape[0], 1024):   # fill in slices: small temporaries
                    t[r:r + 1024] = torch.randn(min(1024, s.shape[0] - r), s.shape[1], generator=g) * 0.02
            w.write(s.name, t)
        w.close()
        (tmp / "config.json").write_text(json.dumps(cfg))
    return sum(s.nbytes for s in specs)


CHILD_OURS = """
import json, resource, sys, time
from dflash_trt.quant.quantize import quantize_checkpoint
t = time.time()
rep = quantize_checkpoint(sys.argv[1], sys.argv[2], "nvfp4", calib=sys.argv[3] or None, progress=False)
print(json.dumps({"seconds": time.time() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "bytes_out": rep.bytes_out, "disk_wait_seconds": rep.disk_wait_seconds}))
"""

CHILD_MODELOPT = """
import json, resource, sys, time, warnings, copy
warnings.simplefilter("ignore")
import torch
t = time.time()
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM
t_import = time.time() - t
t = time.time()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
ids = torch.tensor([json.loads(l)["input_ids"] for l in open(sys.argv[3])])
m = mtq.quantize(m, copy.deepcopy(mtq.NVFP4_DEFAULT_CFG), lambda mm: mm(ids))
export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=sys.argv[2])
print(json.dumps({"seconds": time.time() - t, "import_seconds": t_import,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(code: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def cat_seconds(folder: Path) -> float:
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    t = time.time()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.time() - t


def disk_write_seconds(folder: Path, nbytes: int) -> float:
    """The time to write nbytes into `folder` with quantize's own writer (dflash_trt.io.direct_io:
    O_DIRECT where the filesystem allows it), from one buffer the disk reads in place: the floor
    any tool that writes the quantized output stays above on this disk."""
    import mmap

    from dflash_trt.io.direct_io import DirectWriter

    piece = 16 << 20
    buf = mmap.mmap(-1, piece)   # page-aligned, so every piece is borrowed, never copied
    buf.write(b"\x5a" * piece)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    path = folder / "disk-floor.bin"
    w = DirectWriter()
    try:
        t = time.time()
        f = w.open(str(path))
        for off in range(0, nbytes, piece):
            w.pwrite(f, memoryview(buf)[:min(piece, nbytes - off)], off, address=address)
        w.finish(f, nbytes)
        return time.time() - t
    finally:
        w.close()
        path.unlink()


def drop_page_cache() -> bool:
    """Empty the page cache (root only), for the cold-cache runs: a 65 GB checkpoint is not cached."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,9", help="decoder layers per checkpoint (8B-sized layers, ~0.44 GB each)")
    ap.add_argument("--modelopt-sizes", default="2", help="sizes to also run ModelOpt on ('' for none)")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder under /work or /tmp)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    mo_sizes = {int(s) for s in a.modelopt_sizes.split(",") if s}
    base = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench-quantize-", dir="/work" if os.access("/work", os.W_OK) else None))
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    need = max(sizes) * 0.44e9 * 2.6 + 1e9
    result = {"bench": "quantize_nvfp4_streaming", "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
              "disk_free_gb": round(free / 1e9, 1), "runs": []}
    if free < need:
        result["error"] = f"not enough disk in {base}: {free / 1e9:.1f} GB free, need about {need / 1e9:.1f} GB"
        print(json.dumps(result, indent=2))
        return
    calib = base / "calib.jsonl"
    calib.write_text("".join(json.dumps(c) + "\n" for c in CALIB))
    try:
        for layers in sizes:
            src = base / f"src-{layers}"
            t = time.time()
            nbytes = build_checkpoint(src, layers)
            run = {"layers": layers, "checkpoint_gb": round(nbytes / 1e9, 3),
                   "shards": len(list(src.glob("*.safetensors"))), "build_seconds": round(time.time() - t, 1)}
            # Cold: both read from disk (page cache emptied before each). Hot: both read from a
            # page cache holding the whole checkpoint (cat run twice, the second timed). The goal
            # (within 3x of cat) is checked against the hot cat, the stricter of the two.
            if drop_page_cache():
                run["cat_cold_seconds"] = round(cat_seconds(src), 3)
                drop_page_cache()
                cold = run_child(CHILD_OURS, src, base / "out", "")
                shutil.rmtree(base / "out", ignore_errors=True)
                run["ours_nvfp4_cold"] = cold
                if "seconds" in cold:
                    run["ours_over_cat_cold"] = round(cold["seconds"] / max(run["cat_cold_seconds"], 1e-9), 2)
            cat_seconds(src)
            run["cat_seconds"] = round(cat_seconds(src), 3)
            ours = run_child(CHILD_OURS, src, base / "out", "")
            shutil.rmtree(base / "out", ignore_errors=True)
            ours_cal = run_child(CHILD_OURS, src, base / "out", calib)
            shutil.rmtree(base / "out", ignore_errors=True)
            run["ours_nvfp4"] = ours
            run["ours_nvfp4_calibrated"] = ours_cal
            if "seconds" in ours:
                run["ours_over_cat"] = round(ours["seconds"] / max(run["cat_seconds"], 1e-9), 2)
                # what this machine's disk allows: writing the output alone, from memory
                run["disk_write_seconds"] = round(disk_write_seconds(base, ours["bytes_out"]), 3)
                run["disk_write_gb_per_s"] = round(ours["bytes_out"] / run["disk_write_seconds"] / 1e9, 2)
                run["ours_over_disk_write"] = round(ours["seconds"] / run["disk_write_seconds"], 2)
            if layers in mo_sizes:
                mo = run_child(CHILD_MODELOPT, src, base / "mo", calib)
                shutil.rmtree(base / "mo", ignore_errors=True)
                run["modelopt_nvfp4_calibrated"] = mo
                if "seconds" in mo and "seconds" in ours_cal:
                    run["modelopt_over_ours"] = round(mo["seconds"] / ours_cal["seconds"], 2)
            result["runs"].append(run)
            shutil.rmtree(src, ignore_errors=True)
            if not a.json:
                print(json.dumps(run), file=sys.stderr)
    finally:
        if not a.workdir:
            shutil.rmtree(base, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    rss = [r["ours_nvfp4"].get("peak_rss_mb") for r in result["runs"] if "peak_rss_mb" in r["ours_nvfp4"]]
    result["peak_rss_mb_max"] = max(rss) if rss else None
    result["note"] = ("wall times include any contention from other jobs (see loadavg); ours_over_cat compares "
                      "hot-cache runs, ours_over_cat_cold cold-cache runs (absent without root); "
                      "disk_write_seconds: writing the output's bytes alone, the disk's floor under any quantizer")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
