"""A real Triton Inference Server for a bundle's model repository, on any machine (no GPU): the
`tritonserver` 2.51 binary and Python backend of the PyPI wheel `nvidia-pytriton` (its files only; its
Python package, which pins numpy<2, is never imported). What makes its Python backend work outside
NVIDIA's container (a numpy<2 stub env, LD_LIBRARY_PATH, the stub in the backend folder), each measured:
docs/pipeline.md, "Triton outside NVIDIA's container".
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashError

PYTRITON_SPEC = "nvidia-pytriton==0.7.0"
STUB_NUMPY = "numpy<2"
STUB_PTH = "zz-dflash-trt-main-env.pth"  # sorts last: numpy 1.x of the stub env wins


def pytriton_dist() -> Path:
    """The wheel's tritonserver folder (found without importing pytriton)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"no Triton server: the `nvidia-pytriton` wheel is not installed; "
                          f"pip install --no-deps '{PYTRITON_SPEC}' (it pins numpy<2, so without its dependencies)")
    dist = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise DFlashError(f"{dist}: no bin/tritonserver in the nvidia-pytriton wheel")
    return dist


def default_stub_env() -> Path:
    """Where the stub env lives: $DFLASH_TRITON_STUB_ENV, else inside this (virtual) environment."""
    return Path(os.environ.get("DFLASH_TRITON_STUB_ENV") or Path(sys.prefix) / "triton-stub")


def base_python() -> Path:
    """The interpreter our venv was made from (the one whose libpython the stub loads)."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def make_stub_env(dest: Path) -> Path:
    """Create the stub env: `python -m venv` of the base interpreter, `pip install numpy<2`, and a
    .pth that adds this environment's site-packages after its own."""
    dest = Path(dest)
    py = dest / "bin" / "python3"
    if not py.exists():
        print(f"dflash-trt serve: creating the Python-backend stub env {dest} (numpy<2)", file=sys.stderr)
        subprocess.run([str(base_python()), "-m", "venv", str(dest)], check=True)
    # idempotent (and offline) once numpy<2 is there; completes an env a failed run left half-made
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", STUB_NUMPY], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / STUB_PTH).write_text(f"import site; site.addsitedir({ours!r})\n")
    return dest


def check_stub_env(env: Path, imports: tuple[str, ...] = ("dflash_trt",), extra_env: dict | None = None) -> None:
    """The stub env imports numpy<2 and `imports` (what its models import: dflash_trt for
    dflash_reference, vllm for the vllm model)."""
    py = Path(env) / "bin" / "python3"
    if not py.exists():
        raise DFlashError(f"{env}: no Python-backend stub env; create it with `dflash-trt serve --make-stub-env` "
                          "(a venv with numpy<2: Triton's stub misreads BYTES tensors under numpy 2)")
    probe = subprocess.run([str(py), "-c", f"import numpy, {', '.join(imports)}; print(numpy.__version__)"],
                           check=False, capture_output=True, text=True, env=server_environment(env, extra_env))
    if probe.returncode != 0:
        raise DFlashError(f"{env}: the stub env cannot import numpy and {', '.join(imports)} "
                          f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no output'}); "
                          "re-create it with `dflash-trt serve --make-stub-env`")
    if int(probe.stdout.split(".")[0]) >= 2:
        raise DFlashError(f"{env}: numpy {probe.stdout.strip()} in the stub env; Triton 2.51's Python-backend stub "
                          "needs numpy<2 (BYTES tensors are misread under numpy 2)")


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, held all at once (asked for one by one, two may be the same)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _backend_dir(work: Path, dist: Path, extra: dict | None = None) -> Path:
    """backends/python with the stub for this Python version (links, not copies), plus `extra`
    Python-based backends ({name: folder with model.py}: Triton runs backends/<name>/model.py
    with the Python backend's library and stub)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise DFlashError(f"nvidia-pytriton ships no Python-backend stub for Python {version} ({stub})")
    py = work / "backends" / "python"
    py.mkdir(parents=True, exist_ok=True)
    for f in (dist / "backends" / "python").iterdir():
        (py / f.name).unlink(missing_ok=True)
        (py / f.name).symlink_to(f)
    (py / stub.name).unlink(missing_ok=True)
    shutil.copy2(stub, py / stub.name)
    for name, folder in (extra or {}).items():
        # model.py plus real copies of the Python backend's library, utils and stub: for a
        # Python-based backend Triton refuses a library whose real path leaves the backend folder
        # ("backend library name 'libtriton_python.so' escapes backend directory", measured)
        own = work / "backends" / name
        shutil.rmtree(own, ignore_errors=True)
        shutil.copytree(Path(folder), own)
        for f in [*(dist / "backends" / "python").glob("*.so"), *(dist / "backends" / "python").glob("*.py"), stub]:
            shutil.copy2(f, own / f.name)
    return work / "backends"


def server_environment(stub_env: Path, extra: dict | None = None) -> dict:
    """os.environ with the wheel's and the base interpreter's libraries and the stub env first."""
    dist = pytriton_dist()
    env = dict(os.environ)
    libs = [str(dist.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or "",
            str(base_python().parent.parent / "lib")]
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = f"{Path(stub_env) / 'bin'}:{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # the stub ignores it; keep the models' imports those of the stub env
    env.update(extra or {})
    return env


# How long a stop waits after the program's graceful-stop signal before it SIGKILLs the process
# group: a stop (SIGTERM / Ctrl-C of `dflash-trt serve`) always ends within this plus the reaping.
# tritonserver is told to give up on in-flight work sooner (EXIT_TIMEOUT_S), so it normally ends itself.
STOP_GRACE_S = 15.0
EXIT_TIMEOUT_S = 10
# serve's watch of a running server: probe() every WATCH_S s, stop after WATCH_FAILURES failures in a row
WATCH_S = 5.0
WATCH_FAILURES = 3


def describe_exit(code: int | None) -> str:
    """`exit code 3` or `killed by signal SIGSEGV (-11)`: a Popen returncode in words."""
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({code})"
        except ValueError:
            return f"killed by signal {-code} ({code})"
    return f"exit code {code}"


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class ServerEnd:
    """How a served program ended: by our stop (Ctrl-C / SIGTERM), by itself (`by_itself`), or
    stopped by us because its probe kept failing (`problem`: the last probe's answer)."""
    name: str
    code: int | None
    by_itself: bool
    problem: str | None
    stop_s: float
    killed: bool
    log_path: Path

    @property
    def ok(self) -> bool:
        return not self.by_itself and self.problem is None

    def line(self) -> str:
        status = describe_exit(self.code) + (", after SIGKILL to its process group" if self.killed else "")
        if self.by_itself:
            return f"{self.name} exited by itself ({status}); log {self.log_path}"
        if self.problem:
            return f"{self.name} stopped by dflash-trt: {self.problem}; it then ended ({status}); log {self.log_path}"
        return f"{self.name} stopped ({status}) in {self.stop_s:.1f} s"


HEALTH_INPUT = "health_check"   # the request input our Triton models answer at once, from execute()
PROBE_TIMEOUT_S = 5.0


def ask_model_health(http_url: str, model: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `model` answers a health request (HEALTH_INPUT) through Triton's generate
    endpoint, else why not (one line): the model's stub and decode workers are alive."""
    body = json.dumps({"text_input": "", HEALTH_INPUT: True}).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/{model}/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
        return None
    except urllib.error.HTTPError as e:
        return f"model {model} answers its health request with HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
    except OSError as e:
        return f"model {model} does not answer its health request: {e}"


class ServerProcess:
    """A server program in its own process group, its output in a log file, ready once its health
    URL answers 200: what tritonserver and `vllm serve` share. A subclass gives command(),
    environment(), HEALTH_URL, NAME and the signal its program stops gracefully on."""

    NAME = "server"
    STOP_SIGNAL = signal.SIGINT
    STOP_GRACE_S = STOP_GRACE_S
    killed = False   # stop() had to SIGKILL the group
    proc: subprocess.Popen | None = None
    log_path: Path

    @property
    def health_url(self) -> str:
        raise NotImplementedError

    def _spawn(self, timeout: float, cwd: Path | None = None) -> None:
        argv, env = self.command(), self.environment()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs; closed in stop)
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.wait_ready(timeout)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=PROBE_TIMEOUT_S) as r:
                return r.status == 200
        except OSError:  # URLError, refused, reset, timed out: not (yet) serving
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DFlashError(f"{self.NAME} exited with code {self.proc.returncode} before it was ready; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if self.probe() is None:
                return
            time.sleep(0.5)
        self.stop()
        raise DFlashError(f"{self.NAME} was not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float | None = None) -> int:
        """STOP_SIGNAL (the program's graceful shutdown), SIGKILL to the whole process group after
        `timeout` (default STOP_GRACE_S) or at once on a second Ctrl-C / SIGTERM; then whatever of
        the group outlived it (vLLM's engine core, Triton's stubs). Returns the exit code."""
        if self.proc is None:
            return 0
        grace = self.STOP_GRACE_S if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(self.STOP_SIGNAL)
            try:
                self.proc.wait(grace)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                self.killed = True
                _killpg(self.proc.pid)
                self.proc.wait()
        _killpg(self.proc.pid)
        self._log.close()
        return self.proc.returncode

    def probe(self) -> str | None:
        """None while the server would serve a request, else why not (one line). The default asks
        the health URL; a server whose health URL answers for the server but not for its models
        asks the models (TritonServer.probe)."""
        return None if self.ready() else f"{self.health_url} does not answer 200"

    def serve_until_stopped(self, announce, watch_s: float = WATCH_S, failures: int = WATCH_FAILURES) -> ServerEnd:
        """Start, call `announce()` once ready, then stay in the foreground until Ctrl-C or SIGTERM
        (a pod's stop: made a Ctrl-C here), the program ends by itself, or probe() has failed
        `failures` times in a row, `watch_s` apart (a model that cannot answer: we stop the server).
        Stops in every case (stop(): at most STOP_GRACE_S, then SIGKILL), a Ctrl-C during a long
        start included. Returns how it ended."""
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        problem = None
        try:
            self.start()
            announce()
            problem = self._watch(watch_s, failures)
        except KeyboardInterrupt:
            pass
        finally:
            by_itself = self.proc is not None and self.proc.poll() is not None and problem is None
            started = time.monotonic()
            code = self.stop()
            stop_s = time.monotonic() - started
        return ServerEnd(self.NAME, code, by_itself, problem, stop_s, self.killed, self.log_path)

    def _watch(self, every: float, failures: int) -> str | None:
        """Wait while the server runs and its probe answers; None once the process has exited,
        else the probe's answer after `failures` failures in a row."""
        failed = 0
        while True:
            try:
                self.proc.wait(every)
                return None
            except subprocess.TimeoutExpired:
                pass
            problem = self.probe()
            failed = failed + 1 if problem else 0
            if failed >= failures and self.proc.poll() is None:
                return f"{problem} ({failed} probes in a row, {every:g} s apart)"

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class TritonServer(ServerProcess):
    """tritonserver on loopback (or `host`) serving `repo` with `models` loaded explicitly.

        with TritonServer(bundle / "triton", ["dflash_reference"], work=tmp) as server:
            server.grpc_url ...
    """

    NAME = "tritonserver"

    def __init__(self, repo: Path, models: list[str], *, work: Path, host: str = "127.0.0.1",
                 http_port: int | None = None, grpc_port: int | None = None, metrics_port: int | None = None,
                 stub_env: Path | None = None, env: dict | None = None,
                 backends: dict | None = None, stub_imports: tuple[str, ...] = ("dflash_trt",)):
        self.repo, self.models, self.work, self.host = Path(repo), list(models), Path(work), host
        self.http_port, self.grpc_port, self.metrics_port = (
            given or free for given, free in zip((http_port, grpc_port, metrics_port), free_ports(3)))
        self.stub_env = Path(stub_env) if stub_env else default_stub_env()
        self.extra_env = env or {}
        self.backends = dict(backends or {})  # Python-based backends: {name: folder with model.py}
        self.stub_imports = stub_imports
        self.log_path = self.work / "tritonserver.log"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def health_url(self) -> str:
        return f"{self.http_url}/v2/health/ready"

    def command(self) -> list[str]:
        dist = pytriton_dist()
        return [str(dist / "bin" / "tritonserver"), "--model-repository", str(self.repo.resolve()),
                "--model-control-mode", "explicit", *[f"--load-model={m}" for m in self.models],
                "--backend-directory", str(_backend_dir(self.work, dist, self.backends)),
                "--cache-directory", str(dist / "caches"),
                "--http-address", self.host, "--http-port", str(self.http_port),
                "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
                "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
                "--allow-metrics", "true", "--allow-gpu-metrics", "false", "--allow-cpu-metrics", "false",
                "--log-verbose", "0", "--exit-timeout-secs", str(EXIT_TIMEOUT_S)]

    def environment(self) -> dict:
        return server_environment(self.stub_env, self.extra_env)

    @property
    def health_models(self) -> list[str]:
        """The loaded models that answer a health request (their config declares HEALTH_INPUT)."""
        return [m for m in self.models if f'name: "{HEALTH_INPUT}"' in (self.repo / m / "config.pbtxt").read_text()]

    def probe(self) -> str | None:
        """The server's ready endpoint, then each health model asked through its own execute():
        tritonserver 2.51 keeps /v2/health/ready and the model's ready endpoint at 200 after a
        Python-backend stub died (its libtriton_python.so exports no TRITONBACKEND_ModelInstanceReady;
        docs/serving-faults.md), so only the model can say it still serves."""
        problem = super().probe()
        for m in [] if problem else self.health_models:
            problem = ask_model_health(self.http_url, m)
            if problem:
                break
        return problem

    def start(self, timeout: float = 180.0) -> TritonServer:
        check_stub_env(self.stub_env, self.stub_imports, self.extra_env)
        for m in self.models:
            if not (self.repo / m / "config.pbtxt").is_file():
                raise DFlashError(f"{self.repo}: no model {m} (no {m}/config.pbtxt; is this a bundle's triton/ folder?)")
        self.work.mkdir(parents=True, exist_ok=True)
        self._spawn(timeout)
        return self
