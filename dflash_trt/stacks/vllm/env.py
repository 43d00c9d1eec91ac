"""How a process of the vLLM side env (paths.vllm_env_dir) is started: its Python and its
environment. One place for both users: stacks/vllm/server.py (`vllm serve`, the env's making) and
train/data.py (the trainer's vLLM answers)."""
from __future__ import annotations

import os
from pathlib import Path

from dflash_trt.paths import VLLM_ENV_READY, vllm_env_dir

# The host/CPU settings a vLLM process runs with (none changes what is decoded; each measured or
# read from vllm/envs.py of 0.32.0):
CPU_ENV = {
    # without it vLLM 0.32's platform detection fails on this CPU build ("Failed to infer device type")
    "VLLM_TARGET_DEVICE": "cpu",
    # KV-cache GiB on CPU (default 0 = vLLM sizes it from free RAM: on a shared 24 GiB host
    # that starves the other jobs; 2 GiB holds ~16k tokens of a 135M model many times over)
    "VLLM_CPU_KVCACHE_SPACE": "2",
    # "auto" pins one OpenMP thread per core of a NUMA node; with other processes on the same
    # cores a pinned thread waits for a busy core. "nobind" leaves placement to the OS.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # busy-waiting OpenMP threads stall when anything else shares the cores (3x faster here)
    "OMP_WAIT_POLICY": "PASSIVE",
    # vLLM is only ever given local folders (a bundle, a target): it has nothing to fetch from the hub
    "HF_HUB_OFFLINE": "1",
}

# what points at our env and would make the vLLM env's Python import our packages, not its own
_OURS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def vllm_python(env: Path | None = None) -> Path:
    """The Python of the vLLM env `env` (default paths.vllm_env_dir())."""
    return Path(env or vllm_env_dir()) / "bin" / "python3"


def vllm_env_ready(env: Path | None = None) -> bool:
    """The env has its Python and the ready stamp `make vllm` writes last (a half-made env is no env)."""
    root = Path(env or vllm_env_dir())
    return vllm_python(root).is_file() and (root / VLLM_ENV_READY).is_file()


def clean_env(extra: dict | None = None) -> dict:
    """os.environ for a process of the vLLM env, less what points at ours (_OURS), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    return {**env, **(extra or {})}


def side_env_problem(env: Path, ready_stamp: str, executable: Path, title: str, make_target: str,
                     env_var: str) -> str | None:
    """None when a side env (the vLLM one, the Dynamo one) is ready, else why not, in one line: the
    recorded failure of `make <make_target>` (<env>.failed, written by `make test`) or the missing env."""
    env = Path(env)
    if (env / ready_stamp).is_file() and executable.is_file():
        return None
    failed = env.with_name(env.name + ".failed")
    if failed.is_file() and failed.read_text().strip():
        return f"the {title} env {env} could not be built: {failed.read_text().strip()}"
    return f"no {title} env at {env} (create it with `make {make_target}`, or set ${env_var})"
