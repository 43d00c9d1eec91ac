"""The bundle onto the cluster, and back (docs/rollout.md): one claim folder per bundle version
(bundle.pvc.subPath = bundles/<bundle>-<manifest digest>), filled by `dflash-trt push` or by the
chart's loader Job, whose script is run here as Helm renders it; two versions rendered with Helm's
engine and their difference."""
from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_trt.deploy.rollout import version_sub_path
from dflash_trt.io.manifest import Manifest, verify

from helpers import run_cli, validate_all

LOADER = "registry.example.com/bundles/llama"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of one bundle (the drafter served at block size 8, then 4: new configs), each
    deployed with the loader Job and rendered."""
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("rollout")
    make_tiny("llama", root / "t", root / "d", seed=3)
    out = {}
    for rev, extra in (("v1", []), ("v2", ["--block-size", "4"])):
        b = root / rev / "llama-h200"
        code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", "hopper",
                               "--gpu", "h200", *extra, "--out", str(b))
        assert code == 0, err
        dep = root / f"{rev}-deploy"
        digest = hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()[:12]
        code, o, err = run_cli("deploy", "--bundle", str(b), "--out", str(dep), "--render", "--pvc", "models",
                               "--loader-image", f"{LOADER}:{digest}")
        assert code == 0, err
        out[rev] = (b, dep, o)
    return out


def objs(dep: Path, name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((dep / "manifests" / name).read_text()) if d]


def test_each_version_mounts_its_own_claim_folder(versions):
    subs = []
    for rev, (b, dep, out) in versions.items():
        sub = version_sub_path(b)
        digest = hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()
        assert sub == f"bundles/llama-h200-{digest[:12]}"
        values = yaml.safe_load((dep / "values.yaml").read_text())
        assert values["bundle"]["pvc"]["subPath"] == sub and values["bundle"]["pvc"]["existingClaim"] == "models"
        pod = objs(dep, "workload.yaml")[0]["spec"]["template"]["spec"]
        mounts = [m for c in pod["containers"] + pod["initContainers"] for m in c["volumeMounts"]
                  if m["name"] == "bundle"]
        assert mounts and {m["subPath"] for m in mounts} == {sub} and all(m["readOnly"] for m in mounts)
        job = next(o for o in objs(dep, "loader-job.yaml") if o["kind"] == "Job")
        assert job["metadata"]["name"] == f"dflash-trt-load-{digest[:8]}"
        assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
        # the loader pod is not one the Service routes to
        svc = next(o for o in objs(dep, "service.yaml") if o["spec"].get("type") != "None")
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        assert f"bundles/llama-h200-{digest[:12]}" in out
        subs.append(sub)
    assert subs[0] != subs[1]


def test_the_rendered_objects_pass_the_kubernetes_schemas(versions):
    pytest.importorskip("kubernetes_validate")
    pytest.importorskip("jsonschema")
    _, dep, _ = versions["v2"]
    objs_all = [o for f in sorted((dep / "manifests").iterdir()) for o in objs(dep, f.name)]
    kinds = validate_all(objs_all)
    assert "Job" in kinds and "ConfigMap" in kinds and "Deployment" in kinds


def test_the_two_revisions_differ_only_in_the_bundle_version(versions):
    """`helm upgrade` from v1 to v2 changes which folder the pods mount and which loader Job runs;
    `helm rollback` renders v1 again, whose folder is still on the claim."""
    (b1, d1, _), (b2, d2, _) = versions["v1"], versions["v2"]
    s1, s2 = version_sub_path(b1), version_sub_path(b2)
    w1, w2 = (d / "manifests" / "workload.yaml" for d in (d1, d2))
    lines = difflib.unified_diff(w1.read_text().splitlines(), w2.read_text().splitlines(), lineterm="", n=0)
    diff = [line for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert diff, "the two revisions render the same Deployment"
    for line in diff:   # every changed line names the bundle version (subPath, the wait message)
        assert s1 in line or s2 in line, line
    for name in ("service.yaml", "pdb.yaml", "scripts.yaml"):
        assert (d1 / "manifests" / name).read_text() == (d2 / "manifests" / name).read_text(), name


def _loader_script(dep: Path, pvc: Path, loader: Path, src: Path) -> Path:
    """The loader's ConfigMap as rendered, with the pod's mount points (/pvc, /loader, the image's
    /bundle) moved to folders here."""
    cm = next(o for o in objs(dep, "loader-job.yaml") if o["kind"] == "ConfigMap")
    loader.mkdir(exist_ok=True)
    (loader / "SHA256SUMS").write_text(cm["data"]["SHA256SUMS"])
    script = cm["data"]["load.sh"].replace("'/pvc/", f"'{pvc}/").replace("/loader/", f"{loader}/")
    script = script.replace("src='/bundle'", f"src='{src}'")
    (loader / "load.sh").write_text(script)
    return loader / "load.sh"


def test_the_loader_job_copies_checks_and_writes_the_manifest_last(versions, tmp_path):
    b, dep, _ = versions["v1"]
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    script = _loader_script(dep, pvc, tmp_path / "loader", b)
    r = subprocess.run(["/bin/sh", str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    dst = pvc / version_sub_path(b)
    assert verify(dst) == [] and Manifest.read(dst).to_dict() == Manifest.read(b).to_dict()
    r = subprocess.run(["/bin/sh", str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "already holds this bundle" in r.stdout
    # a source that does not match the manifest: the copy is refused and no manifest.json appears
    bad = tmp_path / "bad"
    shutil.copytree(b, bad)
    y = bad / "configs" / "trtllm-serve.yaml"
    y.write_text(y.read_text() + "# edited\n")
    pvc2 = tmp_path / "pvc2"
    pvc2.mkdir()
    script = _loader_script(dep, pvc2, tmp_path / "loader2", bad)
    r = subprocess.run(["/bin/sh", str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "trtllm-serve.yaml" in r.stdout + r.stderr
    assert not (pvc2 / version_sub_path(b) / "manifest.json").exists()


def test_push_copies_a_verified_bundle_under_its_version(versions, tmp_path):
    b, _, _ = versions["v1"]
    claim = tmp_path / "claim"
    claim.mkdir()
    code, out, err = run_cli("push", "--bundle", str(b), "--to", str(claim), "--json")
    assert code == 0, err
    res = json.loads(out)
    dest = Path(res["to"])
    assert res["copied"] and dest == claim / version_sub_path(b) and verify(dest) == []
    code, out, _ = run_cli("push", "--bundle", str(b), "--to", str(claim))
    assert code == 0 and out.startswith("already there")
    assert [p.name for p in (claim / "bundles").iterdir()] == [dest.name]   # no temp folder left
    tampered = tmp_path / "t"
    shutil.copytree(b, tampered)
    (tampered / "drafter" / "config.json").write_text("{}")
    code, _, err = run_cli("push", "--bundle", str(tampered), "--to", str(claim))
    assert code == 1 and "drafter/config.json" in err
