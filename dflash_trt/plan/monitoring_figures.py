"""The planned figures a deployment's alerts compare the served traffic with, computed once from the plan.

A bundle's draft schedule (manifest.json `draft_schedule.schedule`, plan/draft_schedule.DraftSchedule.to_dict)
holds, per evaluated concurrency c, the tokens/s per user of plain decoding and of the K it chose, and the
acceptance length at each K. From those:

- planned acceptance length at c: acceptance_lengths[K(c)], what the rollout was sized for;
- break-even acceptance length at c: the acceptance length at which drafting K tokens gives exactly plain
  decoding's speed, lengths[K] * ar(c) / speed(c, K) (one step with K drafted tokens costs lengths[K] / speed
  seconds, an AR step 1 / ar); below it speculation costs more than it gives;
- per-token latency target: 1 / the per-user tokens/s to hold (deploy --min-tokens-per-user), else 1 / the
  planned tokens/s per user at the highest concurrency planned (the slowest the plan expects).

Each figure holds from its evaluated concurrency up to the next one (the schedule's grid); a schedule by
context (DraftSchedule.contexts) has them per context bucket too (`by_context`). A bundle without a schedule
(a CPU bundle, a drafter without an acceptance figure) has no planned figures: the alerts that need them are not
written.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest


@dataclass(frozen=True)
class ConcurrencyFigure:
    """A figure that holds for the measured concurrency in [first, until) (until None: and above), at every
    context (context None) or at the contexts (first, last token) of one bucket of a schedule by context."""
    first: int
    until: int | None
    k: int                         # tokens drafted per step there (the schedule's K; its max K where it says 0)
    planned_acceptance_length: float
    break_even_acceptance_length: float
    context: tuple[int, int] | None = None


@dataclass(frozen=True)
class PlannedFigures:
    by_concurrency: tuple[ConcurrencyFigure, ...] = ()
    time_per_output_token_s: float | None = None    # the per-user latency target
    source: str = "no draft schedule: no planned figures"
    # a schedule by context (DraftSchedule.contexts): the figures of every bucket, for an engine that drafts by
    # context (by_concurrency: the shortest bucket's, what an engine keyed by batch size only drafts everywhere)
    by_context: tuple[ConcurrencyFigure, ...] = ()

    def to_dict(self) -> dict:
        return {"by_concurrency": [vars(f) for f in self.by_concurrency],
                "time_per_output_token_s": self.time_per_output_token_s, "source": self.source,
                **({"by_context": [vars(f) for f in self.by_context]} if self.by_context else {})}


NONE = PlannedFigures()


def _rows(lengths: list, max_k: int, levels: list, context: tuple[int, int] | None = None) -> list[ConcurrencyFigure]:
    lengths = [float(x) for x in lengths]
    levels = sorted(levels, key=lambda lv: int(lv["concurrency"]))
    rows = []
    for i, lv in enumerate(levels):
        k = int(lv["k"]) or max_k
        speed = float(lv["tokens_per_s_per_user"] if int(lv["k"]) else lv["always_k_tokens_per_s_per_user"])
        nxt = int(levels[i + 1]["concurrency"]) if i + 1 < len(levels) else None
        rows.append(ConcurrencyFigure(int(lv["concurrency"]), nxt, k, planned_acceptance_length=lengths[k],
                                      break_even_acceptance_length=lengths[k] * float(lv["ar_tokens_per_s_per_user"])
                                      / speed, context=context))
    return rows


def planned_figures(schedule: dict | None, *, min_tokens_per_user: float | None = None,
                    where: str = "draft_schedule") -> PlannedFigures:
    """The figures of a schedule dict (DraftSchedule.to_dict()); NONE without one, or with only a target speed."""
    tpot = 1 / min_tokens_per_user if min_tokens_per_user else None
    if not schedule:
        return PlannedFigures(time_per_output_token_s=tpot,
                              source=f"--min-tokens-per-user {min_tokens_per_user:g}" if tpot else NONE.source)
    try:
        max_k = int(schedule["max_k"])
        rows = _rows(schedule["acceptance_lengths"], max_k, schedule["levels"])
        by_context = [r for c in schedule.get("contexts") or []
                      for r in _rows(c["acceptance_lengths"], max_k, c["levels"], (int(c["first"]), int(c["last"])))]
        top_speed = float(max(schedule["levels"], key=lambda lv: int(lv["concurrency"]))["tokens_per_s_per_user"])
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
        raise DFlashError(f"{where}: not a draft schedule (acceptance_lengths, max_k, levels): {e!r}") from None
    if not rows:
        raise DFlashError(f"{where}: the schedule has no levels")
    if tpot is None:
        tpot = 1 / top_speed
        src = f"the draft schedule; per-token target: planned speed at concurrency {rows[-1].first}"
    else:
        src = f"the draft schedule; per-token target: --min-tokens-per-user {min_tokens_per_user:g}"
    return PlannedFigures(by_concurrency=tuple(rows), time_per_output_token_s=tpot, source=src,
                          by_context=tuple(by_context))


def bundle_figures(m: Manifest, *, min_tokens_per_user: float | None = None) -> PlannedFigures:
    """The figures of a bundle: the draft schedule it serves (manifest.json `draft_schedule.schedule`, which a
    `tune` revision replaces; plan.json keeps the figures build planned the first one from). No layout search."""
    sched = m.draft_schedule.schedule if m.draft_schedule else None
    return planned_figures(sched, min_tokens_per_user=min_tokens_per_user,
                           where="manifest.json draft_schedule.schedule")
