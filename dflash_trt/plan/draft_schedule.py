"""How many tokens to draft at each concurrency: the draft-length schedule.

A DFlash drafter proposes up to B - 1 tokens per step, but at high concurrency the verify pass of
K + 1 tokens per sequence turns compute-bound and a long draft costs more than its accepted tokens
pay. Given the acceptance at each draft position and the cost of one step with K drafted tokens at
concurrency c, the best K at c maximises

    tokens/s per sequence = acceptance_length(K) / step_seconds(c, K)     (K = 0: plain AR, length 1)

Acceptance at position k is taken as the share of blocks that accepted at least k drafted tokens
(`survival`). A block accepts a prefix, so drafting only K tokens keeps the first K positions'
acceptance: acceptance_length(K) = 1 + survival[0] + ... + survival[K-1]. (This assumes a drafter run
with a shorter block predicts its first K positions as it does with the full block; DFlash's drafter
attends over the whole block of mask tokens, so the assumption is stated wherever a schedule is
printed.)

The cost model is the caller's: the GPU speed model (plan/speed.py) for `plan --speed`, measured
step times for a CPU run. This module only chooses; it is written once and each engine's config
writer turns `DraftSchedule.ranges` into that engine's own control (the type: io/draft_schedule.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dflash_trt.errors import DFlashError
from dflash_trt.io.draft_schedule import ContextLevels, DraftSchedule, Level, from_dict
from dflash_trt.io.jsonio import read_json

__all__ = ["DraftSchedule", "Level", "from_dict"]   # the plain type lives in io/ (the stacks type it)


def survival_from_histogram(histogram: Mapping[str | int, int], block_size: int) -> list[float]:
    """survival[k-1] = share of blocks that accepted at least k drafted tokens, k = 1..B-1, from a
    histogram of tokens per block bonus token included (`bench`'s acceptance_histogram: 1..B)."""
    counts = {int(n): int(v) for n, v in histogram.items()}
    total = sum(counts.values())
    if total <= 0:
        raise DFlashError("acceptance histogram: no blocks counted")
    if bad := [n for n in counts if not 1 <= n <= block_size]:
        raise DFlashError(f"acceptance histogram: {bad[0]} tokens in a block is outside 1..{block_size} (block size)")
    return [sum(v for n, v in counts.items() if n >= k + 1) / total for k in range(1, block_size)]


def survival_from_tau(tau: float, block_size: int) -> list[float]:
    """A per-position acceptance from a mean acceptance length alone: each drafted token accepted with
    the same probability a given its predecessors were (geometric), a solved so that the full-block
    acceptance length equals tau. An assumption, for drafters with only a published tau."""
    if not 1 <= tau <= block_size:
        raise DFlashError(f"tau {tau:g}: must be in [1, {block_size}] (the block size)")

    def length(a: float) -> float:
        return 1 + sum(a ** k for k in range(1, block_size))
    lo, hi = 0.0, 1.0
    for _ in range(60):                      # length() is increasing in a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if length(mid) < tau else (lo, mid)
    a = (lo + hi) / 2
    return [a ** k for k in range(1, block_size)]


def acceptance_lengths(survival: Sequence[float]) -> list[float]:
    """acceptance_length(K) for K = 0..len(survival): tokens one step emits per sequence."""
    out = [1.0]
    for s in survival:
        if not 0 <= s <= 1:
            raise DFlashError(f"acceptance at a draft position must be in [0, 1], got {s:g}")
        out.append(out[-1] + s)
    return out


def best_k(concurrency: int, lengths: Sequence[float], step_seconds: Callable[[int, int], float]) -> tuple[int, float]:
    """(K, tokens/s per user) maximising lengths[K] / step_seconds(c, K); ties go to the shorter draft."""
    best = (0, lengths[0] / step_seconds(concurrency, 0))
    for k in range(1, len(lengths)):
        rate = lengths[k] / step_seconds(concurrency, k)
        if rate > best[1] * (1 + 1e-9):
            best = (k, rate)
    return best


def choose(survival: Sequence[float], step_seconds: Callable[[int, int], float], concurrencies: Sequence[int], *,
           max_k: int | None = None, assumptions: Sequence[str] = ()) -> DraftSchedule:
    """The best K at each concurrency and the ranges covering 1..max(concurrencies).

    step_seconds(c, K): one decode step of c sequences drafting K tokens each (K = 0: an AR step).
    Between two evaluated concurrencies whose K differ, the boundary is found by bisection (K falls
    as concurrency grows: every cost term grows with the tokens of a step)."""
    grid = sorted(set(int(c) for c in concurrencies))
    if not grid or grid[0] < 1:
        raise DFlashError("draft schedule: concurrencies must be >= 1")
    lengths = acceptance_lengths(survival)
    if max_k is not None:
        if not 1 <= max_k <= len(survival):
            raise DFlashError(f"draft schedule: max K {max_k} must be in [1, {len(survival)}] (block size - 1)")
        lengths = lengths[:max_k + 1]
    top = len(lengths) - 1
    memo: dict[int, tuple[int, float]] = {}

    def pick(c: int) -> tuple[int, float]:
        if c not in memo:
            memo[c] = best_k(c, lengths, step_seconds)
        return memo[c]

    levels = []
    for c in grid:
        k, rate = pick(c)
        levels.append(Level(concurrency=c, k=k, tokens_per_s_per_user=rate,
                            always_k_tokens_per_s_per_user=lengths[top] / step_seconds(c, top),
                            ar_tokens_per_s_per_user=1 / step_seconds(c, 0)))
    # (first concurrency, K) at every change of K, each boundary found by bisection (K monotone)
    changes = [(1, pick(1)[0])]
    points = sorted({1, *grid})
    for lo, hi in zip(points, points[1:]):
        while changes[-1][1] != pick(hi)[0]:
            a, b = max(lo, changes[-1][0]), hi
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if pick(mid)[0] == changes[-1][1] else (a, mid)
            changes.append((b, pick(b)[0]))
    ranges = [[c, nxt - 1, k] for (c, k), (nxt, _) in zip(changes, changes[1:])] + \
        [[changes[-1][0], grid[-1], changes[-1][1]]]
    notes = [f"acceptance length for K = 0..{top}: " + ", ".join(f"{x:.2f}" for x in lengths),
             "a draft of K tokens keeps the acceptance of the full block's first K positions", *assumptions]
    return DraftSchedule(max_k=top, acceptance_lengths=lengths, levels=levels,
                         ranges=[tuple(r) for r in ranges], assumptions=notes)


CONTEXT_END = (1 << 31) - 1   # the last bucket's entries cover every longer context


def choose_by_context(buckets: Sequence[tuple[int, Sequence[float]]],
                      step_seconds_at: Callable[[int], Callable[[int, int], float]], concurrencies: Sequence[int], *,
                      max_k: int | None = None, assumptions: Sequence[str] = ()) -> DraftSchedule:
    """K by concurrency and context: `choose` at each measured context bucket (context tokens, its survival),
    with the step cost at that context (step_seconds_at(context)); a bucket's entries cover the contexts nearer
    to it than to its neighbours. The ranges (for an engine with no context control) are the shortest bucket's."""
    buckets = sorted(buckets)
    per = [choose(surv, step_seconds_at(ctx), concurrencies, max_k=max_k, assumptions=assumptions)
           for ctx, surv in buckets]
    edges = [0, *[(a + b) // 2 + 1 for (a, _), (b, _) in zip(buckets, buckets[1:])], CONTEXT_END + 1]
    entries = [(a, b, lo, hi - 1, k) for (lo, hi), sched in zip(zip(edges, edges[1:]), per) for a, b, k in sched.ranges]
    notes = [f"context {lo}-{hi - 1 if hi <= CONTEXT_END else 'on'} (bucket {ctx}): " + ", ".join(
        f"{a}-{b}: K {k}" for a, b, k in sched.ranges) for (lo, hi), (ctx, _), sched in zip(zip(edges, edges[1:]),
                                                                                            buckets, per)]
    first = per[0]
    return DraftSchedule(max_k=first.max_k, acceptance_lengths=first.acceptance_lengths, levels=first.levels,
                         ranges=first.ranges, assumptions=[*first.assumptions, *notes], by_context=entries,
                         contexts=[ContextLevels(lo, hi - 1, s.acceptance_lengths, s.levels)
                                   for (lo, hi), s in zip(zip(edges, edges[1:]), per)])


def format_schedule(s: DraftSchedule) -> str:
    """The schedule for people: the ranges, then the per-concurrency choice against always-K and AR."""
    lines = ["draft length by concurrency: " + ", ".join(
        f"{a}-{b}: K {k}" if a != b else f"{a}: K {k}" for a, b, k in s.ranges)]
    stop = s.stop_concurrency
    lines.append(f"speculation stops paying at concurrency {stop}" if stop else
                 "speculation pays at every concurrency evaluated")
    lines.append(f"  {'conc':>6} {'K':>3} {'tok/s/user':>11} {f'always K {s.max_k}':>12} {'never':>9}")
    for l in s.levels:
        lines.append(f"  {l.concurrency:>6} {l.k:>3} {l.tokens_per_s_per_user:>11,.1f} "
                     f"{l.always_k_tokens_per_s_per_user:>12,.1f} {l.ar_tokens_per_s_per_user:>9,.1f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reading files: `build --draft-schedule FILE.json` (plan/schedule_cost.schedule_file) and the acceptance of a
# `dflash-trt bench --json` report (plan --acceptance FILE, a preset's measured acceptance_file)


def read_json_file(path: str, where: str) -> dict:
    """A JSON object's file (io/jsonio.read_json); its one-line error starts with `where`."""
    try:
        return read_json(path)
    except DFlashError as e:
        raise DFlashError(f"{where}: {e}") from None


def survival_by_bucket(path: str, block_size: int, where: str) -> list[tuple[int | None, list[float]]]:
    """[(context tokens, survival)] of each bucket of a `dflash-trt bench --context-buckets --json` report, shortest
    first; a plain `bench --json` report: [(None, its survival)]. The report's block_size must be the drafter's."""
    r = read_json_file(path, where)
    if not isinstance(r.get("context_buckets"), list) or not r["context_buckets"]:
        return [(None, survival_from_report(r, block_size, where))]
    out = []
    for i, b in enumerate(r["context_buckets"]):
        if not isinstance(b, dict) or not isinstance(b.get("context_tokens"), int | float) or b["context_tokens"] < 1:
            raise DFlashError(f"{where}: context_buckets[{i}] has no context_tokens (a `bench --context-buckets` row)")
        out.append((round(b["context_tokens"]), survival_from_report(b, block_size, f"{where} context_buckets[{i}]")))
    return sorted(out)


def survival_from_report(r: object, block_size: int, where: str) -> list[float]:
    if not isinstance(r, dict) or not isinstance(r.get("acceptance_histogram"), dict):
        raise DFlashError(f"{where}: no acceptance_histogram (expected a `dflash-trt bench --json` report)")
    if r.get("block_size") != block_size:
        raise DFlashError(f"{where}: measured with block size {r.get('block_size')!r}, the drafter serves "
                          f"block {block_size}")
    try:
        surv = survival_from_histogram(r["acceptance_histogram"], block_size)
    except (TypeError, ValueError) as e:
        raise DFlashError(f"{where}: acceptance_histogram: {e}") from None
    except DFlashError as e:
        raise DFlashError(f"{where}: {e}") from None
    return surv
