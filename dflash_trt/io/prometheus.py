"""Prometheus text exposition format: the samples of a /metrics page (prometheus_client's parser), and the
sum of one metric's series."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample of a Prometheus text page; none of a page that is not one
    (trtllm-serve's /metrics is JSON: prometheus_client refuses its first line)."""
    try:
        return [(s.name, dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
                for s in family.samples]
    except ValueError:
        return []


def sum_series(samples: list[tuple[str, dict, float]], spec: dict) -> float | None:
    """The sum of a counter's (or gauge's) series: spec {"name", optional "where": {label: value}};
    prometheus_client exposes a counter as <name>_total, accepted either way. None when the page
    has no such series."""
    names = {spec["name"], spec["name"] + "_total"}
    where = spec.get("where", {})
    vals = [v for n, labels, v in samples if n in names and all(labels.get(k) == x for k, x in where.items())]
    return sum(vals) if vals else None
