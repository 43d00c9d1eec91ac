"""Readiness and liveness of a Triton pod that follow the models, not only the server.

tritonserver 2.51's /v2/health/ready and /v2/models/<m>/ready stay 200 after a Python-backend
stub dies, while every request to that model fails (docs/serving-faults.md). So this asks the
server, then every ready model whose config declares the input `health_check` (the bundle's
Triton models: answered at once from the model's execute(), nothing decoded) for a health
request. Exit 0: it would serve; exit 1 with one line: why not. Python's standard library only
(the serving image's python3); run by the chart's probes as `python3 triton_ready.py [BASE_URL]`.
"""
import json
import sys
import urllib.error
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
HEALTH_INPUT = "health_check"
TIMEOUT_S = 2


def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        text = r.read()
    return json.loads(text) if text else None


def problem():
    try:
        call("/v2/health/ready")
        for model in call("/v2/repository/index", {"ready": True}) or []:
            name = model["name"]
            config = call(f"/v2/models/{name}/config")
            if any(i.get("name") == HEALTH_INPUT for i in config.get("input", [])):
                call(f"/v2/models/{name}/generate", {"text_input": "", HEALTH_INPUT: True})
    except urllib.error.HTTPError as e:
        return f"{e.url}: HTTP {e.code} {e.read()[:200].decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return f"{BASE}: {e}"
    return None


if __name__ == "__main__":
    why = problem()
    if why:
        print(f"dflash-trt: not ready: {why}", flush=True)
    sys.exit(1 if why else 0)
