"""A wheel install works, not only an editable checkout: everything the code loads at run time
(the Helm chart, the C sources, the Triton kernel, preset configs, Triton templates, the embedded
drafter) ships inside the wheel and is found there, with the source checkout out of reach."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run from the installed copy: each line loads one kind of package data the way the tool does.
_SMOKE = r"""
import sys
from pathlib import Path
import dflash_trt
site = Path(sys.argv[1]).resolve()
assert Path(dflash_trt.__file__).resolve().is_relative_to(site), dflash_trt.__file__
from dflash_trt.deploy.values import default_chart_dir
assert (default_chart_dir() / "Chart.yaml").is_file() and (default_chart_dir() / "templates").is_dir()
assert default_chart_dir().resolve().is_relative_to(site), default_chart_dir()   # the wheel's copy of deploy/
from dflash_trt.paths import deploy_path
assert deploy_path("multinode.Dockerfile").is_file() and deploy_path("triton-trtllm.Dockerfile").is_file()
from dflash_trt import engines
assert engines.dflash_problem("trtllm-serve", engines.facts()["servers"]["trtllm-serve"]["engine_version"]) is None
from dflash_trt.io.formats import c_kernels
assert c_kernels() is not None, "formats.c did not build from the installed csrc/"
from dflash_trt.kernels import kv_inject_triton, kv_inject_trt
from dflash_trt.presets.catalog import PRESETS
assert all(p.config()["model_type"] for p in PRESETS.values())
from dflash_trt.presets.embedded import embedded_drafter_path
assert (embedded_drafter_path() / "model.safetensors").is_file()
from dflash_trt.paths import package_path
assert all(package_path("assets", "triton_templates", m, "config.pbtxt").is_file()
           for m in ("tensorrt_llm", "dflash_reference", "vllm"))
from dflash_trt.bundle.stages import PIPELINE, code_hash
for stage in PIPELINE:
    code_hash(*stage.code)
from dflash_trt.hardware import catalog
assert catalog()
print("ok")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so that the build leaves no build/ or egg-info in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "engines", ".bench", "build", "dist",
                                                             "*.egg-info", "__pycache__", ".pytest_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(tmp / "dist")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return next((tmp / "dist").glob("dflash_trt-*.whl"))


def test_wheel_carries_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "dflash_trt"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    missing = [f for f in tracked.stdout.split() if f not in names]
    assert not missing, f"files of the package missing from the wheel: {missing[:10]}"
    # the top-level deploy/ (the Helm chart, the Dockerfiles) ships as dflash_trt/_deploy (setup.py)
    deploy = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert "deploy/helm/dflash-trt/Chart.yaml" in deploy
    missing = [f for f in deploy if "dflash_trt/_" + f not in names]
    assert not missing, f"deploy/ files missing from the wheel: {missing[:10]}"


def test_installed_wheel_finds_its_data(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PYTHONPATH=str(site), DFLASH_TRT_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-c", _SMOKE, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
