"""deploy/draft_schedule.py: the ranges agree with a brute-force best K at every concurrency."""
import pytest

from dflash_trt.deploy import draft_schedule as ds
from dflash_trt.errors import DFlashError


def test_survival_from_histogram():
    # tokens per block incl. bonus: 10 blocks of 1, 5 of 2, 5 of 3 -> >=1 draft 10/20, >=2 drafts 5/20, >=3 0
    assert ds.survival_from_histogram({"1": 10, "2": 5, "3": 5}, 4) == [0.5, 0.25, 0.0]
    with pytest.raises(DFlashError, match="outside 1..4"):
        ds.survival_from_histogram({"5": 1}, 4)


def test_survival_from_tau_reproduces_tau():
    for tau, B in ((4.4, 10), (1.0, 8), (1.9, 16)):
        assert ds.acceptance_lengths(ds.survival_from_tau(tau, B))[-1] == pytest.approx(tau, abs=1e-9)


@pytest.mark.parametrize("per_token", [0.002, 0.02, 0.2])
def test_ranges_match_brute_force(per_token):
    surv = ds.survival_from_tau(4.4, 10)

    def step(c, k):
        return 1 + c * (k + 1) * per_token + (0.3 if k else 0.0)   # a drafter pass costs something fixed
    s = ds.choose(surv, step, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 300])
    lengths = ds.acceptance_lengths(surv)
    for c in range(1, 301):
        want = max(range(10), key=lambda k: (lengths[k] / step(c, k), -k))
        assert s.k_at(c) == want, c
    firsts = [r[0] for r in s.ranges]
    assert firsts[0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(s.ranges, s.ranges[1:]))
    assert s.ranges[-1][1] == 300
    for lvl in s.levels:   # the choice is at least the better of always-K and never
        assert lvl.tokens_per_s_per_user >= max(lvl.always_k_tokens_per_s_per_user, lvl.ar_tokens_per_s_per_user)


def test_max_k_caps_the_draft():
    s = ds.choose(ds.survival_from_tau(4.4, 10), lambda c, k: 1.0, [1, 8], max_k=3)
    assert s.max_k == 3 and s.ranges == [(1, 8, 3)] and not s.adaptive and s.stop_concurrency is None
