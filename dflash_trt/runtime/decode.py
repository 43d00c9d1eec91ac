"""The DFlash decode loop (docs/decode-loop.md) and its autoregressive baseline, in one file.

    prefill → [draft a block in one drafter pass → verify it in one target pass → accept a
    prefix + one bonus token → crop caches (a length) → inject accepted features] → ...

Greedy DFlash is token-identical to greedy AR; sampling uses speculative sampling, so the output
distribution is the target's. `mode="ar"` runs the same target code one token at a time.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import linear
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.kv_inject import fused_injector, reference_inject_contiguous
from dflash_trt.runtime.sampling import (
    SamplingParams,
    probs_from_logits,
    sample_token,
    sample_tokens,
    speculative_accept,
)


@dataclass
class GenerationResult:
    token_ids: list[int]
    tau: float | None
    blocks: int
    accepted_per_block: list[int]
    seconds: float
    tokens_per_s: float
    timings: dict = field(default_factory=dict)  # prefill / draft / verify / inject / bookkeeping seconds
    text: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class DrafterCache:
    """Static drafter KV cache: projected context K/V only (block K/V are never stored)."""

    def __init__(self, drafter: DFlashDrafter, max_len: int, fused_inject: bool = True):
        c = drafter.config
        dt = drafter.fc.weight.dtype
        self.k = torch.zeros(c.num_hidden_layers, c.num_key_value_heads, max_len, c.head_dim, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.drafter = drafter
        # built once per drafter (concatenated, transposed weights), looked up once per generate
        self.fused = fused_injector(drafter) if fused_inject else None

    def views(self):
        return [(self.k[i, :, :self.length], self.v[i, :, :self.length]) for i in range(self.k.shape[0])]

    def inject(self, features, start: int) -> None:
        """Write the K/V of the tokens at positions start.. from their target features; the
        cache then ends after them (a shorter write crops it: rejected drafts are never stored)."""
        T = features.shape[0]
        if self.fused is None:   # the per-layer reference
            reference_inject_contiguous(self.drafter, features, torch.arange(start, start + T), self.k, self.v, start)
        else:
            self.fused.inject_contiguous(features, torch.arange(start, start + T), self.k, self.v, start)
        self.length = start + T


@contextmanager
def timed(timings: dict, key: str):
    t0 = time.perf_counter()
    yield
    timings[key] += time.perf_counter() - t0


def prefill(target: TargetModel, prompt_ids: list[int], capture, sp: SamplingParams, gen) -> tuple[int, torch.Tensor]:
    """One target pass over the prompt: the first new token, and the prompt's features at `capture`."""
    logits, feats = target(torch.tensor(prompt_ids), 0, capture)
    return sample_token(logits[-1], sp, gen), feats


def ar_step(target: TargetModel, token: int, pos: int) -> torch.Tensor:
    """One target pass over one token at `pos`: the logits of the next one."""
    logits, _ = target(torch.tensor([token]), pos)
    return logits[-1]


def draft(target: TargetModel, drafter: DFlashDrafter, cache: DrafterCache, last_token: int, pos: int, b: int,
          sp: SamplingParams, gen):
    """One drafter pass over the block [last verified token, mask × (b-1)] at positions pos..pos+b-1.
    Returns the block to verify (drafts filled in), the drafts, and their distribution (sampling only)."""
    c = drafter.config
    block = torch.full((b,), c.mask_token_id, dtype=torch.long)
    block[0] = last_token
    emb = target.embed(block)
    if c.input_embedding_scale != 1.0:   # z-lab `_raw_input_embeddings(..., input_embedding_scale)`
        emb = emb * c.input_embedding_scale
    h = drafter.forward_cached(emb, torch.arange(pos, pos + b), cache.views())
    logits = drafter.scale_logits(draft_logits(target, drafter, h[1:]))
    if c.kind == "dflash2":
        drafts, q = select_candidates(drafter, h[1:], logits, last_token, sp, gen)
    else:
        drafts, q = sample_tokens(logits, sp, gen)
    block[1:] = drafts
    return block, drafts, q


def select_candidates(drafter: DFlashDrafter, h: torch.Tensor, logits: torch.Tensor, anchor: int,
                      sp: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash2's walk (z-lab dflash/model.py `CandidateSelector.select`; vLLM dflash2 speculator
    `_selector_walk_kernel`): position i picks among its top-k candidates by unary logit + the
    bilinear score against the token picked at i-1 (the anchor for i = 0): greedy the best, else
    one draw from softmax(scores / temperature). Returns the drafts and (sampling) q [T, V], the
    distribution each was drawn from (zero outside the candidates), for speculative acceptance."""
    sel = drafter.candidate_selector
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)
    q = None if sp.greedy else torch.zeros(logits.shape, dtype=torch.float64)
    drafts, prev = [], anchor
    for i in range(h.shape[0]):
        s = sel.scores(h, unary, cand, prev, i)
        if sp.greedy:
            j = int(s.float().argmax())
        else:
            qi = torch.softmax(s.double() / sp.temperature, dim=-1)
            j = int(torch.multinomial(qi, 1, generator=gen))
            q[i, cand[i]] = qi
        prev = int(cand[i, j])
        drafts.append(prev)
    return torch.tensor(drafts, dtype=torch.long), q


def draft_logits(target: TargetModel, drafter: DFlashDrafter, h: torch.Tensor) -> torch.Tensor:
    """The target's logits [T, V] for drafter states h [T, H]: over the drafter's draft vocabulary
    when it has one (every other token -inf; models/draft_vocab.py says why), else the whole one."""
    ids = drafter.draft_vocab
    if ids is None:
        return target.logits(h)
    w = target.lm_head_weight()
    head = drafter._draft_head
    if head is None or head[0] is not w or head[1] != w._version:
        head = drafter._draft_head = (w, w._version, w.detach()[ids].contiguous())   # rows of the draft tokens
    sub = linear(h, head[2])
    return torch.full((h.shape[0], w.shape[0]), float("-inf"), dtype=sub.dtype).index_copy_(1, ids, sub)


def verify(target: TargetModel, block: torch.Tensor, pos: int, capture):
    """One target pass over the block: logits at every position, and the features to inject."""
    return target(block, pos, capture, all_logits=True)


def accept(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sp: SamplingParams, gen) -> list[int]:
    """The accepted drafts plus one bonus token from the target. Greedy: the longest prefix the
    target agrees with; sampling: speculative sampling (the output distribution is the target's)."""
    if sp.greedy:
        tgt = logits.float().argmax(-1)
        n = int((drafts == tgt[:-1]).cumprod(0).sum())
        return drafts[:n].tolist() + [int(tgt[n])]
    return speculative_accept(drafts, q, probs_from_logits(logits, sp), gen)


@torch.no_grad()
def generate(target: TargetModel, drafter: DFlashDrafter | None, prompt_ids: list[int], *,
             max_new_tokens: int = 128, sampling: SamplingParams | None = None, seed: int = 0,
             block_size: int | None = None, mode: str = "dflash", stop_ids: list[int] = (),
             fused_inject: bool = True) -> GenerationResult:
    sp = sampling or SamplingParams()
    gen = torch.Generator().manual_seed(seed)
    stop = set(stop_ids)
    P = len(prompt_ids)
    B = block_size or (drafter.config.block_size if drafter is not None else 1)
    if mode not in ("ar", "dflash"):
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "dflash" and drafter is None:
        raise ValueError("mode='dflash' needs a drafter")
    max_len = P + max_new_tokens + B + 1
    target.setup_cache(max_len)
    t = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "inject": 0.0}
    t0 = time.perf_counter()
    capture = drafter.config.target_layer_ids if mode == "dflash" else ()
    with timed(t, "prefill"):
        first, feats = prefill(target, prompt_ids, capture, sp, gen)
    out, accepted = [first], []
    pos = P  # position of out[-1], the last verified token (not yet in the target cache)

    if mode == "ar":
        while len(out) < max_new_tokens and out[-1] not in stop:
            with timed(t, "verify"):
                logits = ar_step(target, out[-1], pos)
            out.append(sample_token(logits, sp, gen))
            pos += 1
    else:
        cache = DrafterCache(drafter, max_len, fused_inject)
        with timed(t, "inject"):
            cache.inject(feats, 0)
        while len(out) < max_new_tokens and out[-1] not in stop:
            b = min(B, max_new_tokens - len(out) + 1)  # never draft past the length limit
            with timed(t, "draft"):
                block, drafts, q = draft(target, drafter, cache, out[-1], pos, b, sp, gen)
            with timed(t, "verify"):
                logits, feats = verify(target, block, pos, capture)
            new = accept(drafts, q, logits, sp, gen)
            for tok in new:  # same stop / length rule as AR, token by token
                out.append(tok)
                if tok in stop or len(out) >= max_new_tokens:
                    break
            accepted.append(len(new))
            with timed(t, "inject"):
                cache.inject(feats[:len(new)], pos)  # last verified token + accepted drafts
            pos += len(new)

    secs = time.perf_counter() - t0
    t["bookkeeping"] = max(0.0, secs - sum(t.values()))
    tau = sum(accepted) / len(accepted) if accepted else None
    return GenerationResult(out, tau, len(accepted), accepted, secs, len(out) / secs if secs else 0.0, t)
