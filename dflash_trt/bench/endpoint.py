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

The requests and the counters are bench/client.py's; --synthetic-acceptance is bench/synthetic.py.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.bench.client import (
    DEFAULT_TIMEOUT_S,
    ENGINE_COUNTERS,
    PER_REQUEST_SPEC,
    Result,
    choose_model,
    find_metrics,
    normalize_url,
    run_batch,
    scrape,
    spec_counters,
    stream_completion,
)
from dflash_trt.bench.context import parse_counts
from dflash_trt.bench.synthetic import SYNTHETIC_LABEL, check_synthetic, parse_synthetic
from dflash_trt.deploy import values
from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import iter_jsonl
from dflash_trt.paths import package_path
from dflash_trt.plan import speed as speed_model
from dflash_trt.plan import tune
from dflash_trt.plan.speed_plot import distinct_curves, draw_layout, new_figure, save_figure

# ---------------------------------------------------------------------------------------------
# Prompts

def read_prompts(path: str | Path | None) -> list[dict]:
    """[{"prompt", "category"?}] of a JSONL file (default: the embedded held-out prompts); one line
    naming the line at fault otherwise."""
    path = path or package_path("data", "heldout_prompts.jsonl")
    rows = []
    for i, row in iter_jsonl(path):
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
    return parse_counts(text, "--concurrency", "positive integers", "1,2,4,8")


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

    def count_tokens(self, text: str) -> int:
        """The server's own count of a prompt's tokens (a request for one token: its usage.prompt_tokens)."""
        r = stream_completion(self.base, self.model, text, 1, timeout=self.timeout)
        if r.error or r.prompt_tokens is None:
            raise DFlashError(f"{self.base}/v1/completions: no usage.prompt_tokens to size a context bucket with "
                              f"({r.error or 'the usage chunk has none'})")
        return int(r.prompt_tokens)

    def _extra(self) -> dict:
        return {"ignore_eos": True} if self.ignore_eos else {}

    def _batch(self, prompts: list[str], c: int) -> dict:
        before = spec_counters(self.engine, scrape(self.metrics_url))
        results, duration = run_batch(self.base, self.model, prompts, self.max_new_tokens, c, timeout=self.timeout,
                                      extra=self._extra())
        after = spec_counters(self.engine, scrape(self.metrics_url))
        if bad := [r.error for r in results if r.error]:
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
    if syn := report.get("synthetic_acceptance"):
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
    """(the plan the bundle carries (plan.json: no layout search), target config, drafter config), or None and
    one line why there is none."""
    p = values.plan_for_bundle(bundle)
    if p is None:
        return None, f"--plan-bundle {bundle}: the bundle pins no GPU (a CPU-only deployment): no plan to overlay"
    return (p, *values.bundle_model_configs(bundle)), None


def plan_prediction(planned, measured_tau: float | None):
    """The SpeedReport of the plan (speed.speed_for) and where its tau came from: the target
    preset's (published or measured) when there is one (what `plan --speed` uses), else the acceptance
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
    if drafts := sum(s["drafts"] for s in sd):
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
    if syn := report.get("synthetic_acceptance"):
        plan += f"\nSYNTHETIC: {syn['label']}, assumed tau {syn['assumed_tau']:.2f}"
    return save_figure(fig, ax, path,
                       f"bench --endpoint: {report['max_new_tokens']} new tokens per request, greedy, streaming{plan}\n"
                       "labels: concurrency, acceptance length (server counters), measured / plan tokens/s per GPU",
                       ylabel=f"tokens/s per GPU (decode, log scale; measured / {gpus} GPU)")
