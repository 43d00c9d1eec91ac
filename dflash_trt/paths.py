"""Where dflash-trt keeps things: its cache folder and the package's own data files."""
from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path


def dflash_home() -> Path:
    """Our cache folder: $DFLASH_TRT_HOME, default ~/.cache/dflash-trt."""
    return Path(os.environ.get("DFLASH_TRT_HOME") or Path.home() / ".cache" / "dflash-trt")


def package_path(*parts: str) -> Path:
    """A file or folder shipped inside the package (works for an installed wheel and a checkout)."""
    return Path(str(resources.files("dflash_trt").joinpath(*parts)))


def deploy_path(*parts: str) -> Path:
    """Operator-facing files (the Helm chart, the Dockerfiles): the repository's top-level deploy/,
    which a wheel carries as dflash_trt/_deploy (setup.py); a checkout or editable install reads
    deploy/ itself."""
    shipped = package_path("_deploy")
    root = shipped if shipped.is_dir() else Path(__file__).resolve().parents[1] / "deploy"
    return root.joinpath(*parts)


VLLM_ENV_READY = ".dflash-trt-vllm-ready"  # written last by `make vllm`: an env without it is half-made


def vllm_env_dir() -> Path:
    """The side env holding vLLM's CPU build (stacks/vllm/server.py makes it; the trainer's answers
    use it too): $DFLASH_TRT_VLLM_ENV, else beside ours (<this env>/vllm, as <this env>/triton-stub)."""
    return Path(os.environ.get("DFLASH_TRT_VLLM_ENV") or Path(sys.prefix) / "vllm")


DYNAMO_ENV_READY = ".dflash-trt-dynamo-ready"  # written last by `make dynamo`


def dynamo_env_dir() -> Path:
    """The side env holding NVIDIA Dynamo (ai-dynamo) and vLLM's CPU build for its worker
    (stacks/dynamo_local.py makes it): $DFLASH_TRT_DYNAMO_ENV, else beside ours (<this env>/dynamo)."""
    return Path(os.environ.get("DFLASH_TRT_DYNAMO_ENV") or Path(sys.prefix) / "dynamo")
