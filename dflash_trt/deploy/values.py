"""Helm values (and, on request, rendered manifests) for a bundle: `dflash-trt deploy`.

The values follow the plan the bundle carries (plan.json: `plan_for_bundle` reads it, searching nothing),
so `dflash-trt plan --bundle DIR` shows exactly what `deploy` will do; the rest comes from the typed
manifest. Nothing is compiled at pod start: the serving path loads the bundle's checkpoints.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from dflash_trt import engines, stacks
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import gpus
from dflash_trt.io.atomic import MARKER, atomic_output_dir
from dflash_trt.io.manifest import Manifest, sha256_file
from dflash_trt.io.manifest import verify as verify_bundle
from dflash_trt.paths import deploy_path
from dflash_trt.plan import planner
from dflash_trt.plan.record import bundle_hardware, drafter_config, read_plan

GIB = 2**30
REFERENCE_MODEL = stacks.tritonserver.REFERENCE_MODEL   # CPU-capable Triton model of the bundle
CPU_POD_MEMORY_GIB = 16                   # memory limit of the CPU-only pod (dflash_reference, no GPU)
# bytes per parameter of the reference runtime's dtype; "auto" is float32 or bfloat16 by the pod's CPU
REFERENCE_DTYPE_BYTES = {"float32": 4, "auto": 4, "bfloat16": 2, "float16": 2, "float64": 8}
SHM_PER_GPU_GIB = 2                       # /dev/shm per GPU: NCCL and Python-backend tensors
HOST_MEMORY_BASE_GIB = 32                 # host memory per GPU pod besides /dev/shm
CPU_PER_GPU = 4
DEFAULT_SSH_SECRET = "dflash-trt-ssh"
POD_GPU_COUNTS = (1, 2, 4, 8, 16)         # the chart's gpu.count (values.schema.json)
MAX_REPLICAS = 1024                       # the chart's replicas maximum
AUTOSCALE_TARGET_SHARE = 0.8              # requests in flight per instance to aim for, of its batch slots
DOCKERFILE = "deploy/multinode.Dockerfile"
# An image reference: repository[:tag][@sha256:<64 hex>].
IMAGE_REF = re.compile(r"^(?P<repo>[a-z0-9][a-z0-9._/:-]*?)(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


def default_chart_dir() -> Path:
    """The chart: deploy/helm/dflash-trt (a wheel carries it as dflash_trt/_deploy/helm/dflash-trt)."""
    return deploy_path("helm", "dflash-trt")


def default_out(bundle: str | Path) -> Path:
    """<bundle>-deploy beside the bundle: writing inside it would add files its manifest does not
    list (`dflash-trt verify` reports them)."""
    b = Path(bundle).resolve()
    return b.with_name(b.name + "-deploy")


def reference_weights(bundle: Path, m: Manifest) -> tuple[int, int, str]:
    """(bytes, parameters, dtype) of the weights the CPU pod's dflash_reference model holds: the
    target's and the drafter's parameters (the planner's count, from the manifest's configs: the
    reference pair may live outside the bundle) in the runtime dtype its model.yaml names."""
    y = bundle / m.triton_model_repository / REFERENCE_MODEL / "1" / "model.yaml"
    dtype = "float32"   # what build writes (stacks/tritonserver reference_settings)
    if y.is_file():
        try:
            dtype = str((yaml.safe_load(y.read_text()) or {}).get("dtype") or dtype)
        except yaml.YAMLError as e:
            raise DFlashError(f"{y}: invalid YAML ({e})") from None
    if dtype not in REFERENCE_DTYPE_BYTES:
        raise DFlashError(f"{y}: dtype {dtype!r}: expected one of {', '.join(REFERENCE_DTYPE_BYTES)}")
    params = planner.target_shape(m.target.config, m.target.name or "target").total_params
    dcfg = drafter_config(bundle, m)[1]
    params += planner.drafter_shape(dcfg).total_params if dcfg else 0
    return params * REFERENCE_DTYPE_BYTES[dtype], params, dtype


def check_cpu_pod_fits(bundle: Path, m: Manifest) -> None:
    """Refuse a CPU-only rollout whose reference model's weights alone exceed the CPU pod's memory
    limit: the pod would be OOM-killed while loading, over and over."""
    need, params, dtype = reference_weights(bundle, m)
    limit = CPU_POD_MEMORY_GIB * GIB
    if need > limit:
        gpu_ids = [g for g, hw in gpus().items() if hw.arch == m.arch]
        raise DFlashError(f"CPU-only deployment of {m.target.name or 'the target'}: the {REFERENCE_MODEL} model holds "
                          f"{params / 1e9:.2f} B parameters (target + drafter) in {dtype}, {need / GIB:.1f} GiB of "
                          f"weights, over the CPU pod's {CPU_POD_MEMORY_GIB} GiB memory limit; deploy on GPUs "
                          f"(--gpu {' | '.join(gpu_ids)}, or rebuild without --gpu none)")


def require_intact(bundle: str | Path) -> None:
    """Refuse a bundle `dflash-trt verify` refuses (a file missing, changed or unlisted), naming the
    first file: deploy and plan read its configs, and the pods would load what the manifest does not
    describe. Re-hashes every file, as verify does."""
    if problems := verify_bundle(bundle):
        raise DFlashError(f"{bundle}: the bundle does not match its manifest.json ({len(problems)} problem(s); "
                          f"`dflash-trt verify --bundle {bundle}` lists them): {problems[0]}; rebuild it "
                          "(`dflash-trt build ... --out` the same folder)")


def plan_for_bundle(bundle: str | Path, *, nodes: int = 1, gpus_per_node: int | None = None,
                    gpu: str | None = None, max_seq_len: int | None = None,
                    objective: str = "latency", manifest: Manifest | None = None, **limits) -> planner.Plan | None:
    """The plan `build` recorded for the bundle (plan.json; plan/record.py) on `nodes` nodes of its GPU's node type
    (or `gpu`'s): no layout search here. None for a bundle without a GPU (CPU-only deployment). `limits`:
    serving limits over the bundle's own (max_batch_size, max_attention_window); `manifest`: the bundle's,
    when the caller has read it."""
    bundle = Path(bundle)
    m = manifest or Manifest.read(bundle)
    hw = bundle_hardware(m, gpu)
    if hw is None:
        return None
    return read_plan(bundle).plan_for(bundle, hw, nodes=nodes, gpus_per_node=gpus_per_node,
                                      max_seq_len=max_seq_len or m.max_seq_len, objective=objective, limits=limits)


def chosen_layout(p: planner.Plan, nodes: int) -> planner.Layout:
    """The plan's chosen layout, or one line why nothing fits `nodes` nodes."""
    if p.chosen is None:
        raise DFlashError(f"the bundle does not fit {nodes} × {p.hardware}: tp {p.layouts[0].tp}: {p.layouts[0].reason}")
    return p.chosen


def bundle_model_configs(bundle: str | Path, manifest: Manifest | None = None) -> tuple[dict, dict | None]:
    """(target config.json, drafter config.json or None) of a bundle: what its plan was made of."""
    bundle = Path(bundle)
    m = manifest or Manifest.read(bundle)
    return m.target.config, drafter_config(bundle, m)[1]


def parse_image(ref: str, option: str) -> dict:
    """--image / --multinode-image REPOSITORY[:TAG][@sha256:DIGEST] → the chart's image block."""
    m = IMAGE_REF.match(ref or "")
    if not m or not (m["tag"] or m["digest"]):
        raise DFlashError(f"{option} {ref!r}: expected REPOSITORY:TAG or REPOSITORY@sha256:<64 hex digits>")
    return {"repository": m["repo"], "tag": m["tag"] or "", "digest": m["digest"] or ""}


def check_counts(*, nodes: int, gpus_per_node: int | None, replicas: int | None) -> None:
    """Every count a user gives deploy, bounded (the chart's own limits)."""
    planner.check_nodes(nodes)
    if gpus_per_node is not None and gpus_per_node not in POD_GPU_COUNTS:
        raise DFlashError(f"--gpus-per-node {gpus_per_node}: must be one of {', '.join(map(str, POD_GPU_COUNTS))} "
                          "(the chart's gpu.count)")
    if replicas is not None and not 1 <= replicas <= MAX_REPLICAS:
        raise DFlashError(f"--replicas {replicas}: must be in [1, {MAX_REPLICAS}]")


def deploy_values(bundle: str | Path, *, nodes: int = 1, gpus_per_node: int | None = None,
                  replicas: int | None = None, gpu: str | None = None, pvc: str | None = None,
                  ssh_secret: str = DEFAULT_SSH_SECRET, image: str | None = None, multinode_image: str | None = None,
                  server: str | None = None, engine_version: str | None = None, manifest: Manifest | None = None,
                  plan: planner.Plan | None = None) -> tuple[dict, planner.Plan | None]:
    """Chart values for a bundle, and the plan they follow (None for CPU-only). `server`: the
    chart's server.stack (default: trtllm-serve when the bundle holds a TensorRT-LLM config, else
    its first stack; Triton's dflash_reference for CPU-only); `image` / `engine_version`: an image
    of your own and the engine version it carries (default: the server's image the manifest
    records, engines.json); `plan`: plan_for_bundle's, when the caller has made it (nodes and GPU as
    here)."""
    check_counts(nodes=nodes, gpus_per_node=gpus_per_node, replicas=replicas)
    bundle = Path(bundle)
    m = manifest or Manifest.read(bundle)
    models = list(m.triton_models)
    served = list(m.served_stacks)
    values: dict = {
        "bundle": {"modelRepository": m.triton_model_repository, "delivery": "pvc", "stacks": served},
        "podAnnotations": {"dflash-trt/target": str(m.target.name or ""),
                           "dflash-trt/tool-version": str(m.tool_version or "")},
    }
    p = plan or plan_for_bundle(bundle, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, manifest=m)
    server = server or (stacks.cpu_server().name if p is None else default_server(served))
    srv = stacks.server(server)
    values["server"] = {"stack": server}
    if p is not None or not srv.cpu_reference:
        values["image"] = server_image(m, server, served, image, engine_version)
    elif image:
        values["image"] = {**parse_image(image, "--image"), "engineVersion": engine_version or ""}

    if p is None:   # CPU-only: the reference-runtime model, one pod, no GPU
        if REFERENCE_MODEL not in models:
            raise DFlashError(f"manifest.json: no GPU and no {REFERENCE_MODEL} model in triton_models {models}; "
                              "pass --gpu")
        if not srv.cpu_reference:
            raise DFlashError(f"--server {server}: a CPU-only deployment serves the {REFERENCE_MODEL} model on "
                              f"{stacks.cpu_server().name}; pass --gpu for the bundle's GPU servers")
        check_cpu_pod_fits(bundle, m)
        values.update({
            "replicas": 1 if replicas is None else replicas,
            "workload": {"kind": "Deployment"},
            "gpu": {"count": 0, "product": ""},
            "parallel": {"tp": 1, "pp": 1, "ep": 1},
            "shmSize": "1Gi",
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": f"{CPU_POD_MEMORY_GIB}Gi"}},
        })
        values["bundle"]["models"] = [REFERENCE_MODEL]
        values["bundle"]["pvc"] = _pvc(pvc, 10, rwx=False)
        return values, None

    chosen = chosen_layout(p, nodes)
    hw = bundle_hardware(m, gpu)
    gpn = p.gpus_per_node
    pod_gpus = min(chosen.tp, gpn)
    n_replicas = chosen.replicas if replicas is None else replicas
    multi = chosen.tp > gpn
    shm_gib = SHM_PER_GPU_GIB * pod_gpus
    weights_gib_per_pod = math.ceil((chosen.weights_bytes_per_gpu + chosen.drafter_bytes_per_gpu) * pod_gpus / GIB)
    gpu_models = [x for x in models if x != REFERENCE_MODEL]
    bundle_gib = math.ceil((p.weights_bytes["target"] + p.weights_bytes["drafter"]) * 1.5 / GIB)
    values.update({
        "replicas": n_replicas,
        "workload": {"kind": "LeaderWorkerSet" if multi else "Deployment"},
        "gpu": {"count": pod_gpus, "product": hw.gpu_product},
        "parallel": {"tp": chosen.tp, "pp": 1, "ep": chosen.ep},
        "shmSize": f"{shm_gib}Gi",
        "resources": {
            "requests": {"cpu": str(CPU_PER_GPU * pod_gpus), "memory": f"{shm_gib + HOST_MEMORY_BASE_GIB}Gi"},
            # Weights pass through host memory (page cache) while loading.
            "limits": {"memory": f"{shm_gib + HOST_MEMORY_BASE_GIB + weights_gib_per_pod}Gi"},
        },
        # Ready for autoscaling.enabled: aim at 80 % of one instance's batch slots in flight.
        "autoscaling": {"targetAverageValue": str(max(1, int(AUTOSCALE_TARGET_SHARE * chosen.max_sequences)))},
    })
    values["bundle"]["models"] = gpu_models if srv.loads_triton_models else []
    values["bundle"]["pvc"] = _pvc(pvc, max(10, bundle_gib), rwx=multi or n_replicas > 1)
    if multi:
        if not srv.mpi_launch:
            raise DFlashError(f"--server {server}: the layout spans {chosen.nodes_per_replica} nodes per instance, and the "
                              f"chart's multi-node launch is MPI, which only {' and '.join(MPI_SERVERS)} run; pass "
                              f"--server {MPI_SERVERS[0]} or a layout within one node")
        if not multinode_image:
            raise DFlashError(f"the layout spans {chosen.nodes_per_replica} nodes per instance (a LeaderWorkerSet): pass "
                              "--multinode-image REPOSITORY:TAG, the serving image plus sshd (MPI starts the worker "
                              f"ranks over ssh; the stock images have none), built from {DOCKERFILE}")
        # built FROM the server's image (deploy/multinode.Dockerfile): the same engine version
        values["multiNode"] = {"sshSecret": ssh_secret, "image": {**parse_image(multinode_image, "--multinode-image"),
                                                                  "engineVersion": values["image"]["engineVersion"]}}
    return values, p


# the chart's LeaderWorkerSet launch (trtllm-llmapi-launch under mpirun) runs these servers
MPI_SERVERS = tuple(name for name, srv in stacks.servers().items() if srv.mpi_launch)


def default_server(served: list[str]) -> str:
    """The first server, in the chart's order (trtllm-serve first), whose stack's config the bundle holds."""
    for name, srv in stacks.servers().items():
        if srv.engine_stack in served:
            return name
    raise DFlashError("manifest.json: serving_stacks.served is empty: the bundle holds no serving config")


def server_image(m: Manifest, server: str, served: list[str], image: str | None, engine_version: str | None) -> dict:
    """The chart's image block for `server`: --image with its engine version, or the image the
    manifest records for the server (engines; engines.json for bundles built before it). Refuses
    a server whose stack the bundle holds no config for, and an engine that predates DFlash."""
    st = stacks.engine_stack(server)
    if st.name not in served:
        raise DFlashError(f"--server {server}: the bundle holds no {st.facts['engine']} config "
                          f"(manifest.json serving_stacks.served {served}); choose one of "
                          f"{', '.join(n for n, s in stacks.servers().items() if s.engine_stack in served)}")
    if image:
        block = parse_image(image, "--image")
        version, where = engine_version, f"--image {image}"
        known = st.image_engine_version(block)
        if known:   # a published image's table (Triton's matrix) wins over a declaration
            version, source = known
            where += f" ({source})"
        if not version:
            raise DFlashError(f"--image {image}: pass --engine-version, the {st.facts['engine']} "
                              "version the image carries (deploy refuses one that predates DFlash)")
    else:
        recorded = (m.engines.get(st.name) or {}).get("servers", {}).get(server)
        row = engines.facts()["servers"][server]
        ref = recorded["image"] if recorded else engines.image_ref(row["image"])
        version = recorded["engine_version"] if recorded else row["engine_version"]
        where = f"manifest.json engines: {ref}"
        if not ref:
            raise DFlashError(f"--server {server}: NVIDIA publishes no image with tritonserver and a DFlash-capable "
                              f"TensorRT-LLM: build {row['build']} and pass --image REPOSITORY:TAG --engine-version "
                              f"{row['engine_version']}")
        block = parse_image(ref, "manifest.json engines")
    if problem := engines.dflash_problem(server, version, where):
        raise DFlashError(problem)
    return {**block, "engineVersion": version}


# Kubernetes' name rules (k8s.io/apimachinery pkg/util/validation): a Service name is a DNS-1035
# label; pods' host names (StatefulSet, LeaderWorkerSet) DNS-1123 labels; other objects DNS-1123
# subdomains. Helm refuses a release name that is not a DNS-1123 label-like name of <= 53 characters.
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
NAME_RULES = {"Service": (DNS1035_LABEL, 63, "a DNS-1035 label: lower-case letters, digits and '-', starting with a "
                                              "letter, ending with a letter or digit"),
              "StatefulSet": (DNS1123_LABEL, 63, "a DNS-1123 label (its pods' host names)"),
              "LeaderWorkerSet": (DNS1123_LABEL, 63, "a DNS-1123 label (its pods' host names and subdomain)")}
SUBDOMAIN_RULE = (DNS1123_SUBDOMAIN, 253, "a DNS-1123 subdomain: lower-case letters, digits, '-' and '.'")
MAX_RELEASE = 53


def check_release(release: str, namespace: str) -> None:
    """--release / --namespace as Helm and the API server take them, before anything renders."""
    if not (DNS1123_LABEL.match(release or "") and len(release) <= MAX_RELEASE):
        raise DFlashError(f"--release {release!r}: Helm refuses it: a release name is a DNS-1123 label of at most "
                          f"{MAX_RELEASE} characters (lower-case letters, digits and '-', starting and ending with a "
                          "letter or digit), e.g. gpt-oss")
    if not (DNS1123_LABEL.match(namespace or "") and len(namespace) <= 63):
        raise DFlashError(f"--namespace {namespace!r}: Kubernetes refuses it: a namespace is a DNS-1123 label of at most "
                          "63 characters")


def rendered_objects(manifests: dict[str, str]) -> Iterator[tuple[str, dict]]:
    """(path, object) of every object in a chart's rendered files {path: YAML text}, NOTES.txt aside."""
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            yield from ((path, obj) for obj in yaml.safe_load_all(text) if isinstance(obj, dict))


def check_names(manifests: dict[str, str]) -> None:
    """Every rendered object's metadata.name against its kind's rule (one line, the first broken)."""
    for path, obj in rendered_objects(manifests):
        kind, name = obj.get("kind"), str((obj.get("metadata") or {}).get("name", ""))
        rule, limit, what = NAME_RULES.get(kind, SUBDOMAIN_RULE)
        if not (rule.match(name) and len(name) <= limit):
            raise DFlashError(f"{Path(path).name}: {kind} name {name!r} ({len(name)} characters): Kubernetes refuses "
                              f"it: must be {what}, at most {limit} characters (from the release name or "
                              "nameOverride / fullnameOverride)")


def _pvc(existing: str | None, size_gib: int, rwx: bool) -> dict:
    if existing:
        return {"existingClaim": existing, "create": False}
    return {"existingClaim": "", "create": True, "size": f"{size_gib}Gi",
            "accessModes": ["ReadWriteMany" if rwx else "ReadWriteOnce"]}


def render(values: dict, chart: str | Path | None = None, release: str = "dflash-trt",
           namespace: str = "default") -> dict[str, str]:
    """Render the chart with Helm's own engine (helm-python-sdk): template path → manifest.
    Helm validates the values against values.schema.json first."""
    import helm_python as helm

    chart = Path(chart) if chart else default_chart_dir()
    if not (chart / "Chart.yaml").is_file():
        raise DFlashError(f"{chart}: no Chart.yaml (pass --chart DIR: a dflash-trt Helm chart folder)")
    with helm.Chart.load(str(chart)) as c:
        try:
            return c.render(values, name=release, namespace=namespace, is_install=True)
        except helm.HelmError as e:
            msg = " ".join(str(e).split())
            raise DFlashError(f"{chart}: helm rejected the values: {msg}") from None


DEPLOY_RECORD = ".dflash-trt-deploy.json"   # {file: sha256} of what deploy wrote: edits since are the user's


@contextmanager
def deploy_folder(out: str | Path, marker: str, force: bool | None = None) -> Iterator[Path]:
    """A folder `deploy` writes, published whole (io/atomic.py atomic_output_dir). An `out` that exists must be
    an earlier one (holding `marker`), else it is refused; with force False, one whose files were edited since
    deploy wrote them (DEPLOY_RECORD) is refused too, naming the file (force True replaces it; None: no such
    check)."""
    out = Path(out)
    if out.is_dir() and not (out / marker).is_file():
        raise DFlashError(f"{out}: exists and is not a deploy folder (no {marker}); choose another --out")
    edited = edited_files(out) if out.is_dir() and force is False else []
    if edited:
        raise DFlashError(f"{out / edited[0]}: edited since deploy wrote it ({len(edited)} file(s) edited); "
                          "pass --force to replace the folder, or --out elsewhere to keep the edits")
    with atomic_output_dir(out) as tmp:
        yield tmp
        record = {f.relative_to(tmp).as_posix(): sha256_file(f) for f in sorted(tmp.rglob("*"))
                  if f.is_file() and f.name != MARKER}
        (tmp / DEPLOY_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def edited_files(out: Path) -> list[str]:
    """The files of a deploy folder that differ from what deploy wrote (DEPLOY_RECORD; a folder
    written before the record existed: none known)."""
    try:
        record = json.loads((out / DEPLOY_RECORD).read_text())
    except (OSError, ValueError):
        return []
    return [rel for rel, digest in record.items()
            if not (out / rel).is_file() or sha256_file(out / rel) != digest]


def write_deployment(out: str | Path, values: dict, manifests: dict[str, str] | None, header: str = "",
                     force: bool | None = None) -> Path:
    """values.yaml (+ manifests/*.yaml) into `out`, written to a temp folder and renamed (deploy_folder,
    `force` as there)."""
    with deploy_folder(out, "values.yaml", force) as tmp:
        (tmp / "values.yaml").write_text(header + yaml.safe_dump(values, sort_keys=False))
        if manifests is not None:
            (tmp / "manifests").mkdir()
            for name, text in sorted(manifests.items()):
                if not text.strip() or name.endswith("NOTES.txt"):
                    continue
                (tmp / "manifests" / Path(name).name).write_text(text.lstrip("\n"))
            if notes := next((t for n, t in manifests.items() if n.endswith("NOTES.txt")), None):
                (tmp / "NOTES.txt").write_text(notes)
    return Path(out)


def rendered_images(manifests: dict[str, str], values: dict) -> list[dict]:
    """Every container image of the rendered objects, once, with the engine version it carries."""
    versions = {}
    for key in ("image", "multiNode"):
        block = values.get(key, {}).get("image") if key == "multiNode" else values.get(key)
        if block and block.get("repository"):
            versions[engines.image_ref(block)] = block.get("engineVersion", "")
    stack = engines.facts()["stacks"][engines.server_stack(values["server"]["stack"])]
    seen: dict[str, dict] = {}
    for _, obj in rendered_objects(manifests):
        for ref, init in _container_images(obj):
            if ref in seen:
                continue
            if obj.get("kind") == "Job":
                what = "the bundle loader Job: copies the bundle onto the claim"
            elif init and ref in versions:
                what = f"init container: waits for the bundle loader ({stack['engine']} {versions[ref]})"
            elif init:
                what = "init container: copies the bundle"
            elif versions.get(ref):
                what = f"{stack['engine']} {versions[ref]}; DFlash since {stack['dflash_since']}"
            else:
                what = "Triton with the bundle's dflash_reference model (the CPU reference runtime, no engine)"
            seen[ref] = {"image": ref, "engine_version": versions.get(ref) or None, "what": what}
    return list(seen.values())


def _container_images(obj: dict):
    specs = []
    spec = obj.get("spec") or {}
    if "template" in spec:
        specs.append(spec["template"].get("spec") or {})
    if lwt := spec.get("leaderWorkerTemplate"):
        specs += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    for ps in specs:
        for c in ps.get("initContainers") or []:
            yield c["image"], True
        for c in ps.get("containers") or []:
            yield c["image"], False
