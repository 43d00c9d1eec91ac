"""The Helm chart, rendered and linted by Helm v4's own engine (helm-python-sdk, offline), every
built-in Kubernetes object checked against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail) and LeaderWorkerSet objects against the CRD's openAPIV3Schema kept
in tests/data (kubernetes-sigs/lws). No cluster is involved."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from helpers import K8S_VERSION, LWS_CRD, lws_schema, objects, validate_all

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from dflash_trt.deploy.values import default_chart_dir  # noqa: E402
from dflash_trt.hardware import all_gpu_product_labels  # noqa: E402

CHART = default_chart_dir()

# The four deployments the chart must get right (issue 7).
SCENARIOS = {
    # The embedded pair on one CPU-only node: the reference-runtime model, no GPU request.
    "embedded-cpu": {
        "gpu": {"count": 0, "product": ""},
        "parallel": {"tp": 1, "pp": 1, "ep": 1},
        "bundle": {"models": ["dflash_reference"]},
        "shmSize": "1Gi",
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
    },
    # gpt-oss-120b on one DGX B300: 8 GPUs, TP 8, deferred compile, every optional object on.
    "gpt-oss-120b-b300": {
        "gpu": {"count": 8, "product": "NVIDIA-B300-SXM6-AC"},
        "parallel": {"tp": 8, "pp": 1, "ep": 1},
        "bundle": {"models": ["tensorrt_llm"], "pvc": {"existingClaim": "gpt-oss-120b-bundle", "create": False}},
        "compile": {"enabled": True},
        "autoscaling": {"enabled": True, "maxReplicas": 3},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "networkPolicy": {"enabled": True,
                          "ingressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}],
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
    },
    # Two DGX B300 nodes per model instance (TP 16): a LeaderWorkerSet, MPI from the leader.
    "two-node-lws": {
        "gpu": {"count": 8, "product": "NVIDIA-B300-SXM6-AC"},
        "parallel": {"tp": 16, "pp": 1, "ep": 1},
        "replicas": 2,
        "bundle": {"models": ["tensorrt_llm"], "pvc": {"accessModes": ["ReadWriteMany"], "size": "300Gi"}},
        "multiNode": {"sshSecret": "dflash-trt-ssh"},
        "compile": {"enabled": True},
        "autoscaling": {"enabled": True},
        "networkPolicy": {"enabled": True},
    },
    # H200 (Hopper, FP8 bundle): 4 GPUs, TP 4, StatefulSet, bundle delivered as an image.
    "h200-fp8": {
        "workload": {"kind": "StatefulSet"},
        "gpu": {"count": 4, "product": "NVIDIA-H200"},
        "parallel": {"tp": 4, "pp": 1, "ep": 1},
        "bundle": {"delivery": "image", "models": ["tensorrt_llm"],
                   "image": {"repository": "registry.example.com/bundles/qwen3-8b-h200-fp8", "tag": "1"}},
        "shmSize": "8Gi",
    },
}


def render(values: dict | None, name: str = "rel") -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=name, namespace="serving", is_install=True)


def pod_specs(obj: dict) -> list[dict]:
    if obj["kind"] == "LeaderWorkerSet":
        t = obj["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]["spec"]]
    return []


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_crd_copy_is_the_lws_v1_crd():
    crd = yaml.safe_load(LWS_CRD.read_text())
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["group"] == "leaderworkerset.x-k8s.io"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_strict_passes(scenario):
    report = helm.lint(str(CHART), SCENARIOS[scenario], strict=True, namespace="serving")
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], (bad, report["errors"])


def test_lint_strict_default_values():
    report = helm.lint(str(CHART), None, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"]


def test_lint_reports_a_broken_value():
    # The oracle can fail: strict lint of a bad value is an error (severity 3).
    report = helm.lint(str(CHART), {"replicas": -3}, strict=True)
    assert any(m["severity"] == 3 and "/replicas" in m["error"] for m in report["messages"])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_template_renders_valid_kubernetes_objects(scenario):
    objs = objects(render(SCENARIOS[scenario]))
    kinds = validate_all(objs)
    assert {"Service", "ConfigMap", "PodDisruptionBudget"} <= set(kinds)


def test_validator_rejects_a_broken_object():
    # The oracle can fail: a typo'd field in a rendered Deployment is caught (strict schema).
    objs = objects(render(SCENARIOS["gpt-oss-120b-b300"]))
    dep = copy.deepcopy(by_kind(objs, "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)
    lws = copy.deepcopy(by_kind(objects(render(SCENARIOS["two-node-lws"])), "LeaderWorkerSet")[0])
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, lws_schema())


def test_embedded_cpu_pod_requests_no_gpu():
    objs = objects(render(SCENARIOS["embedded-cpu"]))
    (dep,) = by_kind(objs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    text = json.dumps(spec)
    assert "nvidia.com/gpu" not in text          # no request, no toleration, no product affinity
    assert "affinity" not in spec
    (c,) = spec["containers"]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    cm = by_kind(objs, "ConfigMap")[0]["data"]["serve.sh"]
    assert "'--model-control-mode=explicit' '--load-model=dflash_reference'" in cm
    assert not by_kind(objs, "LeaderWorkerSet")


def test_b300_single_node_pod():
    objs = objects(render(SCENARIOS["gpt-oss-120b-b300"]))
    (dep,) = by_kind(objs, "Deployment")
    assert "replicas" not in dep["spec"]                      # the HPA owns the count
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    res = c["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 8
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "In",
                                         "values": ["NVIDIA-B300-SXM6-AC"]}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
    assert {p["containerPort"] for p in c["ports"]} == {8000, 8001, 8002}
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # non-root, no privilege escalation, all capabilities dropped
    assert spec["securityContext"]["runAsNonRoot"] is True
    for cont in spec["containers"] + spec["initContainers"]:
        sc = cont["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    # deferred compile: an init container on the GPUs, engines keyed by GPU product + TensorRT
    (init,) = spec["initContainers"]
    assert init["name"] == "compile" and init["resources"]["limits"]["nvidia.com/gpu"] == 8
    script = by_kind(objs, "ConfigMap")[0]["data"]["compile.sh"]
    assert "engine_key(detect_toolchain())" in script and 'dflash-trt compile --bundle "$BUNDLE_DIR"' in script
    assert "compile skipped" in script
    claim = next(v for v in spec["volumes"] if v["name"] == "bundle")["persistentVolumeClaim"]["claimName"]
    assert claim == "gpt-oss-120b-bundle" and not by_kind(objs, "PersistentVolumeClaim")
    (svc,) = by_kind(objs, "Service")
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("http", 8000), ("grpc", 8001), ("metrics", 8002)}
    (hpa,) = by_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rel-dflash-trt"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "triton_queue_compute_ratio"
    assert by_kind(objs, "ServiceMonitor") and by_kind(objs, "NetworkPolicy")


def test_two_node_leaderworkerset():
    objs = objects(render(SCENARIOS["two-node-lws"]))
    assert not by_kind(objs, "Deployment")
    (lws,) = by_kind(objs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2                                 # tp 16 / 8 GPUs per node
    leader, worker = tpl["leaderTemplate"]["spec"], tpl["workerTemplate"]["spec"]
    assert leader["containers"][0]["command"][-1].endswith("leader.sh")
    assert worker["containers"][0]["command"][-1].endswith("worker.sh")
    assert [c["name"] for c in leader["initContainers"]] == ["compile"] and "initContainers" not in worker
    for spec in (leader, worker):
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    leader_sh = by_kind(objs, "ConfigMap")[0]["data"]["leader.sh"]
    assert "mpirun -np 16" in leader_sh and "trtllm-llmapi-launch tritonserver" in leader_sh
    # The Service reaches leaders only; the HPA scales the LeaderWorkerSet.
    (svc,) = by_kind(objs, "Service")
    assert svc["spec"]["selector"]["dflash-trt/role"] == "server"
    assert tpl["leaderTemplate"]["metadata"]["labels"]["dflash-trt/role"] == "server"
    assert tpl["workerTemplate"]["metadata"]["labels"]["dflash-trt/role"] == "worker"
    (hpa,) = by_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    (pvc,) = by_kind(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_h200_statefulset_with_image_delivery():
    objs = objects(render(SCENARIOS["h200-fp8"]))
    (sts,) = by_kind(objs, "StatefulSet")
    assert sts["spec"]["serviceName"] == "rel-dflash-trt-headless"
    assert any(s["spec"].get("clusterIP") == "None" for s in by_kind(objs, "Service"))
    spec = sts["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["bundle"]
    assert next(v for v in spec["volumes"] if v["name"] == "bundle")["emptyDir"]["sizeLimit"] == "200Gi"
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["NVIDIA-H200"]
    assert not by_kind(objs, "PersistentVolumeClaim")


# -- values.schema.json: Helm's own validation rejects each bad value ----------------------------

BAD_VALUES = {
    "wrong type": ({"replicas": "two"}, "/replicas", "got string, want integer"),
    "unknown GPU product": ({"gpu": {"product": "NVIDIA-B301"}}, "/gpu/product", "value must be one of"),
    "gpus not dividing tp*pp": ({"gpu": {"count": 8}, "parallel": {"tp": 4, "pp": 1}}, "/parallel", "multipleOf"),
    "negative replicas": ({"replicas": -1}, "/replicas", "minimum: got -1, want 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects(case):
    values, where, what = BAD_VALUES[case]
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as e:
            chart.validate_schema(chart.merge_values(values))
        assert f"at '{where}" in str(e.value) and what in str(e.value)
        # helm template / install refuse them the same way
        with pytest.raises(helm.HelmValuesError):
            chart.render(values, name="rel")


@pytest.mark.parametrize("gpus,tp,pp,ok", [(8, 8, 1, True), (8, 4, 2, True), (8, 2, 2, False), (4, 2, 2, True),
                                           (2, 1, 2, True), (2, 1, 1, False), (8, 16, 1, True), (4, 1, 8, True),
                                           (16, 16, 1, True), (16, 8, 1, False), (16, 4, 4, True)])
def test_schema_divisibility_rule(gpus, tp, pp, ok):
    with helm.Chart.load(str(CHART)) as chart:
        values = chart.merge_values({"gpu": {"count": gpus}, "parallel": {"tp": tp, "pp": pp}})
        if ok:
            chart.validate_schema(values)
        else:
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(values)


def test_schema_gpu_products_are_the_hardware_catalog():
    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["gpu"]["properties"]["product"]["enum"]
    assert sorted(enum) == sorted(all_gpu_product_labels() + [""])


def test_template_checks_fail_with_the_value_to_change():
    with pytest.raises(helm.HelmRenderError, match="multiNode.sshSecret is required"):
        render({"parallel": {"tp": 16}})
    with pytest.raises(helm.HelmRenderError, match="must equal gpu.count"):
        render({"workload": {"kind": "Deployment"}, "parallel": {"tp": 16}})
    with pytest.raises(helm.HelmRenderError, match="compile.enabled needs a GPU node"):
        render({**SCENARIOS["embedded-cpu"], "compile": {"enabled": True}})


def test_every_top_level_value_is_documented():
    """Each top-level key of values.yaml, and each key of the gpu / parallel / bundle blocks, has
    a comment directly above it or is a plain field of a documented block."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if not line or line.startswith((" ", "#", "-")):
            continue
        if not lines[i - 1].startswith("#"):
            # a block whose keys each carry the comment, e.g. "gpu:" then "  # -- ..."
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not nxt.strip().startswith("#"):
                undocumented.append(line)
    assert not undocumented, undocumented
    text = "\n".join(lines)
    for key in ("count", "product", "delivery", "existingClaim", "sshSecret", "metricName"):
        idx = text.index(f"  {key}:")
        assert "#" in text[text.rfind("\n", 0, idx - 1) - 200: idx], key
