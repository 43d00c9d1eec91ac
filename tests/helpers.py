"""Helpers shared by the test modules (tests import them as `from helpers import ...`; fixtures
live in conftest.py): the CLI run in-process, a tiny target with its own answers, a test double of Triton's Python-backend API, a
streamed request to a real Triton server, whether network namespaces can be made here, and
validation of rendered Kubernetes objects."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import queue
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from dflash_trt.cli import main
from dflash_trt.stacks.tritonserver.repo import parse_model_config
from dflash_trt.stacks.tritonserver.server import default_stub_env, pytriton_dist, server_environment


# ------------------------------------------------------------------------------------ the CLI
def run_cli(*argv: str) -> tuple[int, str, str]:
    """`dflash-trt ARGV...` in-process: (exit code, stdout, stderr). main() always ends in SystemExit
    (click usage errors exit 2). Redirection, not capsys, so module-scoped fixtures can use it too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, out.getvalue(), err.getvalue()


def generate_json(target, drafter, prompt: str, max_new_tokens: int) -> dict:
    """`dflash-trt generate --json` in a fresh process: what a user running it would get."""
    out = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--target", str(target), "--drafter",
                          str(drafter), "-p", prompt, "--max-new-tokens", str(max_new_tokens), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def add_plan(bundle: Path) -> None:
    """plan.json of a bundle written by hand (its manifest.json), as `build` writes it (plan/record.py write_plan),
    listed with its sha256 in the manifest: deploy and `plan --bundle` read it and verify the bundle first."""
    from dflash_trt.io.manifest import Manifest, sha256_file
    from dflash_trt.plan.record import PLAN_FILE, write_plan

    write_plan(bundle, Manifest.read(bundle))
    m = json.loads((bundle / "manifest.json").read_text())
    f = bundle / PLAN_FILE
    m["artifacts"] = [a for a in m["artifacts"] if a["path"] != PLAN_FILE] + [
        {"path": PLAN_FILE, "bytes": f.stat().st_size, "sha256": sha256_file(f)}]
    (bundle / "manifest.json").write_text(json.dumps(m))


# ------------------------------------------------------------------ training data
def block_loss(drafter, frozen, batch, gamma: float):
    """The trainer's loss of one batch (train/objective.block_loss_terms, normalised by its weights)."""
    from dflash_trt.train.objective import block_loss_terms

    total, weight = block_loss_terms(drafter, frozen, batch, gamma)
    return total / weight if weight > 0 else total


def tiny_target_with_answers(root: Path) -> Path:
    """A tiny Llama target (root/target) and root/data.jsonl: its own greedy answers (transformers,
    40 new tokens) to 12 training prompts, the trainer tests' data set. Returns root."""
    from dflash_trt.models.tiny import make_tiny
    from dflash_trt.train.data import generate_responses
    from dflash_trt.train.prompts import build_prompts

    make_tiny("llama", root / "target")
    prompts = [r["prompt"] for r in build_prompts("train", limit=12)]
    generate_responses(root / "target", prompts, root / "data.jsonl", max_new_tokens=40, batch_size=12,
                       progress=False, engine="hf")
    return root


# ----------------------------------------------------------------- test double of Triton's API
# The objects of `triton_python_backend_utils` (the module Triton's Python backend injects), with
# the methods the bundle's model.py files call. No Triton server runs in these tests.
class TritonModelException(Exception):
    pass


class TritonError:
    # the codes the Python backend's stub exposes (python_backend r24.10 src/pb_stub.cc:1645-1672)
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG"

    def __init__(self, message, code=None):
        self._message = message
        self._code = code or self.INTERNAL

    def code(self):
        return self._code

    def message(self):
        return self._message


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def is_cpu(self):
        return True


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self._tensors, self._error = list(output_tensors), error

    def output_tensors(self):
        return self._tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class ResponseSender:
    def __init__(self):
        self.sent = []  # (response, flags)

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class InferenceRequest:
    def __init__(self, inputs, request_id=""):
        self._inputs, self._id, self._sender = list(inputs), request_id, ResponseSender()

    def inputs(self):
        return self._inputs

    def request_id(self):
        return self._id

    def get_response_sender(self):
        return self._sender

    def is_cancelled(self):
        return False


class Logger:
    @staticmethod
    def log_info(msg):
        pass

    log_warn = log_error = log_verbose = log_info


class MetricFamily:
    """Triton's custom-metrics API (pb_utils.MetricFamily / Metric): values kept in memory."""
    GAUGE, COUNTER = "gauge", "counter"

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []

    def Metric(self, labels=None):
        metric = _Metric(labels or {})
        self.metrics.append(metric)
        return metric


class _Metric:
    def __init__(self, labels):
        self.labels, self._value = labels, 0.0

    def set(self, value):
        self._value = float(value)

    def increment(self, value):
        self._value += float(value)

    def value(self):
        return self._value


def get_input_tensor_by_name(request, name):
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response, name):
    return next((t for t in response.output_tensors() if t.name() == name), None)


def make_pb_utils(model_dir: Path) -> types.ModuleType:
    """A minimal `triton_python_backend_utils` for the model in model_dir."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    for obj in (TritonModelException, TritonError, Tensor, InferenceResponse, InferenceRequest, Logger,
                MetricFamily, get_input_tensor_by_name, get_output_tensor_by_name):
        setattr(pb, obj.__name__, obj)
    pb.get_model_dir = lambda: str(model_dir)
    return pb


def load_model_module(model_py: Path, pb):
    """Import a bundle's model.py with pb as its `triton_python_backend_utils` (the conftest
    fixture pb_cleanup removes it from sys.modules afterwards)."""
    sys.modules["triton_python_backend_utils"] = pb
    sys.modules.pop("dflash_metrics", None)  # each model folder has its own copy
    spec = importlib.util.spec_from_file_location(f"triton_model_{model_py.parent.parent.name}", model_py)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(model_py.parent))  # Triton's Python backend imports the model's sibling files
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(model_py.parent))
    return mod


def triton_args(repo: Path, name: str) -> dict:
    """The `args` dict Triton passes to initialize()."""
    from google.protobuf.json_format import MessageToJson

    cfg = parse_model_config((repo / name / "config.pbtxt").read_text())
    return {"model_config": MessageToJson(cfg), "model_instance_kind": "CPU", "model_instance_name": f"{name}_0",
            "model_instance_device_id": "0", "model_repository": str(repo / name), "model_version": "1",
            "model_name": name}


# ------------------------------------------------------------------- a real Triton server
def infer_inputs(*tensors: tuple[str, np.ndarray, str]):
    """tritonclient gRPC InferInputs from (name, array, Triton dtype) triples."""
    import tritonclient.grpc as g

    out = []
    for name, arr, dtype in tensors:
        t = g.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def grpc_stream(grpc_url: str, model: str, inputs, timeout: float) -> tuple[list[dict], object]:
    """One request over a Triton gRPC stream, until its final response: (each response that has
    outputs, as {name: array}; the stream's error or None)."""
    import tritonclient.grpc as g

    client = g.InferenceServerClient(grpc_url)
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    responses, error = [], None
    while True:
        result, error = got.get(timeout=timeout)
        if error is not None:
            break
        resp = result.get_response()
        if resp.outputs:
            responses.append({o.name: result.as_numpy(o.name) for o in resp.outputs})
        if resp.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return responses, error


# ------------------------------------------------------------------ network namespaces
@functools.cache
def tritonserver_missing(stub: bool = True) -> str | None:
    """None when tritonserver can execute here, else why not (the one reason to skip); `stub`: also
    that its Python-backend stub can load (a repository with Python models needs it)."""
    binary = pytriton_dist() / "bin" / "tritonserver"
    try:
        p = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False,
                           env=server_environment(default_stub_env()), timeout=60)
    except OSError as e:
        return f"{binary} cannot execute here: {e}"
    if "error while loading shared libraries" in p.stderr:
        return f"{binary} cannot start here: {p.stderr.strip().splitlines()[-1]}"
    if not stub:
        return None
    # the Python-backend stub links the base interpreter's libpython3.x.so (absent from a static build)
    stub_dir = pytriton_dist() / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    if not shutil.which("ldd"):
        return None  # cannot tell ahead; the server start reports a stub that cannot load
    ldd = subprocess.run(["ldd", str(stub_dir / "triton_python_backend_stub")], capture_output=True, text=True,
                         env=server_environment(default_stub_env()), check=False)
    missing = [line.strip() for line in ldd.stdout.splitlines() if "not found" in line]
    if missing:
        return f"the Python-backend stub cannot start here: {missing[0]}"
    return None


def netns_missing() -> str | None:
    """None where this process can make a network namespace (root, iproute2, `ip netns add`
    works), else why not: the reason the multi-node tests skip."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    if not shutil.which("ip"):
        return "no iproute2 (ip)"
    probe = f"dft-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


# ------------------------------------------------------------------ rendered Kubernetes objects
LWS_CRD = Path(__file__).parent / "data" / "leaderworkerset-crd.yaml"
KEDA_CRD = Path(__file__).parent / "data" / "keda-scaledobject-crd.yaml"
K8S_VERSION = "1.33"


def objects(manifests: dict[str, str]) -> list[dict]:
    """The Kubernetes objects of rendered chart files {path: yaml text}, NOTES.txt left out."""
    out = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


def lws_schema() -> dict:
    return crd_schema(LWS_CRD, "v1")


def crd_schema(path: Path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return v["schema"]["openAPIV3Schema"]


def validate_all(objs: list[dict]) -> list[str]:
    """Validate every object; returns the kinds validated. The modules that call it skip
    themselves when kubernetes-validate or jsonschema is missing."""
    import jsonschema
    import kubernetes_validate as kv

    kinds = []
    for o in objs:
        if o["kind"] == "LeaderWorkerSet":
            jsonschema.validate(o, lws_schema())
            # CRD schemas do not reject unknown fields (the API server prunes them): check the
            # leader and worker pod templates as Pods against the strict Kubernetes schema too.
            tpl = o["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": tpl[role].get("metadata", {}),
                             "spec": tpl[role]["spec"]}, K8S_VERSION, strict=True)
        elif o["apiVersion"] == "keda.sh/v1alpha1" and o["kind"] == "ScaledObject":
            jsonschema.validate(o, crd_schema(KEDA_CRD, "v1alpha1"))
        elif o["apiVersion"].startswith("monitoring.coreos.com/"):
            # A Prometheus Operator kind: against its CRD copied into deploy/schemas (unknown fields refused),
            # and a ServiceMonitor scrapes a named port of the release's Service, at an absolute path.
            from dflash_trt.deploy.monitoring import crd_schema as monitoring_crd_schema
            # (no meta-schema check: the CRDs carry Go regexes, e.g. "^(?i)(abort|warn)?$", Python's re refuses)
            jsonschema.Draft7Validator(monitoring_crd_schema(o["kind"])).validate(o)
            if o["kind"] == "ServiceMonitor":
                ep = o["spec"]["endpoints"][0]
                ports = {p["name"] for s in objs if s["kind"] == "Service" for p in s["spec"]["ports"]}
                assert ep["port"] in ports and ep["path"].startswith("/"), (ep, ports)
        else:
            kv.validate(o, K8S_VERSION, strict=True)
        kinds.append(o["kind"])
    return kinds


WHEEL_CACHE = Path(__file__).parent / ".cache" / "wheels"


def pypi_wheel(spec: str) -> Path:
    """An upstream wheel (`name==version`) to read, never to install: `pip download --no-deps` once into
    tests/.cache/wheels (each stack's and Dynamo's sources are read from their own release)."""
    name, version = spec.split("==")
    found = sorted(WHEEL_CACHE.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-q", spec, "-d", str(WHEEL_CACHE)],
                           capture_output=True, text=True, check=False)
        found = sorted(WHEEL_CACHE.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        assert found, f"pip download --no-deps {spec} failed: {r.stderr.strip()[-500:]}"
    return found[0]


def wheel_source(spec: str, path: str) -> str:
    """One source file of an upstream wheel (pypi_wheel), as text."""
    with zipfile.ZipFile(pypi_wheel(spec)) as z:
        return z.read(path).decode()


def dynamo_env_problem(env: Path) -> str | None:
    """None when the Dynamo env (stacks/dynamo_local.py) is ready, else why not, in one line."""
    from dflash_trt.paths import DYNAMO_ENV_READY
    from dflash_trt.stacks.vllm.env import side_env_problem, vllm_python

    return side_env_problem(env, DYNAMO_ENV_READY, vllm_python(env), "Dynamo", "dynamo", "DFLASH_TRT_DYNAMO_ENV")
