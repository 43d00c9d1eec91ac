"""Shared fixtures: tiny pairs of every supported family, built once per test session. Shared
helpers that are not fixtures are in helpers.py."""
from __future__ import annotations

import os
import shutil
import sys

# Busy-waiting OpenMP threads stall when other processes share the 2 cores; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests never reach the Hugging Face hub (tests/test_hub.py tests the unreachable case on its own).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

# Tiny models: one thread is ~10x faster than two when other processes share the 2 cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pairs(tmp_path_factory):
    """{arch: (target_dir, drafter_dir)} for llama, qwen3 and gpt-oss (MXFP4 experts)."""
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for i, arch in enumerate(("llama", "qwen3", "gpt-oss")):
        make_tiny(arch, root / arch, root / f"{arch}-drafter", seed=i)
        out[arch] = (root / arch, root / f"{arch}-drafter")
    return out


@pytest.fixture
def pair(tiny_pairs, tmp_path):
    """A private copy of the tiny llama pair (target_dir, drafter_dir), for tests that damage it."""
    t, d = tiny_pairs["llama"]
    shutil.copytree(t, tmp_path / "t")
    shutil.copytree(d, tmp_path / "d")
    return tmp_path / "t", tmp_path / "d"


@pytest.fixture(scope="session")
def vllm_env():
    """The vLLM env (vLLM's CPU build, stacks/vllm/server.py), or a skip naming why there is none.
    `make test` builds it first (`make vllm`); a failed build is recorded and named here."""
    from dflash_trt.paths import vllm_env_dir
    from dflash_trt.stacks.vllm.server import vllm_env_problem

    env = vllm_env_dir()
    problem = vllm_env_problem(env)
    if problem:
        pytest.skip(problem)
    return env


@pytest.fixture(scope="session")
def dynamo_env():
    """The Dynamo env (ai-dynamo with vLLM's CPU build, stacks/dynamo_local.py), or a skip naming why
    there is none. `make test` builds it first (`make dynamo`); a failed build is recorded and named here."""
    from dflash_trt.paths import dynamo_env_dir

    from helpers import dynamo_env_problem

    env = dynamo_env_dir()
    problem = dynamo_env_problem(env)
    if problem:
        pytest.skip(problem)
    return env


@pytest.fixture(scope="session")
def vllm_bundle(vllm_env, embedded_vllm_bundle):
    """The embedded pair built for vLLM (embedded_vllm_bundle), for tests that run vLLM's own env."""
    return embedded_vllm_bundle


@pytest.fixture(scope="session")
def embedded_vllm_bundle(tmp_path_factory):
    """The embedded pair (SmolLM2-135M + our drafter) built for vLLM as a GPU user builds it:
    `build --arch hopper --gpu h200 --quant none --stacks vllm`. Tests must not modify it."""
    from helpers import run_cli

    out = tmp_path_factory.mktemp("vllm") / "bundle"
    code, _, err = run_cli("build", "--arch", "hopper", "--gpu", "h200", "--quant", "none", "--stacks", "vllm",
                           "--out", str(out))
    assert code == 0, err
    return out


@pytest.fixture
def pb_cleanup():
    """Removes the Triton API test double that helpers.load_model_module installs."""
    yield
    sys.modules.pop("triton_python_backend_utils", None)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(params=["c", "torch"])
def c_or_torch(request):
    """Run a test through a C kernel library (dflash_trt.kernels.c_loader) and through the torch code used
    where no C compiler exists. The test module names the library: C_KERNEL = (name, loader)."""
    from dflash_trt.kernels import c_loader

    name, loader = request.module.C_KERNEL
    if request.param == "torch":
        with c_loader.disabled():
            assert loader() is None
            yield request.param
        return
    if loader() is None:
        error = c_loader.build_error(name)
        pytest.fail(f"the {name} C kernels did not build:\n{error}" if error
                    else f"no C compiler: the {name} C kernels cannot be tested")
    yield request.param
