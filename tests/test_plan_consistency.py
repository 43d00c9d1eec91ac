"""`dflash-trt plan` agrees with itself (issue 41 item 6): the speed curves stop where the capacity table's
layout stops, ep variants with the same figures are listed once, a draft length that changes with concurrency
is explained in numbers (and is what an exhaustive search gives), the plot labels everything it draws, the
embedded pair's drafter is known, and `plan --json` is what `build --draft-schedule` takes (the recipe `build`
prints works as written)."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import get_hardware
from dflash_trt.plan import cost, planner, schedule_cost, speed, speed_check
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.presets.embedded import embedded_drafter_path

from helpers import run_cli


@pytest.fixture(scope="module")
def gptoss_b300():
    name, tcfg, dcfg = planner.target_configs("gpt-oss-120b")
    p = planner.plan(tcfg, dcfg, "dgx-b300", target_name=name, drafter_name=f"{name} drafter")
    return p, speed.speed_for(p, tcfg, dcfg), tcfg, dcfg


def test_speed_curves_stop_at_the_layouts_max_batch_size(gptoss_b300):
    p, report, _, _ = gptoss_b300
    by_layout = {(l.tp, l.ep): l for l in p.layouts}
    assert by_layout[(8, 1)].max_batch_size == 102          # the draft context caps it (the capacity table)
    for ls in report.layouts:
        lay = by_layout[(ls.tp, ls.ep)]
        kv_cap = lay.kv_budget_bytes_per_gpu // (lay.kv_bytes_per_token_per_gpu * (report.context_tokens + 10))
        assert ls.max_concurrency == min(lay.max_batch_size, kv_cap) <= lay.max_batch_size
        assert ls.points[-1].concurrency == ls.max_concurrency
        if ls.draft_schedule:
            assert ls.draft_schedule["ranges"][-1][1] == ls.max_concurrency


def test_identical_ep_variants_are_listed_once_and_said_so():
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed")
    assert code == 0, err
    table = out[out.index(" rank "):out.index("chosen:")]
    assert len(re.findall(r"^\s+\S+\s+8\s", table, flags=re.M)) == 1 and " 1/2/4/8 " in table
    assert "differ only in ep" in table
    assert "tp 8, ep 1/2/4/8: 1 replica(s) of 8 GPU(s), up to 102 sequences each" in out
    assert "listed once" in out and "tp 8, ep 2" not in out and "tp 4, ep 1/2/4 (up to 99)" in out
    code, out, _ = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--json")
    tp8 = [l for l in json.loads(out)["speed"]["layouts"] if l["tp"] == 8]
    assert [l["ep"] for l in tp8] == [1, 2, 4, 8]                # the JSON keeps each layout
    assert len({json.dumps(l["points"]) for l in tp8}) == 1      # and they are indeed the same figures


def test_a_changing_draft_length_is_explained_and_is_the_exhaustive_choice():
    """gpt-oss-120b on one B300 GPU: K 7, 6, 7, 9 over concurrency. Every concurrency evaluated on its own
    (no bisection) gives the schedule's K, and each range's explanation carries the marginal numbers
    recomputed here from the schedule's acceptance lengths and the cost model's step times."""
    name, tcfg, dcfg = planner.target_configs("gpt-oss-120b")
    p = planner.plan(tcfg, dcfg, "dgx-b300", target_name=name, drafter_name="d", tp=1)
    ls = speed.speed_for(p, tcfg, dcfg).layouts[0]
    sched = ds.from_dict(ls.draft_schedule, p.block_size, "test")
    assert [k for _, _, k in sched.ranges] == [7, 6, 7, 9]
    step = cost.StepCost(p, planner.target_shape(tcfg, name), planner.drafter_shape(dcfg), get_hardware("dgx-b300"),
                         1, speed.DEFAULT_CONTEXT_TOKENS, cost.EFFICIENCY["central"]).step_seconds
    L = ds.acceptance_lengths(ds.survival_from_tau(4.4, 10))
    alone = [max(range(10), key=lambda k: (L[k] / step(c, k), -k)) for c in range(1, ls.max_concurrency + 1)]
    assert alone == [sched.k_at(c) for c in range(1, ls.max_concurrency + 1)]
    why = "\n".join(ls.draft_schedule_why)
    assert "not an artefact of the search" in why
    for first, _, k in sched.ranges:
        line = next(x for x in ls.draft_schedule_why if x.strip().startswith(f"concurrency {first}"))
        if k < 9:
            assert (f"K {k + 1} would add {L[k + 1] / L[k] - 1:+.1%} tokens per step for "
                    f"{step(first, k + 1) / step(first, k) - 1:+.1%} step time") in line
    assert "MoE (128 experts, top-4)" in why
    # a schedule that drafts the whole block everywhere needs no explanation
    code, out, _ = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed")
    first_layout = out[out.index("tp 8, ep 1/2/4/8:"):out.index("other layouts")]
    assert "draft length by concurrency: 1-102: K 9" in first_layout and "why K changes" not in first_layout


def test_the_plot_labels_every_line_band_and_box(gptoss_b300):
    from dflash_trt.plan.speed_plot import speed_figure

    _, report, _, _ = gptoss_b300
    fig = speed_figure(report)
    main, key, kax, notes = fig.axes
    # the K panel is its own axes, beside nothing it could cover
    a, b = main.get_position(), kax.get_position()
    assert a.y0 > b.y1 or b.y0 > a.y1
    legend = [t.get_text() for t in key.get_legend().get_texts()]
    assert any("low / high efficiency sets (dotted)" in t for t in legend)
    assert any("published claim: users at 500-600 tok/s (grey band)" in t for t in legend)
    assert any("best K per concurrency" in t for t in legend)
    # every line drawn on the curves' axes is in the legend, or labelled where it ends
    annotations = {t.get_text() for t in main.texts}
    assert {"AR low", "AR high", "DFlash low", "DFlash high"} <= annotations
    unlabelled = [ln for ln in main.get_lines() if ln.get_label().startswith("_")]
    assert len(unlabelled) == 3          # the other three dotted range lines, each annotated above
    assert kax.get_ylabel().startswith("K") and kax.get_legend() is not None
    text = "\n".join(t.get_text() for t in notes.texts)
    for pt in speed_check.matching_points(report.target, report.hardware):
        assert pt["id"] not in text and pt["id"] not in "\n".join(annotations)   # no internal ids
        assert speed_check.verdict(pt, speed_check.predict_point(pt))[:20] in " ".join(text.split())


def test_plan_knows_the_embedded_pairs_drafter():
    name, _, dcfg = planner.target_configs("smollm2-135m")
    assert dcfg == json.loads((embedded_drafter_path() / "config.json").read_text())
    code, out, err = run_cli("plan", "--target", "smollm2-135m", "--hardware", "dgx-b300")
    assert code == 0, err
    assert "drafter smollm2-135m drafter: " in out and f"block {dcfg['block_size']}" in out


@pytest.fixture()
def bench_report(tmp_path):
    """A `dflash-trt bench --json` report's acceptance fields (qwen3-8b's drafter: a block of 16)."""
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"block_size": 16, "acceptance_histogram": {"1": 51, "2": 36, "3": 14, "4": 10, "5": 6,
                                                                        "6": 2, "7": 1, "16": 3}}))
    return f


def _schedule(name, mode, **kw):
    _, tcfg, dcfg = planner.target_configs(name)
    args = dict(target_name=name, target_config=tcfg, drafter_config=dcfg, gpu="b300", quant="nvfp4",
                kv_cache="fp8", drafter_quant="none", tp=1, ep=1, block_size=dcfg["block_size"], max_batch_size=128,
                max_seq_len=8192)
    return schedule_cost.build_schedule(mode, **{**args, **kw})


def test_embedded_bundle_is_planned_from_the_drafters_measured_acceptance():
    """build --draft-schedule auto for the embedded pair: the acceptance `bench` measured, stored beside the
    drafter's model card (presets/catalog.py acceptance_file), not a geometric guess."""
    stored = json.loads((embedded_drafter_path() / "acceptance.json").read_text())
    sched, why = _schedule("smollm2-135m", "auto")
    assert "smollm2-135m-dflash/acceptance.json" in why
    lengths = [1 + sum(stored["acceptance_per_position"][:k]) for k in range(stored["block_size"])]
    assert sched.acceptance_lengths == pytest.approx(lengths[:sched.max_k + 1], abs=1e-5)


def test_builds_recipe_works_as_written_and_plan_json_is_a_draft_schedule(tmp_path, bench_report, monkeypatch):
    sched, why = _schedule("qwen3-8b", "auto")     # a preset whose drafter has no published or measured tau
    assert sched is None
    commands = re.findall(r"`(dflash-trt [^`]+)`", why)
    plan_cmd = next(c for c in commands if c.startswith("dflash-trt plan"))
    assert commands[-1].startswith("dflash-trt build") and "--draft-schedule plan.json" in commands[-1]
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(plan_cmd.split(" > ")[0])[1:]
    code, out, err = run_cli(*argv)
    assert code == 0, err
    (tmp_path / "plan.json").write_text(out)
    sched, src = _schedule("qwen3-8b", "plan.json")
    planned = next(l for l in json.loads(out)["speed"]["layouts"] if (l["tp"], l["ep"]) == (1, 1))
    assert [list(r) for r in sched.ranges] == planned["draft_schedule"]["ranges"] and src == "read from plan.json"
    # one layout's schedule object is still taken as it is
    (tmp_path / "one.json").write_text(json.dumps(planned["draft_schedule"]))
    assert _schedule("qwen3-8b", "one.json")[0].ranges == sched.ranges
    # a layout the plan has no schedule for, or another block size: one line naming the file
    with pytest.raises(DFlashError, match=r"plan.json: no draft schedule for tp 3 ep 1 \(it has tp 8 ep 1, tp 4 ep 1, "
                                          r"tp 2 ep 1, tp 1 ep 1\)"):
        _schedule("qwen3-8b", "plan.json", tp=3)
    with pytest.raises(DFlashError, match=r"planned for block size 16, the bundle's drafter serves block 10"):
        _schedule("qwen3-8b", "plan.json", block_size=10)
