"""Serving engines as facts: which engine each stack runs, the first version with DFlash, the
version our contract was read at, and per server the image and the engine version it carries.

The data is deploy/helm/dflash-trt/engines.json, every row with its source; the Helm chart reads
the same file (.Files.Get), so `helm install` refuses what `dflash-trt deploy` refuses. `build`
copies the served stacks' rows into manifest.json (`engines`); `deploy` and `plan` read them there.
Versions compare as PEP 440 versions (1.3.0rc20 < 1.4.0rc4 < 1.4.0), as TensorRT-LLM numbers them.
"""
from __future__ import annotations

import json
from functools import lru_cache

from packaging.version import InvalidVersion, Version

from dflash_trt.errors import DFlashError
from dflash_trt.paths import deploy_path

# deploy --server values that render an orchestrator's own resource instead of the chart's values
# (engines.json `dynamo`: dflash_trt/deploy/dynamo.py, a DynamoGraphDeployment)
ORCHESTRATORS = ("dynamo",)


@lru_cache(maxsize=1)
def facts() -> dict:
    return json.loads(deploy_path("helm", "dflash-trt", "engines.json").read_text())


def server_names() -> tuple[str, ...]:
    """The chart's server.stack values, in engines.json's order (its servers)."""
    return tuple(facts()["servers"])


SERVERS = server_names()   # (deploy --server's choices)


def server_stack(server: str) -> str:
    """trtllm-serve / triton -> trtllm; vllm -> vllm; sglang -> sglang (the bundle config it loads)."""
    try:
        return facts()["servers"][server]["stack"]
    except KeyError:
        raise DFlashError(f"unknown server {server!r}: expected one of {', '.join(server_names())}") from None


def parse_version(text: str, where: str) -> Version:
    try:
        return Version(str(text))
    except InvalidVersion:
        raise DFlashError(f"{where} {text!r}: not a version (e.g. 1.4.0rc4, 0.33.0)") from None


def dflash_problem(server: str, engine_version: str, where: str = "engine version") -> str | None:
    """Why an image carrying `engine_version` of the server's engine cannot run DFlash (None: it can)."""
    stack = facts()["stacks"][server_stack(server)]
    if parse_version(engine_version, where) < parse_version(stack["dflash_since"], "dflash_since"):
        return (f"{where}: {stack['engine']} {engine_version} predates DFlash, so decoding_type DFlash cannot load "
                f"(first in {stack['dflash_since']}: {stack['dflash_since_source'].split('. ')[0]})")
    return None


def pinned_version(stack: str) -> str:
    """The engine version the stack's servers run (their images' engine_version; one per stack)."""
    versions = {srv["engine_version"] for srv in facts()["servers"].values() if srv["stack"] == stack}
    if len(versions) != 1:
        raise DFlashError(f"engines.json: stack {stack!r} has servers on {len(versions)} engine versions")
    return versions.pop()


def triton_image_engine(tag: str) -> str | None:
    """The TensorRT-LLM version of an NGC tritonserver:<tag> image (Triton's compatibility matrix)."""
    return facts()["triton_trtllm_images"]["tensorrt_llm_by_tag"].get(tag)


def image_ref(image: dict) -> str:
    """repository@digest when pinned, else repository:tag ("" when the image must be built)."""
    if not image.get("repository"):
        return ""
    return f"{image['repository']}@{image['digest']}" if image.get("digest") else f"{image['repository']}:{image['tag']}"


def manifest_record(stacks: list[str]) -> dict:
    """manifest.json `engines`: for each served stack its engine facts and its servers' images."""
    f = facts()
    out: dict = {}
    for stack in stacks:
        s = f["stacks"][stack]
        servers = {name: {"image": image_ref(srv["image"]), "engine_version": srv["engine_version"],
                          **({"build": srv["build"]} if srv.get("build") else {})}
                   for name, srv in f["servers"].items() if srv["stack"] == stack}
        out[stack] = {"engine": s["engine"], "dflash_since": s["dflash_since"], "contract": s["contract"],
                      "contract_source": s["contract_source"], "servers": servers}
    return out
