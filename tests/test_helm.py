"""The Helm chart, rendered and linted by Helm v4's own engine (helm-python-sdk, offline), every
built-in Kubernetes object checked against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail) and LeaderWorkerSet objects against the CRD's openAPIV3Schema kept
in tests/data (kubernetes-sigs/lws). No cluster is involved."""
from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from helpers import K8S_VERSION, KEDA_CRD, LWS_CRD, crd_schema, lws_schema, objects, validate_all

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from dflash_trt.deploy.values import default_chart_dir
from dflash_trt.hardware import catalog

CHART = default_chart_dir()

TRITON_IMAGE = {"repository": "registry.example.com/dflash-trt-triton", "digest": "sha256:" + "ab" * 32,
                "engineVersion": "1.4.0rc4"}     # built from deploy/triton-trtllm.Dockerfile
MN_IMAGE = {"repository": "registry.example.com/dflash-trt-triton-mpi", "tag": "1.4.0rc4", "engineVersion": "1.4.0rc4"}

# The deployments the chart must get right (issue 7; servers per stack: issue 25).
SCENARIOS = {
    # The defaults: trtllm-serve on TensorRT-LLM's release image, gpt-oss-120b on one DGX B300.
    "defaults-trtllm-serve": {},
    # Two DGX B300 nodes per instance with the default server: trtllm-serve under MPI.
    "two-node-trtllm-serve": {
        "parallel": {"tp": 16, "pp": 1, "ep": 1},
        "bundle": {"pvc": {"accessModes": ["ReadWriteMany"]}},
        "multiNode": {"sshSecret": "dflash-trt-ssh", "image": {**MN_IMAGE, "repository": "registry.example.com/trtllm-mpi"}},
    },
    "vllm": {"server": {"stack": "vllm"}, "serviceMonitor": {"enabled": True},
             "autoscaling": {"enabled": True, "provider": "keda"}, "bundle": {"pvc": {"accessModes": ["ReadWriteMany"]}},
             "networkPolicy": {"enabled": True}},
    "sglang": {"server": {"stack": "sglang"}, "serviceMonitor": {"enabled": True}},
    # The embedded pair on one CPU-only node: the reference-runtime model, no GPU request.
    "embedded-cpu": {
        "server": {"stack": "triton"},
        "gpu": {"count": 0, "product": ""},
        "parallel": {"tp": 1, "pp": 1, "ep": 1},
        "bundle": {"models": ["dflash_reference"]},
        "shmSize": "1Gi",
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
    },
    # gpt-oss-120b on one DGX B300: 8 GPUs, TP 8, every optional object on, image pinned by digest.
    "gpt-oss-120b-b300": {
        "server": {"stack": "triton"},
        "image": TRITON_IMAGE,
        "gpu": {"count": 8, "product": "NVIDIA-B300-SXM6-AC"},
        "parallel": {"tp": 8, "pp": 1, "ep": 1},
        "bundle": {"models": ["tensorrt_llm"], "pvc": {"existingClaim": "gpt-oss-120b-bundle", "create": False}},
        "autoscaling": {"enabled": True, "maxReplicas": 3},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "networkPolicy": {"enabled": True,
                          "ingressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}],
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
    },
    # Two DGX B300 nodes per model instance (TP 16): a LeaderWorkerSet, MPI from the leader.
    "two-node-lws": {
        "server": {"stack": "triton"},
        "gpu": {"count": 8, "product": "NVIDIA-B300-SXM6-AC"},
        "parallel": {"tp": 16, "pp": 1, "ep": 1},
        "replicas": 2,
        "bundle": {"models": ["tensorrt_llm"], "pvc": {"accessModes": ["ReadWriteMany"], "size": "300Gi"}},
        "multiNode": {"sshSecret": "dflash-trt-ssh", "exclusiveTopology": "nvidia.com/gpu.clique",
                      "image": MN_IMAGE},
        "rdma": {"enabled": True, "resources": {"rdma/rdma_shared_device_a": 1}, "ibHca": "mlx5"},
        "nccl": {"socketIfname": "eth0"},
        "autoscaling": {"enabled": True, "provider": "keda"},
        "networkPolicy": {"enabled": True},
    },
    # H200 (Hopper, FP8 bundle): 4 GPUs, TP 4, StatefulSet, bundle delivered as an image.
    "h200-fp8": {
        "server": {"stack": "triton"},
        "image": {**TRITON_IMAGE, "digest": "", "tag": "26.07-trtllm1.4.0rc4"},
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
    # Triton's liveness and readiness ask the models (files/triton_ready.py: docs/serving-faults.md)
    probe = ["python3", "/opt/dflash-trt/triton_ready.py"]
    assert c["livenessProbe"]["exec"]["command"] == c["readinessProbe"]["exec"]["command"] == probe
    (scripts,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scripts")]
    assert scripts["data"]["triton_ready.py"] == (default_chart_dir() / "files" / "triton_ready.py").read_text()
    assert {"name": "scripts", "mountPath": "/opt/dflash-trt", "readOnly": True} in c["volumeMounts"]
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
    assert {p["containerPort"] for p in c["ports"]} == {8000, 8001, 8002}
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # non-root, no privilege escalation, all capabilities dropped, read-only root filesystem
    assert spec["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in c["env"]}
    for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[var].startswith("/tmp/"), var         # the writable emptyDir
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # nothing compiles at pod start; the image is pinned by its digest
    assert "initContainers" not in spec
    assert not any("compile" in k for k in by_kind(objs, "ConfigMap")[0]["data"])
    assert c["image"] == "registry.example.com/dflash-trt-triton@sha256:" + "ab" * 32
    # shutdown: preStop drain, then Triton's exit timeout, inside the grace period
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "/opt/dflash-trt/drain.sh"]
    data = by_kind(objs, "ConfigMap")[0]["data"]
    assert "'--exit-timeout-secs=45'" in data["serve.sh"] and "dflash_requests_active" in data["drain.sh"]
    assert spec["terminationGracePeriodSeconds"] >= 60 + 45
    # the rollout may last as long as the startup probe allows
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert dep["spec"]["progressDeadlineSeconds"] >= startup
    claim = next(v for v in spec["volumes"] if v["name"] == "bundle")["persistentVolumeClaim"]["claimName"]
    assert claim == "gpt-oss-120b-bundle" and not by_kind(objs, "PersistentVolumeClaim")
    (svc,) = by_kind(objs, "Service")
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("http", 8000), ("grpc", 8001), ("metrics", 8002)}
    (hpa,) = by_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rel-dflash-trt"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "dflash_requests_load"
    assert by_kind(objs, "ServiceMonitor") and by_kind(objs, "NetworkPolicy")
    (pdb,) = by_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"]["dflash-trt/role"] == "server"


def test_two_node_leaderworkerset():
    objs = objects(render(SCENARIOS["two-node-lws"]))
    assert not by_kind(objs, "Deployment")
    (lws,) = by_kind(objs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    name = lws["metadata"]["name"]
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2                                 # tp 16 / 8 GPUs per node
    leader, worker = tpl["leaderTemplate"]["spec"], tpl["workerTemplate"]["spec"]
    assert leader["containers"][0]["command"][-1].endswith("leader.sh")
    assert worker["containers"][0]["command"][-1].endswith("worker.sh")
    assert "initContainers" not in leader and "initContainers" not in worker
    for spec in (leader, worker):
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert c["image"] == "registry.example.com/dflash-trt-triton-mpi:1.4.0rc4"     # the image with sshd
        # RDMA: the device plugin's resource, IPC_LOCK for pinned memory, NCCL told which HCA / interface
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert env["OMPI_MCA_orte_keep_fqdn_hostnames"] == "1"
    # Each pod mounts only the half of the ssh key pair it uses.
    for spec, key in ((leader, "id_ed25519"), (worker, "authorized_keys")):
        (vol,) = [v for v in spec["volumes"] if v["name"] == "ssh"]
        assert vol["secret"]["items"] == [{"key": key, "path": key}]
    # Worker DNS: the pods' subdomain is the LWS name, and no Service of the chart takes it, so the
    # LWS controller creates its headless Service (CreateHeadlessServiceIfNotExists).
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
    assert name not in {s["metadata"]["name"] for s in by_kind(objs, "Service")}
    assert lws["metadata"]["annotations"] == {"leaderworkerset.sigs.k8s.io/exclusive-topology": "nvidia.com/gpu.clique"}
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    data = by_kind(objs, "ConfigMap")[0]["data"]
    leader_sh = data["leader.sh"]
    assert "mpirun -np 16" in leader_sh and "--mca orte_keep_fqdn_hostnames 1" in leader_sh
    assert '--prefix "$prefix"' in leader_sh and "--mca plm_rsh_no_tree_spawn 1" in leader_sh
    # every variable of the container's env list is forwarded to the ranks
    forwarded = set(re.findall(r"-x ([A-Za-z_][A-Za-z0-9_]*)", leader_sh))
    assert {e["name"] for e in leader["containers"][0]["env"]} | {"PATH"} <= forwarded
    assert "within 900 s: giving up" in leader_sh
    assert data["rank.sh"].rstrip().split("\n")[-1].startswith("exec trtllm-llmapi-launch tritonserver ")
    assert "exec trtllm-llmapi-launch trtllm-serve target --config configs/trtllm-serve.yaml" in by_kind(
        objects(render(SCENARIOS["two-node-trtllm-serve"])), "ConfigMap")[0]["data"]["rank.sh"]
    # The client Service reaches leaders only; the autoscaler scales the LeaderWorkerSet.
    (svc,) = by_kind(objs, "Service")
    assert svc["spec"]["selector"]["dflash-trt/role"] == "server"
    assert tpl["leaderTemplate"]["metadata"]["labels"]["dflash-trt/role"] == "server"
    assert tpl["workerTemplate"]["metadata"]["labels"]["dflash-trt/role"] == "worker"
    assert not by_kind(objs, "HorizontalPodAutoscaler")
    (so,) = by_kind(objs, "ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                                            "name": name}
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert "dflash_requests_active" in trigger["metadata"]["query"] and "dflash_requests_waiting" in trigger["metadata"]["query"]
    (pvc,) = by_kind(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_scaled_object_schema_rejects_a_broken_object():
    # The oracle can fail: the KEDA CRD schema rejects a trigger without its type.
    (so,) = by_kind(objects(render(SCENARIOS["two-node-lws"])), "ScaledObject")
    del so["spec"]["triggers"][0]["type"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, crd_schema(KEDA_CRD, "v1alpha1"))


def test_hpa_on_a_leaderworkerset_targets_its_scale_subresource():
    objs = objects(render({**SCENARIOS["two-node-lws"], "autoscaling": {"enabled": True, "provider": "hpa"}}))
    (hpa,) = by_kind(objs, "HorizontalPodAutoscaler")
    (lws,) = by_kind(objs, "LeaderWorkerSet")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                                             "name": lws["metadata"]["name"]}
    validate_all(objs)


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
    assert sorted(enum) == sorted([label for hw in catalog().values() for label in hw.gpu_product_labels] + [""])


LWS_OK = SCENARIOS["two-node-lws"]
RWO = {"accessModes": ["ReadWriteOnce"]}
# Values that cannot start, each refused at render time with what to change (template `fail`s).
REFUSED = {
    "lws without ssh secret": ({"parallel": {"tp": 16}}, "multiNode.sshSecret is required"),
    "lws on the stock image": ({**LWS_OK, "multiNode": {"sshSecret": "s"}},
                               "multiNode.image.repository is required for a LeaderWorkerSet: the stock images have no sshd"),
    "gpus != tp*pp": ({"workload": {"kind": "Deployment"}, "parallel": {"tp": 16}}, "must equal gpu.count (8)"),
    "lws inside one node": ({**LWS_OK, "workload": {"kind": "LeaderWorkerSet"}, "parallel": {"tp": 8}},
                            "must be at least twice gpu.count"),
    "worker wait past the startup probe": ({**LWS_OK, "multiNode": {**LWS_OK["multiNode"], "workerWaitSeconds": 4000}},
                                           ("multiNode.workerWaitSeconds 4000 must be shorter than the startup probe's "
                                            "allowance (probes.startup.periodSeconds × failureThreshold = 3600 s)")),
    "compile on": ({"compile": {"enabled": True}}, "compile: removed — the chart compiles nothing at pod start"),
    "rwo with a lws": ({**LWS_OK, "bundle": {"pvc": RWO}},
                       "attach the volume to one node, but a LeaderWorkerSet puts its 2 pods on 2 nodes"),
    "rwo with replicas": ({"replicas": 3, "bundle": {"pvc": RWO}}, "but 3 replicas land on different GPU nodes"),
    "rwo with an hpa": ({"autoscaling": {"enabled": True}, "bundle": {"pvc": RWO}},
                        "but the autoscaler adds pods on other nodes"),
    "grace shorter than drain": ({"terminationGracePeriodSeconds": 60},
                                 ("terminationGracePeriodSeconds 60 is shorter than shutdown.drainSeconds 60 + "
                                  "shutdown.exitTimeoutSeconds 45 + 10 s: raise it to 115")),
    "cpu-only with rdma": ({**SCENARIOS["embedded-cpu"], "rdma": {"enabled": True}}, "rdma.enabled needs GPU pods"),
    "max below min": ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2},
                       "bundle": {"pvc": {"accessModes": ["ReadWriteMany"]}}}, "autoscaling.maxReplicas 2 is below"),
    # -- engines without DFlash (engines.json), stacks the bundle lacks, names Kubernetes refuses (issue 25)
    "triton 25.10 image": ({"server": {"stack": "triton"}, "image": {"repository": "nvcr.io/nvidia/tritonserver",
                                                                      "tag": "25.10-trtllm-python-py3"}},
                           ("image nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3 carries TensorRT-LLM 1.0.0 "
                            "(Triton's compatibility matrix), which predates DFlash (first in 1.3.0rc20")),
    "triton 26.07 declared newer": ({"server": {"stack": "triton"}, "image": {
        "repository": "nvcr.io/nvidia/tritonserver", "tag": "26.07-trtllm-python-py3", "engineVersion": "1.4.0rc4"}},
        "carries TensorRT-LLM 1.2.1 (Triton's compatibility matrix), which predates DFlash"),
    "declared 1.2.1": ({"image": {"repository": "r.example.com/trtllm", "tag": "1", "engineVersion": "1.2.1"}},
                       "image r.example.com/trtllm:1 carries TensorRT-LLM 1.2.1, which predates DFlash"),
    "rc4 before rc20": ({"image": {"repository": "r.example.com/trtllm", "tag": "1", "engineVersion": "1.3.0rc4"}},
                        "carries TensorRT-LLM 1.3.0rc4, which predates DFlash"),
    "vllm 0.10": ({"server": {"stack": "vllm"}, "image": {"repository": "vllm/vllm-openai", "tag": "v0.10.0",
                                                         "engineVersion": "0.10.0"}}, "carries vLLM 0.10.0, which predates"),
    "image without its engine version": ({"image": {"repository": "r.example.com/trtllm", "tag": "1"}},
                                         "set image.engineVersion, the TensorRT-LLM version the image carries"),
    "triton without a built image": ({"server": {"stack": "triton"}},
                                     "no published image carries tritonserver with a DFlash-capable TensorRT-LLM"),
    "multinode image without dflash": ({**LWS_OK, "multiNode": {**LWS_OK["multiNode"],
                                                                "image": {**MN_IMAGE, "engineVersion": "1.2.1"}}},
                                       "multiNode.image registry.example.com/dflash-trt-triton-mpi:1.4.0rc4 carries "
                                       "TensorRT-LLM 1.2.1, which predates DFlash"),
    "a stack the bundle lacks": ({"server": {"stack": "vllm"}, "bundle": {"stacks": ["trtllm"]}},
                                 "server.stack vllm serves the bundle's configs/vllm.json, but bundle.stacks [trtllm] "
                                 "holds no vllm config"),
    "trtllm-serve without its config": ({"bundle": {"stacks": ["sglang"]}}, "holds no trtllm config"),
    "vllm on a leaderworkerset": ({**LWS_OK, "server": {"stack": "vllm"}},
                                  "which only trtllm-serve and triton run"),
    "triton models on vllm": ({"server": {"stack": "vllm"}, "bundle": {"models": ["tensorrt_llm"]}},
                              "bundle.models [tensorrt_llm]: Triton models, but server.stack is vllm"),
    "bad nameOverride": ({"nameOverride": "Bad_Name"}, "resource name \"rel-Bad_Name\""),
    "fullnameOverride with a digit first": ({"fullnameOverride": "9lives"},
                                            "Kubernetes refuses it as a Service name, which must be a DNS-1035 label"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_template_refuses_what_cannot_start(case):
    values, message = REFUSED[case]
    with pytest.raises(helm.HelmRenderError) as e:
        render(values)
    assert message in str(e.value)


# Values the schema refuses (Helm validates values.schema.json before rendering).
SCHEMA_REFUSED = {
    "LeaderReady deadlocks": ({**LWS_OK, "multiNode": {**LWS_OK["multiNode"], "startupPolicy": "LeaderReady"}},
                              "/multiNode/startupPolicy", "LeaderCreated"),
    "bad digest": ({"image": {"digest": "latest"}}, "/image/digest", "sha256"),
    "unknown autoscaler": ({"autoscaling": {"provider": "knative"}}, "/autoscaling/provider", "value must be one of"),
    "replicas unbounded": ({"replicas": 100000}, "/replicas", "maximum"),
    "env from a secret ref": ({"triton": {"env": [{"name": "X", "valueFrom": {}}]}}, "/triton/env/0", "value"),
    "unknown server": ({"server": {"stack": "tgi"}}, "/server/stack", "value must be one of"),
    "engine version latest": ({"image": {"engineVersion": "latest"}}, "/image/engineVersion", "does not match"),
    "unknown bundle stack": ({"bundle": {"stacks": ["tgi"]}}, "/bundle/stacks/0", "value must be one of"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_REFUSED))
def test_schema_refuses_what_cannot_start(case):
    values, where, what = SCHEMA_REFUSED[case]
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert f"at '{where}" in str(e.value) and what in str(e.value), str(e.value)


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


def test_default_server_is_trtllm_serve_on_an_engine_with_dflash():
    """The defaults: trtllm-serve on TensorRT-LLM's release image (engines.json), its /health
    probes, /prometheus/metrics on the serving port, its request gauges for drain and KEDA."""
    from dflash_trt import engines
    objs = objects(render({**SCENARIOS["defaults-trtllm-serve"], "serviceMonitor": {"enabled": True},
                           "autoscaling": {"enabled": True, "provider": "keda"},
                           "bundle": {"pvc": {"accessModes": ["ReadWriteMany"]}}}))
    validate_all(objs)
    (dep,) = by_kind(objs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    row = engines.facts()["servers"]["trtllm-serve"]
    assert c["image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4" == engines.image_ref(row["image"])
    assert engines.dflash_problem("trtllm-serve", row["engine_version"]) is None
    assert c["name"] == "trtllm-serve" and [p["containerPort"] for p in c["ports"]] == [8000]
    assert {c[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")} == {"/health"}
    data = by_kind(objs, "ConfigMap")[0]["data"]
    assert data["serve.sh"].rstrip().endswith("exec trtllm-serve target --config configs/trtllm-serve.yaml "
                                              "--host 0.0.0.0 --port 8000")
    assert "trtllm_num_requests_running" in data["drain.sh"] and "127.0.0.1:8000/prometheus/metrics" in data["drain.sh"]
    (sm,) = by_kind(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/prometheus/metrics"
    (so,) = by_kind(objs, "ScaledObject")
    assert "trtllm_num_requests_waiting" in so["spec"]["triggers"][0]["metadata"]["query"]
    (svc,) = by_kind(objs, "Service")
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]


@pytest.mark.parametrize("version", ["1.2.1", "1.3.0rc4", "1.3.0rc19", "1.3.0rc20", "1.3.0", "1.4.0rc4", "1.4.0",
                                     "2.0.0"])
def test_the_chart_and_python_agree_on_which_engines_have_dflash(version):
    """One source (engines.json), two readers: the chart's semverCompare of the PEP 440 versions
    and dflash_trt.engines (packaging.version) refuse the same versions."""
    from dflash_trt import engines
    values = {"image": {"repository": "r.example.com/trtllm", "tag": "x", "engineVersion": version}}
    python_refuses = engines.dflash_problem("trtllm-serve", version) is not None
    try:
        render(values)
        chart_refuses = False
    except helm.HelmRenderError as e:
        assert "predates DFlash" in str(e)
        chart_refuses = True
    assert chart_refuses == python_refuses


def test_a_release_name_kubernetes_refuses_fails_the_render():
    with pytest.raises(helm.HelmRenderError, match="Kubernetes refuses it as a Service name"):
        render(None, name="9rel")
