"""Prometheus text exposition format: the samples of a /metrics page, and the sum of one metric's
series. Written here rather than taken from prometheus_client, whose parser is not part of our
dependencies (vLLM's env has it, ours does not); the format is line-based and small."""
from __future__ import annotations

import re

SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample line of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), value))
    return out


def sum_series(samples: list[tuple[str, dict, float]], spec: dict) -> float | None:
    """The sum of a counter's (or gauge's) series: spec {"name", optional "where": {label: value}};
    prometheus_client exposes a counter as <name>_total, accepted either way. None when the page
    has no such series."""
    names = {spec["name"], spec["name"] + "_total"}
    where = spec.get("where", {})
    vals = [v for n, labels, v in samples if n in names and all(labels.get(k) == x for k, x in where.items())]
    return sum(vals) if vals else None
