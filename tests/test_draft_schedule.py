"""plan/draft_schedule.py: the ranges agree with a brute-force best K at every concurrency."""
import json

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.plan import draft_schedule as ds

from helpers import run_cli


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


@pytest.mark.parametrize("doc,message", [
    ([1, 2], "expected a draft schedule"),
    ({"ranges": []}, "expected a draft schedule"),
    ({"ranges": [[2, 8, 7]]}, "ranges[0] starts at concurrency 2, expected 1"),
    ({"ranges": [[1, 8, 7], [10, 20, 3]]}, "ranges[1] starts at concurrency 10, expected 9"),
    ({"ranges": [[1, 8, 7], [8, 20, 3]]}, "ranges[1] starts at concurrency 8, expected 9"),
    ({"ranges": [[1, 8, 8]]}, "ranges[0] drafts k = 8, outside 0..7"),
    ({"ranges": [[1, 8, -1]]}, "ranges[0] drafts k = -1, outside 0..7"),
    ({"ranges": [[1, 0, 7]]}, "ranges[0] ends at 0, before its first concurrency 1"),
    ({"ranges": [[1, 8, 2.5]]}, "ranges[0] must be [first, last, k] integers"),
    ({"ranges": [[1, 8, 3]], "max_k": 9}, "max_k 9 must be an integer from the largest k of the ranges to 7"),
])
def test_schedule_file_is_checked(doc, message):
    with pytest.raises(DFlashError) as e:
        ds.from_dict(doc, 8, "s.json")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_schedule_round_trips_through_its_dict():
    s = ds.choose(ds.survival_from_tau(4.4, 10), lambda c, k: 1 + c * (k + 1) * 0.02 + (0.3 if k else 0), [1, 8, 64])
    back = ds.from_dict(json.loads(json.dumps(s.to_dict())), 10, "x.json")
    assert back.ranges == s.ranges and back.levels == s.levels and back.stop_concurrency == s.stop_concurrency


def test_acceptance_from_a_bench_report(tmp_path):
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"block_size": 4, "acceptance_histogram": {"1": 10, "2": 5, "3": 5}}))
    ((ctx, surv),) = ds.survival_by_bucket(str(report), 4, "r")
    assert ctx is None and surv == [0.5, 0.25, 0.0]
    assert ds.acceptance_lengths(surv)[-1] == pytest.approx((10 * 1 + 5 * 2 + 5 * 3) / 20)
    with pytest.raises(DFlashError, match="r: measured with block size 4, the drafter serves block 10"):
        ds.survival_by_bucket(str(report), 10, "r")
    report.write_text(json.dumps({"block_size": 4}))
    with pytest.raises(DFlashError, match="no acceptance_histogram"):
        ds.survival_by_bucket(str(report), 4, "r")
    report.write_text("[1, 2]")
    with pytest.raises(DFlashError, match=r"^r: .*bench.json: expected a JSON object, found list$"):
        ds.survival_by_bucket(str(report), 4, "r")


def test_k_by_context_chooses_per_bucket_and_covers_every_context(tmp_path):
    """Two buckets, each its own acceptance and step cost: every (concurrency, context) gets what `choose` gives
    at the nearer bucket; the ranges are the shorter bucket's; the entries survive the dict and a bench report
    with buckets gives the buckets' acceptance."""
    short, long = ds.survival_from_tau(4.4, 8), ds.survival_from_tau(1.1, 8)   # acceptance collapses when long

    def cost_at(ctx):
        return lambda c, k: 1 + c * (k + 1) * 0.01 * (1 + ctx / 4096) + (0.3 if k else 0.0)
    s = ds.choose_by_context([(8192, long), (512, short)], cost_at, [1, 4, 16, 64])
    want = {ctx: ds.choose(surv, cost_at(ctx), [1, 4, 16, 64]) for ctx, surv in ((512, short), (8192, long))}
    assert s.ranges == want[512].ranges and s.k_at(1) > 0
    for c in (1, 3, 4, 16, 40, 64):
        for ctx in (0, 512, 4352, 4353, 8192, 10 ** 6):
            (k,) = [e[4] for e in s.by_context if e[0] <= c <= e[1] and e[2] <= ctx <= e[3]]
            assert k == want[512 if ctx <= 4352 else 8192].k_at(c), (c, ctx)
    assert all(k == 0 for *_, lo, _, k in s.by_context if lo > 4352)        # speculation off when long
    back = ds.from_dict(json.loads(json.dumps(s.to_dict())), 8, "s.json")
    assert back.by_context == s.by_context and back.adaptive
    assert back.contexts == s.contexts and [(c.first, c.last) for c in s.contexts] == [(0, 4352), (4353, ds.CONTEXT_END)]
    assert s.contexts[1].levels == want[8192].levels and s.contexts[1].acceptance_lengths == want[8192].acceptance_lengths
    with pytest.raises(DFlashError, match=r"s.json: contexts\[0\] must be \{first, last, acceptance_lengths, levels\}"):
        ds.from_dict({"ranges": [[1, 8, 7]], "contexts": [{"first": 0, "last": 9}]}, 8, "s.json")
    with pytest.raises(DFlashError, match=r"by_context\[0\] must be \[first, last concurrency, first, last context"):
        ds.from_dict({"ranges": [[1, 8, 7]], "by_context": [[1, 8, 0, 100]]}, 8, "s.json")
    report = tmp_path / "buckets.json"
    report.write_text(json.dumps({"context_buckets": [
        {"context_tokens": 505.5, "block_size": 4, "acceptance_histogram": {"1": 10, "2": 5, "3": 5}},
        {"context_tokens": 8000, "block_size": 4, "acceptance_histogram": {"1": 20}}]}))
    assert ds.survival_by_bucket(str(report), 4, "r") == [(506, [0.5, 0.25, 0.0]), (8000, [0.0, 0.0, 0.0])]


def test_plan_plots_k_by_context_a_line_per_bucket(tmp_path):
    """`plan --speed --acceptance` with a bench report by context bucket plans K(c, ctx) and `--plot` draws K
    against concurrency once per bucket (matplotlib's own legend of the K axes is the oracle)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    from types import SimpleNamespace

    from matplotlib.figure import Figure

    from dflash_trt.plan.speed_plot import draw_schedule

    report = tmp_path / "buckets.json"
    report.write_text(json.dumps({"context_buckets": [
        {"context_tokens": 512, "block_size": 10, "acceptance_histogram": {"1": 10, "4": 30, "10": 60}},
        {"context_tokens": 16000, "block_size": 10, "acceptance_histogram": {"1": 90, "2": 10}}]}))
    png = tmp_path / "k.png"
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--acceptance",
                             str(report), "--plot", str(png), "--json")
    assert code == 0, err
    d = json.loads(out)["speed"]["layouts"][0]["draft_schedule"]
    assert {(c["first"], c["last"]) for c in d["contexts"]} == {(0, 8256), (8257, ds.CONTEXT_END)}
    assert png.stat().st_size > 10_000
    fig = Figure()
    ax, kax = fig.add_subplot(211), fig.add_subplot(212)
    draw_schedule(ax, kax, "tp8", SimpleNamespace(draft_schedule=d, gpus_per_replica=8), "C0")
    labels = [line.get_label() for line in kax.get_lines()]
    assert labels[:2] == ["tp8: K drafted per step at context 0-8256", "tp8: K drafted per step at context 8257-on"]
    # each line is its bucket's entries: K at concurrency 1 as the schedule says
    for line, lo in zip(kax.get_lines()[:2], (0, 8257)):
        (k,) = [e[4] for e in d["by_context"] if e[0] == 1 and e[2] == lo]
        assert line.get_ydata()[0] == k
