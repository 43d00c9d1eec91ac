"""One layout of a plan, sized: whether the models split tp (and ep) ways on the GPUs, what one GPU then holds
and how much KV cache the rest of its memory gives (plan/planner.py's docstring states the terms), and the
(tp, ep) candidates the planner's search evaluates. Called by planner.plan only: a bundle's readers take the
layouts its plan.json recorded (plan/record.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import Hardware
from dflash_trt.plan.cost import activation_bytes, kv_bytes_per_token, weight_bytes
from dflash_trt.plan.shapes import ModelShape
from dflash_trt.stacks.trtllm.budget import draft_context_budget

GIB = 2**30
# CUDA context, NCCL buffers, CUDA graphs, cuBLAS/cuDNN workspaces: a fixed allowance per GPU
# (an assumption, conservative for TensorRT-LLM's PyTorch backend on one node).
RUNTIME_RESERVE_BYTES = 3 * GIB


@dataclass
class Layout:
    tp: int
    ep: int
    pp: int
    replicas: int
    nodes_per_replica: int
    fits: bool
    kv_tokens: int
    max_sequences: int     # concurrent sequences of max_seq_len per replica: KV-cache fit, capped by max_batch_size
    reason: str
    weights_bytes_per_gpu: int = 0
    drafter_bytes_per_gpu: int = 0
    activation_bytes_per_gpu: int = 0
    runtime_reserve_bytes: int = RUNTIME_RESERVE_BYTES
    kv_budget_bytes_per_gpu: int = 0
    kv_bytes_per_token_per_gpu: int = 0
    kv_sequences: int = 0  # sequences the KV cache alone would hold (before the max_batch_size cap)
    within_nvlink_domain: bool = True
    # TensorRT-LLM's enable_attention_dp: each of the tp ranks runs attention for its own batch (its
    # KV heads whole, attention weights replicated); the MoE / MLP stay split
    attention_dp: bool = False
    # DFlash's draft-context buffer on one rank and the budget TensorRT-LLM checks it against
    # (stacks/trtllm/budget.py, PR #19466); 0 without a drafter
    draft_context_bytes_per_gpu: int = 0
    draft_context_budget_bytes_per_gpu: int = 0
    max_batch_size: int = 0    # what this layout runs with: the plan's, or less where the draft context caps it


# Layout order per objective, fitting layouts first (plan()'s docstring gives the reasons).
RANKING = {
    "latency": lambda l: (not l.fits, not l.within_nvlink_domain, -l.tp, l.ep, -l.kv_tokens),
    "throughput": lambda l: (not l.fits, -l.max_sequences * l.replicas, l.tp, -l.ep),
}


@dataclass
class Sizing:
    """What every candidate layout of one plan is sized against: the two models and their
    formats, the nodes, and the serving limits."""
    target: ModelShape
    drafter: ModelShape | None
    hw: Hardware
    gpus_per_node: int
    total_gpus: int
    quant: str             # the target's weight format
    drafter_quant: str
    kv: str                # the KV cache format
    max_seq_len: int
    max_num_tokens: int
    logits_tokens: int     # tokens one step computes logits for: max_batch_size × block, at most max_num_tokens
    block: int
    kv_fraction: float
    max_batch_size: int
    windows: list[int | None]   # per target layer: tokens kept per sequence, None = the whole sequence
    drafter_cfg: dict | None = None
    attention_dp: bool = False  # the profile's enable_attention_dp, for layouts of tp > 1
    preferred: tuple[int, int] | None = None   # the curated (tp, ep) of the profile, ranked first when it fits
    batch_pinned: bool = False  # max_batch_size is the bundle's (its serving config): a layout may not lower it


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_layouts(s: Sizing, nodes: int, tp: int | None, ep: int | None) -> list[tuple[int, int]]:
    """The (tp, ep) pairs to evaluate: every tp that divides the GPUs, each ep that divides tp
    for an MoE target (else 1); `tp` / `ep` pin them. Powers of two only: the head counts of
    the models served are, and the chart's schema checks GPU counts against tp × pp for powers
    of two."""
    if tp is not None and tp & (tp - 1):
        raise DFlashError(f"tp {tp}: the planner and the Helm chart take tensor parallel sizes that are powers of two")
    if tp is not None and s.total_gpus % tp:
        raise DFlashError(f"tp {tp}: {nodes} node(s) × {s.gpus_per_node} GPUs = {s.total_gpus} is not a multiple "
                          "of tp (pass --nodes / --gpus-per-node)")
    pairs = []
    for t in _divisors(s.total_gpus):
        if t & (t - 1) or (tp is not None and t != tp):
            continue
        eps = [e for e in _divisors(t) if ep is None or e == ep] if s.target.experts else []
        pairs += [(t, e) for e in eps or [1]]
    return pairs


def _evaluate(s: Sizing, tp: int, ep: int) -> Layout:
    """One layout: whether the models split this way, and if so what one GPU holds and how
    much KV cache (tokens, whole sequences) the rest of its memory gives."""
    lay = Layout(tp=tp, ep=ep, pp=1, replicas=s.total_gpus // tp, nodes_per_replica=max(1, math.ceil(tp / s.gpus_per_node)),
                 fits=False, kv_tokens=0, max_sequences=0, reason=_split_error(s, tp, ep),
                 within_nvlink_domain=tp <= s.hw.nvlink_domain_gpus)
    if lay.reason:
        return lay
    target, drafter, hw = s.target, s.drafter, s.hw
    lay.attention_dp = dp = s.attention_dp and tp > 1
    attn_tp = 1 if dp else tp          # attention DP: whole KV heads and attention weights on every rank
    lay.weights_bytes_per_gpu = weight_bytes(target, s.quant, tp, attn_tp)
    lay.drafter_bytes_per_gpu = weight_bytes(drafter, s.drafter_quant, tp, attn_tp) if drafter else 0
    lay.activation_bytes_per_gpu = activation_bytes(target, tp, s.max_num_tokens, s.logits_tokens)
    fixed = lay.weights_bytes_per_gpu + lay.drafter_bytes_per_gpu + lay.activation_bytes_per_gpu + lay.runtime_reserve_bytes
    full_layers = sum(w is None for w in s.windows)
    per_tok = (kv_bytes_per_token(target, s.kv, attn_tp, layers=full_layers)
               + (kv_bytes_per_token(drafter, s.kv, attn_tp) if drafter else 0))
    lay.kv_bytes_per_token_per_gpu = per_tok
    if fixed >= hw.reported_memory_bytes:
        lay.reason = (f"does not fit: weights {lay.weights_bytes_per_gpu / GIB:.1f} GiB + drafter "
                      f"{lay.drafter_bytes_per_gpu / GIB:.1f} GiB + activations {lay.activation_bytes_per_gpu / GIB:.1f} GiB "
                      f"+ runtime {lay.runtime_reserve_bytes / GIB:.1f} GiB per GPU > {hw.reported_memory_bytes / GIB:.1f} GiB "
                      f"of {hw.gpu}")
        return lay
    budget = int((hw.reported_memory_bytes - fixed) * s.kv_fraction)
    lay.kv_budget_bytes_per_gpu = budget
    # layers with a window hold at most window + block tokens of each sequence
    window = kv_bytes_per_token(target, s.kv, attn_tp, layers=1) * sum(w for w in s.windows if w is not None)
    per_seq = s.max_seq_len * per_tok + window
    ranks = tp if dp else 1            # attention DP: each rank holds its own sequences
    lay.kv_tokens = ranks * (budget // per_tok) if per_tok else 0
    lay.kv_sequences = ranks * (budget // per_seq) if per_seq else 0
    lay.max_batch_size = s.max_batch_size
    lay.max_sequences = ranks * min(lay.kv_sequences // ranks, s.max_batch_size)
    if lay.max_sequences < 1:
        lay.reason = (f"does not fit: one sequence of {s.max_seq_len} tokens needs {per_seq / GIB:.2f} GiB of KV per GPU, "
                      f"{budget / GIB:.2f} GiB left")
        return lay
    if s.drafter_cfg and s.drafter:
        # every rank holds the draft context of the max_batch_size requests it schedules
        b = draft_context_budget(max_batch=s.max_batch_size, max_seq_len=s.max_seq_len, drafter_cfg=s.drafter_cfg,
                                 gpu_memory_bytes=hw.reported_memory_bytes,
                                 weights_bytes_per_rank=lay.weights_bytes_per_gpu + lay.drafter_bytes_per_gpu,
                                 free_gpu_memory_fraction=s.kv_fraction)
        lay.draft_context_bytes_per_gpu, lay.draft_context_budget_bytes_per_gpu = b.buffer_bytes, b.budget_bytes
        if not b.fits and (s.batch_pinned or b.largest_batch < 1):
            lay.reason = (f"does not fit: {b.describe()}; TensorRT-LLM refuses it at start (max_batch_size "
                          f"{b.largest_batch} fits)")
            return lay
        if not b.fits:   # the layout runs with the largest max_batch_size whose draft context fits
            lay.max_batch_size = b.largest_batch
            lay.draft_context_bytes_per_gpu = b.largest_batch * b.per_request_bytes
            lay.max_sequences = ranks * min(lay.kv_sequences // ranks, b.largest_batch)
    lay.fits = True
    where = "one NVLink domain" if lay.within_nvlink_domain else "crosses NVLink domains"
    capped = f" (max_batch_size; the KV cache holds {lay.kv_sequences:,})" if lay.kv_sequences > lay.max_sequences else ""
    if lay.max_batch_size < s.max_batch_size:
        capped += (f"; max_batch_size {lay.max_batch_size} (not {s.max_batch_size}): the DFlash draft context "
                   f"{lay.draft_context_bytes_per_gpu / GIB:.1f} GiB per rank fits its budget "
                   f"{lay.draft_context_budget_bytes_per_gpu / GIB:.1f} GiB")
    elif lay.draft_context_bytes_per_gpu:
        capped += (f"; DFlash draft context {lay.draft_context_bytes_per_gpu / GIB:.1f} GiB per rank of "
                   f"{lay.draft_context_budget_bytes_per_gpu / GIB:.1f} GiB budget")
    where += ", attention DP" if dp else ""
    lay.reason = (f"fits: {budget / GIB:.1f} GiB KV per GPU, {lay.kv_tokens:,} tokens, {lay.max_sequences:,} "
                  f"sequences of {s.max_seq_len} per replica{capped}; {where}")
    return lay


def _split_error(s: Sizing, tp: int, ep: int) -> str:
    """Why the models cannot be split tp (and ep) ways; "" when they can."""
    if tp > s.gpus_per_node and tp % s.gpus_per_node:
        return f"tp {tp} spans nodes but is not a multiple of {s.gpus_per_node} GPUs per node"
    for m in filter(None, (s.target, s.drafter)):
        if m.heads % tp:
            return f"tp {tp} does not divide the {m.heads} attention heads of the {m.name}"
    if s.target.experts and s.target.experts % ep:
        return f"ep {ep} does not divide the {s.target.experts} experts"
    if s.target.experts and s.target.intermediate % (tp // ep):
        return f"moe tp {tp // ep} does not divide the expert intermediate size {s.target.intermediate}"
    return ""
