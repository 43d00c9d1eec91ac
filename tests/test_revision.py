"""A bundle revision (bundle/package.py write_revision, the one packager; `tune` writes one): it keeps every field
of its parent's manifest, records its parent and exactly the files that differ, and `verify` accepts it and
refuses one tampered by hand.

Oracles: the parent's manifest.json as written (JSON, not our reader), the sha256 of both folders' files read
here with hashlib, and the schedule the re-plan chose."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dflash_trt.bundle.package import RevisionChange, write_revision
from dflash_trt.deploy.revision import tune_change
from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest
from dflash_trt.plan import speed, tune

from helpers import run_cli

# what a tune revision writes anew (written out here, not read from the package): everything else is the parent's
TUNE_REVISES = {"tool_version", "created", "draft_schedule", "serving_configs", "artifacts", "artifact_stats",
                "revision"}


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_pairs):
    t, d = tiny_pairs["llama"]
    out = tmp_path_factory.mktemp("rev") / "parent"
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--gpu", "h200",
                           "--quant", "none", "--out", str(out))
    assert code == 0, err
    return out


def _retune(bundle: Path, tau: float = 2.0) -> tune.Retune:
    """A re-plan from a window of served counts (acceptance falling with the position) and a linear step cost."""
    max_k = Manifest.read(bundle).drafter.block_size - 1
    per_pos = [1000.0 * (tau - 1) / max_k * (max_k - i) / max_k * 2 for i in range(max_k)]
    w = tune.Window(source="test counts", stack="vllm", start=0.0, seconds=60.0, drafts=1000.0,
                    draft_tokens=1000.0 * max_k, accepted=sum(per_pos), accepted_per_pos=per_pos,
                    mean_concurrency=4.0, max_concurrency=6.0)
    cost = speed.ScheduleCost(lambda c, k: 1.0 + 0.01 * c * (k + 1), [1, 2, 4, 8, 16, 32, 64], "linear test cost")
    return tune.replan(None, w, tune.survival_from_window(w, max_k), cost, max_k)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def revision(parent, tmp_path_factory):
    out = tmp_path_factory.mktemp("rev") / "r2"
    r = _retune(parent)
    write_revision(parent, out, tune_change(r))
    return out, r


def test_a_tune_revision_keeps_every_field_of_its_parent(parent, revision):
    out, r = revision
    before = json.loads((parent / "manifest.json").read_text())
    after = json.loads((out / "manifest.json").read_text())
    assert "serving_profile" in before and "reference_runtime" in before and "stages" in before
    assert before.keys() <= after.keys() and after.keys() - before.keys() == {"revision"}
    kept = [k for k in before if k not in TUNE_REVISES]
    assert {k: after[k] for k in kept} == {k: before[k] for k in kept}
    assert after["draft_schedule"]["schedule"]["ranges"] == [list(x) for x in r.after.ranges]


def test_the_revision_records_its_parent_and_what_changed(parent, revision):
    out, r = revision
    rev = json.loads((out / "manifest.json").read_text())["revision"]
    assert rev["kind"] == "tune" and rev["summary"].startswith("draft schedule re-planned from 1000 drafts")
    assert rev["parent"] == {"path": str(parent.resolve()),
                             "manifest_sha256": hashlib.sha256((parent / "manifest.json").read_bytes()).hexdigest()}
    a, b = _hashes(parent), _hashes(out)
    differ = sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p) and p != "manifest.json")
    assert rev["changed"] == differ and differ
    assert all(p.startswith(("configs/", "triton/")) for p in differ)   # the model folders are the parent's
    assert rev["tune"]["drafts"] == 1000.0 and rev["tune"]["acceptance"]["tau"] == pytest.approx(r.acceptance.tau)
    code, vout, verr = run_cli("verify", "--bundle", str(out))
    assert code == 0, verr
    assert f"tune revision of {parent.resolve()}" in vout


def test_a_revision_of_a_revision_records_its_immediate_parent(revision, tmp_path):
    r2, _ = revision
    write_revision(r2, tmp_path / "r3", tune_change(_retune(r2, tau=3.0)))
    m = Manifest.read(tmp_path / "r3")
    assert m.revision.parent.path == str(r2.resolve())
    assert m.serving_profile == Manifest.read(r2).serving_profile
    assert run_cli("verify", "--bundle", str(tmp_path / "r3"))[0] == 0


def _tampered(revision, tmp_path) -> Path:
    copy = tmp_path / "r2"
    shutil.copytree(revision[0], copy)
    return copy


def test_verify_refuses_a_file_edited_by_hand(revision, tmp_path):
    copy = _tampered(revision, tmp_path)
    f = copy / "configs" / "vllm.json"
    text = f.read_text()
    f.write_text(text.replace('"num_speculative_tokens": 7', '"num_speculative_tokens": 5', 1))
    assert f.read_text() != text
    code, _, err = run_cli("verify", "--bundle", str(copy))
    assert code == 1 and "configs/vllm.json: sha256" in err


def test_verify_refuses_an_edit_rehashed_into_the_manifest(revision, tmp_path):
    """A file the revision did not change, edited and its new sha256 written into manifest.json: it differs from
    the parent's, which the revision does not say."""
    copy = _tampered(revision, tmp_path)
    cfg = copy / "drafter" / "config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"edited": 1, ', 1))
    m = json.loads((copy / "manifest.json").read_text())
    entry = next(a for a in m["artifacts"] if a["path"] == "drafter/config.json")
    entry["bytes"], entry["sha256"] = cfg.stat().st_size, hashlib.sha256(cfg.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(m, indent=2))
    code, _, err = run_cli("verify", "--bundle", str(copy))
    assert code == 1 and "drafter/config.json: differs from its parent's" in err


def test_verify_refuses_a_parent_field_changed_in_the_manifest(revision, tmp_path):
    copy = _tampered(revision, tmp_path)
    m = json.loads((copy / "manifest.json").read_text())
    m["serving_profile"]["max_batch_size"] += 1
    (copy / "manifest.json").write_text(json.dumps(m, indent=2))
    code, _, err = run_cli("verify", "--bundle", str(copy))
    assert code == 1 and "field serving_profile differs from its parent's" in err


def test_a_revision_kind_takes_its_own_record(parent, tmp_path):
    with pytest.raises(DFlashError, match="revision kind 'tune' with a dict"):
        write_revision(parent, tmp_path / "x", RevisionChange(kind="tune", summary="s", record={}))
    with pytest.raises(DFlashError, match="lies inside"):
        write_revision(parent, parent, tune_change(_retune(parent)))
    assert not (tmp_path / "x").exists()
