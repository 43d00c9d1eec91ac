"""Decode speed of a planned layout: tokens/s per user and per GPU against concurrency, for plain
autoregressive decoding (AR) and for DFlash, from what one decode step physically does on the GPU.

What one step of a layout costs (bytes read, FLOPs, collectives, fixed launch cost per layer, each pass a
roofline) is the cost model's, plan/cost.py, which the planner also asks for what a layout holds; this module
turns step times into curves.

DFlash step = verify (target pass over B tokens per sequence) + draft (the drafter's layers over its block of
B, reading its own cache of projected target features, plus the target's lm_head over the B − 1 drafted
positions). Each step emits tau tokens per sequence (tau: mean accepted length, bonus token included), so

    tokens/s per user = tau / (verify + draft)   (AR: 1 / step)
    tokens/s per GPU  = concurrency · tokens/s per user / GPUs of the replica.

Draft schedule (per layout, with a drafter): plan/draft_schedule.py picks the K of most tokens/s at each
concurrency, each K priced by cost.StepCost.step_seconds, from the acceptance per draft position
(resolve_acceptance). Efficiency factors (cost.EFFICIENCY: every number printed is the central set, the low-high
range beside it), the published points they are checked against and what the curves leave out (prefill:
`disaggregated` below): docs/speed-model.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib import resources

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import Hardware, get_hardware
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import planner
from dflash_trt.plan.cost import EFFICIENCY, Efficiency, Forward, StepCost, experts_touched
from dflash_trt.plan.planner import Layout, ModelShape, Plan
from dflash_trt.presets.catalog import PRESETS

DEFAULT_CONTEXT_TOKENS = 2048   # mean tokens of context per sequence while decoding (1k prompt + half of 2k out)


# ---------------------------------------------------------------------------------------------
# Curves


@dataclass
class SpeedPoint:
    concurrency: int                     # sequences decoding at once on one replica
    ar_step_ms: float
    ar_tokens_per_s_per_user: float
    ar_tokens_per_s_per_gpu: float
    ar_bound: str
    dflash_verify_ms: float = 0.0
    dflash_draft_ms: float = 0.0
    dflash_tokens_per_s_per_user: float = 0.0
    dflash_tokens_per_s_per_gpu: float = 0.0
    dflash_bound: str = ""
    # [low, high] over the efficiency sets
    ar_tokens_per_s_per_user_range: list[float] = field(default_factory=list)
    ar_tokens_per_s_per_gpu_range: list[float] = field(default_factory=list)
    dflash_tokens_per_s_per_user_range: list[float] = field(default_factory=list)
    dflash_tokens_per_s_per_gpu_range: list[float] = field(default_factory=list)
    ar_detail: dict = field(default_factory=dict)      # bytes, FLOPs, ms per component (central)
    dflash_detail: dict = field(default_factory=dict)


@dataclass
class LayoutSpeed:
    tp: int
    ep: int
    replicas: int
    gpus_per_replica: int
    attention_dp: bool
    # min(the layout's max_batch_size, sequences of context + block the KV cache fits)
    max_concurrency: int
    points: list[SpeedPoint]
    reason: str = ""                     # why there are no points
    # the draft length per concurrency (plan/draft_schedule.DraftSchedule.to_dict()), with a drafter
    draft_schedule: dict | None = None
    # why K changes with concurrency, with the numbers (explain_schedule); empty where K is the same throughout
    draft_schedule_why: list[str] = field(default_factory=list)


@dataclass
class SpeedReport:
    target: str
    hardware: str
    tau: float | None
    tau_source: str
    block_size: int
    context_tokens: int
    efficiency: dict
    assumptions: list[str]
    layouts: list[LayoutSpeed]
    acceptance_source: str = ""          # where the per-position acceptance of the draft schedules comes from

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def chosen(self) -> LayoutSpeed | None:
        return next((l for l in self.layouts if l.points), None)


def resolve_acceptance(target_name: str, tau: float | None, block: int, has_drafter: bool,
                       acceptance: str | None = None) -> tuple[float | None, str, list[float] | None, str, list | None]:
    """(tau, its source, survival per draft position, its source, survival by context bucket or None), from the
    first of: --acceptance REPORT (a `dflash-trt bench --json` report; a `--context-buckets` one gives its buckets
    and the shortest's survival), --tau, the preset's acceptance measured by bench (presets/catalog.py
    acceptance_file), the preset's published tau; checked against the drafter's block. Where only a tau is known,
    per position is the geometric shape through it (an assumption, said)."""
    given = "--acceptance" if acceptance is not None else "--tau" if tau is not None else None
    if not has_drafter:
        if given:
            raise DFlashError(f"{given}: there is no drafter to accept tokens from (pass --drafter or a preset with one)")
        return None, "no drafter: AR only", None, "", None
    if acceptance is not None and tau is not None:
        raise DFlashError("--tau and --acceptance: the report's histogram gives tau; pass one of them")
    preset = PRESETS.get(target_name)
    if acceptance is not None or (tau is None and preset and preset.acceptance_file):
        where = f"--acceptance {acceptance}" if acceptance else f"dflash_trt/{preset.acceptance_file}"
        path = acceptance or str(resources.files("dflash_trt") / preset.acceptance_file)
        buckets = ds.survival_by_bucket(path, block, where)
        surv, by_context = buckets[0][1], buckets if buckets[0][0] is not None else None
        src = where if acceptance else f"measured by `dflash-trt bench`: {where} (the {target_name} preset's)"
        return (ds.acceptance_lengths(surv)[-1], src, surv, f"measured per position: {where} (bench's acceptance "
                "histogram)", by_context)
    if tau is not None:
        if not (math.isfinite(tau) and 1 <= tau <= block):
            raise DFlashError(f"--tau {tau:g}: must be in [1, {block}] (1 = nothing accepted, {block} = the drafter's "
                              "whole block)")
        t, src = float(tau), "--tau"
    elif preset and preset.published_tau:
        t, src = min(preset.published_tau[0], block), preset.published_tau[1]
    else:
        raise DFlashError(f"--tau: no published or measured acceptance for {target_name}'s drafter; pass --tau TAU or "
                          "--acceptance REPORT (`dflash-trt bench --json` measures it)")
    return t, src, ds.survival_from_tau(t, block), (
        f"geometric through tau {t:g} ({src}): every drafted token accepted with the same probability given its "
        "predecessors were (an assumption: no per-position figure is published for this drafter; "
        "`dflash-trt bench --json` measures one, plan --acceptance REPORT reads it)"), None


def resolve_tau(target_name: str, tau: float | None, block: int, has_drafter: bool) -> tuple[float | None, str]:
    """(tau, its source) as resolve_acceptance finds them."""
    return resolve_acceptance(target_name, tau, block, has_drafter)[:2]


SCHEDULE_COST = ("step cost: K = 0 a plain AR step; K >= 1 the target's verify over K + 1 tokens per sequence plus the "
                 "drafter's whole block (its pass does not shorten with K: TensorRT-LLM's DFlashWorker drafts the full "
                 "block and keeps K positions), central efficiency set")


def explain_schedule(sched: ds.DraftSchedule, cost: StepCost) -> list[str]:
    """Why the draft length changes with concurrency, in numbers ([] when it does not): at each range's first
    concurrency, what one more and one fewer drafted token would add to the tokens per step and to the step
    time (the schedule's own acceptance lengths and the cost model's step), how flat tokens/s is around the
    chosen K, and for an MoE target the expert weights the verify pass reads, which is what makes K rise
    again once a step's tokens already touch nearly every expert."""
    if len({k for _, _, k in sched.ranges}) < 2:
        return []
    L, top, last = sched.acceptance_lengths, sched.max_k, sched.ranges[-1][1]
    alone = [c for c in range(1, last + 1) if ds.best_k(c, L, cost.step_seconds)[0] != sched.k_at(c)]
    search = (f"not an artefact of the search: each concurrency 1-{last} evaluated alone gives the same K" if not alone
              else f"the search's ranges differ from K evaluated alone at concurrency {alone[:5]}")
    loss = max((1 - (L[top] / cost.step_seconds(c, top)) / (L[k] / cost.step_seconds(c, k)), c)
               for a, b, k in sched.ranges for c in (a, b))
    out = [f"why K changes with concurrency ({search}): K maximises tokens per step L(K) over the step time, L(K) = "
           + ", ".join(f"{x:.2f}" for x in L) + f" for K = 0..{top}; a drafted token adds one token per sequence to "
           f"the target's verify pass. Drafting K {top} throughout would lose at most {loss[0]:.1%} tokens/s per user "
           f"(concurrency {loss[1]})"]
    for first, last, k in sched.ranges:
        t = [cost.step_seconds(first, j) for j in range(top + 1)]
        rate = [L[j] / t[j] for j in range(top + 1)]
        parts = []
        if k < top:
            parts.append(f"K {k + 1} would add {L[k + 1] / L[k] - 1:+.1%} tokens per step for "
                         f"{t[k + 1] / t[k] - 1:+.1%} step time")
        if k > 0:
            parts.append(f"K {k - 1} would save {1 - t[k - 1] / t[k]:.1%} step time for "
                         f"{L[k - 1] / L[k] - 1:+.1%} tokens")
        near = [j for j in range(top + 1) if rate[j] >= 0.99 * rate[k]]
        span = f"{first}-{last}" if last != first else f"{first}"
        out.append(f"  concurrency {span}: K {k}: " + "; ".join(parts)
                   + f"; tokens/s within 1% of its best for K {min(near)}-{max(near)}")
    target = cost.target
    if target.experts:
        c0, c1 = sched.ranges[0][0], sched.ranges[-1][0]
        lo = [cost.verify(c0, j + 1).weight_bytes / 1e9 for j in (1, top)]
        share = experts_touched(target.experts, target.experts_per_token, c1 * (top + 1)) / target.experts
        out.append(f"  MoE ({target.experts} experts, top-{target.experts_per_token}): a verify of T tokens reads the "
                   f"weights of the experts they route to, E(1 - (1 - k/E)^T); at concurrency {c0} K 1 -> {top} reads "
                   f"{lo[0]:.1f} -> {lo[1]:.1f} GB of weights per GPU, so a long draft costs memory time; at "
                   f"concurrency {c1}, K {top}, the step's {c1 * (top + 1)} tokens already touch {share:.0%} of the "
                   "experts, a longer draft reads little more and the choice follows compute")
    return out


def concurrencies(cap: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... below cap, then cap."""
    grid = {2**k for k in range(cap.bit_length() + 1)} | {3 * 2**k for k in range(cap.bit_length())}
    return sorted(c for c in grid if c < cap) + [cap]


def layout_speed(plan: Plan, layout: Layout, target: ModelShape, drafter: ModelShape | None, hw: Hardware,
                 tau: float | None, context: int, *, attention_dp: bool | None = None) -> LayoutSpeed:
    """AR and DFlash at every concurrency of one fitting layout."""
    adp = getattr(layout, "attention_dp", False) if attention_dp is None else attention_dp
    tp, B = layout.tp, plan.block_size if drafter else 1
    out = LayoutSpeed(tp=tp, ep=layout.ep, replicas=layout.replicas, gpus_per_replica=tp, attention_dp=adp,
                      max_concurrency=0, points=[])
    if not layout.fits:
        out.reason = "does not fit"
        return out
    if not layout.within_nvlink_domain:
        out.reason = "crosses NVLink domains: the inter-node network is not modelled"
        return out
    per_seq = layout.kv_bytes_per_token_per_gpu * (context + B)
    batch = layout.max_batch_size or plan.max_batch_size    # the layout's, where the draft context caps it
    cap = min(batch, int(layout.kv_budget_bytes_per_gpu // per_seq) if per_seq else batch)
    if cap < 1:
        out.reason = f"one sequence of {context} tokens does not fit the KV cache"
        return out
    out.max_concurrency = cap
    costs = {name: StepCost(plan, target, drafter, hw, tp, context, eff, attention_dp=adp)
             for name, eff in EFFICIENCY.items()}
    for c in concurrencies(cap):
        runs = {}
        for name, cost in costs.items():
            ar = cost.ar(c)
            r = {"ar": ar, "ar_user": 1 / ar.time_s}
            if drafter and tau:
                v, d = cost.verify(c, B), cost.draft(c)
                r.update(v=v, d=d, df_user=tau / (v.time_s + d.time_s))
            runs[name] = r
        m = runs["central"]

        def per_gpu(user: float, c: int = c) -> float:
            return c * user / tp
        p = SpeedPoint(concurrency=c, ar_step_ms=m["ar"].time_s * 1e3, ar_tokens_per_s_per_user=m["ar_user"],
                       ar_tokens_per_s_per_gpu=per_gpu(m["ar_user"]), ar_bound=m["ar"].bound,
                       ar_tokens_per_s_per_user_range=[runs["low"]["ar_user"], runs["high"]["ar_user"]],
                       ar_tokens_per_s_per_gpu_range=[per_gpu(runs["low"]["ar_user"]), per_gpu(runs["high"]["ar_user"])],
                       ar_detail=_detail(m["ar"]))
        if "df_user" in m:
            p.dflash_verify_ms, p.dflash_draft_ms = m["v"].time_s * 1e3, m["d"].time_s * 1e3
            p.dflash_tokens_per_s_per_user = m["df_user"]
            p.dflash_tokens_per_s_per_gpu = per_gpu(m["df_user"])
            p.dflash_bound = m["v"].bound
            p.dflash_tokens_per_s_per_user_range = [runs["low"]["df_user"], runs["high"]["df_user"]]
            p.dflash_tokens_per_s_per_gpu_range = [per_gpu(runs["low"]["df_user"]), per_gpu(runs["high"]["df_user"])]
            p.dflash_detail = {"verify": _detail(m["v"]), "draft": _detail(m["d"])}
        out.points.append(p)
    return out


def _detail(f: Forward) -> dict:
    return {"tokens": f.tokens, "weight_bytes_per_gpu": round(f.weight_bytes), "kv_bytes_per_gpu": round(f.kv_bytes),
            "linear_flops_per_gpu": round(f.linear_flops), "attention_flops_per_gpu": round(f.attention_flops),
            "comm_bytes_per_gpu": round(f.comm_bytes), "memory_ms": f.memory_s * 1e3, "compute_ms": f.compute_s * 1e3,
            "comm_ms": f.comm_s * 1e3, "fixed_ms": f.fixed_s * 1e3, "time_ms": f.time_s * 1e3, "bound": f.bound}


def speed(plan: Plan, target: ModelShape, drafter: ModelShape | None, hw: Hardware, *, tau: float | None = None,
          context_tokens: int = DEFAULT_CONTEXT_TOKENS, acceptance: str | None = None) -> SpeedReport:
    """The speed report of every layout of a plan (fitting ones get curves and, with a drafter, the draft
    length per concurrency). acceptance: a `dflash-trt bench --json` report (its per-position histogram)."""
    if not 1 <= context_tokens <= plan.max_seq_len:
        raise DFlashError(f"--context-tokens {context_tokens}: must be in [1, {plan.max_seq_len}] (max_seq_len)")
    if not hw.dense_flops_per_s or "bf16" not in hw.dense_flops_per_s:
        raise DFlashError(f"hardware.json: {hw.name} has no dense_flops_per_s; the speed model needs it")
    t, src, survival, acc_src, by_context = resolve_acceptance(plan.target, tau, plan.block_size,
                                                               drafter is not None, acceptance)
    layouts = [layout_speed(plan, l, target, drafter, hw, t, context_tokens) for l in plan.layouts]
    for l in layouts:
        if l.points and drafter is not None and survival:   # K per concurrency at the layout's own concurrencies
            def cost_at(ctx: int, l=l) -> StepCost:
                return StepCost(plan, target, drafter, hw, l.tp, min(ctx, plan.max_seq_len), EFFICIENCY["central"],
                                attention_dp=l.attention_dp)
            levels, notes = [p.concurrency for p in l.points], [f"acceptance per position: {acc_src}", SCHEDULE_COST]
            cost = cost_at(context_tokens)
            sched = ds.choose_by_context(by_context, lambda ctx: cost_at(ctx).step_seconds, levels,
                                         assumptions=notes) if by_context else \
                ds.choose(survival, cost.step_seconds, levels, assumptions=notes)
            l.draft_schedule, l.draft_schedule_why = sched.to_dict(), explain_schedule(sched, cost)
    c = EFFICIENCY["central"]
    assumptions = [
        f"decode only, every sequence holding {context_tokens} tokens of context (--context-tokens); prefill not counted",
        f"tau {t} tokens per DFlash step ({src}), the same at every concurrency" if t else "AR only (no drafter)",
        (f"HBM at {c.hbm:.0%} of {hw.hbm_bytes_per_s / 1e12:.2f} TB/s, GEMMs at {c.tensor:.0%} of the dense peak "
         f"({', '.join(f'{k} {v / 1e15:.2f} PFLOP/s' for k, v in hw.dense_flops_per_s.items())}), NVLink at "
         f"{c.nvlink:.0%} of {hw.nvlink_bytes_per_s / 2e9:.0f} GB/s per direction"),
        (f"fixed {c.layer_latency_s * 1e6:.1f} us per layer per pass (fitted: TensorRT-LLM gpt-oss-120b 8 x B200 "
         f"batch 1), {c.collective_latency_s * 1e6:.0f} us per collective, {c.step_overhead_s * 1e6:.0f} us per pass"),
        "MoE routing uniform over the experts (no load imbalance); one replica inside one NVLink domain",
        "ranges: the low / high efficiency sets of dflash_trt/plan/cost.py (EFFICIENCY)",
    ]
    if survival:
        assumptions += [f"draft schedule: acceptance per position {acc_src}",
                        "draft schedule: a draft of K tokens keeps the acceptance of the full block's first K "
                        "positions; " + SCHEDULE_COST]
    return SpeedReport(target=plan.target, hardware=hw.name, tau=t, tau_source=src, block_size=plan.block_size,
                       context_tokens=context_tokens, efficiency={k: asdict(v) for k, v in EFFICIENCY.items()},
                       assumptions=assumptions, layouts=layouts, acceptance_source=acc_src)


def speed_for(plan: Plan, target_cfg: dict, drafter_cfg: dict | None, *, tau: float | None = None,
              context_tokens: int = DEFAULT_CONTEXT_TOKENS, acceptance: str | None = None) -> SpeedReport:
    """speed() from the configs the plan was made of."""
    target = planner.target_shape(target_cfg, plan.target)
    drafter = planner.drafter_shape(drafter_cfg, plan.drafter or "drafter") if drafter_cfg and plan.drafter else None
    return speed(plan, target, drafter, get_hardware(plan.hardware), tau=tau, context_tokens=context_tokens,
                 acceptance=acceptance)



def user_speed(target: ModelShape, drafter: ModelShape | None, plan: Plan, hw: Hardware, tp: int, context: int,
               eff: Efficiency, *, tau: float | None = None, attention_dp: bool = False):
    """concurrency -> tokens/s per user of one replica: DFlash with tau (and a drafter), else AR."""
    cost = StepCost(plan, target, drafter, hw, tp, context, eff, attention_dp=attention_dp)

    def user(c: int) -> float:
        return tau / cost.dflash_seconds(c) if tau else 1 / cost.ar(c).time_s
    return user


def largest_concurrency(user, min_tokens_per_user: float, most: int) -> int:
    """The largest c in 1..most with user(c) >= min_tokens_per_user (0: not even c = 1). Per-user speed
    falls as concurrency grows (every cost term grows with the tokens of a step): a bisection."""
    if user(1) < min_tokens_per_user:
        return 0
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if user(mid) >= min_tokens_per_user else (lo, mid - 1)
    return lo


def max_concurrency_at(report: SpeedReport, plan: Plan, target_cfg: dict, drafter_cfg: dict | None,
                       min_tokens_per_user: float) -> tuple[int, float]:
    """The most sequences one replica of the plan's chosen layout can decode at once with each user
    still getting min_tokens_per_user tokens/s (central estimate; DFlash when the report has a tau,
    else AR; at most what its KV cache holds at the report's context, past max_batch_size: this picks
    the batch size to serve with), and the tokens/s per user there."""
    lay, chosen = report.chosen, plan.chosen
    if lay is None or chosen is None or (lay.tp, lay.ep) != (chosen.tp, chosen.ep):
        raise DFlashError(f"--min-tokens-per-user: the chosen layout of {plan.target} on {plan.hardware} has no "
                          "speed figures (it does not fit inside one NVLink domain)")
    target = planner.target_shape(target_cfg, plan.target)
    drafter = planner.drafter_shape(drafter_cfg, plan.drafter or "drafter") if report.tau else None
    user = user_speed(target, drafter, plan, get_hardware(plan.hardware), lay.tp, report.context_tokens,
                      EFFICIENCY["central"], tau=report.tau, attention_dp=lay.attention_dp)
    per_seq = chosen.kv_bytes_per_token_per_gpu * (report.context_tokens + report.block_size)
    k = largest_concurrency(user, min_tokens_per_user, int(chosen.kv_budget_bytes_per_gpu // per_seq))
    if k == 0:
        raise DFlashError(f"--min-tokens-per-user {min_tokens_per_user:g}: the model predicts at most "
                          f"{user(1):,.0f} tokens/s per user (concurrency 1, tp {lay.tp} on {plan.hardware}, "
                          f"{'DFlash tau ' + format(report.tau, 'g') if report.tau else 'AR'})")
    return k, user(k)


# ---------------------------------------------------------------------------------------------
# Disaggregated serving: how many instances prefill and how many decode (an estimate)


@dataclass
class DisaggEstimate:
    """Prefill and decode instances for a target input / output length (`plan --disaggregated`,
    `deploy --server dynamo --disaggregated`): an estimate from the roofline above, not a measurement."""
    isl: int
    osl: int
    tp: int                               # GPUs per instance, prefill and decode alike (the bundle's layout)
    instances: int
    prefill_instances: int
    decode_instances: int
    prefill_gpus: int
    decode_gpus: int
    prefill_ms: float                     # one prompt of isl tokens through one prefill instance (~ TTFT, unqueued)
    prefill_ms_range: list[float]
    decode_concurrency: int               # sequences one decode instance holds (KV cache at isl + osl, max_batch_size)
    decode_tokens_per_s_per_user: float
    decode_tokens_per_s_per_instance: float
    decode_tokens_per_s_per_instance_range: list[float]
    requests_per_s: float                 # sustained by the split: min(prefill side, decode side)
    prefill_requests_per_s: float
    decode_requests_per_s: float
    mode: str                             # "dflash" or "ar" (decode)
    assumptions: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def disaggregated(plan: Plan, target_cfg: dict, drafter_cfg: dict | None, *, isl: int, osl: int,
                  instances: int | None = None, tau: float | None = None) -> DisaggEstimate:
    """Split `instances` (default: the chosen layout's replicas) of the chosen layout into prefill and decode
    ones so that neither side limits the request rate: a prefill instance takes one prompt at a time
    (1 / the prefill time requests/s: cost.StepCost.prefill_seconds), a decode instance holds as many sequences as its KV cache fits at
    isl + osl tokens and emits concurrency × tokens/s per user (osl tokens per request). P in 1..N-1
    maximises min(P · prefill rate, (N - P) · decode rate)."""
    for name, v in (("--isl", isl), ("--osl", osl)):
        if not isinstance(v, int) or v < 1:
            raise DFlashError(f"{name} {v}: must be a positive number of tokens")
    chosen = plan.chosen
    if chosen is None:
        raise DFlashError(f"{plan.target} does not fit {plan.nodes} x {plan.hardware}: nothing to disaggregate")
    if isl + osl > plan.max_seq_len:
        raise DFlashError(f"--isl {isl} + --osl {osl} = {isl + osl} tokens: above max_seq_len {plan.max_seq_len}")
    if not chosen.within_nvlink_domain:
        raise DFlashError(f"tp {chosen.tp} crosses NVLink domains: the speed model has no figures for it")
    n = chosen.replicas if instances is None else instances
    if n < 2:
        raise DFlashError(f"disaggregated serving needs at least 2 instances (1 prefill + 1 decode); the layout has "
                          f"{n} of tp {chosen.tp} on {plan.nodes} x {plan.gpus_per_node} GPUs: add --nodes or --replicas")
    hw = get_hardware(plan.hardware)
    target = planner.target_shape(target_cfg, plan.target)
    t, _src = resolve_tau(plan.target, tau, plan.block_size, bool(drafter_cfg and plan.drafter))
    drafter = planner.drafter_shape(drafter_cfg, plan.drafter or "drafter") if t else None
    B = plan.block_size if drafter else 1
    batch = chosen.max_batch_size or plan.max_batch_size     # the layout's, where the draft context caps it
    per_seq = chosen.kv_bytes_per_token_per_gpu * (isl + osl + B)
    conc = max(1, min(batch, int(chosen.kv_budget_bytes_per_gpu // per_seq) if per_seq else batch))
    ctx = isl + osl // 2                                  # mean context while decoding
    runs = {}
    for name, eff in EFFICIENCY.items():
        pre = StepCost(plan, target, drafter, hw, chosen.tp, isl, eff).prefill_seconds(isl)
        user = user_speed(target, drafter, plan, hw, chosen.tp, ctx, eff, tau=t,
                          attention_dp=chosen.attention_dp)(conc)
        runs[name] = (pre, user)
    pre, user = runs["central"]
    rate_p, rate_d = 1 / pre, conc * user / osl
    p_best = max(range(1, n), key=lambda k: (min(k * rate_p, (n - k) * rate_d), -k))
    d_best = n - p_best
    c = EFFICIENCY["central"]
    assumptions = [
        "an estimate from the roofline speed model (docs/speed-model.md), not a measurement",
        f"every request: {isl} prompt tokens, {osl} output tokens (--isl / --osl)",
        f"prefill: one prompt at a time per instance, one pass over its {isl} tokens at {c.tensor:.0%} of the dense "
        "peak (compute-bound), attention over half the prompt on average"
        + ("; the drafter's pass over the prompt included (the prefill worker fills its context)" if drafter else ""),
        f"decode: {conc} sequences per instance (KV cache at {isl + osl} tokens, max_batch_size {batch}), "
        + (f"DFlash tau {t:g}" if t else "AR"),
        "KV transfer between prefill and decode, queueing and scheduler stalls not counted; prefill and decode "
        f"instances both tp {chosen.tp} (the bundle's layout)",
    ]
    return DisaggEstimate(
        isl=isl, osl=osl, tp=chosen.tp, instances=n, prefill_instances=p_best, decode_instances=d_best,
        prefill_gpus=p_best * chosen.tp, decode_gpus=d_best * chosen.tp, prefill_ms=pre * 1e3,
        prefill_ms_range=sorted([runs["low"][0] * 1e3, runs["high"][0] * 1e3]), decode_concurrency=conc,
        decode_tokens_per_s_per_user=user, decode_tokens_per_s_per_instance=conc * user,
        decode_tokens_per_s_per_instance_range=[conc * runs["low"][1], conc * runs["high"][1]],
        requests_per_s=min(p_best * rate_p, d_best * rate_d), prefill_requests_per_s=p_best * rate_p,
        decode_requests_per_s=d_best * rate_d, mode="dflash" if t else "ar", assumptions=assumptions)


def format_disaggregated(e: DisaggEstimate) -> str:
    lines = ["", f"disaggregated (ESTIMATE) for isl {e.isl} / osl {e.osl}: {e.prefill_instances} prefill + "
                 f"{e.decode_instances} decode instance(s) of tp {e.tp} = {e.prefill_gpus} prefill GPU(s) + "
                 f"{e.decode_gpus} decode GPU(s)",
             f"  prefill: {e.prefill_ms:,.0f} ms per prompt [{e.prefill_ms_range[0]:,.0f}-{e.prefill_ms_range[1]:,.0f}] "
             f"(~ time to first token, unqueued); {e.prefill_requests_per_s:,.2f} requests/s on the prefill side",
             f"  decode ({e.mode}): {e.decode_concurrency} sequences per instance, "
             f"{e.decode_tokens_per_s_per_user:,.0f} tokens/s per user, {_rng(e.decode_tokens_per_s_per_instance, e.decode_tokens_per_s_per_instance_range)} "
             f"tokens/s per instance; {e.decode_requests_per_s:,.2f} requests/s on the decode side",
             f"  sustained: ~{e.requests_per_s:,.2f} requests/s"]
    lines += [f"  - {a}" for a in e.assumptions]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The text report


def distinct_layouts(layouts: list[LayoutSpeed]) -> list[tuple[list[int], LayoutSpeed]]:
    """The layouts with speed figures, those of one tp whose every figure is the same merged: (their eps, the
    first). At tensor-parallel attention the expert-parallel split moves the same expected bytes per GPU, so
    ep 1/2/4/8 of tp 8 give one curve; attention DP or a different cap keeps them apart."""
    out: dict[tuple, tuple[list[int], LayoutSpeed]] = {}
    for l in layouts:
        if not l.points:
            continue
        figures = tuple((p.concurrency, round(p.ar_tokens_per_s_per_gpu, 6), round(p.dflash_tokens_per_s_per_gpu, 6))
                        for p in l.points)
        ranges = tuple(map(tuple, l.draft_schedule["ranges"])) if l.draft_schedule else ()
        out.setdefault((l.tp, l.attention_dp, l.replicas, figures, ranges), ([], l))[0].append(l.ep)
    return list(out.values())


def layout_name(eps: list[int], l: LayoutSpeed) -> str:
    return f"tp {l.tp}, ep {'/'.join(map(str, eps))}" + (", attention DP" if l.attention_dp else "")


def format_speed(r: SpeedReport, layouts: int = 1) -> str:
    """The text report: assumptions, then per layout a table of concurrency against speed (layouts that differ
    only in an ep with identical figures listed once)."""
    lines = ["", f"speed ({r.target} on {r.hardware}; central estimate [low-high]):"]
    lines += [f"  - {a}" for a in r.assumptions]
    groups = distinct_layouts(r.layouts)
    if any(len(eps) > 1 for eps, _ in groups):
        lines.append("  - layouts of one tp whose ep split gives identical figures are listed once (ep 1/2/...): with "
                     "tensor-parallel attention every GPU reads the same expected expert bytes per step whatever ep")
    for eps, l in groups[:layouts]:
        lines.append("")
        lines.append(f"  {layout_name(eps, l)}: {l.replicas} replica(s) of {l.gpus_per_replica} GPU(s), up to "
                     f"{l.max_concurrency} sequences each")
        head = f"  {'conc':>5} {'AR ms':>7} {'AR tok/s/user':>22} {'AR tok/s/GPU':>24}"
        if r.tau:
            head += f" {'DF ms':>7} {'DFlash tok/s/user':>22} {'DFlash tok/s/GPU':>24} {'gain':>5}"
        lines.append(head)
        for p in l.points:
            row = (f"  {p.concurrency:>5} {p.ar_step_ms:>7.2f} {_rng(p.ar_tokens_per_s_per_user, p.ar_tokens_per_s_per_user_range):>22} "
                   f"{_rng(p.ar_tokens_per_s_per_gpu, p.ar_tokens_per_s_per_gpu_range):>24}")
            if r.tau:
                row += (f" {p.dflash_verify_ms + p.dflash_draft_ms:>7.2f} "
                        f"{_rng(p.dflash_tokens_per_s_per_user, p.dflash_tokens_per_s_per_user_range):>22} "
                        f"{_rng(p.dflash_tokens_per_s_per_gpu, p.dflash_tokens_per_s_per_gpu_range):>24} "
                        f"{p.dflash_tokens_per_s_per_user / p.ar_tokens_per_s_per_user:>4.2f}x")
            lines.append(row)
        if l.draft_schedule:
            lines.append("")
            sched = ds.from_dict(l.draft_schedule, r.block_size, "speed report")
            lines += ["  " + x for x in ds.format_schedule(sched).splitlines()]
            lines += ["  " + x for x in l.draft_schedule_why]
    if rest := groups[layouts:]:
        lines.append("")
        lines.append("  other layouts: tok/s/user at concurrency 1; tok/s/GPU (tok/s/user) at their most concurrency:")
        for eps, l in rest:
            p1, pm = l.points[0], l.points[-1]
            s = (f"    {layout_name(eps, l)} (up to {l.max_concurrency}): AR {p1.ar_tokens_per_s_per_user:,.0f}; "
                 f"{pm.ar_tokens_per_s_per_gpu:,.0f} ({pm.ar_tokens_per_s_per_user:,.0f})")
            if r.tau:
                s += (f" | DFlash {p1.dflash_tokens_per_s_per_user:,.0f}; {pm.dflash_tokens_per_s_per_gpu:,.0f} "
                      f"({pm.dflash_tokens_per_s_per_user:,.0f})")
            lines.append(s)
            if l.draft_schedule:
                lines.append("      draft K: " + ", ".join(f"{a}-{b}: {k}" if a != b else f"{a}: {k}"
                                                       for a, b, k in l.draft_schedule["ranges"])
                             + (f"; speculation stops paying at {l.draft_schedule['stop_concurrency']}"
                                if l.draft_schedule["stop_concurrency"] else ""))
                lines += ["      " + x for x in l.draft_schedule_why]
    for l in r.layouts:
        if l.reason and l.reason != "does not fit":
            lines.append(f"  tp {l.tp}, ep {l.ep}: no speed figures ({l.reason})")
    return "\n".join(lines)


def _rng(v: float, r: list[float]) -> str:
    return f"{v:,.0f} [{r[0]:,.0f}-{r[1]:,.0f}]"


