"""`doctor`: on this CPU machine every CUDA check says it was not run and why, the checks that can run
here do (the plugin's AOT compile, DFlash == AR on the CPU), and the bundle-GPU rule refuses a node
whose GPU is not the bundle's (run on node facts as nvidia-smi and torch report them)."""
from __future__ import annotations

import json

import pytest

from dflash_trt.bench.doctor import CHECKS, FAIL, NOT_RUN, OK, Node, check_bundle_gpu
from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest

from helpers import run_cli

CUDA_CHECKS = ("plugin-load", "kv-inject-cuda", "runtime-cuda")


@pytest.fixture(scope="module")
def hopper_bundle(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("doc")
    make_tiny("llama", root / "t", root / "d", seed=5)
    code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", "hopper",
                           "--gpu", "h200", "--out", str(root / "b"))
    assert code == 0, err
    return root / "b"


@pytest.fixture(scope="module")
def report(hopper_bundle):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: this file pins what doctor says where there is none")
    code, out, err = run_cli("doctor", "--bundle", str(hopper_bundle), "--json")
    assert code == 0, err
    return json.loads(out)


def test_every_check_reports_and_the_cuda_ones_say_why_not(report):
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [name for name, _ in CHECKS]
    assert checks["driver"]["status"] == NOT_RUN and "no NVIDIA GPU" in checks["driver"]["detail"]
    assert checks["bundle-gpu"]["status"] == NOT_RUN and "h200 (sm 90)" in checks["bundle-gpu"]["detail"]
    for name in CUDA_CHECKS:
        assert checks[name]["status"] == NOT_RUN and "no usable CUDA GPU" in checks[name]["detail"], name
    assert checks["runtime-cpu"]["status"] == OK and "DFlash == AR" in checks["runtime-cpu"]["detail"]
    # the kernel compiles for the bundle's SM without a GPU (triton ships ptxas), or says why it did not
    assert checks["plugin-compile"]["status"] in (OK, NOT_RUN)
    if checks["plugin-compile"]["status"] == OK:
        assert "sm_90 (hopper" in checks["plugin-compile"]["detail"]
    assert report["ok"] is True and report["counts"][FAIL] == 0


def test_require_gpu_turns_not_run_into_a_failure(hopper_bundle):
    code, _, err = run_cli("doctor", "--require-gpu")
    assert code == 1 and "driver" in err and "could not run" in err


@pytest.mark.parametrize("gpu,sm,ok", [("NVIDIA H200", 90, True), ("NVIDIA H100 80GB HBM3", 90, False),
                                       ("NVIDIA B200", 100, False)])
def test_bundle_gpu_rule(hopper_bundle, gpu, sm, ok):
    node = Node(gpu_name=gpu, sm=sm, bundle=hopper_bundle, manifest=Manifest.read(hopper_bundle))
    if ok:
        assert "the bundle's h200 (sm 90)" in check_bundle_gpu(node)
    else:
        with pytest.raises(DFlashError, match="not the bundle's h200"):
            check_bundle_gpu(node)


# ------------------------------------------------------------------ the chart's opt-in init step
def test_chart_doctor_init_step_is_opt_in_and_runs_on_the_servers_gpus():
    pytest.importorskip("helm_python")   # as tests/test_helm.py
    pytest.importorskip("kubernetes_validate")
    from test_helm import SCENARIOS, helm, pod_specs, render

    from helpers import objects, validate_all

    values = SCENARIOS["h200-fp8"]
    off = objects(render(values))
    for spec in (s for o in off for s in pod_specs(o)):
        assert "doctor" not in [c["name"] for c in spec.get("initContainers", [])]
    image = {"repository": "registry.example.com/dflash-trt-doctor", "tag": "0.1.0"}
    objs = objects(render({**values, "doctor": {"enabled": True, "image": image}}))
    validate_all(objs)
    [spec] = [s for o in objs for s in pod_specs(o)]
    init = {c["name"]: c for c in spec["initContainers"]}
    assert list(init) == ["bundle", "doctor"]   # the bundle is copied in first, then checked
    doctor, server = init["doctor"], spec["containers"][0]
    assert doctor["command"] == ["dflash-trt", "doctor", "--bundle", "/bundle", "--require-gpu"]
    assert doctor["image"] == "registry.example.com/dflash-trt-doctor:0.1.0"
    assert doctor["resources"] == server["resources"] and doctor["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {m["mountPath"] for m in server["volumeMounts"]} <= {m["mountPath"] for m in doctor["volumeMounts"]}
    with pytest.raises(helm.HelmRenderError) as e:
        render({**values, "doctor": {"enabled": True}})
    assert "doctor.enabled needs doctor.image.repository" in str(e.value)
