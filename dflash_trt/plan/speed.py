"""Decode speed of a planned layout: tokens/s per user and per GPU against concurrency, for plain
autoregressive decoding (AR) and for DFlash, from what one decode step physically does on the GPU.

One forward pass of a model over T tokens (T = concurrent sequences × tokens per sequence: 1 for an
AR step, the block B for a DFlash verify or draft) costs, on each GPU of a replica:

    Σ over its stages  max(bytes read / (HBM bandwidth · HBM_EFF),  FLOPs / (dense peak of the format · TENSOR_EFF))
    + collectives: TP all-reduce (2 per layer) or, with attention data parallel, EP all-to-all
      (dispatch + combine per MoE layer): COLLECTIVE_LATENCY + bytes / (NVLink per direction · NVLINK_EFF)
    + layers · LAYER_LATENCY + STEP_OVERHEAD          (the fixed cost of launching a layer's kernels)

Stages (each a roofline of its own, they run as separate kernels):
  dense linears  every weight outside the experts (attention projections, dense MLPs, lm_head, router), read
                 once per pass in its format; FLOPs 2 · elements · tokens.
  experts        of E experts with top-k routing, T tokens touch E·(1 − (1 − k/E)^T) on average (each
                 token picks k distinct experts: an expert is missed by one token with probability
                 1 − k/E); the bytes of those are read, FLOPs are 2 · k/E · expert elements per token.
  attention      each sequence reads its KV cache once per pass whatever its query count (a verify of
                 B tokens reads the context once): full layers the whole context, sliding-window layers
                 at most the window; FLOPs 4 · heads · head_dim per query per context token.

Formats: weight bytes are the planner's (BF16 2, FP8 1, NVFP4 0.5625, MXFP4 0.53125 bytes per element,
scales included). A GEMM runs at the dense peak of its math format: NVFP4 at FP4, FP8 at FP8, MXFP4 experts
at FP8 on Blackwell (TensorRT-LLM's W4A8 MXFP4 x MXFP8 MoE; its gpt-oss deployment guide) and at BF16 on
Hopper (weights dequantized in the kernel), everything else and attention at BF16.

DFlash step = verify (target pass over B tokens per sequence) + draft (the drafter's layers over its block of
B, reading its own cache of projected target features, plus the target's lm_head over the B − 1 drafted
positions). Each step emits tau tokens per sequence (tau: mean accepted length, bonus token included), so

    tokens/s per user = tau / (verify + draft)   (AR: 1 / step)
    tokens/s per GPU  = concurrency · tokens/s per user / GPUs of the replica.

Draft schedule (per layout, with a drafter): the same passes price a step drafting K < B - 1 tokens (verify
over K + 1 tokens, the drafter's whole block; K = 0 an AR step, step_seconds_for), and
plan/draft_schedule.py picks the K of most tokens/s at each concurrency from the acceptance per draft
position (resolve_acceptance). build_schedule is `build --draft-schedule`'s.

Efficiency factors (EFFICIENCY, a low / central / high set; every number printed is the central one with
the low-high range beside it). LAYER_LATENCY's central value is fitted to one public point, TensorRT-LLM's
420 tokens/s per user for gpt-oss-120b on 8 × B200 at batch 1 (its gpt-oss deployment blog): at that batch
the weights read per GPU take about 0.1 ms, so nearly all of the 2.4 ms step is fixed per-layer cost. The
other factors are stated assumptions, checked (not fitted) against the published points of
docs/speed-model.md. Not modelled in the curves: prefill (they are decode only: a workload with long prompts
delivers fewer output tokens per GPU; `disaggregated` below adds a compute-bound prefill pass to split
instances into prefill and decode ones, an estimate), scheduler stalls, expert load imbalance, networks past one NVLink
domain (layouts that cross it get no speed figures).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

from dflash_trt.plan import draft_schedule as ds
from dflash_trt.plan import planner
from dflash_trt.plan.planner import Group, Layout, ModelShape, Plan, weight_bytes
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import Hardware, get_hardware, hardware_for_gpu


@dataclass(frozen=True)
class Efficiency:
    hbm: float                    # share of the datasheet HBM bandwidth decode kernels reach
    tensor: float                 # share of the dense tensor peak a GEMM over many tokens reaches
    nvlink: float                 # share of the per-direction NVLink bandwidth a collective reaches
    layer_latency_s: float        # fixed time per transformer layer per forward pass
    collective_latency_s: float   # fixed time per all-reduce / all-to-all
    step_overhead_s: float        # per forward pass: graph launch, sampling, scheduler


# low = pessimistic, high = optimistic. Sources and fits in docs/speed-model.md:
# - hbm 0.8 (0.7-0.9): the share of peak bandwidth bandwidth-bound kernels are commonly measured at; with it
#   Llama-3.3-70B FP8 on one H200 at batch 1 comes out at 47 tokens/s against NVIDIA's 51.14 (a check).
# - tensor 0.6 (0.45-0.75): dense GEMMs over thousands of tokens; checked against TensorRT-LLM's max-throughput
#   Llama-3.1-8B FP8 table (perf-overview), compute-bound at those batches.
# - nvlink 0.7 (0.6-0.8), collective latency 8 us (12-5): NCCL / TensorRT-LLM custom all-reduce of small messages.
# - layer latency 44.5 us central: fitted (module docstring); 60 us low, 25 us high (newer engines with fused
#   kernels and programmatic dependent launch).
# - step overhead 100 us (200-50): sampling and the host side of a step under CUDA graphs.
EFFICIENCY = {
    "low": Efficiency(hbm=0.7, tensor=0.45, nvlink=0.6, layer_latency_s=60e-6, collective_latency_s=12e-6,
                      step_overhead_s=200e-6),
    "central": Efficiency(hbm=0.8, tensor=0.6, nvlink=0.7, layer_latency_s=44.5e-6, collective_latency_s=8e-6,
                          step_overhead_s=100e-6),
    "high": Efficiency(hbm=0.9, tensor=0.75, nvlink=0.8, layer_latency_s=25e-6, collective_latency_s=5e-6,
                       step_overhead_s=50e-6),
}

# Mean accepted length (tau, bonus token included) of the presets' published drafters, used when --tau is not
# given. gpt-oss-120b: z-lab/gpt-oss-120b-DFlash model card, block 10, SGLang on one H200, reasoning effort
# medium: HumanEval 4.4, MBPP 4.6, MT-Bench 3.7, GSM8K 5.3, Math500 5.4 (coding, as NVIDIA's SPEED-Bench
# coding curve). llama-3.1-8b: an SGLang decode log of z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (block 10),
# "accept len: 6.10", one request (NVIDIA developer forum thread 359958): a weak source, say so.
PUBLISHED_TAU = {
    "gpt-oss-120b": (4.4, ("z-lab/gpt-oss-120b-DFlash model card: HumanEval, block 10, SGLang, 1 x H200 "
                           "(MBPP 4.6, MT-Bench 3.7, GSM8K 5.3, Math500 5.4)")),
    "llama-3.1-8b": (6.1, ("SGLang log of z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat, one request "
                           "(forums.developer.nvidia.com/t/359958)")),
}

# Acceptance per draft position (share of blocks accepting at least k drafted tokens) published for the
# presets' drafters: none found. The z-lab model cards and the DFlash paper (arXiv 2602.06036) give the mean
# acceptance length only, so a preset's schedule takes the geometric shape through its tau
# (draft_schedule.survival_from_tau), said as an assumption; `dflash-trt bench --json` measures the real one
# (plan --speed --acceptance REPORT).
PUBLISHED_SURVIVAL: dict[str, tuple[list[float], str]] = {}

DEFAULT_CONTEXT_TOKENS = 2048   # mean tokens of context per sequence while decoding (1k prompt + half of 2k out)
ACTIVATION_BYTES = 2            # hidden states on the wire (bf16)


def experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens route to, each picking top_k of `experts` (uniform)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def math_format(group: Group, weight_format: str, hw: Hardware) -> str:
    """The tensor-core format a group's GEMMs run in (module docstring)."""
    if not group.quantizable or weight_format == "none":
        return "bf16"
    if weight_format == "fp8":
        return "fp8"
    if weight_format == "nvfp4":
        return "fp4"
    if weight_format == "mxfp4" and group.expert:
        return "fp8" if hw.fp4 else "bf16"
    return "bf16"


@dataclass
class Forward:
    """One forward pass on one GPU of a replica: what it reads, computes and sends, and its time."""
    tokens: int                    # tokens through the model on the whole replica
    weight_bytes: float
    kv_bytes: float
    linear_flops: float
    attention_flops: float
    comm_bytes: float
    memory_s: float = 0.0          # stage times (each stage: max of its memory and compute time)
    compute_s: float = 0.0
    bound: str = ""                # "memory" or "compute": which dominates the linear stages
    comm_s: float = 0.0
    fixed_s: float = 0.0
    time_s: float = 0.0


def forward(shape: ModelShape, weight_format: str, kv_format: str, hw: Hardware, tp: int, sequences: int,
            queries: int, context: int, eff: Efficiency, *, attention_dp: bool = False,
            extra_groups: tuple[Group, ...] = ()) -> Forward:
    """Cost of one pass of `shape` over `queries` tokens of each of `sequences` sequences holding `context`
    tokens of KV, on one of the replica's `tp` GPUs. attention_dp: attention (and dense weights) replicated,
    each GPU its share of the sequences, experts split over the tp GPUs (expert parallel, all-to-all)."""
    T = sequences * queries
    share = 1 / tp if attention_dp else 1.0          # the share of the sequences one GPU attends to
    dense_tp = 1 if attention_dp else tp
    bw = hw.hbm_bytes_per_s * eff.hbm
    peak = {f: v * eff.tensor for f, v in hw.dense_flops_per_s.items()}

    w_dense = w_expert = fl_dense_s = fl_expert_s = fl_dense = fl_expert = 0.0
    for g in (*shape.groups, *extra_groups):
        if g.name == "embed":
            continue                                  # a lookup of T rows
        one = replace(shape, groups=[g])
        if g.expert or g.name == "expert_bias":
            frac = experts_touched(shape.experts, shape.experts_per_token, T) / shape.experts
            w_expert += weight_bytes(one, weight_format, tp) * frac
            fl = 2 * g.elements * g.active_fraction * T / tp
            fl_expert += fl
            fl_expert_s += fl / peak[math_format(g, weight_format, hw)]
        else:
            w_dense += weight_bytes(one, weight_format, dense_tp)
            if g.quantizable or g.name in ("lm_head", "fc"):
                fl = 2 * g.elements / dense_tp * T * share
                fl_dense += fl
                fl_dense_s += fl / peak[math_format(g, weight_format, hw)]

    # attention: KV read once per sequence per pass, written for the new tokens
    kv_heads = shape.kv_heads if attention_dp else math.ceil(shape.kv_heads / tp)
    heads = shape.heads if attention_dp else shape.heads // tp
    kv_per_token_layer = 2 * kv_heads * shape.head_dim * (1 if kv_format == "fp8" else 2)
    sliding = shape.sliding_layers if shape.sliding_window else 0
    window = min(context, shape.sliding_window or context)
    ctx_tokens = (shape.layers - sliding) * context + sliding * window    # context tokens read, over the layers
    seqs = sequences * share
    kv = seqs * (ctx_tokens + queries * shape.layers) * kv_per_token_layer
    fl_attn = seqs * queries * ctx_tokens * 4 * heads * shape.head_dim

    dense_s = max(w_dense / bw, fl_dense_s)
    expert_s = max(w_expert / bw, fl_expert_s)
    attn_s = max(kv / bw, fl_attn / peak["bf16"])
    mem_s = (w_dense + w_expert + kv) / bw
    comp_s = fl_dense_s + fl_expert_s + fl_attn / peak["bf16"]

    link = hw.nvlink_bytes_per_s / 2 * eff.nvlink        # catalog figure is both directions
    comm_bytes = comm_s = 0.0
    if tp > 1 and not attention_dp:                      # all-reduce after attention and after the MLP / MoE
        msg = T * shape.hidden * ACTIVATION_BYTES
        comm_bytes = 2 * shape.layers * 2 * (tp - 1) / tp * msg
        comm_s = 2 * shape.layers * eff.collective_latency_s + comm_bytes / link
    elif tp > 1 and shape.experts:                       # dispatch + combine of the routed tokens
        moe_layers = shape.layers
        msg = T * share * shape.experts_per_token * shape.hidden * ACTIVATION_BYTES * (tp - 1) / tp
        comm_bytes = moe_layers * 2 * msg
        comm_s = moe_layers * 2 * eff.collective_latency_s + comm_bytes / link

    fixed_s = shape.layers * eff.layer_latency_s + eff.step_overhead_s
    return Forward(tokens=T, weight_bytes=w_dense + w_expert, kv_bytes=kv, linear_flops=fl_dense + fl_expert,
                   attention_flops=fl_attn, comm_bytes=comm_bytes, memory_s=mem_s, compute_s=comp_s,
                   bound="compute" if fl_dense_s + fl_expert_s > (w_dense + w_expert) / bw else "memory",
                   comm_s=comm_s, fixed_s=fixed_s, time_s=dense_s + expert_s + attn_s + comm_s + fixed_s)


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
    max_concurrency: int                 # min(max_batch_size, sequences of context + block that fit the KV cache)
    points: list[SpeedPoint]
    reason: str = ""                     # why there are no points
    # the draft length per concurrency (deploy/draft_schedule.DraftSchedule.to_dict()), with a drafter
    draft_schedule: dict | None = None


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


def resolve_tau(target_name: str, tau: float | None, block: int, has_drafter: bool) -> tuple[float | None, str]:
    """--tau, checked against the drafter's block; else the preset's published one."""
    if not has_drafter:
        if tau is not None:
            raise DFlashError("--tau: there is no drafter to accept tokens from (pass --drafter or a preset with one)")
        return None, "no drafter: AR only"
    if tau is not None:
        if not (math.isfinite(tau) and 1 <= tau <= block):
            raise DFlashError(f"--tau {tau:g}: must be in [1, {block}] (1 = nothing accepted, {block} = the drafter's "
                              "whole block)")
        return float(tau), "--tau"
    if target_name in PUBLISHED_TAU:
        t, src = PUBLISHED_TAU[target_name]
        return min(t, block), src
    raise DFlashError(f"--tau: no published acceptance length for {target_name}'s drafter; pass --tau TAU "
                      "(`dflash-trt bench` measures it)")


def resolve_acceptance(target_name: str, tau: float | None, block: int, has_drafter: bool,
                       acceptance: str | None = None) -> tuple[float | None, str, list[float] | None, str]:
    """(tau, its source, survival per draft position or None, its source): --acceptance REPORT (a
    `dflash-trt bench --json` histogram, block size checked), else a published per-position figure, else
    the geometric shape through tau (--tau or the preset's published one)."""
    if acceptance is not None:
        if not has_drafter:
            raise DFlashError("--acceptance: there is no drafter to accept tokens from (pass --drafter or a preset "
                              "with one)")
        if tau is not None:
            raise DFlashError("--tau and --acceptance: the report's histogram gives tau; pass one of them")
        surv, t = ds.survival_from_bench(acceptance, block)
        return t, f"--acceptance {acceptance}", surv, f"measured per position: {acceptance} (bench --json histogram)"
    t, src = resolve_tau(target_name, tau, block, has_drafter)
    if t is None:
        return None, src, None, ""
    if tau is None and target_name in PUBLISHED_SURVIVAL:
        surv, where = PUBLISHED_SURVIVAL[target_name]
        return t, src, list(surv), where
    return t, src, ds.survival_from_tau(t, block), (
        f"geometric through tau {t:g} ({src}): every drafted token accepted with the same probability given its "
        "predecessors were (an assumption: no per-position figure is published for this drafter; "
        "`dflash-trt bench --json` measures one, plan --acceptance REPORT reads it)")


def step_seconds_for(plan: Plan, tp: int, target: ModelShape, drafter: ModelShape, hw: Hardware, context: int,
                     eff: Efficiency, *, attention_dp: bool = False):
    """step_seconds(c, K) of one decode step of c sequences drafting K tokens each (draft_schedule.choose):
    K = 0 a plain AR step; K >= 1 the target's verify over K + 1 tokens per sequence, plus the drafter's
    pass over its whole block B (and the target's lm_head it borrows) whatever K. A shorter draft keeps the
    drafter's block: TensorRT-LLM's DFlashWorker (tensorrt_llm/_torch/speculative/dflash.py @ 2fc4bbbc414379ff,
    prepare_1st_drafter_inputs) builds a query block of the drafter's block_size and gathers only the K
    drafted positions' logits, so what a schedule saves is the verify's tokens, not the drafter's."""
    fmt, kv, dq, B = plan.quant["target"], plan.quant["kv_cache"], plan.quant["drafter"], plan.block_size
    lm_head = _lm_head(target)
    draft_s: dict[int, float] = {}

    def step(c: int, k: int) -> float:
        if k == 0:
            return forward(target, fmt, kv, hw, tp, c, 1, context, eff, attention_dp=attention_dp).time_s
        if c not in draft_s:
            draft_s[c] = forward(drafter, dq, kv, hw, tp, c, B, context, eff, attention_dp=attention_dp,
                                 extra_groups=(lm_head,)).time_s
        return forward(target, fmt, kv, hw, tp, c, k + 1, context, eff, attention_dp=attention_dp).time_s + draft_s[c]
    return step


SCHEDULE_COST = ("step cost: K = 0 a plain AR step; K >= 1 the target's verify over K + 1 tokens per sequence plus the "
                 "drafter's whole block (its pass does not shorten with K: TensorRT-LLM's DFlashWorker drafts the full "
                 "block and keeps K positions), central efficiency set")


def layout_schedule(plan: Plan, layout: LayoutSpeed, target: ModelShape, drafter: ModelShape, hw: Hardware,
                    context: int, survival: list[float], acceptance_source: str,
                    concurrency_grid: list[int] | None = None) -> ds.DraftSchedule:
    """The draft length per concurrency of one layout with speed figures (its own concurrencies, or a grid)."""
    step = step_seconds_for(plan, layout.tp, target, drafter, hw, context, EFFICIENCY["central"],
                            attention_dp=layout.attention_dp)
    grid = concurrency_grid or [p.concurrency for p in layout.points]
    return ds.choose(survival, step, grid, assumptions=[f"acceptance per position: {acceptance_source}",
                                                        SCHEDULE_COST])


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
    cap = min(plan.max_batch_size, int(layout.kv_budget_bytes_per_gpu // per_seq) if per_seq else plan.max_batch_size)
    if cap < 1:
        out.reason = f"one sequence of {context} tokens does not fit the KV cache"
        return out
    out.max_concurrency = cap
    fmt, kv, dq = plan.quant["target"], plan.quant["kv_cache"], plan.quant["drafter"]
    lm_head = _lm_head(target)
    for c in concurrencies(cap):
        runs = {}
        for name, eff in EFFICIENCY.items():
            ar = forward(target, fmt, kv, hw, tp, c, 1, context, eff, attention_dp=adp)
            r = {"ar": ar, "ar_user": 1 / ar.time_s}
            if drafter and tau:
                v = forward(target, fmt, kv, hw, tp, c, B, context, eff, attention_dp=adp)
                # the drafter's pass over its block, and the target's lm_head it borrows (counted over all B
                # positions: B - 1 are drafted, an overestimate of 1/B of its FLOPs)
                d = forward(drafter, dq, kv, hw, tp, c, B, context, eff, attention_dp=adp, extra_groups=(lm_head,))
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


def _lm_head(target: ModelShape) -> Group:
    """The target's output projection (the embedding when tied), which the drafter borrows."""
    return next((g for g in target.groups if g.name == "lm_head"),
                Group("lm_head", target.vocab * target.hidden, "tp", False))


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
    t, src, survival, acc_src = resolve_acceptance(plan.target, tau, plan.block_size, drafter is not None, acceptance)
    layouts = [layout_speed(plan, l, target, drafter, hw, t, context_tokens) for l in plan.layouts]
    for l in layouts:
        if l.points and drafter is not None and survival:
            l.draft_schedule = layout_schedule(plan, l, target, drafter, hw, context_tokens, survival,
                                               acc_src).to_dict()
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
        "ranges: the low / high efficiency sets of dflash_trt/plan/speed.py (EFFICIENCY)",
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


def build_schedule(mode: str, *, target_name: str, target_config: dict, drafter_config: dict, gpu: str | None,
                   quant: str, kv_cache: str, drafter_quant: str, tp: int, ep: int, block_size: int,
                   max_batch_size: int, max_seq_len: int, attention_dp: bool = False,
                   context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> tuple[ds.DraftSchedule | None, str]:
    """`build --draft-schedule auto|off|FILE.json`: (the schedule the bundle's stacks get, or None, and where it
    comes from or why there is none). auto plans it as `plan --speed` does, for the bundle's GPU node, layout,
    formats and max_batch_size (the concurrencies 1..max_batch_size), from the preset drafter's published tau;
    without a GPU (a CPU bundle) or a tau there is none."""
    if mode == "off":
        return None, "--draft-schedule off"
    if mode != "auto":
        return ds.load_schedule(mode, block_size), f"read from {mode}"
    if not gpu:
        return None, ("no GPU (a CPU bundle): the speed model needs the node's hardware (build --gpu), or pass "
                      "--draft-schedule FILE.json")
    if target_name not in PUBLISHED_TAU:
        return None, (f"no acceptance figure for {target_name}'s drafter (no published tau): measure one with "
                      "`dflash-trt bench --json`, plan with `dflash-trt plan --speed --acceptance REPORT --json` and "
                      "pass the layout's draft_schedule as --draft-schedule FILE.json")
    cost = schedule_cost(target_name=target_name, target_config=target_config, drafter_config=drafter_config,
                         gpu=gpu, quant=quant, kv_cache=kv_cache, drafter_quant=drafter_quant, tp=tp, ep=ep,
                         block_size=block_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         attention_dp=attention_dp, context_tokens=context_tokens)
    if isinstance(cost, str):
        return None, cost
    t, src, survival, acc_src = resolve_acceptance(target_name, None, block_size, True)
    sched = ds.choose(survival, cost.step_seconds, cost.concurrencies,
                      assumptions=[f"acceptance per position: {acc_src}", SCHEDULE_COST, cost.source])
    return sched, f"planned for {cost.hardware} (speed model, tau {t:g}: {src})"


@dataclass(frozen=True)
class StepCost:
    """What one decode step costs, for draft_schedule.choose: step_seconds(c, K), the concurrencies to plan
    at, and where the figures come from."""
    step_seconds: object            # Callable[[int, int], float]
    concurrencies: list[int]
    source: str
    hardware: str = ""


def schedule_cost(*, target_name: str, target_config: dict, drafter_config: dict, gpu: str, quant: str,
                  kv_cache: str, drafter_quant: str, tp: int, ep: int, block_size: int, max_batch_size: int,
                  max_seq_len: int, attention_dp: bool = False,
                  context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> StepCost | str:
    """The speed model's step cost of a bundle's layout on its GPU node (build --draft-schedule auto, and
    `tune` re-planning from served acceptance), or why there is none (a str)."""
    hw = hardware_for_gpu(gpu)
    dcfg = {**drafter_config, "block_size": block_size}
    p = planner.plan(target_config, dcfg, hw, target_name=target_name, drafter_name=f"{target_name} drafter",
                     quant=quant, kv_cache=kv_cache, drafter_quant=drafter_quant, max_seq_len=max_seq_len, tp=tp,
                     ep=ep, max_batch_size=max_batch_size, attention_dp=attention_dp, batch_pinned=True)
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
    step = step_seconds_for(p, ls.tp, target, drafter, hw, context, EFFICIENCY["central"],
                            attention_dp=ls.attention_dp)
    return StepCost(step, concurrencies(max_batch_size),
                    f"planned by the speed model for {hw.name}, tp {tp} ep {ep}, {quant} weights, {context_tokens} "
                    f"tokens of context, concurrency 1..{max_batch_size} (max_batch_size)", hw.name)


def user_speed(target: ModelShape, drafter: ModelShape | None, plan: Plan, hw: Hardware, tp: int, context: int,
               eff: Efficiency, *, tau: float | None = None, attention_dp: bool = False):
    """concurrency -> tokens/s per user of one replica: DFlash with tau (and a drafter), else AR."""
    fmt, kv, dq, B = plan.quant["target"], plan.quant["kv_cache"], plan.quant["drafter"], plan.block_size

    def user(c: int) -> float:
        if not tau:
            return 1 / forward(target, fmt, kv, hw, tp, c, 1, context, eff, attention_dp=attention_dp).time_s
        v = forward(target, fmt, kv, hw, tp, c, B, context, eff, attention_dp=attention_dp)
        d = forward(drafter, dq, kv, hw, tp, c, B, context, eff, attention_dp=attention_dp,
                    extra_groups=(_lm_head(target),))
        return tau / (v.time_s + d.time_s)
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
    lay = next((l for l in report.layouts if l.points), None)
    chosen = plan.chosen
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


def prefill_time(target: ModelShape, drafter: ModelShape | None, plan: Plan, hw: Hardware, tp: int, isl: int,
                 eff: Efficiency) -> float:
    """Seconds for one prompt of `isl` tokens on one instance: a single pass over all its tokens (compute-bound
    past a few hundred tokens), attention over the causal half of the prompt on average; with a drafter, its
    pass over the same tokens too (DFlash drafts from the prompt's target features: the worker that prefills
    fills the drafter's context, engines.json dynamo workers.<engine>.disaggregation.drafter_on_prefill)."""
    fmt, kv, dq = plan.quant["target"], plan.quant["kv_cache"], plan.quant["drafter"]
    ctx = max(1, isl // 2)
    t = forward(target, fmt, kv, hw, tp, 1, isl, ctx, eff).time_s
    if drafter is not None:
        t += forward(drafter, dq, kv, hw, tp, 1, isl, ctx, eff).time_s
    return t


def disaggregated(plan: Plan, target_cfg: dict, drafter_cfg: dict | None, *, isl: int, osl: int,
                  instances: int | None = None, tau: float | None = None) -> DisaggEstimate:
    """Split `instances` (default: the chosen layout's replicas) of the chosen layout into prefill and decode
    ones so that neither side limits the request rate: a prefill instance takes one prompt at a time
    (1 / prefill_time requests/s), a decode instance holds as many sequences as its KV cache fits at
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
        pre = prefill_time(target, drafter, plan, hw, chosen.tp, isl, eff)
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
# Reading a curve


def best_at_interactivity(points: list[SpeedPoint], min_user: float, mode: str) -> SpeedPoint | None:
    """The point of most tokens/s per GPU among those giving each user at least min_user tokens/s."""
    key_user, key_gpu = f"{mode}_tokens_per_s_per_user", f"{mode}_tokens_per_s_per_gpu"
    ok = [p for p in points if getattr(p, key_user) >= min_user]
    return max(ok, key=lambda p: getattr(p, key_gpu)) if ok else None


def max_concurrency_for(points: list[SpeedPoint], min_user: float, mode: str) -> int:
    """The largest concurrency whose predicted tokens/s per user is at least min_user (0: none)."""
    ok = [p.concurrency for p in points if getattr(p, f"{mode}_tokens_per_s_per_user") >= min_user]
    return max(ok) if ok else 0


def format_speed(r: SpeedReport, layouts: int = 1) -> str:
    """The text report: assumptions, then per layout a table of concurrency against speed."""
    lines = ["", f"speed ({r.target} on {r.hardware}; central estimate [low-high]):"]
    lines += [f"  - {a}" for a in r.assumptions]
    shown = [l for l in r.layouts if l.points][:layouts]
    for l in shown:
        lines.append("")
        lines.append(f"  tp {l.tp}, ep {l.ep}{', attention DP' if l.attention_dp else ''}: {l.replicas} replica(s) of "
                     f"{l.gpus_per_replica} GPU(s), up to {l.max_concurrency} sequences each")
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
            lines += ["  " + x for x in ds.format_schedule(schedule_of(l)).splitlines()]
    rest = [l for l in r.layouts if l.points][layouts:]
    if rest:
        lines.append("")
        lines.append("  other layouts: tok/s/user at concurrency 1; tok/s/GPU (tok/s/user) at their most concurrency:")
        for l in rest:
            p1, pm = l.points[0], l.points[-1]
            s = (f"    tp {l.tp}, ep {l.ep} (up to {l.max_concurrency}): AR {p1.ar_tokens_per_s_per_user:,.0f}; "
                 f"{pm.ar_tokens_per_s_per_gpu:,.0f} ({pm.ar_tokens_per_s_per_user:,.0f})")
            if r.tau:
                s += (f" | DFlash {p1.dflash_tokens_per_s_per_user:,.0f}; {pm.dflash_tokens_per_s_per_gpu:,.0f} "
                      f"({pm.dflash_tokens_per_s_per_user:,.0f})")
            lines.append(s)
            if l.draft_schedule:
                lines.append("      draft K: " + _ranges_text(l.draft_schedule["ranges"])
                             + (f"; speculation stops paying at {l.draft_schedule['stop_concurrency']}"
                                if l.draft_schedule["stop_concurrency"] else ""))
    for l in r.layouts:
        if l.reason and l.reason != "does not fit":
            lines.append(f"  tp {l.tp}, ep {l.ep}: no speed figures ({l.reason})")
    return "\n".join(lines)


def schedule_of(layout: LayoutSpeed) -> ds.DraftSchedule:
    """A layout's draft schedule as the object (the report carries its to_dict())."""
    d = layout.draft_schedule
    return ds.DraftSchedule(max_k=d["max_k"], acceptance_lengths=d["acceptance_lengths"],
                            levels=[ds.Level(**lv) for lv in d["levels"]], ranges=[tuple(r) for r in d["ranges"]],
                            assumptions=d["assumptions"])


def _ranges_text(ranges) -> str:
    return ", ".join(f"{a}-{b}: {k}" if a != b else f"{a}: {k}" for a, b, k in ranges)


def _rng(v: float, r: list[float]) -> str:
    return f"{v:,.0f} [{r[0]:,.0f}-{r[1]:,.0f}]"


# ---------------------------------------------------------------------------------------------
# Published measurements (plan/published_speeds.json): what the model is checked against


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
    target = planner.target_shape(tcfg, name)
    drafter = planner.drafter_shape(dcfg) if dcfg else None
    tau = pt.get("tau") or (PUBLISHED_TAU[name][0] if name in PUBLISHED_TAU else None)
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
        ar = forward(target, p.quant["target"], p.quant["kv_cache"], hw, lay.tp, c, 1, ctx, eff, attention_dp=adp)
        if metric == "ar_tokens_per_s_per_user":
            out[e_name] = 1 / ar.time_s
        elif metric == "ar_tokens_per_s_per_gpu":
            out[e_name] = c / ar.time_s / lay.tp
        elif metric == "dflash_over_ar_per_user":
            B = p.block_size
            v = forward(target, p.quant["target"], p.quant["kv_cache"], hw, lay.tp, c, B, ctx, eff, attention_dp=adp)
            d = forward(drafter, "none", p.quant["kv_cache"], hw, lay.tp, c, B, ctx, eff, attention_dp=adp,
                        extra_groups=(_lm_head(target),))
            out[e_name] = tau / (v.time_s + d.time_s) * ar.time_s
        else:
            raise DFlashError(f"published point {pt['id']}: unknown metric {metric!r}")
    return out


def _one_set(ls: LayoutSpeed, eff_name: str) -> list[SpeedPoint]:
    """The curve's points with one efficiency set's figures in the central fields."""
    if eff_name == "central":
        return ls.points
    i = 0 if eff_name == "low" else 1
    out = []
    for p in ls.points:
        q = replace(p, ar_tokens_per_s_per_user=p.ar_tokens_per_s_per_user_range[i],
                    ar_tokens_per_s_per_gpu=p.ar_tokens_per_s_per_gpu_range[i])
        if p.dflash_tokens_per_s_per_user_range:
            q = replace(q, dflash_tokens_per_s_per_user=p.dflash_tokens_per_s_per_user_range[i],
                        dflash_tokens_per_s_per_gpu=p.dflash_tokens_per_s_per_gpu_range[i])
        out.append(q)
    return out


def check_table() -> str:
    """docs/speed-model.md's table: every published point beside the model's figure."""
    rows = ["| point | setup | published | predicted (central [low-high]) | error |", "|---|---|---|---|---|"]
    for pt in published_points():
        pr = predict_point(pt)
        v, c = pt["value"], pr["central"]
        fmt = (lambda x: "AR never reaches it" if math.isinf(x) else f"{x:,.2f}x") if "over" in pt["metric"] \
            else (lambda x: f"{x:,.0f}")
        if pt["compare"] == ">=" and math.isinf(c):
            err = ("AR never gets there (central); " + ("high set above the claim" if pr["high"] >= v
                                                        else "high set below the claim"))
        elif pt["compare"] == ">=":
            err = "consistent (above the claim)" if c >= v else f"{c / v - 1:+.0%} below the claim"
        else:
            err = f"{c / v - 1:+.0%}" + (" (fitted)" if pt.get("fit") else "")
        setup = (f"{pt['target']}, {pt['hardware']} × {pt['gpus']}, tp {pt['tp']} ep {pt['ep']}"
                 f"{' attention-DP' if pt['attention_dp'] else ''}, {pt['quant']}/{pt['kv_cache']} KV, "
                 f"concurrency {pt['concurrency']}, context {pt['context_tokens']}"
                 + (f", tau {pt['tau']}" if pt.get("tau") else ""))
        rows.append(f"| {pt['id']} | {setup} | {pt['metric']} {pt['compare']} {v:,} | "
                    f"{fmt(c)} [{fmt(pr['low'])}-{fmt(pr['high'])}] | {err} |")
    return "\n".join(rows)


if __name__ == "__main__":   # python -m dflash_trt.plan.speed --check: the table of docs/speed-model.md
    if sys.argv[1:] != ["--check"]:
        sys.exit("usage: python -m dflash_trt.plan.speed --check")
    print(check_table())
