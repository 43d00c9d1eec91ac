"""A real Triton Inference Server (2.51, from the PyPI wheel nvidia-pytriton) serving a bundle's
dflash_reference model: the same code as `dflash-trt serve --bundle DIR` (stacks/tritonserver/server.py).

The oracle is `dflash-trt generate` in a separate process: the text streamed back over gRPC must
equal it for the same prompt and settings (lossless through the server). The only skip is a
server binary that cannot run on this machine; a missing wheel or stub env is a failure (make
setup installs both).
"""
import json
import re
import subprocess
import sys
import threading
import time
import types
import urllib.request

import numpy as np
import pytest
import yaml

from dflash_trt.stacks.tritonserver.server import TritonServer

from helpers import grpc_stream, infer_inputs, run_cli, tritonserver_missing

pytest.importorskip("tritonclient.grpc")  # the client of helpers.grpc_stream
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = tritonserver_missing()
    if reason:
        pytest.skip(reason)
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("served")
    make_tiny("llama", root / "t", root / "d", seed=1)
    code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", "hopper",
                             "--quant", "none", "--out", str(root / "bundle"), "--json")
    assert code == 0, err
    srv = TritonServer(root / "bundle" / "triton", ["dflash_reference"], work=root / "server")
    srv.start(timeout=240)
    srv.pair = (root / "t", root / "d")
    srv.bundle = root / "bundle"
    yield srv
    srv.stop()


def _inputs(prompt=PROMPT, max_tokens=24, streaming=True, text=True):
    tensors = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")] if text else []
    return infer_inputs(*tensors, ("sampling_param_max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
                        ("streaming", np.array([streaming]), "BOOL"))


def _stream(server, inputs, timeout=120):
    """One request over a gRPC stream: (responses as {name: array}, error or None)."""
    return grpc_stream(server.grpc_url, "dflash_reference", inputs, timeout)


def _generate(server, prompt, max_tokens):
    t, d = server.pair
    out = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--target", str(t), "--drafter", str(d),
                          "-p", prompt, "--max-new-tokens", str(max_tokens), "--dtype", "float32", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(\w+)\{[^}]*model="dflash_reference"[^}]*\} (\S+)$', line)
        if m and m.group(1) not in out:
            out[m.group(1)] = float(m.group(2))
    return out


def test_streamed_text_equals_generate(server):
    settings = yaml.safe_load((server.bundle / "triton/dflash_reference/1/model.yaml").read_text())
    assert settings["dtype"] == "float32"
    responses, error = _stream(server, _inputs(max_tokens=24))
    assert error is None
    [out] = responses  # one final response with the whole (cumulative) text
    expected = _generate(server, PROMPT, 24)
    assert out["text_output"][0].decode() == expected["text"]
    B = settings["block_size"]
    assert int(out["total_draft_tokens"][0]) == expected["blocks"] * (B - 1) > 0
    assert int(out["total_accepted_draft_tokens"][0]) == sum(a - 1 for a in expected["accepted_per_block"])
    assert out["tau"][0] == pytest.approx(expected["tau"]) and out["tau"][0] >= 1.0
    assert out["finish_reason"][0].decode() in ("length", "stop")


@pytest.mark.parametrize("case", ["no text_input", "max_tokens 0", "10 MB prompt"])
def test_bad_request_gets_a_triton_error_and_the_server_stays_healthy(server, case):
    inputs = {"no text_input": lambda: _inputs(text=False),
              "max_tokens 0": lambda: _inputs(max_tokens=0),
              "10 MB prompt": lambda: _inputs(prompt="x" * (10 << 20))}[case]()
    responses, error = _stream(server, inputs)
    assert error is not None and not responses
    msg = str(error)
    assert {"no text_input": "text_input", "max_tokens 0": "max_tokens", "10 MB prompt": "max_prompt_bytes"}[case] \
        in msg, msg
    assert server.ready() and server.proc.poll() is None
    responses, error = _stream(server, _inputs(max_tokens=4))  # and it still answers
    assert error is None and responses[0]["text_output"][0]


def test_metrics_count_concurrent_requests(server):
    before = _metrics(server)
    n, max_tokens = 4, 96
    results, seen = [None] * n, {"active": 0.0, "waiting": 0.0}

    def one(i):
        results[i] = _stream(server, _inputs(prompt=f"{PROMPT} {i}", max_tokens=max_tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        m = _metrics(server)
        seen["active"] = max(seen["active"], m.get("dflash_requests_active", 0))
        seen["waiting"] = max(seen["waiting"], m.get("dflash_requests_waiting", 0))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert all(err is None for _, err in results)
    after = _metrics(server)
    blocks = sum(int(r[0]["total_draft_tokens"][0]) for r, _ in results) // (
        yaml.safe_load((server.bundle / "triton/dflash_reference/1/model.yaml").read_text())["block_size"] - 1)
    assert after["dflash_draft_blocks_total"] - before["dflash_draft_blocks_total"] == blocks
    assert after["dflash_accepted_tokens_total"] - before["dflash_accepted_tokens_total"] >= blocks
    assert after["nv_inference_request_success"] - before["nv_inference_request_success"] == n
    # one decode slot: while one request decodes, the others wait (and are seen waiting)
    assert seen["active"] == 1 and seen["waiting"] >= 1, seen
    assert after["dflash_requests_active"] == 0 and after["dflash_requests_waiting"] == 0
    assert 0 <= after["dflash_kv_cache_utilization"] <= 1 and after["dflash_acceptance_length"] >= 1


def test_server_stops_cleanly(server):
    assert server.stop() == 0
    assert not server.ready()
    log = server.log_path.read_text()
    assert "successfully unloaded" in log or "Successfully unloaded" in log, log[-2000:]


def test_dflash_trt_serve_command_runs_and_stops_on_sigterm(server):
    """`dflash-trt serve --bundle DIR` in its own process: ready, answers, exits 0 on SIGTERM
    (what a pod's stop sends) with tritonserver gone."""
    import signal

    from dflash_trt.stacks.tritonserver.server import free_ports

    ports = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", "--bundle", str(server.bundle),
                             "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads("".join(iter(proc.stdout.readline, "}\n")) + "}")
        assert info["grpc"] == f"127.0.0.1:{ports[1]}" and info["models"] == ["dflash_reference"]
        responses, error = _stream(types.SimpleNamespace(grpc_url=info["grpc"]), _inputs(max_tokens=8))
        assert error is None and responses[0]["text_output"][0]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert "tritonserver stopped (exit code 0)" in err


def test_serve_refuses_a_folder_that_is_not_a_bundle(tmp_path):
    code, _, err = run_cli("serve", "--bundle", str(tmp_path))
    assert code == 1 and "no triton/ model repository" in err


@pytest.mark.slow
def test_embedded_pair_through_the_server_is_lossless_with_real_acceptance(tmp_path):
    """The embedded SmolLM2-135M target and our trained drafter: the text streamed back equals
    `dflash-trt generate` and the drafter's acceptance survives the server (tau well above 1)."""
    from dflash_trt.errors import DFlashError
    from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target

    if tritonserver_missing():
        pytest.skip(tritonserver_missing())
    try:
        ensure_embedded_target(progress=False)
        embedded_drafter_path()
    except DFlashError as e:
        pytest.fail(f"the embedded pair is part of the package: {e}")
    code, _, err = run_cli("build", "--arch", "hopper", "--quant", "none", "--out", str(tmp_path / "b"))
    assert code == 0, err
    prompt, n = "Write a Python function that reverses a list", 48
    with TritonServer(tmp_path / "b" / "triton", ["dflash_reference"], work=tmp_path / "srv") as srv:
        [out], error = _stream(srv, _inputs(prompt=prompt, max_tokens=n))
    assert error is None
    gen = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "-p", prompt, "--max-new-tokens", str(n),
                          "--dtype", "float32", "--json"], capture_output=True, text=True, check=True)
    expected = json.loads(gen.stdout)
    assert out["text_output"][0].decode() == expected["text"]
    assert out["tau"][0] == pytest.approx(expected["tau"]) and expected["tau"] > 1.5
    assert int(out["total_accepted_draft_tokens"][0]) > 0
