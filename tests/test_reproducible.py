"""Byte-reproducible bundles: the same inputs built twice, in two processes with different hash seeds,
give identical files. manifest.json is compared without its run facts (io/manifest.py RUN_FACTS: when it
was built, how long each stage took, the files' mtimes), every other file byte for byte."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.io.manifest import MANIFEST_NAME, RUN_FACTS, STAGE_RUN_FACTS

ROOT = Path(__file__).resolve().parents[1]


def _build(out: Path, seed: str, *args: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "build", *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]


def without_run_facts(manifest: dict) -> dict:
    """A manifest dict without its run facts (RUN_FACTS, each stage's STAGE_RUN_FACTS)."""
    out = {k: v for k, v in manifest.items() if k not in RUN_FACTS}
    if "stages" in out:
        out["stages"] = {n: {k: v for k, v in e.items() if k not in STAGE_RUN_FACTS} for n, e in out["stages"].items()}
    return out


def _files(bundle: Path) -> dict[str, bytes]:
    return {p.relative_to(bundle).as_posix(): p.read_bytes() for p in sorted(bundle.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.parametrize("which", ["embedded", "gpt-oss"])
def test_two_builds_in_two_processes_give_identical_files(which, tiny_pairs, tmp_path):
    """The embedded pair's bundle holds configs/vllm-drafter/draft_vocab.safetensors, whose safetensors
    metadata (two keys) the library writes in a per-process order; the gpt-oss one the MXFP4 target, tp 2 ep 2."""
    if which == "embedded":
        args = ("--arch", "blackwell")
    else:
        t, d = tiny_pairs["gpt-oss"]
        args = ("--target", str(t), "--drafter", str(d), "--arch", "blackwell", "--tp", "2", "--ep", "2")
    a, b = tmp_path / "a", tmp_path / "b"
    _build(a, "1", *args)
    _build(b, "2", *args)
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    ma, mb = json.loads(fa.pop(MANIFEST_NAME)), json.loads(fb.pop(MANIFEST_NAME))
    assert ma["created"] and ma["artifact_stats"]   # the run facts are there, and only they are set aside
    assert without_run_facts(ma) == without_run_facts(mb)
    differ = [rel for rel in fa if fa[rel] != fb[rel]]
    assert differ == [], f"{len(differ)} file(s) differ between two builds: {differ[:5]}"
    if which == "embedded":
        assert "configs/vllm-drafter/draft_vocab.safetensors" in fa


def test_safetensors_metadata_is_written_in_one_order(tmp_path):
    """save_safetensors: the same tensors and metadata give the same bytes whatever the dict order (the
    library alone writes its HashMap's order), and the file reads back with every tensor and key."""
    import torch
    from safetensors import safe_open

    from dflash_trt.io.shards import save_safetensors

    t = {"b": torch.arange(6, dtype=torch.int64), "a": torch.ones(2, 3)}
    keys = [f"k{i}" for i in range(8)]
    save_safetensors(t, tmp_path / "x.safetensors", metadata={k: f"v {k} é" for k in keys})
    save_safetensors(t, tmp_path / "y.safetensors", metadata={k: f"v {k} é" for k in reversed(keys)})
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {k: f"v {k} é" for k in keys}
        assert torch.equal(f.get_tensor("b"), t["b"]) and torch.equal(f.get_tensor("a"), t["a"])
