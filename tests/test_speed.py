"""The speed model of `dflash-trt plan --speed` (dflash_trt/plan/speed.py): its physics against
independent oracles (a Monte-Carlo of random top-k routing for the experts a step touches; the
planner's weight bytes, themselves checked against the checkpoint formats; a roofline crossover
worked out by hand from the parameter groups), the shape of its curves, the published-point table
of docs/speed-model.md, and the CLI (--json carries every number, --plot writes a PNG, bad input
is one line and writes nothing)."""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import catalog, get_hardware
from dflash_trt.plan import cost, planner, speed, speed_check

from helpers import run_cli

CENTRAL = cost.EFFICIENCY["central"]


def shapes(name):
    tname, cfg, dcfg = planner.target_configs(name)
    return planner.target_shape(cfg, tname), cfg, dcfg


# --- physics against independent oracles --------------------------------------------------------


@pytest.mark.parametrize("experts,k,tokens", [(128, 4, 1), (128, 4, 10), (128, 4, 32), (128, 4, 320), (32, 4, 7),
                                              (8, 2, 3)])
def test_experts_touched_matches_a_monte_carlo_of_random_routing(experts, k, tokens):
    """Each token draws k distinct experts uniformly; count the distinct experts a step touches."""
    rng = np.random.default_rng(0)
    trials = 4000
    picks = np.argsort(rng.random((trials, tokens, experts)), axis=-1)[..., :k]   # k distinct per token
    touched = np.array([np.unique(t).size for t in picks.reshape(trials, -1)])
    se = touched.std(ddof=1) / math.sqrt(trials)
    expected = cost.experts_touched(experts, k, tokens)
    assert abs(touched.mean() - expected) < 4 * se + 1e-9, (touched.mean(), expected)


def test_weight_bytes_read_are_the_planners_by_format():
    """A dense model reads every weight once per step whatever the batch: the planner's bytes (tested
    against the checkpoint formats) less the embedding table, which is a lookup. FP8 / NVFP4 shrink
    exactly the quantized linears; an MoE step at batch 1 reads k/E of the experts' bytes."""
    t, _, _ = shapes("qwen3-8b")
    hw = get_hardware("dgx-b200")
    embed = next(g for g in t.groups if g.name == "embed")
    embed_bytes = embed.elements * 2
    for fmt in ("none", "fp8", "nvfp4"):
        for seqs in (1, 64):
            f = cost.forward(t, fmt, "fp8", hw, 1, seqs, 1, 1024, CENTRAL)
            assert f.weight_bytes == pytest.approx(cost.weight_bytes(t, fmt) - embed_bytes, rel=1e-12)
    q = sum(g.elements for g in t.groups if g.quantizable)
    none, fp8 = (cost.forward(t, f, "fp8", hw, 1, 1, 1, 1024, CENTRAL).weight_bytes for f in ("none", "fp8"))
    assert none - fp8 == pytest.approx(q * (2 - 1) - 8 * sum(g.linears for g in t.groups if g.quantizable), rel=1e-9)

    g, _, _ = shapes("gpt-oss-120b")
    experts = [x for x in g.groups if x.expert or x.name == "expert_bias"]
    exp_bytes = cost.weight_bytes(replace(g, groups=experts), "mxfp4")
    rest = cost.weight_bytes(replace(g, groups=[x for x in g.groups if x not in experts and x.name != "embed"]),
                                "mxfp4")
    f = cost.forward(g, "mxfp4", "fp8", hw, 1, 1, 1, 1024, CENTRAL)
    assert f.weight_bytes == pytest.approx(rest + exp_bytes * 4 / 128, rel=1e-9)


def test_verify_reads_the_kv_cache_once_whatever_the_block():
    """A verify of B tokens reads each sequence's context once (FlashAttention over a query block):
    the KV bytes differ from an AR step only by the B - 1 extra tokens written."""
    t, _, _ = shapes("llama-3.1-8b")
    hw = get_hardware("hgx-h200")
    ar = cost.forward(t, "fp8", "fp8", hw, 1, 16, 1, 4096, CENTRAL)
    v = cost.forward(t, "fp8", "fp8", hw, 1, 16, 10, 4096, CENTRAL)
    per_token_layer = 2 * t.kv_heads * t.head_dim * 1
    assert v.kv_bytes - ar.kv_bytes == 16 * 9 * t.layers * per_token_layer
    assert ar.kv_bytes == 16 * (4096 + 1) * t.layers * per_token_layer


@pytest.mark.parametrize("name,hw_name,fmt", [("qwen3-8b", "hgx-h100", "fp8"), ("qwen3-8b", "hgx-h100", "none"),
                                              ("qwen3-8b", "dgx-b200", "nvfp4"), ("llama-3.1-8b", "dgx-b300", "fp8")])
def test_memory_to_compute_crossover_where_the_flops_say(name, hw_name, fmt):
    """The linear layers of a dense model turn compute-bound at the token count where
    2 · params · T / (peak · eff) equals their bytes / (bandwidth · eff): worked out here from the
    parameter groups, against the token count at which forward() says 'compute'."""
    t, _, _ = shapes(name)
    hw = get_hardware(hw_name)
    fmt_math = {"none": "bf16", "fp8": "fp8", "nvfp4": "fp4"}[fmt]
    linear = [g for g in t.groups if g.name != "embed"]
    bytes_ = sum(cost.weight_bytes(replace(t, groups=[g]), fmt) for g in linear)
    secs_per_token = sum(2 * g.elements / (hw.dense_flops_per_s[fmt_math if g.quantizable else "bf16"] * CENTRAL.tensor)
                         for g in linear if g.quantizable or g.name == "lm_head")
    crossover = bytes_ / (hw.hbm_bytes_per_s * CENTRAL.hbm) / secs_per_token
    bound = {T: cost.forward(t, fmt, "fp8", hw, 1, T, 1, 512, CENTRAL).bound for T in
             (math.floor(crossover) - 1, math.ceil(crossover) + 1)}
    assert bound == {math.floor(crossover) - 1: "memory", math.ceil(crossover) + 1: "compute"}
    # FP8 halves the bytes and doubles the peak against BF16, so on Hopper both cross at the same batch
    if fmt == "fp8" and hw.arch == "hopper":
        assert 100 < crossover < 400


def test_dense_verify_costs_an_ar_step_at_batch_1_and_moe_verify_does_not():
    """At batch 1 a dense target reads its weights once for 1 or B tokens, so a verify costs about
    an AR step and the DFlash gain is tau / (1 + draft / AR step). An MoE target's B tokens touch
    many more experts than 1 token (128 · (1 - (1 - 4/128)^10) = 34.9 against 4), so its verify is dearer."""
    t, _, _ = shapes("qwen3-8b")
    hw = get_hardware("hgx-h100")
    ar = cost.forward(t, "fp8", "fp8", hw, 1, 1, 1, 2048, CENTRAL)
    v = cost.forward(t, "fp8", "fp8", hw, 1, 1, 16, 2048, CENTRAL)
    assert 1 <= v.time_s / ar.time_s < 1.03
    g, _, _ = shapes("gpt-oss-120b")
    ar = cost.forward(g, "mxfp4", "fp8", get_hardware("hgx-h200"), 1, 1, 1, 2048, CENTRAL)
    v = cost.forward(g, "mxfp4", "fp8", get_hardware("hgx-h200"), 1, 1, 10, 2048, CENTRAL)
    assert v.weight_bytes / ar.weight_bytes > 3 and v.time_s / ar.time_s > 1.5


def test_dflash_gain_is_tau_over_the_block_cost():
    _, cfg, dcfg = planner.target_configs("qwen3-8b")
    p = planner.plan(cfg, dcfg, "hgx-h200", target_name="qwen3-8b", drafter_name="d", quant="fp8")
    r = speed.speed_for(p, cfg, dcfg, tau=6.5)
    pt = r.chosen.points[0]
    assert pt.concurrency == 1
    gain = pt.dflash_tokens_per_s_per_user / pt.ar_tokens_per_s_per_user
    assert gain == pytest.approx(6.5 * pt.ar_step_ms / (pt.dflash_verify_ms + pt.dflash_draft_ms), rel=1e-12)
    assert 1 < gain < 6.5                      # a block costs more than one AR step, less than tau of them
    # tau = 1 (nothing accepted) makes DFlash slower than AR everywhere
    r1 = speed.speed_for(p, cfg, dcfg, tau=1.0)
    assert all(x.dflash_tokens_per_s_per_user < x.ar_tokens_per_s_per_user for x in r1.chosen.points)


@pytest.mark.parametrize("name,hw_name,quant", [("gpt-oss-120b", "dgx-b300", "auto"), ("qwen3-8b", "hgx-h200", "fp8"),
                                                ("qwen3-8b", "dgx-b200", "nvfp4"), ("gpt-oss-20b", "hgx-h100", "auto")])
def test_curves_are_monotonic_in_concurrency(name, hw_name, quant):
    """More concurrent sequences: never faster per user, never fewer tokens per GPU (AR and DFlash,
    central, low and high), and low <= central <= high."""
    tname, cfg, dcfg = planner.target_configs(name)
    p = planner.plan(cfg, dcfg, hw_name, target_name=tname, drafter_name="d" if dcfg else None, quant=quant,
                     max_batch_size=512)
    r = speed.speed_for(p, cfg, dcfg, tau=4.0 if dcfg else None)
    for lay in r.layouts:
        pts = lay.points
        for a, b in itertools.pairwise(pts):
            assert b.concurrency > a.concurrency
            assert b.ar_tokens_per_s_per_user <= a.ar_tokens_per_s_per_user
            assert b.ar_tokens_per_s_per_gpu >= a.ar_tokens_per_s_per_gpu
            if dcfg:
                assert b.dflash_tokens_per_s_per_user <= a.dflash_tokens_per_s_per_user
                assert b.dflash_tokens_per_s_per_gpu >= a.dflash_tokens_per_s_per_gpu
        for x in pts:
            lo, hi = x.ar_tokens_per_s_per_user_range
            assert lo <= x.ar_tokens_per_s_per_user <= hi
            if dcfg:
                lo, hi = x.dflash_tokens_per_s_per_user_range
                assert lo <= x.dflash_tokens_per_s_per_user <= hi


def test_tp_all_reduce_and_ep_all_to_all_bytes_by_hand():
    g, _, _ = shapes("gpt-oss-120b")
    hw = get_hardware("dgx-b200")
    f = cost.forward(g, "mxfp4", "fp8", hw, 8, 4, 1, 1024, CENTRAL)
    # 2 all-reduces per layer of T x hidden bf16, ring: 2 (tp - 1) / tp of it leaves each GPU
    assert f.comm_bytes == pytest.approx(2 * 36 * 2 * 7 / 8 * 4 * 2880 * 2)
    a = cost.forward(g, "mxfp4", "fp8", hw, 4, 2560, 1, 1024, CENTRAL, attention_dp=True)
    # attention DP: each GPU dispatches and combines its 640 tokens x top-4 x hidden, 3/4 of them to other GPUs
    assert a.comm_bytes == pytest.approx(36 * 2 * 640 * 4 * 2880 * 2 * 3 / 4)
    assert cost.forward(g, "mxfp4", "fp8", hw, 1, 4, 1, 1024, CENTRAL).comm_bytes == 0


def test_every_catalog_gpu_has_sourced_dense_peaks():
    for hw in catalog().values():
        assert hw.sources and all(s.startswith("https://") for s in hw.sources)
        assert hw.dense_flops_per_s["fp8"] == 2 * hw.dense_flops_per_s["bf16"]
        assert ("fp4" in hw.dense_flops_per_s) == hw.fp4


# --- published points ------------------------------------------------------------------------------


def test_the_fitted_point_is_reproduced_and_the_docs_table_is_current():
    fit = [p for p in speed_check.published_points() if p.get("fit")]
    assert len(fit) == 1
    assert speed_check.predict_point(fit[0])["central"] == pytest.approx(fit[0]["value"], rel=0.01)
    doc = (Path(__file__).parents[1] / "docs" / "speed-model.md").read_text()
    assert speed_check.check_table() in doc, "docs/speed-model.md: rerun python -m dflash_trt.plan.speed_check"


# --- CLI ---------------------------------------------------------------------------------------------


def test_plan_speed_json_carries_every_number():
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--json")
    assert code == 0, err
    d = json.loads(out)
    s = d["speed"]
    assert s["tau"] == 4.4 and "z-lab" in s["tau_source"] and s["context_tokens"] == 2048
    assert set(s["efficiency"]) == {"low", "central", "high"}
    lay = s["layouts"][0]
    assert (lay["tp"], lay["ep"]) == (d["chosen"]["tp"], d["chosen"]["ep"])
    p = lay["points"][0]
    for key in ("ar_step_ms", "ar_tokens_per_s_per_user", "ar_tokens_per_s_per_gpu", "dflash_verify_ms",
                "dflash_draft_ms", "dflash_tokens_per_s_per_user", "dflash_tokens_per_s_per_gpu",
                "dflash_tokens_per_s_per_user_range"):
        assert key in p
    for key in ("weight_bytes_per_gpu", "kv_bytes_per_gpu", "linear_flops_per_gpu", "comm_ms", "fixed_ms", "time_ms"):
        assert key in p["ar_detail"] and key in p["dflash_detail"]["verify"] and key in p["dflash_detail"]["draft"]
    assert p["ar_tokens_per_s_per_gpu"] == pytest.approx(p["ar_tokens_per_s_per_user"] / lay["gpus_per_replica"])
    # the draft schedule of every layout with curves: ranges covering 1..its most concurrency, one level per
    # point; drafting the whole block is the DFlash curve, K = 0 the AR curve, the choice at least both
    for lay in (x for x in s["layouts"] if x["points"]):
        sc = lay["draft_schedule"]
        assert sc["ranges"][0][0] == 1 and sc["ranges"][-1][1] == lay["max_concurrency"]
        assert all(a[1] + 1 == b[0] for a, b in zip(sc["ranges"], sc["ranges"][1:]))
        assert sc["max_k"] == s["block_size"] - 1 and "stop_concurrency" in sc
        assert sc["acceptance_lengths"][-1] == pytest.approx(s["tau"])
        for pt, lv in zip(lay["points"], sc["levels"], strict=True):
            assert lv["concurrency"] == pt["concurrency"]
            assert lv["always_k_tokens_per_s_per_user"] == pytest.approx(pt["dflash_tokens_per_s_per_user"])
            assert lv["ar_tokens_per_s_per_user"] == pytest.approx(pt["ar_tokens_per_s_per_user"])
            assert lv["tokens_per_s_per_user"] >= max(lv["always_k_tokens_per_s_per_user"],
                                                      lv["ar_tokens_per_s_per_user"]) * (1 - 1e-9)


def test_plan_prints_the_schedule_and_where_speculation_stops():
    code, out, err = run_cli("plan", "--target", "qwen3-8b", "--hardware", "dgx-b200", "--speed", "--tau", "6.5",
                             "--max-batch-size", "1024")
    assert code == 0, err
    assert "draft length by concurrency: 1-" in out and "always K 15" in out
    assert "geometric through tau 6.5" in out and "verify over K + 1 tokens" in out   # the assumptions
    code, out, _ = run_cli("plan", "--target", "qwen3-8b", "--hardware", "dgx-b200", "--speed", "--tau", "6.5",
                           "--max-batch-size", "1024", "--json")
    sc = json.loads(out)["speed"]["layouts"][0]["draft_schedule"]
    ks = [k for _, _, k in sc["ranges"]]
    assert ks[0] == 15 and ks[-1] < 15     # a dense 8B target: the verify turns compute-bound, K falls


def test_a_measured_histogram_sets_the_schedule(tmp_path):
    """--acceptance: a bench report's per-position histogram. One that never accepts a drafted token
    makes speculation pay nowhere (K 0 from concurrency 1); a report of another block size is refused."""
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"block_size": 10, "acceptance_histogram": {"1": 100}}))
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--acceptance",
                             str(report), "--json")
    assert code == 0, err
    s = json.loads(out)["speed"]
    assert s["tau"] == 1.0 and str(report) in s["acceptance_source"]
    sc = s["layouts"][0]["draft_schedule"]
    assert sc["ranges"] == [[1, s["layouts"][0]["max_concurrency"], 0]] and sc["stop_concurrency"] == 1
    report.write_text(json.dumps({"block_size": 10, "acceptance_histogram": {"1": 1, "3": 1, "10": 2}}))
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--speed", "--acceptance",
                             str(report), "--json")
    s = json.loads(out)["speed"]
    assert s["tau"] == pytest.approx((1 + 3 + 20) / 4)
    assert s["layouts"][0]["draft_schedule"]["acceptance_lengths"][:3] == pytest.approx([1, 1.75, 2.5])
    for args, message in ((["--acceptance", str(report), "--tau", "4"], "--tau and --acceptance"),
                          (["--acceptance", str(report)], "measured with block size 10, the drafter serves block 16")):
        target = ["--target", "qwen3-8b", "--hardware", "dgx-b200"] if "16" in message else \
            ["--target", "gpt-oss-120b", "--hardware", "dgx-b300"]
        code, out, err = run_cli("plan", *target, "--speed", *args)
        assert code == 1 and message in err and err.count("\n") == 1 and out == "", err


def test_plan_plot_writes_a_png(tmp_path):
    import matplotlib.image

    png = tmp_path / "out" / "curve.png"
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b200", "--plot", str(png))
    assert code == 0, err
    assert "plot:" in out and "DFlash tok/s/user" in out
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 400 and img.shape[1] > 600
    assert [p.name for p in png.parent.iterdir()] == ["curve.png"]       # no temp file left


@pytest.mark.parametrize("args,message", [
    (["--speed", "--tau", "12"], "--tau 12: must be in [1, 10]"),
    (["--speed", "--tau", "0.5"], "--tau 0.5: must be in [1, 10]"),
    (["--speed", "--tau", "nan"], "--tau nan: must be in [1, 10]"),
    (["--tau", "4"], "--tau / --context-tokens / --acceptance set the speed model: add --speed"),
    (["--speed", "--context-tokens", "0"], "--context-tokens 0: must be in [1, 32768]"),
])
def test_bad_speed_options_are_one_line(tmp_path, args, message):
    png = tmp_path / "x.png"
    code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", *args, "--plot", str(png)) \
        if "--speed" in args else run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", *args)
    assert code == 1 and out == ""
    assert err.strip() == f"error: {message}" or (message in err and err.count("\n") == 1), err
    assert not png.exists() and list(tmp_path.iterdir()) == []


def test_plot_needs_png_and_a_tau_for_an_unknown_drafter(tmp_path):
    code, _, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--plot", str(tmp_path / "a.jpg"))
    assert code == 1 and "name the file *.png" in err and not (tmp_path / "a.jpg").exists()
    code, _, err = run_cli("plan", "--target", "qwen3-8b", "--hardware", "hgx-h200", "--speed")
    assert code == 1 and "no published or measured acceptance for qwen3-8b" in err and "--tau" in err
    with pytest.raises(DFlashError, match="no drafter"):
        speed.resolve_tau("x", 3.0, 1, has_drafter=False)
