"""The draft-length schedule as a plain type: how many tokens to draft at each concurrency.

Chosen by the planner (plan/draft_schedule.py, plan/speed.py) or read from a file, recorded in the
bundle manifest (io/manifest.py DraftScheduleRecord) and turned by each serving stack into its own
control (stacks/*: draft_schedule_fields). It lives here, below every stage that passes it along, so
that each of them can type it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_trt.errors import DFlashError


@dataclass(frozen=True)
class Level:
    """The choice at one concurrency."""
    concurrency: int
    k: int                            # tokens drafted per step (0: no speculation)
    tokens_per_s_per_user: float      # at the chosen k
    always_k_tokens_per_s_per_user: float   # drafting the most K every step
    ar_tokens_per_s_per_user: float   # never speculating


@dataclass(frozen=True)
class ContextLevels:
    """What the choice at one context bucket was made from (monitoring's break-even per concurrency and context)."""
    first: int                        # its contexts, first..last token, inclusive
    last: int
    acceptance_lengths: list[float]
    levels: list[Level]


@dataclass
class DraftSchedule:
    max_k: int                        # the most a step drafts (block size - 1, or less if asked)
    acceptance_lengths: list[float]   # index K
    levels: list[Level]               # one per concurrency evaluated
    ranges: list[tuple[int, int, int]]  # (first, last concurrency, k), inclusive, covering 1..max concurrency
    assumptions: list[str]
    # K by concurrency and context: (first, last concurrency, first, last context token, k), inclusive, as vLLM
    # PR #48944 proposes them; empty: the ranges hold at every context (plan/draft_schedule.choose_by_context)
    by_context: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    contexts: list[ContextLevels] = field(default_factory=list)   # one per bucket where by_context was planned

    def k_at(self, concurrency: int) -> int:
        """The draft length at a concurrency (past the last range: the last range's)."""
        for first, last, k in self.ranges:
            if first <= concurrency <= last:
                return k
        return self.ranges[-1][2]

    @property
    def stop_concurrency(self) -> int | None:
        """The lowest concurrency from which on speculation no longer pays (k 0), None if it always does."""
        tail = self.ranges[-1]
        return tail[0] if tail[2] == 0 else None

    @property
    def adaptive(self) -> bool:
        """Whether the schedule drafts anything other than max_k somewhere."""
        return any(r[-1] != self.max_k for r in (*self.ranges, *self.by_context))

    def to_dict(self) -> dict:
        return {"max_k": self.max_k, "acceptance_lengths": self.acceptance_lengths,
                "levels": [asdict(l) for l in self.levels], "ranges": [list(r) for r in self.ranges],
                "stop_concurrency": self.stop_concurrency, "assumptions": self.assumptions,
                **({"by_context": [list(r) for r in self.by_context]} if self.by_context else {}),
                **({"contexts": [asdict(c) for c in self.contexts]} if self.contexts else {})}



def from_dict(d: object, block_size: int, where: str) -> DraftSchedule:
    """A DraftSchedule from its to_dict() form, checked: ranges of integers contiguous from 1, every K in
    0..block_size - 1. `where` names the file in the one-line errors."""
    if not isinstance(d, dict) or not isinstance(d.get("ranges"), list) or not d["ranges"]:
        raise DFlashError(f"{where}: expected a draft schedule (a JSON object with \"ranges\": [[first, last, k], ...], "
                          "as `plan --speed --json` writes under layouts[].draft_schedule)")
    ranges: list[tuple[int, int, int]] = []
    for i, r in enumerate(d["ranges"]):
        if not (isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise DFlashError(f"{where}: ranges[{i}] must be [first, last, k] integers, got {r!r}")
        first, last, k = r
        want = ranges[-1][1] + 1 if ranges else 1
        if first != want:
            raise DFlashError(f"{where}: ranges[{i}] starts at concurrency {first}, expected {want} (ranges cover "
                              "1..N without gaps or overlaps)")
        if last < first:
            raise DFlashError(f"{where}: ranges[{i}] ends at {last}, before its first concurrency {first}")
        if not 0 <= k <= block_size - 1:
            raise DFlashError(f"{where}: ranges[{i}] drafts k = {k}, outside 0..{block_size - 1} (block size "
                              f"{block_size} - 1)")
        ranges.append((first, last, k))
    max_k = d.get("max_k", max(k for _, _, k in ranges))
    if not isinstance(max_k, int) or not max(k for _, _, k in ranges) <= max_k <= block_size - 1:
        raise DFlashError(f"{where}: max_k {max_k!r} must be an integer from the largest k of the ranges to "
                          f"{block_size - 1} (block size - 1)")
    lengths = d.get("acceptance_lengths") or []
    levels = _levels(d.get("levels"), f"{where}: levels")
    by_context = []
    for i, r in enumerate(d.get("by_context") or []):
        if not (isinstance(r, list) and len(r) == 5 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 1 <= r[0] <= r[1] and 0 <= r[2] <= r[3] and 0 <= r[4] <= max_k):
            raise DFlashError(f"{where}: by_context[{i}] must be [first, last concurrency, first, last context token, "
                              f"k] integers (1 <= first <= last, 0 <= k <= max_k {max_k}), got {r!r}")
        by_context.append(tuple(r))
    contexts = []
    for i, c in enumerate(d.get("contexts") or []):
        try:
            contexts.append(ContextLevels(int(c["first"]), int(c["last"]), [float(x) for x in c["acceptance_lengths"]],
                                          _levels(c["levels"], f"{where}: contexts[{i}].levels")))
        except (KeyError, TypeError, ValueError) as e:
            raise DFlashError(f"{where}: contexts[{i}] must be {{first, last, acceptance_lengths, levels}}: {e!r}") \
                from None
    return DraftSchedule(max_k=max_k, acceptance_lengths=[float(x) for x in lengths], levels=levels, ranges=ranges,
                         assumptions=[*[str(a) for a in d.get("assumptions") or []], f"schedule read from {where}"],
                         by_context=by_context, contexts=contexts)


def _levels(rows: object, where: str) -> list[Level]:
    try:
        return [Level(**lv) for lv in rows or []]
    except TypeError as e:
        raise DFlashError(f"{where}: {e}") from None
