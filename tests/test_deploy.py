"""`dflash-trt deploy`: values from a bundle manifest agree with the bundle (tp, GPU product, model
repository), follow the planner's chosen layout, and render with Helm's engine into objects that
kubernetes-validate (and the LeaderWorkerSet CRD schema) accept.

The bundles here are manifest.json files built by the test in the format `dflash-trt build`
writes (checked against the build's own manifest schema); no weights are needed for deploy."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_trt import engines
from dflash_trt.deploy import values as deploy
from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import validate as validate_manifest
from dflash_trt.plan import cost, planner

from helpers import add_plan, objects, run_cli, validate_all

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")   # for validate_all
pytest.importorskip("jsonschema")


def write_bundle(root: Path, target="gpt-oss-120b", gpu="b300", arch="blackwell", quant="mxfp4", kv="fp8",
                 tp=8, ep=1, compile_status="deferred", drafter_config=True,
                 stacks=("trtllm", "vllm", "sglang")) -> Path:
    _, cfg, dcfg = planner.target_configs(target)
    bundle = root / f"{target}-{gpu or arch}-{quant}-tp{tp}"
    bundle.mkdir(parents=True)
    ids = (dcfg or {}).get("dflash_config", {}).get("target_layer_ids", [1])
    m = {
        "schema_version": 1, "tool_version": "0.1.0",
        "target": {"name": target, "hf_id": None, "path": f"/src/{target}", "bundle_path": "target", "config": cfg},
        "drafter": {"path": "/src/drafter", "bundle_path": "drafter", "block_size": (dcfg or {}).get("block_size", 8),
                    "mask_token_id": 0,
                    "target_layer_ids": {"zlab": ids, "trtllm": ids, "speculators": [i + 1 for i in ids],
                                         "vllm": ids, "sglang": [i - 1 for i in ids]}},
        "arch": arch, "gpu": gpu, "quant": {"target": quant, "drafter": "none", "kv_cache": kv},
        "parallel": {"tp": tp, "ep": ep, "pp": 1}, "backend": "pytorch",
        "max_seq_len": 32768,
        "stages": {"compile": {"status": compile_status, "inputs_sha256": "0" * 64, "outputs": [],
                               "commands": ["dflash-trt compile --bundle <bundle>"]}},
        "triton_model_repository": "triton", "triton_models": ["tensorrt_llm", "dflash_reference"],
        "artifacts": [],
        "serving_stacks": {"served": list(stacks), "skipped": {}},
        "engines": engines.manifest_record(list(stacks)),
    }
    if drafter_config and dcfg:
        m["drafter"]["config"] = dcfg
    validate_manifest(m)           # the shape `dflash-trt build` writes
    (bundle / "manifest.json").write_text(json.dumps(m))
    add_plan(bundle)               # plan.json, as build writes it: what deploy reads
    return bundle


def test_values_agree_with_the_bundle(tmp_path):
    b = write_bundle(tmp_path)
    values, _ = deploy.deploy_values(b)
    assert values["parallel"] == {"tp": 8, "pp": 1, "ep": 1}
    assert values["gpu"] == {"count": 8, "product": "NVIDIA-B300-SXM6-AC"}
    assert values["bundle"]["modelRepository"] == "triton"
    assert values["server"] == {"stack": "trtllm-serve"} and values["bundle"]["models"] == []
    assert values["bundle"]["stacks"] == ["trtllm", "vllm", "sglang"]
    # the image the manifest records for trtllm-serve (engines.json), with the engine version it carries
    assert values["image"] == {"repository": "nvcr.io/nvidia/tensorrt-llm/release", "tag": "1.4.0rc4", "digest": "",
                               "engineVersion": "1.4.0rc4"}
    assert "compile" not in values               # nothing compiles at pod start, deferred stage or not
    assert values["replicas"] == 1 and values["workload"]["kind"] == "Deployment"
    assert values["shmSize"] == "16Gi"
    objs = objects(deploy.render(values, release="gptoss"))
    validate_all(objs)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    serve = next(o for o in objs if o["kind"] == "ConfigMap")["data"]["serve.sh"]
    assert 'cd "$BUNDLE_DIR" && exec trtllm-serve target --config configs/trtllm-serve.yaml' in serve
    assert c["image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    # Triton: on an image of our own (NVIDIA publishes none with DFlash), its tensorrt_llm model only
    with pytest.raises(DFlashError, match="build deploy/triton-trtllm.Dockerfile and pass --image"):
        deploy.deploy_values(b, server="triton")
    values, _ = deploy.deploy_values(b, server="triton", image=TRITON_IMAGE, engine_version="1.4.0rc4")
    assert values["bundle"]["models"] == ["tensorrt_llm"]          # not the CPU reference copy of a 120B model
    objs = objects(deploy.render(values, release="gptoss"))
    validate_all(objs)
    serve = next(o for o in objs if o["kind"] == "ConfigMap")["data"]["serve.sh"]
    assert "'--model-repository=/bundle/triton'" in serve and "'--load-model=tensorrt_llm'" in serve


TRITON_IMAGE = "registry.example.com/dflash-trt-triton:26.07-trtllm1.4.0rc4"


@pytest.mark.parametrize("server,config,ready,metrics", [
    ("trtllm-serve", "configs/trtllm-serve.yaml", "/health", ("http", "/prometheus/metrics")),
    ("vllm", "configs/vllm.json", "/health", ("http", "/metrics")),
    ("sglang", "configs/sglang.json", "/health", ("http", "/metrics")),
    ("triton", None, "/v2/health/ready", ("metrics", "/metrics")),
])
def test_each_stack_gets_its_own_server(tmp_path, server, config, ready, metrics):
    """One server per stack the bundle holds a config for, each with its readiness probe, metrics
    endpoint and autoscaling signal (engines.json endpoints), rendered to valid objects."""
    b = write_bundle(tmp_path)
    extra = {"image": TRITON_IMAGE, "engine_version": "1.4.0rc4"} if server == "triton" else {}
    values, _ = deploy.deploy_values(b, server=server, **extra)
    values["autoscaling"].update({"enabled": True, "provider": "keda"})
    values["serviceMonitor"] = {"enabled": True}
    values["bundle"]["pvc"]["accessModes"] = ["ReadWriteMany"]     # the autoscaler's pods land on other nodes
    objs = objects(deploy.render(values, release="gptoss"))
    validate_all(objs)
    c = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["name"] == server
    assert c["startupProbe"]["httpGet"]["path"] == ready
    # Triton's readiness asks the models, not only the server (docs/serving-faults.md)
    assert c["readinessProbe"] == ({"exec": {"command": ["python3", "/opt/dflash-trt/triton_ready.py"]}}
                                   if server == "triton" else {"httpGet": {"path": ready, "port": "http"}}) | {
        k: c["readinessProbe"][k] for k in ("periodSeconds", "timeoutSeconds", "failureThreshold")}
    row = engines.facts()["servers"][server]
    assert c["image"] == (TRITON_IMAGE if server == "triton" else engines.image_ref(row["image"]))
    serve = next(o for o in objs if o["kind"] == "ConfigMap")["data"]["serve.sh"]
    if config:
        assert config in serve and "--port 8000" in serve
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert (sm["spec"]["endpoints"][0]["port"], sm["spec"]["endpoints"][0]["path"]) == metrics
    (so,) = [o for o in objs if o["kind"] == "ScaledObject"]
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    assert all(m in query for m in row["endpoints"]["load_metrics"])


def test_a_default_rollout_runs_only_engines_with_dflash(tmp_path):
    """`deploy --render` of a default bundle, one node and two: every image the manifests name is
    listed with its engine version, and each has DFlash (engines.json dflash_since)."""
    from packaging.version import Version
    for nodes, tp, extra in ((1, 8, []), (2, 16, ["--multinode-image", MN_IMAGE])):
        b = write_bundle(tmp_path / str(nodes), tp=tp)
        code, out, err = run_cli("deploy", "--bundle", str(b), "--nodes", str(nodes), "--render", "--json", *extra)
        assert code == 0, err
        d = json.loads(out)
        rendered = {c["image"] for p in Path(d["manifests"]).iterdir() for o in yaml.safe_load_all(p.read_text()) if o
                    for c in _containers(o)}
        assert rendered == {im["image"] for im in d["images"]}
        for im in d["images"]:
            assert Version(im["engine_version"]) >= Version(engines.facts()["stacks"]["trtllm"]["dflash_since"]), im
        code, out, _ = run_cli("deploy", "--bundle", str(b), "--nodes", str(nodes), "--out", str(tmp_path / f"o{nodes}"),
                               *extra)
        assert code == 0 and "TensorRT-LLM 1.4.0rc4; DFlash since 1.3.0rc20" in out


def _containers(obj):
    spec = obj.get("spec") or {}
    pods = [spec["template"]["spec"]] if "template" in spec else []
    if "leaderWorkerTemplate" in spec:
        pods += [spec["leaderWorkerTemplate"][k]["spec"] for k in ("leaderTemplate", "workerTemplate")]
    return [c for ps in pods for c in ps.get("initContainers", []) + ps["containers"]]


@pytest.mark.parametrize("args,message", [
    (["--server", "triton", "--image", "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"],
     "TensorRT-LLM 1.0.0 predates DFlash, so decoding_type DFlash cannot load (first in 1.3.0rc20"),
    # Triton's compatibility matrix wins over a declared version
    (["--server", "triton", "--image", "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3", "--engine-version",
      "1.4.0rc4"], "TensorRT-LLM 1.2.1 predates DFlash"),
    (["--image", "registry.example.com/trtllm:old", "--engine-version", "1.2.1"], "TensorRT-LLM 1.2.1 predates DFlash"),
    (["--image", "registry.example.com/trtllm:x"], "pass --engine-version"),
    (["--server", "vllm", "--image", "vllm/vllm-openai:v0.10.0", "--engine-version", "0.10.0"],
     "vLLM 0.10.0 predates DFlash"),
    (["--server", "triton"], "NVIDIA publishes no image with tritonserver and a DFlash-capable TensorRT-LLM"),
    (["--release", "Bad_Name!"], "--release 'Bad_Name!': Helm refuses it: a release name is a DNS-1123 label"),
    (["--release", "a" * 54], "of at most 53 characters"),
    (["--release", "-x"], "Helm refuses it"),
    (["--namespace", "Prod"], "--namespace 'Prod': Kubernetes refuses it"),
])
def test_deploy_refuses_what_cannot_start_and_writes_nothing(tmp_path, args, message):
    b = write_bundle(tmp_path)
    out = tmp_path / "out"
    code, _, err = run_cli("deploy", "--bundle", str(b), "--out", str(out), "--render", *args)
    assert code == 1 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [b.name]


def test_a_stack_the_bundle_has_no_config_for_is_refused(tmp_path):
    b = write_bundle(tmp_path, stacks=("trtllm",))
    with pytest.raises(DFlashError, match=r"--server vllm: the bundle holds no vLLM config .*choose one of trtllm-serve, "
                                          "triton"):
        deploy.deploy_values(b, server="vllm")
    only_vllm = write_bundle(tmp_path / "v", stacks=("vllm",))
    values, _ = deploy.deploy_values(only_vllm)        # the default follows the bundle
    assert values["server"]["stack"] == "vllm" and values["bundle"]["stacks"] == ["vllm"]


def test_multi_node_runs_only_the_mpi_servers(tmp_path):
    b = write_bundle(tmp_path, tp=16)
    with pytest.raises(DFlashError, match="--server vllm: the layout spans 2 nodes per instance"):
        deploy.deploy_values(b, nodes=2, server="vllm", multinode_image=MN_IMAGE)


def test_check_names_refuses_each_kind_by_its_rule():
    ok = "apiVersion: v1\nkind: Service\nmetadata:\n  name: gpt-oss-dflash-trt\n"
    deploy.check_names({"t/service.yaml": ok})
    for kind, name, why in (("Service", "1gpt-dflash-trt", "DNS-1035 label"), ("Service", "Bad_Name!-dflash-trt", "DNS-1035"),
                            ("ConfigMap", "x_y-scripts", "DNS-1123 subdomain"), ("Service", "a" * 64, "at most 63"),
                            ("LeaderWorkerSet", "a.b-lws", "DNS-1123 label")):
        text = f"apiVersion: v1\nkind: {kind}\nmetadata:\n  name: '{name}'\n"
        with pytest.raises(DFlashError, match=f"{kind} name .*{why}"):
            deploy.check_names({"t/x.yaml": text})

def test_default_layout_is_the_planners_choice(tmp_path):
    # A bundle written for TP 1: the planner fits 8 replicas of it on a DGX B300, and deploy writes that.
    b = write_bundle(tmp_path, tp=1)
    code, out, _ = run_cli("plan", "--bundle", str(b), "--json")
    assert code == 0
    chosen = json.loads(out)["chosen"]
    code, out, _ = run_cli("deploy", "--bundle", str(b), "--json")
    assert code == 0
    d = json.loads(out)
    v = yaml.safe_load(Path(d["values"]).read_text())
    assert (v["parallel"]["tp"], v["parallel"]["ep"], v["replicas"]) == (chosen["tp"], chosen["ep"], chosen["replicas"])
    assert (v["parallel"]["tp"], v["replicas"], v["gpu"]["count"]) == (1, 8, 1)
    assert d["layout"] == chosen
    assert Path(d["values"]).parent == b.with_name(b.name + "-deploy")   # beside the bundle, not in it
    assert sorted(p.name for p in b.iterdir()) == ["manifest.json", "plan.json"]
    # Same with two nodes: 16 replicas.
    code, out, _ = run_cli("deploy", "--bundle", str(b), "--nodes", "2", "--json", "--out", str(tmp_path / "two"))
    assert json.loads(out)["values_content"]["replicas"] == 16


def test_the_planner_picks_ep_when_the_bundle_leaves_it(tmp_path):
    b = write_bundle(tmp_path, tp=8, ep=1)
    p = deploy.plan_for_bundle(b)
    assert {(l.tp, l.ep) for l in p.layouts} == {(8, 1)}      # the bundle's Triton model fixes tp / ep
    assert p.chosen.weights_bytes_per_gpu == cost.weight_bytes(planner.target_shape(
        json.loads((b / "manifest.json").read_text())["target"]["config"]), "mxfp4", 8)


MN_IMAGE = "registry.example.com/dflash-trt-trtllm-mpi:1.4.0rc4"


def test_two_nodes_leaderworkerset(tmp_path):
    b = write_bundle(tmp_path, tp=16, quant="mxfp4")
    with pytest.raises(DFlashError, match="pass --multinode-image .* built from deploy/multinode.Dockerfile"):
        deploy.deploy_values(b, nodes=2)
    values, _ = deploy.deploy_values(b, nodes=2, ssh_secret="gptoss-ssh", multinode_image=MN_IMAGE)
    assert values["workload"]["kind"] == "LeaderWorkerSet"
    assert values["gpu"]["count"] == 8 and values["parallel"]["tp"] == 16 and values["replicas"] == 1
    assert values["multiNode"] == {"sshSecret": "gptoss-ssh", "image": {
        "repository": "registry.example.com/dflash-trt-trtllm-mpi", "tag": "1.4.0rc4", "digest": "",
        "engineVersion": "1.4.0rc4"}}   # built FROM the server's image: its engine version
    assert values["bundle"]["pvc"]["accessModes"] == ["ReadWriteMany"]
    objs = objects(deploy.render(values))
    kinds = validate_all(objs)
    assert "LeaderWorkerSet" in kinds and "Deployment" not in kinds
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_gb200_tp8_spans_two_compute_trays(tmp_path):
    # GB200 NVL72 nodes hold 4 GPUs; TP 8 stays in the 72-GPU NVLink domain but spans two pods.
    b = write_bundle(tmp_path, target="qwen3-8b", gpu="gb200", quant="nvfp4", tp=8)
    values, p = deploy.deploy_values(b, nodes=2, multinode_image=MN_IMAGE)
    assert values["workload"]["kind"] == "LeaderWorkerSet" and values["gpu"] == {"count": 4, "product": "NVIDIA-GB200"}
    assert p.chosen.within_nvlink_domain and p.chosen.nodes_per_replica == 2
    lws = next(o for o in objects(deploy.render(values)) if o["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    with pytest.raises(DFlashError, match="not a multiple of tp"):
        deploy.deploy_values(b, nodes=1)


def test_h200_fp8_bundle(tmp_path):
    b = write_bundle(tmp_path, target="qwen3-8b", gpu="h200", arch="hopper", quant="fp8", kv="fp8", tp=2,
                     compile_status="done")
    values, p = deploy.deploy_values(b)
    assert values["gpu"] == {"count": 2, "product": "NVIDIA-H200"}
    assert values["parallel"]["tp"] == 2 and values["replicas"] == 4 and "compile" not in values
    assert p.quant["target"] == "fp8" and p.hardware == "hgx-h200"
    validate_all(objects(deploy.render(values)))


def test_cpu_only_embedded_pair(tmp_path):
    b = write_bundle(tmp_path, target="smollm2-135m", gpu=None, arch="blackwell", quant="nvfp4", tp=1,
                     drafter_config=False)
    values, p = deploy.deploy_values(b)
    assert p is None
    assert values["gpu"] == {"count": 0, "product": ""} and values["bundle"]["models"] == ["dflash_reference"]
    objs = objects(deploy.render(values))
    validate_all(objs)
    assert "nvidia.com/gpu" not in json.dumps(objs)


def test_render_writes_values_and_manifests(tmp_path):
    b = write_bundle(tmp_path)
    out = tmp_path / "out"
    code, stdout, _ = run_cli("deploy", "--bundle", str(b), "--out", str(out), "--render")
    assert code == 0 and "helm install" in stdout
    assert (out / "values.yaml").read_text().startswith("# Written by `dflash-trt deploy")
    names = sorted(p.name for p in (out / "manifests").iterdir())
    assert "workload.yaml" in names and "service.yaml" in names and (out / "NOTES.txt").is_file()
    validate_all([d for p in (out / "manifests").iterdir() for d in yaml.safe_load_all(p.read_text()) if d])
    # The values file is what helm install -f would read: it renders on its own.
    validate_all(objects(deploy.render(yaml.safe_load((out / "values.yaml").read_text()))))
    # Re-running replaces the folder; nothing half-written is left beside it.
    code, _, _ = run_cli("deploy", "--bundle", str(b), "--out", str(out))
    assert code == 0 and not (out / "manifests").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([b.name, "out"])


def test_bad_input(tmp_path):
    code, _, err = run_cli("deploy", "--bundle", str(tmp_path))
    assert code == 1 and "manifest.json" in err and "Traceback" not in err
    b = write_bundle(tmp_path)
    code, _, err = run_cli("deploy", "--bundle", str(b), "--gpu", "h200")
    assert code == 1 and "built for arch blackwell" in err
    big = write_bundle(tmp_path, gpu="h100", arch="hopper", quant="none", kv="bf16", tp=1)
    code, _, err = run_cli("deploy", "--bundle", str(big))
    assert code == 1 and "does not fit" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "precious.txt").write_text("x")
    code, _, err = run_cli("deploy", "--bundle", str(b), "--out", str(tmp_path / "taken"))
    assert code == 1 and "not a deploy folder" in err and (tmp_path / "taken" / "precious.txt").exists()
    with pytest.raises(DFlashError, match="helm rejected the values"):
        deploy.render({"replicas": -1})


def test_real_build_output(tmp_path):
    """A bundle from `dflash-trt build` itself (tiny Qwen3 pair, H200 FP8, compile deferred here):
    deploy reads its manifest, the values agree with it, the render validates, and the bundle
    still verifies (deploy writes nothing inside it)."""
    code, _, err = run_cli("make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "t"),
                           "--drafter-out", str(tmp_path / "d"))
    assert code == 0, err
    b = tmp_path / "bundle"
    code, _, err = run_cli("build", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                           "--gpu", "h200", "--quant", "fp8", "--tp", "2", "--out", str(b))
    assert code == 0, err
    m = json.loads((b / "manifest.json").read_text())
    code, out, err = run_cli("deploy", "--bundle", str(b), "--render", "--json")
    assert code == 0, err
    v = json.loads(out)["values_content"]
    assert v["parallel"]["tp"] == m["parallel"]["tp"] == 2
    assert v["gpu"]["product"] == "NVIDIA-H200" and v["gpu"]["count"] == 2 and v["replicas"] == 4
    assert v["bundle"]["modelRepository"] == m["triton_model_repository"]
    assert (b / m["triton_model_repository"] / "tensorrt_llm").is_dir()
    assert "compile" not in v
    # The plan uses the bundle's own TensorRT-LLM settings (model.yaml).
    llm = yaml.safe_load((b / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    p = deploy.plan_for_bundle(b)
    assert p.kv_fraction == llm["kv_cache_config"]["free_gpu_memory_fraction"]
    assert (p.max_batch_size, p.max_num_tokens) == (llm["max_batch_size"], llm["max_num_tokens"])
    manifests = Path(json.loads(out)["manifests"])
    validate_all([d for p in manifests.iterdir() for d in yaml.safe_load_all(p.read_text()) if d])
    code, out, err = run_cli("verify", "--bundle", str(b))
    assert code == 0, out + err


ENGINES_JSON = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "dflash-trt" / "engines.json"


def _workload_container(manifests: Path) -> dict:
    docs = [d for d in yaml.safe_load_all((manifests / "workload.yaml").read_text()) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("pair")
    make_tiny("llama", root / "t", root / "d", seed=5)
    return root


@pytest.mark.parametrize("arch, gpu, node, product", [("blackwell", "b300", "dgx-b300", "NVIDIA-B300-SXM6-AC"),
                                                      ("hopper", "h200", "hgx-h200", "NVIDIA-H200")])
def test_build_arch_alone_deploys_on_the_arch_node(tiny_pair, tmp_path, arch, gpu, node, product):
    """Issue 33 item 5: `build --arch X` with no --gpu records X's node (hardware.json
    arch_default_nodes), plans for it, and `deploy --render` asks for its GPUs with the
    trtllm-serve image engines.json names; it is not the CPU-only reference Deployment."""
    b = tmp_path / "b"
    code, out, err = run_cli("build", "--target", str(tiny_pair / "t"), "--drafter", str(tiny_pair / "d"),
                             "--arch", arch, "--quant", "none", "--out", str(b), "--json")
    assert code == 0, err
    res = json.loads(out)
    m = json.loads((b / "manifest.json").read_text())
    assert (m["gpu"], m["node"], m["gpu_source"]) == (gpu, node, "arch_default")
    assert (res["gpu"], res["node"], res["plan"]["hardware"]) == (gpu, node, node)
    code, out, err = run_cli("deploy", "--bundle", str(b), "--render", "--json")
    assert code == 0, err
    d = json.loads(out)
    c = _workload_container(Path(d["manifests"]))
    im = json.loads(ENGINES_JSON.read_text())["servers"]["trtllm-serve"]["image"]
    image = f"{im['repository']}:{im['tag']}"
    assert d["server"] == "trtllm-serve" and c["image"] == image
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] >= 1
    assert d["values_content"]["gpu"]["product"] == product
    assert d["values_content"]["bundle"]["models"] != ["dflash_reference"]


def test_build_gpu_none_is_the_only_cpu_only_bundle(tiny_pair, tmp_path):
    b = tmp_path / "b"
    code, out, err = run_cli("build", "--target", str(tiny_pair / "t"), "--drafter", str(tiny_pair / "d"),
                             "--arch", "blackwell", "--gpu", "none", "--quant", "none", "--out", str(b), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert (res["gpu"], res["node"], res["gpu_source"], res["plan"]) == (None, None, "none", None)
    code, out, err = run_cli("deploy", "--bundle", str(b), "--render", "--json")
    assert code == 0, err
    d = json.loads(out)
    c = _workload_container(Path(d["manifests"]))
    assert d["server"] == "triton" and d["values_content"]["bundle"]["models"] == ["dflash_reference"]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["resources"]["limits"]["memory"] == f"{deploy.CPU_POD_MEMORY_GIB}Gi"
    # the weights deploy checks against that limit: the planner's count from the configs, against the
    # tensors the checkpoints' own headers list (what the runtime's memory bound counts)
    from dflash_trt.io.checkpoint import CheckpointReader
    from dflash_trt.io.manifest import Manifest

    elements = 0
    for folder in (b / "target", b / "drafter"):
        with CheckpointReader(folder) as r:
            elements += sum(math.prod(r.meta(k)[1]) for k in r.keys())
    need, params, dtype = deploy.reference_weights(b, Manifest.read(b))
    assert dtype == "float32" and need == 4 * params and params == pytest.approx(elements, rel=1e-3)


def test_cpu_only_rollout_too_big_for_the_pod_is_refused(tmp_path):
    """A CPU-only deployment (a --gpu none bundle, or deploy --gpu none) of a model whose weights
    alone exceed the CPU pod's memory limit is refused in one line with the numbers, nothing
    written. Oracle: gpt-oss-120b has 116.8 B parameters (its model card: 117B; our drafter adds
    under 1 B), in float32 (dflash_reference's dtype) ~4 bytes each."""
    cpu = write_bundle(tmp_path, gpu=None, tp=1)
    gpu = write_bundle(tmp_path / "g")
    for argv in (["--bundle", str(cpu)], ["--bundle", str(gpu), "--gpu", "none"]):
        out = tmp_path / "out"
        code, stdout, err = run_cli("deploy", *argv, "--out", str(out), "--render")
        assert code == 1 and err.count("\n") == 1 and stdout == "", err
        assert "CPU-only deployment of gpt-oss-120b" in err and "in float32" in err, err
        assert f"over the CPU pod's {deploy.CPU_POD_MEMORY_GIB} GiB memory limit" in err
        params = float(err.split(" B parameters")[0].split()[-1])
        gib = float(err.split(" GiB of weights")[0].split()[-1])
        assert 116.8 <= params <= 116.8 * 1.03 and gib == pytest.approx(params * 1e9 * 4 / 2**30, abs=0.1)
        assert not out.exists()


def test_tp16_b300_two_nodes_render(tmp_path):
    """`deploy --nodes 2 --render` of a TP16 B300 bundle: a LeaderWorkerSet whose workers resolve
    (its name is the pods' subdomain and no Service of ours takes it, so the LWS controller
    creates the headless Service) and an mpirun that keeps FQDNs."""
    b = write_bundle(tmp_path, tp=16)
    out = tmp_path / "two"
    code, _, err = run_cli("deploy", "--bundle", str(b), "--nodes", "2", "--render", "--out", str(out),
                                "--multinode-image", MN_IMAGE + "@sha256:" + "0" * 64)
    assert code == 0, err
    objs = [d for p in (out / "manifests").iterdir() for d in yaml.safe_load_all(p.read_text()) if d]
    validate_all(objs)
    (lws,) = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    assert lws["metadata"]["name"] not in {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert leader["image"] == "registry.example.com/dflash-trt-trtllm-mpi@sha256:" + "0" * 64
    leader_sh = next(o for o in objs if o["kind"] == "ConfigMap")["data"]["leader.sh"]
    assert "mpirun -np 16" in leader_sh and "--mca orte_keep_fqdn_hostnames 1" in leader_sh
    assert {"name": "OMPI_MCA_orte_keep_fqdn_hostnames", "value": "1"} in leader["env"]


def test_trtllm_serve_windows_and_batch_size_reach_the_plan(tmp_path):
    """The bundle's configs/trtllm-serve.yaml (max_attention_window, max_batch_size) is what the
    planner sizes against; without it no sliding-window saving is counted."""
    b = write_bundle(tmp_path, tp=8)
    plain = deploy.plan_for_bundle(b)
    (b / "configs").mkdir()
    (b / "configs" / "trtllm-serve.yaml").write_text(yaml.safe_dump(
        {"max_batch_size": 64, "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "max_attention_window": [128, 32768]}}))
    add_plan(b)    # planned, as build plans, with the config it wrote
    p = deploy.plan_for_bundle(b)
    assert p.max_attention_window == [128, 32768] and p.max_batch_size == 64 and p.kv_fraction == 0.85
    assert "target_sliding_window" in p.kv_bytes_per_token and "target_sliding_window" not in plain.kv_bytes_per_token
    assert p.chosen.kv_sequences > plain.chosen.kv_sequences and p.chosen.max_sequences == 64
    values, _ = deploy.deploy_values(b)
    assert values["autoscaling"] == {"targetAverageValue": str(int(0.8 * 64))}
    (b / "configs" / "trtllm-serve.yaml").write_text("kv_cache_config: {max_attention_window: 128}\n")
    add_plan(b)    # the planner's refusal is recorded, and deploy reads it
    with pytest.raises(DFlashError, match="max_attention_window must be a list"):
        deploy.plan_for_bundle(b)


@pytest.mark.parametrize("args,message", [
    (["--nodes", "0"], "--nodes 0: must be in [1, 1024]"),
    (["--nodes", "-1"], "--nodes -1: must be in [1, 1024]"),
    (["--nodes", "1000000000"], "--nodes 1000000000: must be in [1, 1024]"),
    (["--replicas", "0"], "--replicas 0: must be in [1, 1024]"),
    (["--replicas", "5000"], "--replicas 5000: must be in [1, 1024]"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0: must be one of 1, 2, 4, 8, 16"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3: must be one of 1, 2, 4, 8, 16"),
    (["--image", "nvcr.io/nvidia/tritonserver"], "--image 'nvcr.io/nvidia/tritonserver': expected REPOSITORY:TAG"),
    (["--nodes", "2", "--multinode-image", "x@sha256:12"], "--multinode-image 'x@sha256:12'"),
])
def test_deploy_counts_are_bounded_and_nothing_is_written(tmp_path, args, message):
    b = write_bundle(tmp_path, tp=16 if "--nodes" in args and "2" in args else 8)
    out = tmp_path / "out"
    code, _, err = run_cli("deploy", "--bundle", str(b), "--out", str(out), *args)
    assert code == 1 and message in err and "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [b.name]


def test_deploy_writes_nothing_the_chart_refuses(tmp_path):
    # An existing claim is fine for any layout, but a created ReadWriteOnce one for 8 replicas is
    # not: deploy never writes such values (here: forced by a chart whose default is changed).
    b = write_bundle(tmp_path, tp=1)
    chart = tmp_path / "chart"
    shutil.copytree(deploy.default_chart_dir(), chart)
    tpl = chart / "templates" / "_helpers.tpl"
    tpl.write_text(tpl.read_text().replace('{{- $shared := or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes) }}',
                                           "{{- $shared := false }}"))
    out = tmp_path / "out"
    code, _, err = run_cli("deploy", "--bundle", str(b), "--out", str(out), "--chart", str(chart))
    assert code == 1 and "attach the volume to one node, but 8 replicas land on different GPU nodes" in err
    assert not out.exists()


def test_min_tokens_per_user_picks_the_batch_that_holds_the_target(tmp_path):
    """deploy --min-tokens-per-user N: the most concurrent sequences whose predicted per-user speed
    is still >= N (one more falls below it, by the speed model's own forward pass), as the
    autoscaling target (capped by what the instance batches) and the max_batch_size to serve with."""
    from dflash_trt.hardware import get_hardware

    b = write_bundle(tmp_path)
    code, out, err = run_cli("deploy", "--bundle", str(b), "--min-tokens-per-user", "500", "--json")
    assert code == 0, err
    s = json.loads(out)["speed_target"]
    k, p = s["max_batch_size"], deploy.plan_for_bundle(b)
    _, cfg, dcfg = planner.target_configs("gpt-oss-120b")
    t, d = planner.target_shape(cfg), planner.drafter_shape(dcfg)
    hw, eff, lay = get_hardware("dgx-b300"), cost.EFFICIENCY["central"], p.chosen

    def user(c):
        v = cost.forward(t, "mxfp4", "fp8", hw, lay.tp, c, 10, 2048, eff)
        dr = cost.forward(d, "none", "fp8", hw, lay.tp, c, 10, 2048, eff, extra_groups=(t.output_projection(),))
        return 4.4 / (v.time_s + dr.time_s)

    assert s["mode"] == "dflash" and s["tau"] == 4.4
    assert user(k) >= 500 > user(k + 1)
    assert s["predicted_tokens_per_s_per_user"] == pytest.approx(user(k))
    values = yaml.safe_load((b.parent / f"{b.name}-deploy" / "values.yaml").read_text())
    assert values["autoscaling"]["targetAverageValue"] == str(min(k, lay.max_sequences))


def test_min_tokens_per_user_out_of_reach_writes_nothing(tmp_path):
    b = write_bundle(tmp_path)
    code, out, err = run_cli("deploy", "--bundle", str(b), "--min-tokens-per-user", "5000")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "--min-tokens-per-user 5000: the model predicts at most" in err and "tokens/s per user" in err
    assert not (b.parent / f"{b.name}-deploy").exists()
    code, _, err = run_cli("deploy", "--bundle", str(b), "--tau", "4")
    assert code == 1 and "--tau is for --min-tokens-per-user" in err


def test_plan_bundle_speed_uses_the_bundles_models(tmp_path):
    b = write_bundle(tmp_path, tp=8)
    code, out, err = run_cli("plan", "--bundle", str(b), "--speed", "--json")
    assert code == 0, err
    d = json.loads(out)
    s = d["speed"]
    assert s["target"] == "gpt-oss-120b" and s["hardware"] == "dgx-b300" and s["block_size"] == d["block_size"]
    assert s["layouts"][0]["tp"] == 8 and s["layouts"][0]["points"][0]["dflash_tokens_per_s_per_user"] > 0
