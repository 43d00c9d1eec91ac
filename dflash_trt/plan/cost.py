"""The cost model: what one layout of a (target, drafter) pair costs on each of its GPUs, in bytes
held and in seconds per decode step. The planner asks it what a layout holds (weights, KV cache per
token, activations); the speed model and the draft schedule ask it what a step takes (StepCost).
Both count a model's bytes the same way, one parameter group at a time (group_bytes).

Bytes held per GPU of a tp-way split (formats and split rules: planner.py's docstring); the time of a
pass: one roofline per stage (dense linears, the experts a step touches, attention), plus collectives and a
fixed cost per layer. A decode step (StepCost.step_seconds): K = 0 an AR step; K >= 1 the target's verify over
K + 1 tokens per sequence plus the drafter's pass over its whole block whatever K. The formulas, the math
format of each GEMM and the efficiency factors (EFFICIENCY) with their sources: docs/speed-model.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from dflash_trt.hardware import Hardware
from dflash_trt.plan.shapes import Group, ModelShape


class Formats(Protocol):
    """What a step's cost reads of a plan (planner.Plan): the formats and the drafter's block."""
    quant: dict            # {"target": weight format, "kv_cache": KV format, "drafter": the drafter's}
    block_size: int

# Bytes per weight element of a quantized linear layer (scale tensors included).
# int8: compressed-tensors W8A8 (a drafter for vLLM); its per-channel scales (2 bytes a row) are left out
ELEMENT_BYTES = {"none": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32, "int8": 1.0}
# Per-tensor fp32 scalars that come with each quantized linear layer (weight_scale(_2), input_scale).
SCALAR_BYTES_PER_LINEAR = {"none": 0, "fp8": 8, "nvfp4": 8, "mxfp4": 0, "int8": 0}
ACTIVATION_BYTES = 2            # hidden states on the wire (bf16)


# ---------------------------------------------------------------------------------------------
# Bytes held


def group_bytes(g: Group, shape: ModelShape, fmt: str, tp: int = 1) -> float:
    """Bytes of one parameter group on one GPU of a tp-way split, in weight format `fmt`."""
    elems = _elements_per_gpu(g, shape, tp)
    if g.quantizable and (fmt in ("fp8", "nvfp4", "int8") or (fmt == "mxfp4" and g.expert)):
        return elems * ELEMENT_BYTES[fmt] + g.linears * SCALAR_BYTES_PER_LINEAR[fmt]
    return elems * 2.0


def weight_bytes(shape: ModelShape, fmt: str, tp: int = 1, attn_tp: int | None = None) -> int:
    """Bytes of the model's weights on one GPU of a tp-way split (tp=1: the whole model);
    `attn_tp`: the attention's own split (1 under attention DP, which replicates it)."""
    return math.ceil(sum(group_bytes(g, shape, fmt, attn_tp if attn_tp is not None and g.name.startswith("attn")
                                     else tp) for g in shape.groups))


def _elements_per_gpu(g: Group, shape: ModelShape, tp: int) -> float:
    if g.split == "rep" or tp == 1:
        return g.elements
    if g.split == "kv":
        return g.elements / g.kv_heads * math.ceil(g.kv_heads / tp)
    if g.name in ("embed", "lm_head"):   # vocab padded to a multiple of tp
        return math.ceil(shape.vocab / tp) * shape.hidden
    return g.elements / tp


def kv_bytes_per_token(shape: ModelShape, kv_format: str, tp: int = 1, layers: int | None = None) -> int:
    """KV bytes per token of context on one GPU of a tp-way split, over `layers` layers (default:
    all of them)."""
    layers = shape.layers if layers is None else layers
    b = 1 if kv_format == "fp8" else 2
    if shape.kv_per_layer:
        # layers of different widths: exact over all of them; a part of them (the layers that
        # max_attention_window leaves whole) is counted at the mean width per layer
        per_layer = [2 * math.ceil(h / tp) * d * b for h, d in shape.kv_per_layer]
        total = sum(per_layer)
        return total if layers == len(per_layer) else math.ceil(total * layers / len(per_layer))
    return layers * 2 * math.ceil(shape.kv_heads / tp) * shape.head_dim * b


def activation_bytes(shape: ModelShape, tp: int, max_num_tokens: int, logits_tokens: int) -> int:
    """A rough upper bound of TensorRT-LLM's activation memory per GPU: bf16 hidden, qkv and MLP
    intermediates for max_num_tokens tokens in flight, plus fp32 logits (vocab/tp) for the tokens
    the step samples or verifies (max_batch_size × block)."""
    heads = shape.heads // tp + 2 * math.ceil(shape.kv_heads / tp)
    inter = shape.intermediate * (shape.experts_per_token if shape.experts else 1)
    per_token = 2 * (4 * shape.hidden + heads * shape.head_dim + 2 * inter // tp)
    logits = logits_tokens * math.ceil(shape.vocab / tp) * 4
    return max_num_tokens * per_token + logits


# ---------------------------------------------------------------------------------------------
# Time of a pass


@dataclass(frozen=True)
class Efficiency:
    hbm: float                    # share of the datasheet HBM bandwidth decode kernels reach
    tensor: float                 # share of the dense tensor peak a GEMM over many tokens reaches
    nvlink: float                 # share of the per-direction NVLink bandwidth a collective reaches
    layer_latency_s: float        # fixed time per transformer layer per forward pass
    collective_latency_s: float   # fixed time per all-reduce / all-to-all
    step_overhead_s: float        # per forward pass: graph launch, sampling, scheduler


# low = pessimistic, high = optimistic; each factor's source or fit (layer latency: fitted to TensorRT-LLM's
# gpt-oss-120b on 8 x B200 at batch 1) in docs/speed-model.md
EFFICIENCY = {
    "low": Efficiency(hbm=0.7, tensor=0.45, nvlink=0.6, layer_latency_s=60e-6, collective_latency_s=12e-6,
                      step_overhead_s=200e-6),
    "central": Efficiency(hbm=0.8, tensor=0.6, nvlink=0.7, layer_latency_s=44.5e-6, collective_latency_s=8e-6,
                          step_overhead_s=100e-6),
    "high": Efficiency(hbm=0.9, tensor=0.75, nvlink=0.8, layer_latency_s=25e-6, collective_latency_s=5e-6,
                       step_overhead_s=50e-6),
}


def experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens route to, each picking top_k of `experts` (uniform)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def math_format(group: Group, weight_format: str, hw: Hardware) -> str:
    """The tensor-core format a group's GEMMs run in (module docstring)."""
    if not group.quantizable:
        return "bf16"
    if weight_format == "mxfp4":
        return "fp8" if group.expert and hw.fp4 else "bf16"
    return {"fp8": "fp8", "nvfp4": "fp4"}.get(weight_format, "bf16")


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
        if g.expert or g.name == "expert_bias":
            frac = experts_touched(shape.experts, shape.experts_per_token, T) / shape.experts
            w_expert += math.ceil(group_bytes(g, shape, weight_format, tp)) * frac
            fl = 2 * g.elements * g.active_fraction * T / tp
            fl_expert += fl
            fl_expert_s += fl / peak[math_format(g, weight_format, hw)]
        else:
            w_dense += math.ceil(group_bytes(g, shape, weight_format, dense_tp))
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
# Time of a decode step of one layout


class StepCost:
    """The passes of one layout of a plan (tp GPUs per replica, its formats, `context` tokens per sequence)
    under one efficiency set: an AR step, a verify, a draft, a DFlash step of K drafted tokens, a prefill."""

    def __init__(self, plan: Formats, target: ModelShape, drafter: ModelShape | None, hw: Hardware, tp: int,
                 context: int, eff: Efficiency, *, attention_dp: bool = False):
        self.target, self.drafter, self.hw, self.tp, self.context, self.eff = target, drafter, hw, tp, context, eff
        self.attention_dp = attention_dp
        self.fmt, self.kv, self.drafter_fmt = plan.quant["target"], plan.quant["kv_cache"], plan.quant["drafter"]
        self.block = plan.block_size
        self._draft: dict[int, Forward] = {}

    def ar(self, c: int) -> Forward:
        """One plain decode step of c sequences."""
        return self.verify(c, 1)

    def verify(self, c: int, tokens: int) -> Forward:
        """The target's pass over `tokens` tokens of each of c sequences."""
        return forward(self.target, self.fmt, self.kv, self.hw, self.tp, c, tokens, self.context, self.eff,
                       attention_dp=self.attention_dp)

    def draft(self, c: int) -> Forward:
        """The drafter's pass over its block for c sequences, and the target's lm_head it borrows (counted over
        all B positions: B - 1 are drafted, an overestimate of 1/B of its FLOPs)."""
        if c not in self._draft:
            self._draft[c] = forward(self.drafter, self.drafter_fmt, self.kv, self.hw, self.tp, c, self.block,
                                     self.context, self.eff, attention_dp=self.attention_dp,
                                     extra_groups=(self.target.output_projection(),))
        return self._draft[c]

    def dflash_seconds(self, c: int) -> float:
        """One DFlash step drafting the whole block: verify over B tokens + draft."""
        return self.verify(c, self.block).time_s + self.draft(c).time_s

    def step_seconds(self, c: int, k: int) -> float:
        """One decode step of c sequences drafting k tokens each (k = 0: AR). A shorter draft keeps the
        drafter's block: TensorRT-LLM's DFlashWorker (tensorrt_llm/_torch/speculative/dflash.py @
        2fc4bbbc414379ff, prepare_1st_drafter_inputs) builds a query block of the drafter's block_size and
        gathers only the K drafted positions' logits, so what a schedule saves is the verify's tokens."""
        if k == 0:
            return self.ar(c).time_s
        return self.verify(c, k + 1).time_s + self.draft(c).time_s

    def prefill_seconds(self, isl: int) -> float:
        """One prompt of `isl` tokens: a single pass over all its tokens (compute-bound past a few hundred
        tokens), attention over the causal half of the prompt on average; with a drafter, its pass over the
        same tokens too (DFlash drafts from the prompt's target features: the worker that prefills fills the
        drafter's context, engines.json dynamo workers.<engine>.disaggregation.drafter_on_prefill). Tensor
        parallel whatever the decode's attention DP."""
        ctx = max(1, isl // 2)
        t = forward(self.target, self.fmt, self.kv, self.hw, self.tp, 1, isl, ctx, self.eff).time_s
        if self.drafter is not None:
            t += forward(self.drafter, self.drafter_fmt, self.kv, self.hw, self.tp, 1, isl, ctx, self.eff).time_s
        return t
