"""Bundles safe to hand to pods (issue 41): modes by the umask, no file shared with a source, deploy
and plan --bundle refusing what verify refuses, build refusing what deploy refuses, deploy keeping
the user's edits; and `build --configs-only` before the download."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trt.io.atomic import atomic_output_dir, atomic_write_text
from dflash_trt.io.clone import clone_file
from dflash_trt.io.manifest import Manifest, verify
from dflash_trt.presets.catalog import PRESETS

from helpers import run_cli


def sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("pairs")
    make_tiny("llama", root / "llama", root / "llama-drafter", seed=1)
    return root


def cli(*argv, env=None, umask=None):
    """`dflash-trt ARGV` in a fresh process (its own umask and environment)."""
    pre = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, preexec_fn=pre, timeout=600, check=False)


@pytest.fixture(scope="module")
def bundle(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "llama-hopper"
    r = cli("build", "--target", tiny / "llama", "--drafter", tiny / "llama-drafter", "--arch", "hopper", "--out", out,
            umask=0o022)
    assert r.returncode == 0, r.stderr
    return out


def test_every_file_and_folder_follows_the_umask(bundle, tiny, tmp_path):
    """0644 / 0755 under umask 022 (mkstemp's 0600 and mkdtemp's 0700 never reach a published path)."""
    modes = {p.relative_to(bundle).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [bundle, *bundle.rglob("*")]}
    assert modes["manifest.json"] == 0o644 and modes["."] == 0o755
    bad = {k: oct(v) for k, v in modes.items() if v != (0o755 if (bundle / k).is_dir() else 0o644)}
    assert bad == {}, bad
    # umask 077: nothing world-readable either (the mode is the umask's, not a fixed 0644)
    out = tmp_path / "private"
    r = cli("build", "--target", tiny / "llama", "--drafter", tiny / "llama-drafter", "--arch", "hopper",
            "--quant", "none", "--stacks", "vllm", "--out", out, umask=0o077)
    assert r.returncode == 0, r.stderr
    assert {stat.S_IMODE(p.stat().st_mode) & 0o077 for p in [out, *out.rglob("*")]} == {0}


def test_atomic_writes_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        f = atomic_write_text(tmp_path / "a.json", "{}")
        with atomic_output_dir(tmp_path / "d") as work:
            (work / "x").write_text("1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o750


def test_writing_a_bundle_file_in_place_leaves_the_source_alone(bundle, tiny):
    """The bug: drafter/model.safetensors was a hard link to the source drafter."""
    src, dst = tiny / "llama-drafter" / "model.safetensors", bundle / "drafter" / "model.safetensors"
    before = sha(src)
    assert not os.path.samefile(src, dst)
    copy = bundle.parent / "keep"
    shutil.copytree(bundle, copy)
    with open(copy / "drafter" / "model.safetensors", "r+b") as f:   # in place: same inode
        f.seek(100)
        f.write(b"\xff" * 16)
    assert sha(src) == before
    problems = verify(copy)
    assert problems and problems[0].startswith("drafter/model.safetensors: sha256")
    # and the other way: a source changed after the build leaves the bundle as verified
    tsrc = tiny / "llama" / "model.safetensors"
    data = tsrc.read_bytes()
    try:
        with open(tsrc, "r+b") as f:
            f.seek(64)
            f.write(b"\x00" * 8)
        assert verify(bundle) == []
    finally:
        tsrc.write_bytes(data)


def test_clone_file_copies_content_mode_and_mtime(tmp_path):
    src = tmp_path / "s.bin"
    src.write_bytes(os.urandom(3 << 20))
    src.chmod(0o600)
    how = clone_file(src, tmp_path / "d.bin")
    assert how in ("reflink", "copy_file_range", "copy")
    d = tmp_path / "d.bin"
    assert d.read_bytes() == src.read_bytes() and d.stat().st_ino != src.stat().st_ino
    assert d.stat().st_mtime_ns == src.stat().st_mtime_ns
    assert stat.S_IMODE(d.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_deploy_and_plan_refuse_a_bundle_verify_refuses(bundle, tmp_path):
    tampered = tmp_path / "t"
    shutil.copytree(bundle, tampered)
    y = tampered / "configs" / "trtllm-serve.yaml"
    y.write_text(y.read_text().replace("max_batch_size:", "max_batch_size: 4096 #"))
    for argv in (("deploy", "--bundle", str(tampered), "--out", str(tmp_path / "dep")),
                 ("plan", "--bundle", str(tampered))):
        code, out, err = run_cli(*argv)
        assert code == 1 and "configs/trtllm-serve.yaml" in err and "does not match its manifest.json" in err, err
    assert not (tmp_path / "dep").exists()


def test_build_refuses_a_layout_deploy_refuses(tmp_path):
    """--tp 3 on the embedded pair (9 heads, 3 KV heads): the build used to exit 0 and deploy refuse it."""
    out = tmp_path / "tp3"
    code, _, err = run_cli("build", "--arch", "blackwell", "--tp", "3", "--out", str(out))
    assert code == 1, err
    assert "deploy would refuse this bundle: tp 3" in err and "powers of two" in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_deploy_keeps_edits_to_its_folder_unless_forced(bundle, tmp_path):
    out = tmp_path / "dep"
    assert run_cli("deploy", "--bundle", str(bundle), "--out", str(out))[0] == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()
    assert run_cli("deploy", "--bundle", str(bundle), "--out", str(out))[0] == 0   # unedited: replaced
    (out / "values.yaml").write_text((out / "values.yaml").read_text() + "# my edit\n")
    code, _, err = run_cli("deploy", "--bundle", str(bundle), "--out", str(out))
    assert code == 1 and "values.yaml: edited since deploy wrote it" in err and "--force" in err
    assert (out / "values.yaml").read_text().endswith("# my edit\n")
    assert run_cli("deploy", "--bundle", str(bundle), "--out", str(out), "--force")[0] == 0
    assert not (out / "values.yaml").read_text().endswith("# my edit\n")


# ------------------------------------------------------------------------------ build --configs-only
def test_configs_only_from_folders_then_filled_in(tiny, tmp_path):
    """Folders holding config.json (and the tokenizer) but no weights: every config, the Triton
    repository, the manifest (weights absent); the same build with the weights fills the bundle in."""
    t, d = tmp_path / "t", tmp_path / "d"
    for src, dst in ((tiny / "llama", t), (tiny / "llama-drafter", d)):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    out = tmp_path / "b"
    code, o, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--configs-only",
                           "--out", str(out), "--json")
    assert code == 0, err
    res = json.loads(o)
    assert res["weights"]["present"] is False
    m = Manifest.read(out)
    assert m.stages["check"].status == m.stages["quantize"].status == "deferred"
    assert not list(out.rglob("*.safetensors"))
    assert (out / "configs" / "trtllm-serve.yaml").is_file() and (out / "configs" / "vllm.json").is_file()
    assert (out / "triton" / "tensorrt_llm" / "config.pbtxt").is_file()
    code, o, _ = run_cli("verify", "--bundle", str(out))
    assert code == 0 and "configs only: target/ and drafter/ hold no weights" in o
    code, o, err = run_cli("deploy", "--bundle", str(out), "--out", str(tmp_path / "dep"), "--render")
    assert code == 0, err
    assert "configs only" in o and (tmp_path / "dep" / "manifests" / "workload.yaml").is_file()
    assert run_cli("plan", "--bundle", str(out))[0] == 0
    # the weights arrive: the same build (with them) into the same --out fills it in
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                           "--arch", "hopper", "--out", str(out))
    assert code == 0, err
    m = Manifest.read(out)
    assert m.weights is None and m.stages["quantize"].status == "done"
    assert (out / "target" / "model.safetensors").is_file() and verify(out) == []


def test_configs_only_preset_with_the_hub_off(tmp_path):
    """gpt-oss-120b with no checkpoint and HF_HUB_OFFLINE: the bundle names both pinned downloads."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf"), "DFLASH_TRT_HOME": str(tmp_path / "home")}
    out = tmp_path / "g"
    r = cli("build", "--target", "gpt-oss-120b", "--arch", "blackwell", "--configs-only", "--out", out, env=env)
    assert r.returncode == 0, r.stderr
    m = Manifest.read(out)
    p = PRESETS["gpt-oss-120b"]
    dl = {d["role"]: d for d in m.weights.downloads}
    assert dl["target"]["hf_id"] == p.hf_id and dl["target"]["revision"] == p.revision
    assert dl["drafter"]["hf_id"] == "z-lab/gpt-oss-120b-DFlash" and dl["drafter"]["revision"] == p.drafter_revision
    assert f"hf download z-lab/gpt-oss-120b-DFlash --revision {p.drafter_revision}" in r.stdout
    assert m.target.revision == p.revision and m.drafter.revision == p.drafter_revision
    assert m.draft_schedule.schedule is not None   # planned from the preset drafter's published tau
    r = cli("deploy", "--bundle", out, "--render", "--out", tmp_path / "dep", env=env)
    assert r.returncode == 0, r.stderr
    work = next(d for d in yaml.safe_load_all((tmp_path / "dep" / "manifests" / "workload.yaml").read_text()) if d)
    res = work["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_missing_checkpoints_name_both_downloads(tmp_path, env):
    env = {**env, "HF_HUB_CACHE": str(tmp_path / "hf"), "DFLASH_TRT_HOME": str(tmp_path / "home")}
    r = cli("build", "--target", "gpt-oss-120b", "--arch", "blackwell", "--out", tmp_path / "x", env=env)
    line = r.stderr.strip()
    assert r.returncode == 1 and "\n" not in line, r.stderr
    p = PRESETS["gpt-oss-120b"]
    assert f"`hf download openai/gpt-oss-120b --revision {p.revision}" in line
    assert f"`hf download z-lab/gpt-oss-120b-DFlash --revision {p.drafter_revision}" in line
    assert "--configs-only" in line
    assert not any(w in line for w in ("Dry run", "snapshot_download", "LocalEntryNotFound", "httpx", "Traceback"))


def _cache_config(cache: Path, hf_id: str, src: Path) -> None:
    """config.json alone in the Hugging Face cache layout (what `hf download ID config.json` leaves)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{hf_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    shutil.copyfile(src / "config.json", repo / "snapshots" / commit / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_configs_only_from_hub_ids(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    code, _, err = run_cli("build", "--target", "someorg/model", "--drafter", "other/drafter", "--arch", "hopper",
                           "--configs-only", "--out", str(tmp_path / "b"))
    assert code == 1 and "`hf download someorg/model config.json` and `hf download other/drafter config.json`" in err
    _cache_config(tmp_path / "hf", "someorg/model", tiny / "llama")
    _cache_config(tmp_path / "hf", "other/drafter", tiny / "llama-drafter")
    code, out, err = run_cli("build", "--target", "someorg/model", "--drafter", "other/drafter", "--arch", "hopper",
                             "--configs-only", "--out", str(tmp_path / "b"), "--json")
    assert code == 0, err
    dl = {d["role"]: d for d in json.loads(out)["weights"]["downloads"]}
    assert dl["target"]["command"].startswith("hf download someorg/model --include '*.safetensors'")
    assert dl["drafter"]["hf_id"] == "other/drafter" and verify(tmp_path / "b") == []
