"""NVIDIA Dynamo: a DynamoGraphDeployment (nvidia.com/v1alpha1) for a bundle, `deploy --server dynamo`.

Dynamo is an orchestrator, not a stack: its workers run an engine whose config the bundle already
holds (vLLM, TensorRT-LLM, SGLang). Each stack hands over its launch as data (Stack.launch_args:
stacks/base.LaunchArgs, the same record its own serve command line is rendered from); this module
renders that into Dynamo's worker command lines and wraps them in the operator's CRD, checked against
Dynamo's own CRD schema with unknown fields refused (the API server prunes them silently) before
anything is written. Its facts are deploy/helm/dflash-trt/engines.json `dynamo`, each with its source.
docs/dynamo.md: the services rendered, what is refused, the checks, the worker command lines by hand.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from dflash_trt import engines, stacks
from dflash_trt.deploy import values as chart_values
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import hardware_for_gpu
from dflash_trt.io.manifest import Manifest
from dflash_trt.paths import deploy_path
from dflash_trt.plan import speed as speed_model
from dflash_trt.stacks.base import LaunchArgs

SERVER = "dynamo"                 # deploy --server dynamo (engines.ORCHESTRATORS)
DGD_FILE = "dgd.yaml"
BUNDLE_MOUNT = "/bundle"          # where the chart mounts the bundle (values.yaml bundle.mountPath)
DEFAULT_ISL, DEFAULT_OSL = 4096, 1024   # --disaggregated split when --isl / --osl are not given
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # the CRD is 0.8 MB of YAML


def facts() -> dict:
    """engines.json `dynamo`: release, images, worker modules, disaggregation, sources."""
    return engines.facts()["dynamo"]


# ------------------------------------------------------------------ the CRD schema, unknown fields refused
@lru_cache(maxsize=1)
def crd_schema() -> dict:
    """The DGD's openAPIV3Schema (served version), closed the way the API server prunes: every object
    schema with properties and no additionalProperties refuses other keys, unless it preserves them."""
    crd = yaml.load(deploy_path("schemas", "nvidia.com_dynamographdeployments.yaml").read_text(), Loader=LOADER)
    api = facts()["crd"]["api_version"].split("/")[1]
    version = next((v for v in crd["spec"]["versions"] if v["name"] == api), None)
    if version is None:
        raise DFlashError(f"deploy/schemas/nvidia.com_dynamographdeployments.yaml: no version {api}")
    return _closed(version["schema"]["openAPIV3Schema"])


def _closed(node):
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_closed(v) if k not in ("enum", "default", "example", "required") else v) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def check_dgd(dgd: dict) -> None:
    """The DGD against Dynamo's CRD schema (jsonschema, the [deploy] extra): one line naming the field."""
    try:
        import jsonschema
    except ImportError:   # the check is the point of rendering here: never skip it silently
        raise DFlashError("deploy --server dynamo checks the DynamoGraphDeployment against Dynamo's CRD schema "
                          "with jsonschema: pip install jsonschema (or the package's [deploy] extra)") from None
    v = jsonschema.Draft7Validator(crd_schema())
    if errors := sorted(v.iter_errors(dgd), key=lambda e: list(e.absolute_path)):
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise DFlashError(f"DynamoGraphDeployment {where}: {e.message} (Dynamo {facts()['version']} CRD "
                          f"{facts()['crd']['api_version']}; {len(errors)} problem(s))")


# ------------------------------------------------------------------ the worker command lines
def worker_args(launch: LaunchArgs, args: dict) -> list[str]:
    """A Dynamo worker's arguments from the stack's launch (stacks/base.LaunchArgs), in the worker's own flag
    names (engines.json dynamo.workers.<engine>.args): the model, the layout where the worker wants it as
    flags, the engine-args file, then the engine's own flags, which the worker parses with the engine's parser."""
    layout = [tok for key, flag in (args.get("layout") or {}).items() for tok in (flag, str(getattr(launch, key)))]
    config = [args["config"], launch.config_file] if launch.config_file else []
    return [args["model"], launch.model, *layout, *config, *launch.flags]


def worker_argv(stack: str, bundle: Path, served_name: str, role: str | None = None) -> tuple[list[str], dict]:
    """(`python3 -m dynamo.<engine> ...`, env) of one worker; role: None (aggregated), prefill, decode."""
    w = facts()["workers"][stack]
    launch = stacks.get(stack).launch_args(bundle)
    args = [*worker_args(launch, w["args"]), "--served-model-name", served_name]
    if role:
        d = w["disaggregation"]
        args += [d["flag"], d[role], *d.get("extra", [])]
    return ["python3", "-m", w["module"], *args], dict(launch.env)


# ------------------------------------------------------------------ choosing the engine and its image
def pick_engine(m: Manifest, engine: str | None, image: str | None, engine_version: str | None,
                disaggregated: bool) -> tuple[str, dict, str]:
    """(stack, image block, engine version): --engine or the first bundle stack whose Dynamo image has DFlash."""
    served = list(m.served_stacks)
    workers = facts()["workers"]
    if engine:
        if engine not in workers:
            raise DFlashError(f"--engine {engine}: Dynamo {facts()['version']} runs workers for "
                              f"{', '.join(workers)} only")
        if engine not in served:
            raise DFlashError(f"--engine {engine}: the bundle holds no {engine} config (manifest.json "
                              f"serving_stacks.served {served})")
        candidates = [engine]
    else:
        candidates = [s for s in workers if s in served]
        if not candidates:
            raise DFlashError(f"deploy --server dynamo: the bundle's stacks {served} include none that Dynamo runs "
                              f"({', '.join(workers)})")
    problems = []
    for stack in candidates:
        w = workers[stack]
        if image:
            block, version = chart_values.parse_image(image, "--image"), engine_version
            where = f"--image {image}"
            if not version:
                raise DFlashError(f"--image {image}: pass --engine-version, the {stack} engine version the image "
                                  "carries (deploy refuses one that predates DFlash)")
        else:
            block, version = dict(w["image"]), w["engine_version"]
            where = f"Dynamo {facts()['version']} image {engines.image_ref(block)} ({w['engine_version_source']})"
        server = next(n for n, s in engines.facts()["servers"].items() if s["stack"] == stack)   # its facts
        problem = engines.dflash_problem(server, version, where)
        if problem is None and disaggregated and not w.get("disaggregation"):
            problem = f"--disaggregated with {stack} workers: {w['disaggregation_refused']}"
        if problem is None:
            return stack, block, version
        problems.append(problem)
    raise DFlashError(problems[0] if len(problems) == 1 else "; ".join(problems))


# ------------------------------------------------------------------ the DGD
def _probe(path: str, port: int, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 30,
            "failureThreshold": failures}


def _worker_service(*, stack: str, argv: list[str], env: dict, image: str, namespace: str, replicas: int,
                    gpus: int, gpu_product: str, pvc: str, role: str | None, metrics_annotations: dict) -> dict:
    sysf = facts()["worker_system"]
    shm = chart_values.SHM_PER_GPU_GIB * gpus
    svc = {
        "componentType": "worker",
        "dynamoNamespace": namespace,
        "replicas": replicas,
        "envs": [{"name": sysf["env"], "value": str(sysf["port"])}, {"name": "BUNDLE_DIR", "value": BUNDLE_MOUNT},
                 *({"name": k, "value": str(v)} for k, v in env.items())],
        "resources": {"requests": {"gpu": str(gpus), "cpu": str(chart_values.CPU_PER_GPU * gpus),
                                   "memory": f"{shm + chart_values.HOST_MEMORY_BASE_GIB}Gi"},
                      "limits": {"gpu": str(gpus)}},
        "sharedMemory": {"size": f"{shm}Gi"},
        "volumeMounts": [{"name": pvc, "mountPoint": BUNDLE_MOUNT}],
        "livenessProbe": _probe(sysf["live"], sysf["port"], 5, 3),
        "readinessProbe": _probe(sysf["ready"], sysf["port"], 10, 60),
        "extraPodMetadata": {"annotations": metrics_annotations},
        "extraPodSpec": {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                       "values": [gpu_product]}]}]}}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "mainContainer": {
                "image": image, "workingDir": BUNDLE_MOUNT, "command": argv[:3], "args": argv[3:],
                # weights load for minutes: the startup probe holds liveness off until the worker answers
                "startupProbe": _probe(sysf["ready"], sysf["port"], 10, 180),
            },
        },
    }
    if role:
        svc["subComponentType"] = role
    return svc


def render_dgd(bundle: str | Path, *, name: str, nodes: int = 1, gpus_per_node: int | None = None,
               replicas: int | None = None, disaggregated: bool = False, isl: int | None = None,
               osl: int | None = None, engine: str | None = None, image: str | None = None,
               engine_version: str | None = None, pvc: str | None = None, gpu: str | None = None,
               tau: float | None = None) -> tuple[dict, dict]:
    """(the DGD, a summary) for a bundle: checked against the CRD before it is returned."""
    chart_values.check_counts(nodes=nodes, gpus_per_node=gpus_per_node, replicas=replicas)
    if not disaggregated and (isl is not None or osl is not None):
        raise DFlashError("--isl / --osl size a disaggregated layout: add --disaggregated (or drop them)")
    bundle = Path(bundle)
    m = Manifest.read(bundle)
    p = chart_values.plan_for_bundle(bundle, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, manifest=m)
    if p is None:
        raise DFlashError("deploy --server dynamo: the bundle pins no GPU (CPU-only); Dynamo's workers serve on GPUs "
                          "here: pass --gpu")
    chosen = chart_values.chosen_layout(p, nodes)
    if chosen.tp > p.gpus_per_node:
        raise DFlashError(f"deploy --server dynamo: an instance of tp {chosen.tp} spans nodes of {p.gpus_per_node} GPUs; "
                          "multi-node Dynamo workers (the DGD's multinode) are not rendered: use a layout within one "
                          "node, or `deploy` with the chart's LeaderWorkerSet")
    stack, image_block, version = pick_engine(m, engine, image, engine_version, disaggregated)
    f, w = facts(), facts()["workers"][stack]
    hw = hardware_for_gpu(gpu or m.gpu)
    served_name = str(m.target.name or "target")
    n = chosen.replicas if replicas is None else replicas
    claim = pvc or f"{name}-bundle"
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(f["worker_system"]["port"]),
                   "prometheus.io/path": f["worker_system"]["metrics_path"]}
    fe = f["frontend"]
    fe_port = fe["ports"]["http"]
    services = {"Frontend": {
        "componentType": "frontend", "dynamoNamespace": name, "replicas": 1,
        "livenessProbe": _probe(fe["live"], fe_port, 5, 3),
        "readinessProbe": _probe(fe["ready"], fe_port, 10, 60),
        "extraPodMetadata": {"annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(fe_port),
                                             "prometheus.io/path": fe["metrics_path"]}},
        "extraPodSpec": {"mainContainer": {"image": engines.image_ref(fe["image"]),
                                           "command": ["python3", "-m", fe["module"]], "args": list(fe["args"])}},
    }}
    common = {"stack": stack, "image": engines.image_ref(image_block), "namespace": name, "gpus": chosen.tp,
              "gpu_product": hw.gpu_product, "pvc": claim, "metrics_annotations": annotations}
    split = None
    title = w["component"]
    if disaggregated:
        split = speed_model.disaggregated(p, *chart_values.bundle_model_configs(bundle, manifest=m),
                                          isl=isl or DEFAULT_ISL, osl=osl or DEFAULT_OSL, instances=n, tau=tau)
        for role, count in (("prefill", split.prefill_instances), ("decode", split.decode_instances)):
            argv, env = worker_argv(stack, bundle, served_name, role)
            services[title.replace("Worker", f"{role.capitalize()}Worker")] = _worker_service(
                argv=argv, env=env, replicas=count, role=role, **common)
    else:
        argv, env = worker_argv(stack, bundle, served_name)
        services[title] = _worker_service(argv=argv, env=env, replicas=n, role=None, **common)
    dgd = {
        "apiVersion": f["crd"]["api_version"], "kind": f["crd"]["kind"],
        "metadata": {"name": name, "annotations": {"dflash-trt/target": served_name,
                                                   "dflash-trt/tool-version": str(m.tool_version or "")}},
        "spec": {"backendFramework": stack, "pvcs": [{"name": claim, "create": False}], "services": services},
    }
    check_dgd(dgd)
    summary = {"server": SERVER, "dynamo": f["version"], "engine": stack,
               "image": {"image": engines.image_ref(image_block), "engine_version": version},
               "frontend_image": engines.image_ref(fe["image"]), "layout": {"tp": chosen.tp, "ep": chosen.ep},
               "gpu_product": hw.gpu_product, "pvc": claim,
               "workers": {k: v["replicas"] for k, v in services.items() if k != "Frontend"},
               "gpus": sum(v["replicas"] * chosen.tp for k, v in services.items() if k != "Frontend"),
               "disaggregated": split.to_dict() if split else None, "schema_check": "passed"}
    return dgd, summary


def write_dgd(out: str | Path, dgd: dict, header: str, render: bool) -> Path:
    """<out>/dgd.yaml (and, with --render, <out>/manifests/dgd.yaml as `kubectl apply -f` takes the chart's),
    written into a temp folder and renamed: nothing half-written."""
    text = header + yaml.safe_dump(dgd, sort_keys=False, width=120)
    with chart_values.deploy_folder(out, DGD_FILE) as tmp:
        (tmp / DGD_FILE).write_text(text)
        if render:
            (tmp / "manifests").mkdir()
            (tmp / "manifests" / DGD_FILE).write_text(text)
    return Path(out)

