"""Monitoring of a rollout: the PrometheusRule groups and the Grafana dashboard the chart deploys with
`monitoring.enabled` (`dflash-trt deploy --monitoring` writes them into the values).

Every query comes from the served stack's metrics data (stacks/<stack> `Stack.metrics`: the engine's own
names and PromQL); the alert thresholds from the plan (plan/monitoring_figures.py). The recording rules
(`dflash:*`, listed in docs/monitoring.md) keep one series per pod (`BY`). A schedule by context served by
an engine that drafts by context (vLLM with our plugin) gets its thresholds per concurrency and context
bucket, the bucket chosen by dflash:context_tokens. The dashboard is built with grafana-foundation-sdk (an
optional dependency, the `monitoring` extra).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import yaml

from dflash_trt import engines, stacks
from dflash_trt.deploy.dynamo import LOADER, _closed
from dflash_trt.errors import DFlashError
from dflash_trt.paths import deploy_path
from dflash_trt.plan.draft_schedule import CONTEXT_END
from dflash_trt.plan.monitoring_figures import PlannedFigures
from dflash_trt.stacks.base import StackMetrics

BY = "namespace, pod"              # the ServiceMonitor's target labels: one series per serving pod
QUANTILES = ("0.5", "0.9", "0.99")
HISTOGRAMS = {  # role: (recording rule, dashboard panel)
    "ttft": ("dflash:ttft_seconds", "Time to first token"),
    "itl": ("dflash:itl_seconds", "Inter-token latency (engine's, per step)"),
    "tpot": ("dflash:time_per_output_token_seconds", "Time per output token"),
}
DASHBOARD_UID = "dflash-trt-speculation"


@dataclass(frozen=True)
class Settings:
    window: str = "2m"                 # rate window of the recording rules (>= 4 scrape intervals)
    alert_for: str = "10m"             # how long a condition holds before its alert fires
    acceptance_tolerance: float = 0.1  # DFlashAcceptanceBelowPlan: below planned × (1 - this)
    latency_quantile: str = "0.9"      # DFlashTokenLatencyOverTarget compares this quantile with the target


def stack_metrics(server: str) -> StackMetrics:
    """The metrics of the engine a server runs, when its Prometheus page is the engine's own."""
    st = stacks.get(engines.server_stack(server))
    page = engines.facts()["servers"][server]["endpoints"]["metrics_path"]
    if st.metrics is None or page != st.metrics.metrics_path:
        raise DFlashError(f"--monitoring: server {server} ({st.title}) exports no speculative-decoding metrics "
                          f"on its page {page}; serve with vllm, sglang or trtllm-serve")
    return st.metrics


def _quantile(m: StackMetrics, role: str, q: str, w: str) -> str:
    return f"histogram_quantile({q}, sum by ({BY}, le) (rate({m.histogram(role)}[{w}])))"


def _tokens_per_second(m: StackMetrics, w: str) -> str:
    return f"sum by ({BY}) (rate({m.metrics['generation_tokens'].name}[{w}]))"


def _concurrency(m: StackMetrics, w: str) -> str:
    return f"sum by ({BY}) (avg_over_time({m.metrics['running'].name}[{w}]))"


def recording_rules(m: StackMetrics, s: Settings = Settings()) -> list[dict]:
    w = s.window
    rules = [{"record": "dflash:acceptance_length", "expr": m.promql("acceptance_length", w, BY)}]
    if m.per_position:
        rules.append({"record": "dflash:acceptance_by_position", "expr": m.promql("per_position", w, BY)})
    rules += [
        {"record": "dflash:draft_efficiency", "expr": m.promql("draft_efficiency", w, BY)},
        {"record": "dflash:concurrency", "expr": _concurrency(m, w)},
        {"record": "dflash:generation_tokens_per_second", "expr": _tokens_per_second(m, w)},
        # concurrency 0: no series (nobody to serve), not a division by zero
        {"record": "dflash:tokens_per_second_per_user",
         "expr": f"dflash:generation_tokens_per_second / on({BY}) (dflash:concurrency > 0)"},
    ]
    if m.context_tokens:
        rules.append({"record": "dflash:context_tokens", "expr": m.promql("context_tokens", w, BY)})
    for role, (record, _) in HISTOGRAMS.items():
        if m.histogram(role):
            rules += [{"record": record, "labels": {"quantile": q}, "expr": _quantile(m, role, q, w)}
                      for q in QUANTILES]
    return rules


def _where(r) -> str:
    if r.context is None:
        return f"c>={r.first}"
    return f"c>={r.first} context {r.context[0]}-" + (f"{r.context[1]}" if r.context[1] < CONTEXT_END else "on")


def _by_level(metric: str, rows, value) -> str:
    """`metric < value(row)` while the measured concurrency (and for a row of a context bucket, the measured
    context) is in the row's range, for every row; neighbouring rows of a bucket with the same threshold (4
    significant digits) are one range."""
    terms = []
    for context, bucket in itertools.groupby(rows, key=lambda r: r.context):
        spans: list[list] = []                   # [first, until, threshold text]
        for r in bucket:
            v = f"{value(r):.4g}"
            if spans and spans[-1][2] == v:
                spans[-1][1] = r.until
            else:
                spans.append([r.first, r.until, v])
        # a bucket's contexts are whole tokens, the measured one a mean: each bucket up to the next one's first
        at = "" if context is None else f" and on({BY}) (dflash:context_tokens >= {context[0]}" + (
            f" < {context[1] + 1})" if context[1] < CONTEXT_END else ")")
        for i, (first, until, v) in enumerate(spans):
            lo = "> 0" if i == 0 else f">= {first}"   # below the first planned concurrency: its figure
            hi = f" < {until}" if until is not None else ""
            terms.append(f"(({metric} < {v}) and on({BY}) (dflash:concurrency {lo}{hi}){at})")
    return "\n or ".join(terms)


def _alert(name: str, s: Settings, expr: str, summary: str, description: str) -> dict:
    return {"alert": name, "expr": expr, "for": s.alert_for, "labels": {"severity": "warning"},
            "annotations": {"summary": summary, "description": description}}


def alert_rules(m: StackMetrics, figures: PlannedFigures, s: Settings = Settings(),
                by_context: bool = False) -> list[dict]:
    """The alerts; by_context: the engine drafts by context (its thresholds per bucket where the plan has them)."""
    out = []
    rows = figures.by_context if by_context and figures.by_context and m.context_tokens else figures.by_concurrency
    if rows:
        keep = 1 - s.acceptance_tolerance
        out.append(_alert(
            "DFlashAcceptanceBelowPlan", s,
            _by_level("dflash:acceptance_length", rows, lambda r: r.planned_acceptance_length * keep),
            "DFlash acceptance below what the rollout was planned for",
            "{{ $labels.pod }}: acceptance length {{ $value | printf \"%.2f\" }} is more than "
            f"{s.acceptance_tolerance:.0%} below the planned one at its concurrency ("
            + ", ".join(f"{_where(r)}: {r.planned_acceptance_length:.2f}" for r in rows)
            + f"; {figures.source}). Retune the draft length (dflash-trt tune) or check the "
            "prompt template and target checkpoint."))
        out.append(_alert(
            "DFlashSpeculationNotPaying", s,
            _by_level("dflash:acceptance_length", rows, lambda r: r.break_even_acceptance_length),
            "Speculative decoding costs more than it gives at this concurrency",
            "{{ $labels.pod }}: acceptance length {{ $value | printf \"%.2f\" }} is below the "
            "break-even of the planned draft length at its concurrency ("
            + ", ".join(f"{_where(r)} K={r.k}: {r.break_even_acceptance_length:.2f}" for r in rows)
            + "): plain decoding would be faster. Draft fewer tokens there (dflash-trt tune)."))
    tpot = figures.time_per_output_token_s
    if tpot and m.histogram("tpot"):
        q = s.latency_quantile
        out.append(_alert(
            "DFlashTokenLatencyOverTarget", s, f'dflash:time_per_output_token_seconds{{quantile="{q}"}} > {tpot:.6g}',
            "Per-user token latency over the plan's target",
            f"{{{{ $labels.pod }}}}: p{float(q) * 100:g} time per output token "
            f"{{{{ $value | humanizeDuration }}}} is over the target {tpot * 1000:.3g} ms "
            f"({1 / tpot:.4g} tokens/s per user; {figures.source})."))
    return out


def rule_groups(server: str, figures: PlannedFigures, s: Settings = Settings()) -> list[dict]:
    m = stack_metrics(server)
    groups = [{"name": "dflash-trt.recording", "rules": recording_rules(m, s)}]
    drafts_by_context = stacks.get(engines.server_stack(server)).draft_schedule_context_problem() is None
    if alerts := alert_rules(m, figures, s, by_context=drafts_by_context):
        groups.append({"name": "dflash-trt.alerts", "rules": alerts})
    return groups


# ------------------------------------------------------------------ the dashboard
def dashboard_queries(server: str, w: str = "$__rate_interval") -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(panel title, unit, [(PromQL, legend)]) per panel, on the engine's own metric names."""
    m = stack_metrics(server)
    legend = "{{pod}}"
    panels = [("Acceptance length (tokens per step, bonus included)", "none",
               [(m.promql("acceptance_length", w, BY), legend)])]
    if m.per_position:
        panels.append(("Acceptance by draft position", "percentunit",
                       [(m.promql("per_position", w, BY), "{{pod}} position {{position}}")]))
    panels += [
        ("Draft efficiency (accepted / drafted tokens)", "percentunit",
         [(m.promql("draft_efficiency", w, BY), legend)]),
        ("Generation tokens/s per user", "none",
         [(f"{_tokens_per_second(m, w)} / on({BY}) ({_concurrency(m, w)} > 0)", legend)]),
        ("Generation tokens/s", "none", [(_tokens_per_second(m, w), legend)]),
        ("Requests in flight", "none", [(f"sum by ({BY}) ({m.metrics['running'].name})", legend)]),
    ]
    if m.context_tokens:
        panels.append(("Prompt tokens, mean of finished requests (the schedule's context axis)", "none",
                       [(m.promql("context_tokens", w, BY), legend)]))
    for role, (_, title) in HISTOGRAMS.items():
        if m.histogram(role):
            panels.append((title, "s", [(_quantile(m, role, q, w), f"{{{{pod}}}} p{float(q) * 100:g}")
                                        for q in QUANTILES]))
    return panels


def dashboard(server: str) -> dict:
    """The Grafana dashboard JSON (grafana-foundation-sdk's builders), two panels a row."""
    try:
        from grafana_foundation_sdk.builders import prometheus, timeseries
        from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos
    except ImportError:
        raise DFlashError("--monitoring: the dashboard needs grafana-foundation-sdk (pip install "
                          "'dflash-trt[monitoring]')") from None
    m = stack_metrics(server)
    d = (Dashboard(f"DFlash speculative decoding ({server})").uid(f"{DASHBOARD_UID}-{server}")
         .tags(["dflash-trt", server]).refresh("30s").time("now-1h", "now")
         .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    for i, (title, unit, queries) in enumerate(dashboard_queries(server)):
        p = (timeseries.Panel().title(title).datasource(ds).unit(unit).min(0)
             .grid_pos(GridPos(h=8, w=12, x=12 * (i % 2), y=8 * (i // 2))))
        for j, (expr, legend) in enumerate(queries):
            p = p.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(65 + j)))
        d = d.with_panel(p)
    d = d.description(f"{m.prefix}* metrics of {server} ({m.source}); " + "; ".join(m.notes))
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def monitoring_values(server: str, figures: PlannedFigures, s: Settings = Settings()) -> dict:
    """The chart's `monitoring` values: rule groups and the dashboard for this server, thresholds from the plan."""
    return {"enabled": True, "ruleGroups": rule_groups(server, figures, s),
            "dashboard": json.dumps(dashboard(server), indent=1, sort_keys=True)}


# ------------------------------------------------------------------ the Prometheus Operator CRDs (deploy/schemas)
CRDS = {"ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
        "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml"}


def crd_schema(kind: str, version: str = "v1") -> dict:
    """The kind's openAPIV3Schema from the copied CRD, closed as the API server prunes (unknown keys refused)."""
    crd = yaml.load(deploy_path("schemas", CRDS[kind]).read_text(), Loader=LOADER)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _closed(v["schema"]["openAPIV3Schema"])


def check_objects(objs: list[dict]) -> list[str]:
    """Every monitoring.coreos.com object against its CRD (jsonschema); one line naming the field. The kinds
    checked."""
    try:
        import jsonschema
    except ImportError:
        raise DFlashError("--monitoring checks the ServiceMonitor and PrometheusRule against the Prometheus Operator "
                          "CRDs with jsonschema: pip install jsonschema (or the package's [deploy] extra)") from None
    kinds = []
    for o in objs:
        if not str(o.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
            continue
        if o["kind"] not in CRDS:
            raise DFlashError(f"{o['kind']}: no Prometheus Operator CRD kept in deploy/schemas")
        err = next(iter(jsonschema.Draft7Validator(crd_schema(o["kind"])).iter_errors(o)), None)
        if err is not None:
            where = "/".join(str(x) for x in err.absolute_path)
            raise DFlashError(f"{o['kind']} {o['metadata']['name']}: /{where}: {err.message} "
                              f"(Prometheus Operator CRD, deploy/schemas/{CRDS[o['kind']]})")
        kinds.append(o["kind"])
    return kinds
