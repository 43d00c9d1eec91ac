"""What a bundle's draft schedule is planned from: `build --draft-schedule auto|off|FILE.json` (the speed
model's step cost of the bundle's own layout on its GPU node, with the preset drafter's acceptance; or a
schedule file, e.g. `plan --speed --json`'s), and the step cost `tune` re-plans with (ScheduleCost: the speed
model's, or a measured table, plan/tune.py). The curves and the per-layout schedules of `plan --speed` are
plan/speed.py's; choosing K per concurrency is plan/draft_schedule.py's."""
from __future__ import annotations

from dataclasses import dataclass, replace

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import get_hardware, hardware_for_gpu
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import planner
from dflash_trt.plan.cost import EFFICIENCY, StepCost
from dflash_trt.plan.planner import Plan
from dflash_trt.plan.speed import (
    DEFAULT_CONTEXT_TOKENS,
    SCHEDULE_COST,
    concurrencies,
    layout_speed,
    resolve_acceptance,
)
from dflash_trt.presets.catalog import PRESETS


def build_schedule(mode: str, *, target_name: str, target_config: dict, drafter_config: dict, gpu: str | None,
                   quant: str, kv_cache: str, drafter_quant: str, tp: int, ep: int, block_size: int,
                   max_batch_size: int, max_seq_len: int, attention_dp: bool = False,
                   context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                   plan: Plan | str | None = None) -> tuple[ds.DraftSchedule | None, str]:
    """`build --draft-schedule auto|off|FILE.json`: (the schedule the bundle's stacks get, or None, and where it
    comes from or why there is none). auto plans it as `plan --speed` does, for the bundle's GPU node, layout,
    formats and max_batch_size (the concurrencies 1..max_batch_size), from the preset drafter's acceptance
    (published tau, or measured: speed.resolve_acceptance); without a GPU (a CPU bundle) or either there is none.
    `plan`: the bundle's one-node plan as plan.json records it (build plans once), or the planner's refusal of it
    (a str): its layout is priced, no layout search of its own; None: the planner's search for the layout."""
    if mode == "off":
        return None, "--draft-schedule off"
    if mode != "auto":
        return schedule_file(mode, block_size, tp, ep), f"read from {mode}"
    if not gpu:
        return None, ("no GPU (a CPU bundle): the speed model needs the node's hardware (build --gpu), or pass "
                      "--draft-schedule FILE.json")
    preset = PRESETS.get(target_name)
    if not (preset and (preset.published_tau or preset.acceptance_file)):
        pair = target_name if preset else "TARGET_DIR --drafter DRAFTER_DIR"
        return None, (f"no acceptance figure for {target_name}'s drafter (none published or measured): measure it "
                      f"and plan with it, then rebuild: `dflash-trt bench --target {pair} --json > bench.json`; "
                      f"`dflash-trt plan --target {pair} --hardware {hardware_for_gpu(gpu).name} --quant {quant} "
                      "--speed --acceptance bench.json --json > plan.json`; `dflash-trt build ... --draft-schedule "
                      "plan.json` (the layout of this build's --tp / --ep is taken from it)")
    if isinstance(plan, str):
        return None, f"the planner refuses tp {tp} ep {ep} on the bundle's node: {plan}"
    cost = schedule_cost(target_name=target_name, target_config=target_config, drafter_config=drafter_config,
                         gpu=gpu, quant=quant, kv_cache=kv_cache, drafter_quant=drafter_quant, tp=tp, ep=ep,
                         block_size=block_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         attention_dp=attention_dp, context_tokens=context_tokens,
                         plan=plan)
    if isinstance(cost, str):
        return None, cost
    t, src, survival, acc_src, _ = resolve_acceptance(target_name, None, block_size, True)
    sched = ds.choose(survival, cost.step_seconds, cost.concurrencies,
                      assumptions=[f"acceptance per position: {acc_src}", SCHEDULE_COST, cost.source])
    return sched, f"planned for {cost.hardware} (speed model, tau {t:g}: {src})"


@dataclass(frozen=True)
class ScheduleCost:
    """What a decode step costs, for draft_schedule.choose: step_seconds(c, K), the concurrencies to plan at,
    and where the figures come from (the speed model's cost.StepCost on a GPU node, or a measured table)."""
    step_seconds: object            # Callable[[int, int], float]
    concurrencies: list[int]
    source: str
    hardware: str = ""


def schedule_cost(*, target_name: str, target_config: dict, drafter_config: dict, gpu: str, quant: str,
                  kv_cache: str, drafter_quant: str, tp: int, ep: int, block_size: int, max_batch_size: int,
                  max_seq_len: int, attention_dp: bool = False,
                  context_tokens: int = DEFAULT_CONTEXT_TOKENS, plan: Plan | None = None) -> ScheduleCost | str:
    """The speed model's step cost of a bundle's layout on its GPU node (build --draft-schedule auto, and
    `tune` re-planning from served acceptance), or why there is none (a str). `plan`: the bundle's recorded
    plan (plan.json, what `tune` passes): its layout, at the served block, instead of a layout search."""
    hw = get_hardware(plan.hardware) if plan else hardware_for_gpu(gpu)
    dcfg = {**drafter_config, "block_size": block_size}
    p = replace(plan, block_size=block_size) if plan else planner.plan(
        target_config, dcfg, hw, target_name=target_name, drafter_name=f"{target_name} drafter", quant=quant,
        kv_cache=kv_cache, drafter_quant=drafter_quant, max_seq_len=max_seq_len, tp=tp, ep=ep,
        max_batch_size=max_batch_size, attention_dp=attention_dp, batch_pinned=True)
    lay = p.chosen
    if lay is None:
        why = p.layouts[0].reason if p.layouts else "no layout"
        return f"the planner finds tp {tp} ep {ep} does not fit {hw.name} ({why}): no speed figures"
    target = planner.target_shape(target_config, target_name)
    drafter = planner.drafter_shape(dcfg, f"{target_name} drafter")
    context = min(context_tokens, p.max_seq_len)
    ls = layout_speed(p, lay, target, drafter, hw, None, context)
    if not ls.points:
        return f"tp {tp} ep {ep} on {hw.name} has no speed figures ({ls.reason})"
    step = StepCost(p, target, drafter, hw, ls.tp, context, EFFICIENCY["central"], attention_dp=ls.attention_dp)
    return ScheduleCost(step.step_seconds, concurrencies(max_batch_size),
                        f"planned by the speed model for {hw.name}, tp {tp} ep {ep}, {quant} weights, {context_tokens} "
                        f"tokens of context, concurrency 1..{max_batch_size} (max_batch_size)", hw.name)


def schedule_file(path: str, block_size: int, tp: int, ep: int) -> ds.DraftSchedule:
    """`build --draft-schedule FILE.json`: what `plan --speed --json` prints (the schedule of the layout with this
    bundle's tp and ep, planned for the drafter's block), or one schedule (a DraftSchedule.to_dict(), e.g.
    measured on a CPU), checked."""
    where = f"--draft-schedule {path}"
    d = ds.read_json_file(path, where)
    speed_report = d.get("speed") if isinstance(d, dict) else None
    if speed_report is None and isinstance(d, dict) and "layouts" in d and "tau" in d:
        speed_report = d                       # the "speed" object alone
    if speed_report is None:
        return ds.from_dict(d, block_size, where)
    if not isinstance(speed_report, dict) or not isinstance(speed_report.get("layouts"), list):
        raise DFlashError(f"{where}: \"speed\" has no layouts (expected the output of "
                          "`dflash-trt plan --speed --json`)")
    if speed_report.get("block_size") != block_size:
        raise DFlashError(f"{where}: planned for block size {speed_report.get('block_size')!r}, the bundle's drafter "
                          f"serves block {block_size}")
    layouts = [l for l in speed_report["layouts"] if isinstance(l, dict)]
    have = [(l.get("tp"), l.get("ep")) for l in layouts if l.get("draft_schedule")]
    lay = next((l for l in layouts if (l.get("tp"), l.get("ep")) == (tp, ep)), None)
    if lay is None or not lay.get("draft_schedule"):
        raise DFlashError(f"{where}: no draft schedule for tp {tp} ep {ep} (it has "
                          + (", ".join(f"tp {t} ep {e}" for t, e in have) or "none: plan without a drafter or tau")
                          + "); plan on the bundle's node with --nodes / --gpus-per-node that allow this layout")
    return ds.from_dict(lay["draft_schedule"], block_size, f"{where} (tp {tp} ep {ep})")
