"""The monitoring rules and dashboard against a real Prometheus (Debian's prometheus 2.42, .ci/run installs it)
scraping a live vLLM-CPU serving the embedded bundle while `dflash-trt bench --endpoint` loads it.

Oracle: Prometheus itself. Every recording rule the chart deploys for vLLM (deploy/monitoring.py, the rate
window shortened to fit a short load) and every query of the dashboard returns data during the load, with
finite values in their ranges (acceptance length in [1, B], shares in [0, 1], latencies > 0); the acceptance
length Prometheus records equals 1 + accepted / drafts of the counters it scraped, at the instant the rule
evaluated (80 % of the evaluations at least: a scrape appended after an evaluation moves the raw figure).
`promtool check rules` passes on the rules. The panels are drawn from Prometheus' query_range into a PNG
(DFLASH_TRT_MONITORING_OUT=DIR keeps it and the query results there)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from dflash_trt.deploy import monitoring as mon
from dflash_trt.stacks.tritonserver.server import free_ports

ROOT = Path(__file__).resolve().parents[1]
WINDOW = "20s"        # rate window of the rules here (1 s scrapes); the chart's default is 2m at 15 s
POD = {"namespace": "serving", "pod": "vllm-0"}

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="no prometheus/promtool (apt-get install prometheus; .ci/run does)")


def _query(base: str, q: str, t: float | None = None) -> list[dict]:
    args = {"query": q, **({"time": f"{t:.3f}"} if t else {})}
    with urllib.request.urlopen(f"{base}/api/v1/query?{urllib.parse.urlencode(args)}", timeout=30) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _query_range(base: str, q: str, start: float, end: float, step: float = 2.0) -> list[dict]:
    args = {"query": q, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{urllib.parse.urlencode(args)}", timeout=60) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def vllm(vllm_bundle, tmp_path_factory):
    from dflash_trt.stacks.vllm.server import VllmServer

    with VllmServer(vllm_bundle, work=tmp_path_factory.mktemp("vllm-mon"), extra_args=["--enforce-eager"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    from dflash_trt.plan.monitoring_figures import NONE

    groups = mon.rule_groups("vllm", NONE, mon.Settings(window=WINDOW))
    path = tmp_path_factory.mktemp("rules") / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def prometheus(vllm, rules_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    host_port = vllm.url.split("//", 1)[1]
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_file)],
        "scrape_configs": [{"job_name": "vllm", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [host_port], "labels": POD}]}],
    }))
    port = free_ports(1)[0]
    with open(work / "prometheus.log", "w") as log:
        proc = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_promtool_check_rules(rules_file):
    r = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 16 rules found" in r.stdout, r.stdout


def _plausible(record: str, v: float) -> bool:
    if not math.isfinite(v):
        return False
    if record == "dflash:acceptance_length":
        return 1 <= v <= 16
    if record in ("dflash:acceptance_by_position", "dflash:draft_efficiency"):
        return 0 <= v <= 1
    return v > 0


@pytest.mark.slow
def test_every_rule_and_panel_returns_data_under_load(vllm, prometheus, rules_file, tmp_path):
    records = [r["record"] + (f'{{quantile="{r["labels"]["quantile"]}"}}' if "labels" in r else "")
               for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]]
    panels = [(title, expr.replace("$__rate_interval", WINDOW), legend)
              for title, _, queries in mon.dashboard_queries("vllm") for expr, legend in queries]
    # the load: bench --endpoint at concurrency 1 and 4, long enough for several rule windows
    bench = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "bench", "--endpoint", vllm.url,
                              "--concurrency", "1,4", "--limit", "8", "--max-new-tokens", "64", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.time()
    seen: dict[str, float] = {}
    checks = []
    while bench.poll() is None:
        time.sleep(2)
        for q in [*records, *(e for _, e, _ in panels)]:
            res = _query(prometheus, q)
            vals = [float(s["value"][1]) for s in res]
            if vals and all(_plausible(q.split("{")[0], v) for v in vals):
                seen.setdefault(q, vals[0])
        # the recorded acceptance length is Prometheus' own counters over the same window
        stamp = _query(prometheus, "timestamp(dflash:acceptance_length)")
        if not stamp:
            continue
        t = float(stamp[0]["value"][1])   # when the rule evaluated: the raw counters at that instant
        rec = _query(prometheus, "dflash:acceptance_length", t)
        raw = _query(prometheus, f"1 + sum by (namespace, pod) (increase(vllm:spec_decode_num_accepted_tokens_total"
                                 f"[{WINDOW}])) / sum by (namespace, pod) (increase(vllm:spec_decode_num_drafts_total"
                                 f"[{WINDOW}]))", t)
        if rec and raw and math.isfinite(float(raw[0]["value"][1])):
            checks.append((float(rec[0]["value"][1]), float(raw[0]["value"][1])))
    end = time.time()
    out, err = bench.communicate()
    assert bench.returncode == 0, err[-2000:]
    missing = [q for q in [*records, *(e for _, e, _ in panels)] if q not in seen]
    assert not missing, f"no data during the load for: {missing}"
    # A scrape appended after a rule's evaluation with an earlier timestamp changes the raw query at that instant
    # afterwards (Prometheus' ingestion race), so most, not all, evaluations match to the last bit.
    same = sum(math.isclose(a, b, rel_tol=1e-9) for a, b in checks)
    # (the number of checks is the load's length over the 2 s poll: 13 on an idle CI machine, 36 on a busy one)
    assert len(checks) >= 5 and same >= 0.8 * len(checks), checks

    report = json.loads(out)
    keep = Path(os.environ.get("DFLASH_TRT_MONITORING_OUT") or tmp_path)
    keep.mkdir(parents=True, exist_ok=True)
    ranges = {(title, expr): _query_range(prometheus, expr, start, end) for title, expr, _ in panels}
    (keep / "monitoring-live.json").write_text(json.dumps(
        {"rules": {q: seen[q] for q in records}, "panels": {e: seen[e] for _, e, _ in panels},
         "load_seconds": end - start, "acceptance_checks": len(checks), "acceptance_checks_equal": same,
         "median_over_load": {f"{title} | {_label(legend, ser['metric'])}": _median(ser["values"])
                              for title, expr, legend in panels for ser in ranges[(title, expr)]},
         "bench_levels": [{k: lv.get(k) for k in ("concurrency", "acceptance_length", "tokens_per_s",
                                                  "tokens_per_s_per_user")}
                          for lv in report.get("levels", [])]}, indent=1))
    png = draw(ranges, panels, keep / "monitoring-dashboard.png", start)
    assert png.stat().st_size > 10_000


def _median(values: list) -> float | None:
    vals = sorted(x for x in (float(v) for _, v in values) if math.isfinite(x))
    return vals[len(vals) // 2] if vals else None


def _label(legend: str, metric: dict) -> str:
    return legend.replace("{{pod}}", metric.get("pod", "")).replace("{{position}}", metric.get("position", ""))


def draw(ranges: dict, panels: list, path: Path, t0: float) -> Path:
    """The dashboard's panels, two a row, from Prometheus' query_range results."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(t for t, _, _ in panels))
    rows = (len(titles) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.2 * rows), squeeze=False)
    for ax, title in zip(axes.flat, titles):
        for (t, expr, legend) in panels:
            if t != title:
                continue
            for s in ranges[(t, expr)]:
                xs = [float(x) - t0 for x, _ in s["values"]]
                ys = [float(y) for _, y in s["values"]]
                ax.plot(xs, ys, label=_label(legend, s["metric"]))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s since load start")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    fig.suptitle("DFlash speculative decoding (vllm), live vLLM-CPU + Prometheus 2.42 under bench --endpoint")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
