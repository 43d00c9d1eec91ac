"""The speed model (plan/speed.py) against published measurements (plan/published_speeds.json): the model's
figure for each published point under each efficiency set, the verdict, and docs/speed-model.md's table
(`python -m dflash_trt.plan.speed_check` prints it); `plan --plot` marks the points of its target and node."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from importlib import resources

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import get_hardware
from dflash_trt.plan import planner
from dflash_trt.plan.cost import EFFICIENCY, StepCost
from dflash_trt.plan.speed import largest_concurrency, layout_speed, resolve_tau, user_speed


def published_points() -> list[dict]:
    return json.loads(resources.files("dflash_trt.plan").joinpath("published_speeds.json").read_text())["points"]


def matching_points(target: str, hardware: str) -> list[dict]:
    """The published points for this target on this node type (the plot marks them)."""
    return [p for p in published_points() if p["target"] == target and p["hardware"] == hardware]


def predict_point(pt: dict) -> dict[str, float]:
    """The model's figure for one published point under each efficiency set ({"low", "central", "high"};
    inf where AR never reaches the interactivity a ratio is taken at)."""
    if "target_config" in pt:
        name, tcfg, dcfg = pt["target"], pt["target_config"], None
    else:
        name, tcfg, dcfg = planner.target_configs(pt["target"])
    if not pt["metric"].startswith("dflash"):
        dcfg = None                                    # AR points: plan without the drafter's memory
    hw = get_hardware(pt["hardware"])
    conc = pt["concurrency"]
    p = planner.plan(tcfg, dcfg, hw, target_name=name, quant=pt["quant"], kv_cache=pt["kv_cache"],
                     gpus_per_node=pt["gpus"], tp=pt["tp"], ep=pt["ep"],
                     max_batch_size=pt.get("max_batch_size", conc if isinstance(conc, int) else 1024),
                     kv_fraction=pt.get("kv_fraction", planner.FREE_GPU_MEMORY_FRACTION),
                     max_seq_len=min(32768, tcfg.get("max_position_embeddings", 32768)))
    lay = p.layouts[0]
    if not lay.fits:
        raise DFlashError(f"published point {pt['id']}: the layout does not fit ({lay.reason})")
    # the published run's max_batch_size, not the lower one the planner gives a layout whose DFlash draft context
    # would exceed TensorRT-LLM's budget (a check of an open PR): the point is a measurement of that config
    lay = replace(lay, max_batch_size=p.max_batch_size)
    target = planner.target_shape(tcfg, name)
    drafter = planner.drafter_shape(dcfg) if dcfg else None
    tau = resolve_tau(name, pt.get("tau"), p.block_size, drafter is not None)[0]
    ctx, adp, metric = pt["context_tokens"], pt["attention_dp"], pt["metric"]
    out = {}
    for e_name, eff in EFFICIENCY.items():
        if conc == "curve":   # the most tokens/s per GPU each mode gives with every user at >= X tokens/s
            x, most = pt["min_tokens_per_s_per_user"], layout_speed(p, lay, target, drafter, hw, tau, ctx).max_concurrency
            df = user_speed(target, drafter, p, hw, lay.tp, ctx, eff, tau=tau, attention_dp=adp)
            ar = user_speed(target, None, p, hw, lay.tp, ctx, eff, attention_dp=adp)
            c_df, c_ar = largest_concurrency(df, x, most), largest_concurrency(ar, x, most)
            out[e_name] = c_df * df(c_df) / (c_ar * ar(c_ar)) if c_ar and c_df else math.inf
            continue
        c = layout_speed(p, lay, target, drafter, hw, tau, ctx, attention_dp=adp).max_concurrency \
            if conc == "max" else conc
        cost = StepCost(p, target, drafter, hw, lay.tp, ctx, eff, attention_dp=adp)
        ar = cost.ar(c)
        if metric == "ar_tokens_per_s_per_user":
            out[e_name] = 1 / ar.time_s
        elif metric == "ar_tokens_per_s_per_gpu":
            out[e_name] = c / ar.time_s / lay.tp
        elif metric == "dflash_over_ar_per_user":
            out[e_name] = tau / cost.dflash_seconds(c) * ar.time_s
        else:
            raise DFlashError(f"published point {pt['id']}: unknown metric {metric!r}")
    return out


def point_figure(pt: dict):
    """How a published point's value and the model's are written: ratios as 2.00x, the rest as counts."""
    if "over" in pt["metric"]:
        return lambda x: "AR never reaches it" if math.isinf(x) else f"{x:,.2f}x"
    return lambda x: f"{x:,.0f}"


def verdict(pt: dict, pr: dict[str, float]) -> str:
    """The model against one published point (pr: predict_point's figures)."""
    v, c = pt["value"], pr["central"]
    if pt["compare"] == ">=" and math.isinf(c):
        return "AR never gets there (central); " + ("high set above the claim" if pr["high"] >= v
                                                    else "high set below the claim")
    if pt["compare"] == ">=":
        return "consistent (above the claim)" if c >= v else f"{c / v - 1:+.0%} below the claim"
    return f"{c / v - 1:+.0%}" + (" (fitted)" if pt.get("fit") else "")


METRIC_TEXT = {
    "ar_tokens_per_s_per_user": "AR tokens/s per user",
    "ar_tokens_per_s_per_gpu": "AR tokens/s per GPU",
    "dflash_over_ar_per_user": "DFlash / AR tokens/s per user",
    "dflash_over_ar_per_gpu_at_user":
        "DFlash / AR tokens/s per GPU, every user at >= {min_tokens_per_s_per_user} tokens/s",
}


def describe_point(pt: dict) -> str:
    """A published point for a reader: what was measured, by whom, at which concurrency."""
    what = METRIC_TEXT.get(pt["metric"], pt["metric"]).format(**pt)
    conc = pt["concurrency"]
    at = f" at concurrency {conc}" if isinstance(conc, int) else (" at the most concurrency" if conc == "max" else "")
    return f"{what}{at} {pt['compare']} {pt['value']:,} ({pt['engine']}; tp {pt['tp']} ep {pt['ep']})"


def check_table() -> str:
    """docs/speed-model.md's table: every published point beside the model's figure."""
    rows = ["| point | setup | published | predicted (central [low-high]) | error |", "|---|---|---|---|---|"]
    for pt in published_points():
        pr = predict_point(pt)
        v, c, fmt = pt["value"], pr["central"], point_figure(pt)
        setup = (f"{pt['target']}, {pt['hardware']} × {pt['gpus']}, tp {pt['tp']} ep {pt['ep']}"
                 f"{' attention-DP' if pt['attention_dp'] else ''}, {pt['quant']}/{pt['kv_cache']} KV, "
                 f"concurrency {pt['concurrency']}, context {pt['context_tokens']}"
                 + (f", tau {pt['tau']}" if pt.get("tau") else ""))
        rows.append(f"| {pt['id']} | {setup} | {pt['metric']} {pt['compare']} {v:,} | "
                    f"{fmt(c)} [{fmt(pr['low'])}-{fmt(pr['high'])}] | {verdict(pt, pr)} |")
    return "\n".join(rows)


if __name__ == "__main__":   # python -m dflash_trt.plan.speed_check: the table of docs/speed-model.md
    print(check_table())
