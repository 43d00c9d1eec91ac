"""Presets and hub ids resolved from $DFLASH_TRT_HOME/models and the Hugging Face cache
(presets/hub.py). The cache is laid out as huggingface_hub lays it out (blobs named by their
hash, snapshots/<commit>/<file> relative symlinks into blobs, refs/<branch> holding a commit)
and checked with huggingface_hub's own scan_cache_dir. No network: the conftest sets
HF_HUB_OFFLINE=1; the one unreachable-hub test points HF_ENDPOINT at a closed local port."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir
from safetensors.torch import load_file, save_file

from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest, sha256_file, verify
from dflash_trt.presets.catalog import PRESETS
from dflash_trt.presets.hub import check_disk, download_command, resolve_hub_id

from helpers import run_cli

QWEN_REV = PRESETS["qwen3-8b"].revision
DRAFTER_REV = PRESETS["qwen3-8b"].drafter_revision


def put_in_cache(cache: Path, repo_id: str, commit: str, src: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay src's files out as huggingface_hub's cache does; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        if f.suffix == ".safetensors":   # LFS files: blob named by the sha256, as the hub's LFS oid
            blob = hashlib.sha256(data).hexdigest()
        else:                             # regular files: by their git blob sha1
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for r in refs:
        (repo / "refs" / r).write_text(commit)
    return snap


def split_in_two_shards(folder: Path) -> list[str]:
    """Re-store a tiny checkpoint as two shards plus model.safetensors.index.json, as big ones are."""
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for shard, part in zip(shards, halves):
        save_file({n: state[n] for n in part}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {n: s for s, part in zip(shards, halves) for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("src")
    make_tiny("qwen3", root / "t", root / "d", seed=5)
    split_in_two_shards(root / "t")
    return root / "t", root / "d"


@pytest.fixture
def env(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.fixture
def cached_qwen(env, qwen_pair):
    t = put_in_cache(env, "Qwen/Qwen3-8B", QWEN_REV, qwen_pair[0])
    d = put_in_cache(env, "z-lab/Qwen3-8B-DFlash-b16", DRAFTER_REV, qwen_pair[1])
    return env, t, d


def test_fixture_is_a_valid_hugging_face_cache(cached_qwen):
    cache, t, _ = cached_qwen
    info = scan_cache_dir(cache)
    assert info.warnings == []
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {"Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"}
    (rev,) = repos["Qwen/Qwen3-8B"].revisions
    assert rev.commit_hash == QWEN_REV and rev.refs == frozenset({"main"}) and Path(rev.snapshot_path) == t
    assert {f.file_name for f in rev.files} >= {"config.json", "model.safetensors.index.json",
                                                 "model-00002-of-00002.safetensors", "tokenizer.json"}


def test_preset_from_the_cache_is_checked_and_built_with_its_revision(cached_qwen):
    _, t, d = cached_qwen
    code, out, err = run_cli("check", "--target", "qwen3-8b", "--json")
    assert code == 0, err
    code, out, err = run_cli("build", "--target", "qwen3-8b", "--arch", "hopper", "--quant", "none", "--json")
    assert code == 0, err
    m = Manifest.read(Path(json.loads(out)["bundle"])).to_dict()
    assert m["target"]["hf_id"] == "Qwen/Qwen3-8B" and m["target"]["revision"] == QWEN_REV
    assert m["target"]["path"] == str(t) and m["drafter"]["path"] == str(d)
    assert m["drafter"]["revision"] == DRAFTER_REV


def test_any_hub_id_resolves_through_refs(env, qwen_pair):
    put_in_cache(env, "someone/tiny-qwen", "a" * 40, qwen_pair[0])
    put_in_cache(env, "someone/tiny-drafter", "b" * 40, qwen_pair[1], refs=("main", "v1"))
    code, out, err = run_cli("check", "--target", "someone/tiny-qwen", "--drafter", "someone/tiny-drafter")
    assert code == 0, err
    code, out, err = run_cli("build", "--target", "someone/tiny-qwen", "--drafter", "someone/tiny-drafter",
                             "--arch", "hopper", "--quant", "none", "--json")
    assert code == 0, err
    m = Manifest.read(Path(json.loads(out)["bundle"])).to_dict()
    assert m["target"]["hf_id"] == "someone/tiny-qwen" and m["target"]["revision"] == "a" * 40
    assert json.loads(out)["bundle"] == "engines/someone-tiny-qwen-hopper-none"
    assert resolve_hub_id("someone/tiny-drafter", "v1").name == "b" * 40   # a tag: refs/v1


def test_own_models_folder_comes_before_the_cache(cached_qwen, qwen_pair, tmp_path):
    mine = tmp_path / "home" / "models" / "Qwen--Qwen3-8B"
    shutil.copytree(qwen_pair[0], mine)
    assert resolve_hub_id("Qwen/Qwen3-8B", QWEN_REV) == mine


def test_revision_mismatch_names_both_revisions(env, qwen_pair):
    other = "f" * 40
    put_in_cache(env, "Qwen/Qwen3-8B", other, qwen_pair[0])   # refs/main -> another commit
    code, _, err = run_cli("check", "--target", "qwen3-8b")
    assert code == 1 and "Traceback" not in err
    assert f"holds revision(s) {other} but not {QWEN_REV}" in err
    assert f"hf download Qwen/Qwen3-8B --revision {QWEN_REV}" in err


def test_partial_snapshot_names_the_missing_shard(cached_qwen):
    _, t, _ = cached_qwen
    (t / "model-00002-of-00002.safetensors").unlink()   # an interrupted download: no symlink yet
    code, _, err = run_cli("build", "--target", "qwen3-8b", "--arch", "hopper", "--out", "b")
    assert code == 1 and "Traceback" not in err and not Path("b").exists()
    assert "incomplete snapshot, 1 of 2 shard(s)" in err and "model-00002-of-00002.safetensors" in err
    assert "finish the download: `hf download Qwen/Qwen3-8B --revision" in err


def test_dangling_blob_link_counts_as_missing(cached_qwen):
    _, t, _ = cached_qwen
    (t / "model-00001-of-00002.safetensors").resolve().unlink()   # blob gone, symlink left
    with pytest.raises(DFlashError, match="model-00001-of-00002.safetensors"):
        resolve_hub_id("Qwen/Qwen3-8B", QWEN_REV)


def test_offline_message_is_one_line_with_every_place_and_the_command(env, tmp_path):
    code, out, err = run_cli("build", "--target", "gpt-oss-120b", "--arch", "blackwell")
    assert code == 1 and out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith("error: target openai/gpt-oss-120b@b5c939de")
    assert str(tmp_path / "home" / "models" / "openai--gpt-oss-120b") in line
    assert str(env / "models--openai--gpt-oss-120b" / "snapshots" / PRESETS["gpt-oss-120b"].revision) in line
    assert "HF_HUB_OFFLINE" in line
    assert f"`{download_command('openai/gpt-oss-120b', PRESETS['gpt-oss-120b'].revision)}`" in line


def test_download_command_fetches_only_what_the_pipeline_reads():
    cmd = download_command("openai/gpt-oss-20b", "main")
    assert cmd.startswith("hf download openai/gpt-oss-20b --include '*.safetensors'") and "--revision" not in cmd
    assert cmd.endswith("--exclude '*/*'")   # not original/ and metal/ (the same weights again)


@pytest.mark.parametrize("cached", [False, True])
def test_unreachable_hub_gives_the_one_line_message(tmp_path, cached):
    """A real connection failure (a closed local port), in a fresh process so that huggingface_hub
    reads HF_HUB_OFFLINE=0 and HF_ENDPOINT at import. With the hub on, a cached snapshot that is
    incomplete (here: only config.json, as a config-only fetch leaves it) is completed by a
    download, so the message says what was there."""
    if cached:
        (tmp_path / "cfg").mkdir()
        (tmp_path / "cfg" / "config.json").write_text("{}")
        put_in_cache(tmp_path / "hub", "someone/model", "c" * 40, tmp_path / "cfg")
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"),
               DFLASH_TRT_HOME=str(tmp_path / "home"), HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    res = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "check", "--target", "someone/model",
                          "--drafter", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, check=False)
    line = res.stderr.strip()
    assert res.returncode == 1 and "\n" not in line, res.stderr
    assert line.startswith("error: target someone/model not found and the hub is unreachable (")
    assert "`hf download someone/model --include" in line
    assert ("(there, but no *.safetensors weights)" in line) == cached


def test_no_room_for_the_download_is_refused_before_the_first_byte(tmp_path):
    with pytest.raises(DFlashError, match=r"to download but .* GB free"):
        check_disk(tmp_path / "not" / "yet", 1 << 60, "target x/y", "hf download x/y")
    check_disk(tmp_path, 1 << 20, "target x/y", "hf download x/y")   # room: no error


def test_cache_blobs_are_hashed_by_their_names_and_verify_rereads_them(cached_qwen):
    """A snapshot's LFS blobs are named by their sha256: the build takes the name instead of
    reading a multi-GB file (its copy in the bundle carries the source's digest: io/clone.py);
    `verify` re-reads, so a blob whose name lies is caught there."""
    _, t, _ = cached_qwen
    code, out, err = run_cli("build", "--target", "qwen3-8b", "--arch", "hopper", "--quant", "none", "--json")
    assert code == 0, err
    bundle = Path(json.loads(out)["bundle"])
    shard = "target/model-00001-of-00002.safetensors"
    arts = {a["path"]: a["sha256"] for a in Manifest.read(bundle).to_dict()["artifacts"]}
    assert arts[shard] == sha256_file(bundle / shard) == (t / shard.split("/")[1]).resolve().name
    assert verify(bundle) == []
    # a blob whose name is not its content's hash: the build believes the name, verify does not
    blob = (t / "model-00001-of-00002.safetensors").resolve()
    liar = blob.with_name("e" * 64)
    blob.rename(liar)
    (t / "model-00001-of-00002.safetensors").unlink()
    (t / "model-00001-of-00002.safetensors").symlink_to(os.path.relpath(liar, t))
    code, out, err = run_cli("build", "--target", "qwen3-8b", "--arch", "hopper", "--quant", "none", "--force",
                             "--json")
    assert code == 0, err
    assert any(shard in p for p in verify(bundle))
