"""What a training step learns from, and how well the drafter drafts: the batches (random anchors,
masked blocks, per-anchor attention), the loss over the target's frozen embeddings and lm_head, and
the offline τ estimate.

A block = [anchor token, MASK × (B-1)] at positions anchor..anchor+B-1 sees the context strictly
before its anchor and its own block (bidirectionally), never other blocks; slot k predicts the
token at anchor+k, weighted exp(-(k-1)/γ), as z-lab and SpecForge train it. Its label (--labels) is
the data's next token ("data": the data is the target's own greedy answers) or the target's top-1
("teacher-forced": any text), a slot k >= 2 labelled only while the text between the anchor and it is
the target's greedy path; --distill topk:K adds the KL to the target's top-K distribution
(docs/decode-loop.md, "Training recipe", says why each).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_trt.train.data import Sequences
from dflash_trt.train.distributed import World
from dflash_trt.train.initial import read_target_tensors


@dataclass
class Batch:
    features: torch.Tensor   # [Tc, n*H] context features of the packed sequences
    ctx_pos: torch.Tensor    # [Tc]
    block_tokens: torch.Tensor  # [N] anchor token then MASKs, per block
    q_pos: torch.Tensor      # [N]
    mask: torch.Tensor       # [N, Tc + N] bool
    labels: torch.Tensor     # [N] target token at each slot (-100: none / slot 0)
    slot: torch.Tensor       # [N] slot index k within the block
    soft_ids: torch.Tensor | None = None   # [N, K] the target's top-K tokens at each slot (distillation)
    soft_logp: torch.Tensor | None = None  # [N, K] their log-probabilities


def make_batch(data: Sequences, picks: list[tuple[int, list[int]]], B: int, mask_id: int,
               labels_from: str = "data", distill_k: int = 0) -> Batch:
    """picks: (sequence index, anchor positions). Context of each block = its sequence's
    features at positions < anchor; a block sees only itself among the blocks. labels_from and
    distill_k: the module docstring."""
    feats, cpos, cseq = [], [], []
    btok, qpos, qseq, qanchor, labels, slots, soft_rows = [], [], [], [], [], [], []
    teacher = labels_from == "teacher-forced"
    # context copies are told apart by pick, not by sequence: a sequence drawn twice in one batch is
    # two copies of its context, and a block must see only its own (duplicated keys would reweight
    # the softmax)
    for j, (s, anchors) in enumerate(picks):
        sl = data.seq(s)
        toks = data.tokens[sl]
        T = len(toks)
        if teacher or distill_k:
            top_ids = data.top_ids[sl]
        if teacher:
            top1 = top_ids[:, 0].long()
            # on_path[t]: the text's token t is the target's greedy choice after t-1
            on_path = torch.cat([torch.zeros(1, dtype=torch.bool), toks[1:] == top1[:-1]])
        if distill_k:
            top_logp = data.top_logp[sl]
        keep = max(anchors)  # context beyond the last anchor is never visible
        feats.append(data.features[sl.start:sl.start + keep])
        cpos.append(torch.arange(keep))
        cseq.append(torch.full((keep,), j))
        for a in anchors:
            k = torch.arange(B)
            btok.append(torch.where(k == 0, toks[a], torch.tensor(mask_id)))
            qpos.append(a + k)
            qseq.append(torch.full((B,), j))
            qanchor.append(torch.full((B,), a))
            lab = torch.full((B,), -100, dtype=torch.long)
            valid = (k >= 1) & (a + k < T)
            if teacher:   # slot k: the target's prediction at a+k-1, while a+1..a+k-1 are its own choices
                pos = (a + k - 1).clamp(max=T - 1)
                path = torch.cat([torch.ones(2, dtype=torch.bool), on_path[a + 1:a + B - 1]])
                path = torch.nn.functional.pad(path, (0, B - len(path)))
                valid &= path.cumprod(0).bool()
                lab[valid] = top1[pos[valid]]
            else:
                lab[valid] = toks[(a + k)[valid]]
            labels.append(lab)
            slots.append(k)
            if distill_k:
                rows = (a + k - 1).clamp(0, T - 1)
                soft_rows.append((top_ids[rows, :distill_k].long(), top_logp[rows, :distill_k].float()))
    features = torch.cat(feats)
    ctx_pos, ctx_seq = torch.cat(cpos), torch.cat(cseq)
    q_seq, q_anchor = torch.cat(qseq), torch.cat(qanchor)
    N = len(q_seq)
    block_id = torch.arange(N) // B
    ctx_mask = (ctx_seq[None, :] == q_seq[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    blk_mask = block_id[None, :] == block_id[:, None]
    batch = Batch(features, ctx_pos, torch.cat(btok), torch.cat(qpos), torch.cat([ctx_mask, blk_mask], 1),
                  torch.cat(labels), torch.cat(slots))
    if distill_k:
        batch.soft_ids = torch.cat([i for i, _ in soft_rows])
        batch.soft_logp = torch.cat([p for _, p in soft_rows])
    return batch


def sample_picks(data: Sequences, rng: random.Random, n_blocks: int, per_seq: int) -> list[tuple[int, list[int]]]:
    """Random anchors in the response part: an anchor a drafts tokens a+1.. from context < a."""
    picks, total = [], 0
    while total < n_blocks:
        s = rng.randrange(len(data))
        P, T = int(data.prompt_lens[s]), int(data.offsets[s + 1] - data.offsets[s])
        cands = list(range(max(P, 1), T - 1))
        if not cands:
            continue
        k = min(per_seq, len(cands), n_blocks - total)
        picks.append((s, sorted(rng.sample(cands, k))))
        total += k
    return picks


def split_picks(picks: list[tuple[int, list[int]]], world: World) -> list[tuple[int, list[int]]]:
    """This rank's share of a global batch: every rank draws the same picks (one seeded RNG), the
    blocks in draw order are cut into world.size contiguous runs, rank r takes run r. The union is
    the one-process batch, so --blocks-per-step is the global batch at any world size."""
    if not world.distributed:
        return picks
    blocks = [(s, a) for s, anchors in picks for a in anchors]
    n = len(blocks)
    mine = blocks[world.rank * n // world.size:(world.rank + 1) * n // world.size]
    out = []
    for s, a in mine:
        if out and out[-1][0] == s:
            out[-1][1].append(a)
        else:
            out.append((s, [a]))
    return out


class FrozenTarget:
    """The target's embeddings and lm_head (frozen; the drafter has none of its own). With a draft
    vocabulary the lm_head keeps only its rows: the logits are over the tokens the drafter may
    propose at decode time (models/draft_vocab.py), and the lm_head, half a step's cost, shrinks by
    the vocabulary ratio."""

    def __init__(self, target_dir: Path, target_cfg: dict, draft_vocab: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16):
        tied = bool(target_cfg.get("tie_word_embeddings", False))
        st = read_target_tensors(target_dir, lambda k: k in ("model.embed_tokens.weight", "lm_head.weight"))
        self.embed = st["model.embed_tokens.weight"]
        head = st["model.embed_tokens.weight"] if tied or "lm_head.weight" not in st else st["lm_head.weight"]
        self.vocab = draft_vocab   # None: the whole vocabulary
        # index of each token in the logits (-1: not draftable)
        self.column = torch.arange(len(head)) if draft_vocab is None else \
            torch.full((len(head),), -1, dtype=torch.long).index_put_((draft_vocab,), torch.arange(len(draft_vocab)))
        # bf16 copy for the big matmul: AMX/AVX512-bf16 CPUs run it several times faster. compute_dtype
        # float32 (--train-dtype) runs the drafter's matmuls without autocast too
        self.lm_head = (head if draft_vocab is None else head[draft_vocab]).to(compute_dtype)

    @property
    def autocast(self) -> bool:
        return self.lm_head.dtype == torch.bfloat16

    def to(self, device: torch.device) -> FrozenTarget:
        """The embeddings and lm_head on the drafter's device (the column map stays on the CPU, with the labels)."""
        self.embed, self.lm_head = self.embed.to(device), self.lm_head.to(device)
        if self.vocab is not None:
            self.vocab = self.vocab.to(device)
        return self

    def token(self, column: torch.Tensor) -> torch.Tensor:
        return column if self.vocab is None else self.vocab[column]


def default_gamma(block_size: int) -> float:
    """Loss decay γ of the DFlash recipe: 7 for B=16, 5 for B=10, 4 for B=8 (linear in between)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


def block_loss_terms(drafter, frozen: FrozenTarget, batch: Batch, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed CE on the labels (+ the KL to the target's top-K distribution when the batch has it; labels
    outside the draft vocabulary dropped: the drafter can never propose them) as (weighted sum, sum of weights):
    ranks add both up, so the loss of a batch split over ranks is the loss of the whole batch."""
    dev = frozen.embed.device
    sel = batch.labels >= 0
    cols = frozen.column[batch.labels.clamp(min=0)]
    sel &= cols >= 0
    if not sel.any():   # nothing labelled in this share: a zero that backward takes
        return drafter.fc.weight.sum() * 0.0, torch.zeros((), device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=frozen.autocast):
        ctx = drafter.project_context(batch.features.to(dev).float())
        h = drafter(frozen.embed[batch.block_tokens.to(dev)], batch.q_pos.to(dev), ctx, batch.ctx_pos.to(dev),
                    batch.mask.to(dev))
        logits = F.linear(h[sel.to(dev)], frozen.lm_head)
    logq = torch.log_softmax(logits.float(), -1)   # bf16 logits: 2x less traffic; the loss in float32
    loss = -logq.gather(1, cols[sel, None].to(dev))[:, 0]
    if batch.soft_ids is not None:
        scols = frozen.column[batch.soft_ids[sel]].to(dev)
        logp = batch.soft_logp[sel].to(dev).masked_fill(scols < 0, float("-inf"))
        # the top-K renormalised over the draftable tokens; a row with none of them (possible with
        # --labels data) has no distribution to match: 0/0 there becomes p = 0, no KL
        p = torch.softmax(logp, -1).nan_to_num(0.0)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - logq.gather(1, scols.clamp(min=0)))).sum(-1)
        loss = loss + kl
    w = torch.exp(-(batch.slot[sel].float() - 1) / gamma).to(dev)
    return (loss * w).sum(), w.sum()


@torch.no_grad()
def estimate_tau(drafter, frozen: FrozenTarget, data: Sequences, max_new_tokens: int = 128,
                 block_size: int | None = None, max_seqs: int = 16, world: World | None = None) -> dict:
    """τ of greedy DFlash decoding on held-out target responses, simulated offline: the data is
    the target's own greedy output, so a draft slot is accepted iff it equals the next token of
    the response. Walks each response as the decode loop does (anchor → accept m → next anchor
    at +m+1), all sequences in lockstep, one block each per drafter pass. The context K/V are
    projected once (as the drafter cache holds them); the mask hides what lies past each anchor.
    With a world of several ranks each walks its share of the sequences and the histogram is summed."""
    world = world or World()
    dev = frozen.embed.device
    B = block_size or drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    n = min(len(data), max_seqs)
    mine = list(range(world.rank, n, world.size))
    plen = {i: int(data.prompt_lens[i]) for i in mine}
    ends = {i: min(data.seq(i).stop - data.seq(i).start, plen[i] + max_new_tokens) for i in mine}
    accepted = []
    anchors = {i: plen[i] for i in mine if ends[i] - plen[i] >= 2}
    if anchors:
        feats = torch.cat([data.features[data.seq(i).start:data.seq(i).start + ends[i]] for i in mine])
        ctx_pos = torch.cat([torch.arange(ends[i]) for i in mine])
        ctx_seq = torch.cat([torch.full((ends[i],), i) for i in mine])
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=frozen.autocast):
            ctx_kv = drafter.context_kv(drafter.project_context(feats.to(dev).float()), ctx_pos.to(dev))
    k = torch.arange(B)
    while anchors:
        rows = list(anchors.items())
        seq_ids = torch.tensor([i for i, _ in rows]).repeat_interleave(B)
        anc = torch.tensor([a for _, a in rows]).repeat_interleave(B)
        toks = [data.tokens[data.seq(i)] for i, _ in rows]
        block = torch.full((len(rows), B), mask_id)
        block[:, 0] = torch.stack([t[a] for t, (_, a) in zip(toks, rows)])
        q_pos = anc + k.repeat(len(rows))
        blk = torch.arange(len(rows) * B) // B
        mask = torch.cat([(ctx_seq[None, :] == seq_ids[:, None]) & (ctx_pos[None, :] < anc[:, None]),
                          blk[None, :] == blk[:, None]], 1)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=frozen.autocast):
            h = drafter.forward_cached(frozen.embed[block.view(-1).to(dev)], q_pos.to(dev), ctx_kv, mask.to(dev))
            pred = frozen.token(F.linear(h, frozen.lm_head).argmax(-1)).view(-1, B).cpu()
        nxt = {}
        for r, ((i, a), t) in enumerate(zip(rows, toks)):
            m = 0
            while m < min(B - 1, ends[i] - a - 1) and int(pred[r, m + 1]) == int(t[a + m + 1]):
                m += 1
            accepted.append(m)
            if a + m + 1 < ends[i] - 1:
                nxt[i] = a + m + 1
        anchors = nxt
    hist = torch.bincount(torch.tensor(accepted, dtype=torch.long), minlength=B).to(torch.float64)
    hist = world.all_reduce(hist.to(dev), "the tau estimate").cpu()
    blocks = float(hist.sum())
    return {"tau": float((hist * torch.arange(B)).sum() / blocks + 1) if blocks else float("nan"),
            "blocks": int(blocks), "histogram": hist.long().tolist()}


