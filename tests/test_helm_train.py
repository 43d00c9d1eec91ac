"""The training chart (dflash-trt-train), rendered and linted by Helm's own engine (helm-python-sdk),
every object checked against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), and the
values that cannot run refused with one message (template `fail`s, values.schema.json)."""
from __future__ import annotations

import json
import shlex

import pytest

from helpers import K8S_VERSION, objects, validate_all

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

from dflash_trt.paths import deploy_path

CHART = deploy_path("helm", "dflash-trt-train")
TWO_H200 = {"nodes": 2, "gpu": {"count": 8, "product": "NVIDIA-H200"},
            "train": {"extraArgs": ["--steps", "20000", "--layers", "2"]}, "nccl": {"socketIfname": "eth0"}}


def render(values: dict | None) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        return objects(chart.render(values, name="rel", namespace="train", is_install=True))


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def test_lint_strict_passes():
    for values in (None, TWO_H200):
        report = helm.lint(str(CHART), values, strict=True, namespace="train")
        assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report


def test_two_node_job_renders_valid_objects():
    objs = render(TWO_H200)
    assert {"Job", "Service", "PersistentVolumeClaim"} <= set(validate_all(objs))
    (job,), (svc,), (pvc,) = by_kind(objs, "Job"), by_kind(objs, "Service"), by_kind(objs, "PersistentVolumeClaim")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    # the headless Service names the pods <job>-<index>.<service>: the rendezvous endpoint is pod 0
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert all(svc["spec"]["selector"][k] == v for k, v in spec["template"]["metadata"]["labels"].items()
               if k in svc["spec"]["selector"])
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    argv = shlex.split(c["args"][0].replace('$([ "$JOB_COMPLETION_INDEX" = 0 ] && echo 1 || echo 0)', "X"))
    assert argv[:2] == ["exec", "torchrun"]
    opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert opt["--nnodes"] == "2" and opt["--nproc-per-node"] == "8" and opt["--rdzv-backend"] == "c10d"
    assert opt["--rdzv-endpoint"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}:29400"
    assert "train-drafter" in argv and "--auto-resume" in argv          # a restarted pod resumes
    assert argv[-4:] == ["--steps", "20000", "--layers", "2"]
    # one shared volume, ReadWriteMany, holds target, data, features and the run folder
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "data"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "data"]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for flag in ("--target", "--data", "--out", "--feature-cache"):
        assert opt[flag].startswith(mount["mountPath"] + "/")
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in c["env"]


def test_cpu_ranks_request_no_gpu():
    objs = render({"nodes": 1, "gpu": {"count": 0}, "cpuRanksPerPod": 2, "storage": {"accessModes": ["ReadWriteOnce"]}})
    validate_all(objs)
    (c,) = by_kind(objs, "Job")[0]["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in (c["resources"].get("limits") or {})
    assert "--nproc-per-node 2" in c["args"][0]


def test_validator_rejects_a_broken_job():
    import copy

    job = copy.deepcopy(by_kind(render(None), "Job")[0])
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)


REFUSED = {
    "rwo on two nodes": ({"storage": {"accessModes": ["ReadWriteOnce"]}}, "use ReadWriteMany"),
    "no ranks": ({"gpu": {"count": 0}, "cpuRanksPerPod": 0}, "a pod would start no rank"),
    "out outside the volume": ({"train": {"out": "/tmp/run"}}, 'train.out "/tmp/run" lies outside storage.mountPath'),
    "data and prompts": ({"train": {"prompts": "/data/p.jsonl"}}, "train.data and train.prompts are both set"),
    "restarts past backoff": ({"rendezvous": {"maxRestarts": 9}, "backoffLimit": 2}, "exceeds backoffLimit 2"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_template_refuses_what_cannot_run(case):
    values, message = REFUSED[case]
    with pytest.raises(helm.HelmRenderError) as e:
        render(values)
    assert message in str(e.value)


@pytest.mark.parametrize("values,where", [({"nodes": 0}, "/nodes"), ({"gpu": {"count": 17}}, "/gpu/count"),
                                          ({"image": {"digest": "latest"}}, "/image/digest"),
                                          ({"trian": {}}, "trian")])
def test_schema_refuses(values, where):
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert where in str(e.value)


def test_deploy_train_cli_writes_the_rendering_and_refuses_in_one_line(tmp_path):
    import yaml

    from helpers import run_cli

    code, out, err = run_cli("deploy-train", "--out", str(tmp_path / "d"), "--nodes", "3", "--gpus-per-node", "4",
                             "--image", "registry.example.com/t:1", "--train-arg=--steps", "--train-arg=500", "--json")
    assert code == 0, err
    assert json.loads(out)["manifests"] == ["job.yaml", "pvc.yaml", "service.yaml"]
    job = yaml.safe_load((tmp_path / "d" / "manifests" / "job.yaml").read_text())
    assert job["spec"]["completions"] == 3 and "--steps" in job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert yaml.safe_load((tmp_path / "d" / "values.yaml").read_text())["nodes"] == 3
    code, _, err = run_cli("deploy-train", "--out", str(tmp_path / "bad"), "--run-dir", "/tmp/run")
    assert code == 1 and not (tmp_path / "bad").exists()
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert 'train.out "/tmp/run" lies outside storage.mountPath' in line
