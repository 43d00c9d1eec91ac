"""Benchmark: `dflash-trt build` end to end on a gpt-oss-20b-sized pair (issue 18).

Writes, streamed with bounded memory (one 64 MiB chunk at a time):
  - a target with the tensor names, shapes and dtypes of openai/gpt-oss-20b (the preset's
    config.json verbatim): MXFP4 experts stored as the real checkpoint stores them
    (`*_blocks` uint8 [E, out, in/32, 16], `*_scales` uint8 [E, out, in/32]), bf16 elsewhere,
    in three shards named as upstream (model-0000{0,1,2}-of-00002.safetensors) plus
    model.safetensors.index.json; random values; ~13.8 GB. The tokenizer is make-tiny's
    (the real o200k_harmony one is not reachable offline); it does not change the build's cost.
  - a drafter of the published z-lab/gpt-oss-20b-DFlash shape (config below), bf16, random.
Then, in this run and on the same disk, each after emptying the page cache when root:
  - before each build, `cp -rL` of the target (+ `sync`), timed, the copy deleted right after (the
    disk is shared: each build is compared with the cp made just before it);
  - `dflash-trt build --arch blackwell` and `--arch hopper`, the pair given two ways (--layout):
    as folders (`--target DIR --drafter DIR`: every input byte is read to be hashed) and as the
    preset found in the Hugging Face cache (`--target gpt-oss-20b`, the files moved into
    models--openai--gpt-oss-20b/blobs + snapshots/<pinned commit>, as `hf download` leaves them:
    weights hashed by their blob names). Each build runs in a fresh child process: wall time, and per phase (the build's own `<stage>: running` lines on stderr mark
    the boundaries) wall time, bytes read / written (/proc/<pid>/io: rchar/wchar through syscalls,
    read_bytes/write_bytes at the block layer; mmap reads show only in read_bytes) and peak RSS
    (VmHWM, reset between phases through /proc/<pid>/clear_refs); the build's peak RSS is the largest.
    Each bundle is deleted after it is measured.
Prints one JSON object: the measurements, the issue's targets (peak RSS <= 2 GB; wall <= 3x cp)
and a projection to gpt-oss-120b (65 GB): the phases that work on the target's bytes scaled by
65.2 / 13.8, the others (drafter, embedding, lm_head: same shapes in the 120b pair) as measured.

    .venv/bin/python bench/bench_build_real_size.py --json --workdir /var/tmp/dflash-bench
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_trt.io.manifest import sha256_file

CHUNK = 64 << 20
GPT_OSS_120B_BYTES = 65_200_000_000   # the 120b safetensors total at b5c939de (search-index id 67564356224)
# z-lab/gpt-oss-20b-DFlash config.json as quoted (trimmed) in a public test suite (SOURCES.md,
# search-index id 53379779500), plus the fields our reader wants that the quote left out.
DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "block_size": 8, "bos_token_id": 199998, "eos_token_id": 200002,
    "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16", "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 7680, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_hidden_layers": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 150000, "vocab_size": 201088,
    # not in the quote: ours
    "num_target_layers": 24, "layer_types": ["full_attention"] * 8, "tie_word_embeddings": False,
}


# ------------------------------------------------------------------------------ the checkpoint
def target_tensors(cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of a gpt-oss checkpoint as openai/gpt-oss-* store it
    (transformers' GptOss layout; experts' MXFP4 blocks/scales as in transformers'
    integrations/mxfp4.py: 32 values per block, 16 bytes of nibbles, one E8M0 scale)."""
    H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    nh, nkv, hd, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", "BF16", (V, H))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", (H,)), (p + "post_attention_layernorm.weight", "BF16", (H,)),
                (p + "self_attn.q_proj.weight", "BF16", (nh * hd, H)), (p + "self_attn.q_proj.bias", "BF16", (nh * hd,)),
                (p + "self_attn.k_proj.weight", "BF16", (nkv * hd, H)), (p + "self_attn.k_proj.bias", "BF16", (nkv * hd,)),
                (p + "self_attn.v_proj.weight", "BF16", (nkv * hd, H)), (p + "self_attn.v_proj.bias", "BF16", (nkv * hd,)),
                (p + "self_attn.o_proj.weight", "BF16", (H, nh * hd)), (p + "self_attn.o_proj.bias", "BF16", (H,)),
                (p + "self_attn.sinks", "BF16", (nh,)),
                (p + "mlp.router.weight", "BF16", (E, H)), (p + "mlp.router.bias", "BF16", (E,)),
                (p + "mlp.experts.gate_up_proj_blocks", "U8", (E, 2 * I, H // 32, 16)),
                (p + "mlp.experts.gate_up_proj_scales", "U8", (E, 2 * I, H // 32)),
                (p + "mlp.experts.gate_up_proj_bias", "BF16", (E, 2 * I)),
                (p + "mlp.experts.down_proj_blocks", "U8", (E, H, I // 32, 16)),
                (p + "mlp.experts.down_proj_scales", "U8", (E, H, I // 32)),
                (p + "mlp.experts.down_proj_bias", "BF16", (E, H))]
    out += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (V, H))]
    return out


def drafter_tensors(c: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The drafter's tensors, taken from our DFlashDrafter built on the meta device."""
    import torch

    from dflash_trt.models.config import DrafterConfig
    from dflash_trt.models.drafter import DFlashDrafter

    with torch.device("meta"):
        m = DFlashDrafter(DrafterConfig.from_dict(c), max_len=16)
    return [(n, "BF16", tuple(t.shape)) for n, t in m.state_dict().items()]


def _nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * (2 if dtype == "BF16" else 1)


def _random_chunk(rng: np.random.Generator, dtype: str, name: str, n: int) -> bytes:
    if dtype == "U8":
        if name.endswith("_scales"):   # E8M0 exponents near 2^0: finite scales (255 would be NaN)
            return rng.integers(118, 130, n, dtype=np.uint8).tobytes()
        return rng.bytes(n)            # any nibble pair is a valid pair of FP4 values
    x = (rng.standard_normal(n // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    return x.astype(np.uint16).tobytes()


def write_safetensors(path: Path, tensors, rng) -> int:
    """One safetensors file, header first, then each tensor in 64 MiB chunks of random values.
    (Our own writer: the safetensors library takes whole tensors in memory.)"""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in tensors:
            left = _nbytes(dtype, shape)
            while left:
                k = min(CHUNK, left)
                f.write(_random_chunk(rng, dtype, name, k))
                left -= k
    return path.stat().st_size


def write_target(folder: Path, cfg: dict, tokenizer_from: Path, shards: int = 3) -> int:
    tensors = target_tensors(cfg)
    total = sum(_nbytes(d, s) for _, d, s in tensors)
    per = total / shards
    groups, size = [[]], 0
    for t in tensors:   # greedy split in checkpoint order, as transformers' max_shard_size does
        if groups[-1] and size + _nbytes(t[1], t[2]) > per * 1.01 and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += _nbytes(t[1], t[2])
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"model-{i:05d}-of-{len(groups) - 1:05d}.safetensors" for i in range(len(groups))]  # upstream's 0-based
    weight_map = {}
    for fname, group in zip(names, groups):
        write_safetensors(folder / fname, group, rng)
        weight_map |= {t[0]: fname for t in group}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, folder / f.name)
    return sum(f.stat().st_size for f in folder.iterdir())


def write_drafter(folder: Path) -> int:
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", drafter_tensors(DRAFTER_CONFIG), np.random.default_rng(1))
    (folder / "config.json").write_text(json.dumps(DRAFTER_CONFIG, indent=2) + "\n")
    return sum(f.stat().st_size for f in folder.iterdir())


# ------------------------------------------------------------------------------ measuring
def drop_caches() -> bool:
    """Empty the page cache (root only) so that every timed run reads from disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _proc_io(pid: int) -> dict:
    try:
        rows = Path(f"/proc/{pid}/io").read_text().split("\n")
    except OSError:
        return {}
    return {k: int(v) for k, v in (r.split(": ") for r in rows if r)}


def _hwm_mb(pid: int) -> float | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def _reset_hwm(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")   # 5: reset the peak RSS (Linux >= 4.0)
    except OSError:
        pass


STAGE_LINE = re.compile(r"^dflash-trt build: ([\w-]+): (running|skipped)")


def timed_build(pair: list[str], env: dict, arch: str, out: Path, log, rss_limit_mb: float) -> dict:
    """Run one build in a child; split its life into phases at the stage lines it prints."""
    cmd = [sys.executable, "-m", "dflash_trt.cli", "build", *pair, "--arch", arch, "--out", str(out), "--json"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    phases, cur = [], {"name": "resolve + hash inputs", "t": t0, "io": _proc_io(p.pid)}
    last_io, last_hwm = dict(cur["io"]), [None]

    def sample():   # keep the latest counters: /proc/<pid> goes away when the child exits
        while p.poll() is None:
            io, hwm = _proc_io(p.pid), _hwm_mb(p.pid)
            if io:
                last_io.update(io)
            if hwm is not None:
                last_hwm[0] = hwm
                if hwm > rss_limit_mb:   # the machine is shared: stop before it swaps
                    log(f"  [{arch}] peak RSS {hwm:.0f} MB over --rss-limit-mb {rss_limit_mb:.0f}: stopping the build")
                    p.kill()
            time.sleep(0.05)
    stdout_box = []
    threading.Thread(target=lambda: stdout_box.append(p.stdout.read()), daemon=True).start()
    threading.Thread(target=sample, daemon=True).start()

    def close(now: float) -> None:
        io = _proc_io(p.pid) or dict(last_io)
        hwm = _hwm_mb(p.pid)
        phases.append({"phase": cur["name"], "seconds": round(now - cur["t"], 2),
                       **{k: io.get(k, 0) - cur["io"].get(k, 0) for k in ("rchar", "wchar", "read_bytes", "write_bytes")},
                       "peak_rss_mb": round(hwm if hwm is not None else (last_hwm[0] or 0), 1)})

    err_lines = []
    for line in p.stderr:
        err_lines.append(line)
        log(f"  [{arch}] {line.rstrip()}")
        m = STAGE_LINE.match(line)
        if m:
            now = time.perf_counter()
            close(now)
            _reset_hwm(p.pid)
            cur = {"name": m.group(1), "t": now, "io": _proc_io(p.pid) or dict(last_io)}
    _, status, _ = os.wait4(p.pid, 0)
    now = time.perf_counter()
    close(now)
    phases[-1]["phase"] += " + finish (artifact hashes, manifest, rename)"
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"build --arch {arch} failed (exit {p.returncode}):\n{''.join(err_lines[-20:])}")
    time.sleep(0.1)
    res = json.loads(stdout_box[0]) if stdout_box and stdout_box[0] else {}
    # the whole build's peak is the largest phase peak (wait4's ru_maxrss is reset with VmHWM)
    return {"arch": arch, "command": "dflash-trt " + " ".join(cmd[3:]), "wall_seconds": round(now - t0, 2), "peak_rss_mb": max(ph["peak_rss_mb"] for ph in phases),
            "phases": phases, "stage_status": {s["name"]: s["status"] for s in res.get("stages", [])},
            "bundle_bytes": sum(a["bytes"] for a in res.get("artifacts", []))}


def timed_cp(src: Path, dst: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-rL", str(src), str(dst)], check=True)   # -L: a cache snapshot's files, not its links
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    return {"cp_seconds": round(t1 - t0, 2), "cp_plus_sync_seconds": round(t2 - t0, 2)}


# Phases whose work grows with the target's bytes; the others read the drafter and the target's
# embedding / lm_head, which have the same shapes in the gpt-oss-120b pair (hidden 2880, vocab
# 201088, an 8-layer drafter: presets/configs/SOURCES.md), so they are kept as measured.
TARGET_PHASES = ("resolve + hash inputs", "check")


def project(phases: list[dict], cp_seconds: float, measured_bytes: int, target_bytes: int) -> dict:
    f = target_bytes / measured_bytes
    per = {ph["phase"]: round(ph["seconds"] * (f if ph["phase"] in TARGET_PHASES else 1), 1) for ph in phases}
    wall = round(sum(per.values()), 1)
    return {"target_bytes": target_bytes, "scale": round(f, 2), "wall_seconds": wall, "phases_seconds": per,
            "dominant_phase": max(per, key=per.get), "cp_seconds": round(cp_seconds * f, 1),
            "wall_over_cp": round(wall / (cp_seconds * f), 2)}


# ------------------------------------------------------------------------------ the HF cache layout
CACHE_REPOS = {"target": ("openai/gpt-oss-20b", None), "drafter": ("z-lab/gpt-oss-20b-DFlash", "d" * 40)}


def _blob_name(path: Path, sums: dict) -> str:
    """As huggingface_hub names blobs: LFS files (weights) by their sha256, others by git sha1."""
    if path.suffix == ".safetensors":
        if path.name not in sums:
            sums[path.name] = sha256_file(path)
        return sums[path.name]
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def to_hf_cache(work: Path) -> Path:
    """Move the pair into work/hub as `hf download` lays it out (renames: no copy); returns the cache."""
    from dflash_trt.presets.catalog import get_preset

    sums_file = work / "sha256.json"
    sums = json.loads(sums_file.read_text()) if sums_file.is_file() else {}
    hub = work / "hub"
    for role, (repo_id, commit) in CACHE_REPOS.items():
        commit = commit or get_preset("gpt-oss-20b").revision
        repo = hub / f"models--{repo_id.replace('/', '--')}"
        snap = repo / "snapshots" / commit
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        snap.mkdir(parents=True, exist_ok=True)
        for f in sorted((work / role).iterdir()):
            blob = repo / "blobs" / _blob_name(f, sums)
            f.rename(blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        (work / role).rmdir()
    sums_file.write_text(json.dumps(sums))
    return hub


def from_hf_cache(work: Path) -> None:
    """Undo to_hf_cache: the plain folders back."""
    for role, (repo_id, _) in CACHE_REPOS.items():
        repo = work / "hub" / f"models--{repo_id.replace('/', '--')}"
        (snap,) = (repo / "snapshots").iterdir()
        (work / role).mkdir()
        for link in snap.iterdir():
            link.resolve().rename(work / role / link.name)
    shutil.rmtree(work / "hub")


def needed_bytes() -> int:
    """Disk the benchmark needs at its peak: target + drafter + the cp copy (+ 5% margin)."""
    from dflash_trt.presets.catalog import get_preset

    cfg = get_preset("gpt-oss-20b").config()
    t = sum(_nbytes(d, s) for _, d, s in target_tensors(cfg))
    return int((2 * t + 2 * 10**9) * 1.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp folder)")
    ap.add_argument("--arch", action="append", help="arch(es) to build (default: blackwell and hopper)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    ap.add_argument("--log", default=None, help="progress log file (default: stderr)")
    ap.add_argument("--check-disk", action="store_true", help="only say whether the disk has room (exit 0 / 3)")
    ap.add_argument("--keep-checkpoint", action="store_true",
                    help="write the pair to <workdir>/pair once and keep it (re-runs skip the 14 GB write)")
    ap.add_argument("--layout", action="append", choices=["folder", "hf-cache"],
                    help="where the pair is: plain folders (--target DIR --drafter DIR) or the Hugging Face cache "
                         "(--target gpt-oss-20b); default both")
    ap.add_argument("--rss-limit-mb", type=float, default=8000, help="stop a build whose RSS passes this")
    a = ap.parse_args()
    logf = open(a.log, "a") if a.log else sys.stderr  # noqa: SIM115 -- the run's log, open until exit

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=logf, flush=True)

    base = Path(a.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    need, free = needed_bytes(), shutil.disk_usage(base).free
    if a.check_disk or free < need:
        ok = free >= need
        print(f"bench_build_real_size: {'room' if ok else 'skipped'}: needs {need / 1e9:.1f} GB free in {base}, "
              f"has {free / 1e9:.1f} GB", file=sys.stderr)
        return 0 if ok else 3
    from dflash_trt.models.tiny import make_tiny
    from dflash_trt.presets.catalog import get_preset

    work = base / "pair" if a.keep_checkpoint else Path(tempfile.mkdtemp(prefix="bench-build-", dir=base))
    result: dict = {"workdir": str(work)}
    try:
        t0 = time.perf_counter()
        if (work / "hub").is_dir():   # a kept pair left in the cache layout by an interrupted run
            from_hf_cache(work)
        if not (work / "written").is_file():
            shutil.rmtree(work, ignore_errors=True)
            make_tiny("gpt-oss", work / "tiny")   # only its tokenizer files are used
            write_target(work / "target", get_preset("gpt-oss-20b").config(), work / "tiny")
            write_drafter(work / "drafter")
            (work / "written").write_text("")
        tb, db = (sum(f.stat().st_size for f in (work / d).iterdir()) for d in ("target", "drafter"))
        result["checkpoint"] = {"target_bytes": tb, "drafter_bytes": db,
                                "write_seconds": round(time.perf_counter() - t0, 1),
                                "target_files": sorted(f.name for f in (work / "target").iterdir())}
        log(f"target {tb / 1e9:.2f} GB + drafter {db / 1e9:.2f} GB ready in {result['checkpoint']['write_seconds']} s")
        result["page_cache_dropped"] = drop_caches()
        result["builds"] = []
        for layout in a.layout or ["folder", "hf-cache"]:
            if layout == "folder":
                pair, env = ["--target", str(work / "target"), "--drafter", str(work / "drafter")], {}
            else:   # `--target gpt-oss-20b` found in the Hugging Face cache, as after `hf download`
                hub = to_hf_cache(work)
                pair = ["--target", "gpt-oss-20b"]
                env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "DFLASH_TRT_HOME": str(work / "home")}
            src = work / "target" if layout == "folder" else next((hub / "models--openai--gpt-oss-20b").glob("snapshots/*"))
            try:
                for arch in a.arch or ["blackwell", "hopper"]:
                    # the disk is shared: each build gets its own cp, just before it, as the yardstick
                    drop_caches()
                    cp = timed_cp(src, work / "copy")
                    shutil.rmtree(work / "copy")
                    drop_caches()
                    r = timed_build(pair, env, arch, work / f"bundle-{arch}", log, a.rss_limit_mb)
                    shutil.rmtree(work / f"bundle-{arch}", ignore_errors=True)
                    log(f"build {layout} {arch}: {r['wall_seconds']} s, peak RSS {r['peak_rss_mb']} MB; cp {cp}")
                    result["builds"].append({"layout": layout, "cp": cp, **r})
            finally:
                if layout == "hf-cache":
                    from_hf_cache(work)
        result["targets"] = {
            f"{b['layout']}/{b['arch']}": {
                "peak_rss_mb": b["peak_rss_mb"], "rss_ok": b["peak_rss_mb"] <= 2048,
                "cp_seconds": b["cp"]["cp_plus_sync_seconds"], "wall_seconds": b["wall_seconds"],
                "wall_over_cp": round(b["wall_seconds"] / b["cp"]["cp_plus_sync_seconds"], 2),
                "wall_ok": b["wall_seconds"] <= 3 * b["cp"]["cp_plus_sync_seconds"]}
            for b in result["builds"]}
        result["projection_gpt_oss_120b"] = {
            f"{b['layout']}/{b['arch']}": project(b["phases"], b["cp"]["cp_plus_sync_seconds"], tb, GPT_OSS_120B_BYTES)
            for b in result["builds"]}
    finally:
        if a.keep_checkpoint:
            for d in work.glob("bundle-*"):
                shutil.rmtree(d, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
