"""Training a DFlash drafter for a (small) target: the public recipe (docs/decode-loop.md).

    prompts ──target generates──▶ responses (JSONL) ──target forward──▶ feature shards on disk (bf16)
            ──▶ random anchors, masked blocks, per-anchor attention, decayed CE ──▶ z-lab drafter

The data (the target's own greedy answers) comes from train/data.py, its features from
train/features.py; this module holds the drafter's config and initial weights, the batches, the
loss, the τ estimate, the resumable state and the training loop, in one process or on every rank
of a torchrun job (train/distributed.py: each rank trains on its share of the global batch).

A block = [anchor token, MASK × (B-1)] at positions anchor..anchor+B-1 sees the context strictly
before its anchor and its own block (bidirectionally), never other blocks; slot k predicts the
token at anchor+k, weighted exp(-(k-1)/γ), as z-lab and SpecForge train it.

Labels (--labels): "data" takes each slot's label from the sequence itself, right when the data is
the target's own greedy answers; "teacher-forced" takes it from the target's top-1 prediction at
that position (train/data.py), so any text (train/corpus.py) is training data. A slot k >= 2 is
labelled only while the text between the anchor and it equals the target's greedy predictions:
then the label is exactly the token greedy decoding would emit there, and beyond that point the
target's prediction is conditioned on tokens the decode loop never sees. --distill topk:K adds
the KL divergence from the target's top-K distribution (renormalised) to the drafter's, beside the
CE on its argmax, both under the same slot decay.

Run folder (--out DIR): DIR/drafter (the z-lab checkpoint, bfloat16, rewritten at every save),
DIR/state (fp32 weights + AdamW moments as safetensors, step and RNG as JSON: what --resume
reads), DIR/features (the target's feature shards), DIR/log.jsonl (loss and τ per log step).
Under torchrun DIR must be on storage every rank sees; rank 0 alone writes into it.
"""
from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import DrafterConfig, default_target_layer_ids, drafter_identity
from dflash_trt.models.draft_vocab import FILE as DRAFT_VOCAB_FILE
from dflash_trt.models.draft_vocab import read_draft_vocab
from dflash_trt.models.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash_trt.runtime.pair import resolve_dtype
from dflash_trt.train.data import Sequences, is_prompt_only, load_sequences, prepare_data
from dflash_trt.train.distributed import World, close_world, init_world
from dflash_trt.train.features import label_sequences


# ------------------------------------------------------------------------------------ model
def choose_mask_token(tokenizer, used: torch.Tensor) -> int:
    """mask_token_id: the tokenizer's mask token if it has one; else the highest-id special
    (added) token that is not bos/eos/pad/unk and never occurs in the training data. For SmolLM2
    that is `<empty_output>` (16), a Jupyter-notebook marker unused in chat text."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    seen = set(used.unique().tolist())
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {}, reverse=True)
    for tid in added:
        if tid not in reserved and tid not in seen:
            return int(tid)
    raise DFlashError("no unused special token in the tokenizer to serve as mask_token_id; pass --mask-token-id")


def default_gamma(block_size: int) -> float:
    """Loss decay γ of the DFlash recipe: 7 for B=16, 5 for B=10, 4 for B=8 (linear in between)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


@dataclass
class TrainConfig:
    layers: int = 1
    block_size: int = 16
    intermediate_size: int | None = None      # default: the target's
    target_layer_ids: list[int] | None = None  # default: up to 5 layers evenly spaced in [1, L-3]
    mask_token_id: int | None = None
    steps: int = 2000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.0
    blocks_per_step: int = 32
    anchors_per_seq: int = 8
    gamma: float | None = None
    save_every: int = 200
    eval_every: int = 100
    log_every: int = 10                        # log.jsonl line interval (steps)
    train_dtype: str = "bfloat16"              # the drafter's matmuls: bf16 autocast, or float32 throughout
    eval_max_new_tokens: int = 128
    eval_max_seqs: int = 64                    # held-out sequences per τ estimate (16 proved too noisy: ±0.05)
    seed: int = 0
    init_from_target: bool = True
    init_from: str | None = None               # start from an existing drafter checkpoint (fine-tune)
    labels: str = "data"                       # "data" | "teacher-forced" (module docstring)
    distill_k: int = 0                         # > 0: KL to the target's top-k distribution beside the CE
    draft_vocab: str | None = None             # a draft_vocab.json: logits (and labels) over its tokens only


def drafter_config_for(target_cfg: dict, tc: TrainConfig, mask_token_id: int):
    L = target_cfg["num_hidden_layers"]
    ids = tc.target_layer_ids or sorted(set(default_target_layer_ids(L, max(1, min(5, L - 3)))))
    if any(not 0 <= i < L for i in ids):
        raise DFlashError(f"--target-layers {ids}: layer ids must lie in [0, {L - 1}] for this {L}-layer target")
    H = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    rope = target_cfg.get("rope_parameters") or {}
    d = {
        **drafter_identity(), "attention_bias": False, "attention_dropout": 0.0,
        "hidden_size": H, "intermediate_size": tc.intermediate_size or target_cfg["intermediate_size"],
        "num_hidden_layers": tc.layers, "num_attention_heads": heads,
        "num_key_value_heads": target_cfg.get("num_key_value_heads", heads),
        "head_dim": target_cfg.get("head_dim") or H // heads, "vocab_size": target_cfg["vocab_size"],
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", target_cfg.get("rope_theta", 10000.0)), "rope_scaling": None,
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096), "hidden_act": "silu",
        "tie_word_embeddings": False, "block_size": tc.block_size, "num_target_layers": L,
        "layer_types": ["full_attention"] * tc.layers,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in ids]},
    }
    return DrafterConfig.from_dict(d, "drafter config")


def init_from_target(drafter, target_state: dict, target_cfg: dict) -> list[str]:
    """Start from the target's LAST decoder layers (their output feeds the same final norm and
    lm_head the drafter's does), copying every tensor whose shape matches; a narrower MLP takes
    the first rows/columns of the target's (a structured slice). fc starts as the average of the
    tapped layers. Returns what was copied, for the model card."""
    copied = []
    L, n = target_cfg["num_hidden_layers"], drafter.config.num_hidden_layers
    own = drafter.state_dict()
    with torch.no_grad():
        for j in range(n):
            src = L - n + j
            for k in own:
                if not k.startswith(f"layers.{j}."):
                    continue
                tk = f"model.layers.{src}." + k[len(f"layers.{j}."):]
                if tk not in target_state:
                    continue
                t, o = target_state[tk], own[k]
                if t.shape == o.shape:
                    o.copy_(t)
                elif t.dim() == 2 and k.endswith(("gate_proj.weight", "up_proj.weight")) and t.shape[1] == o.shape[1]:
                    o.copy_(t[: o.shape[0]])
                elif t.dim() == 2 and k.endswith("down_proj.weight") and t.shape[0] == o.shape[0]:
                    o.copy_(t[:, : o.shape[1]])
                else:
                    continue
                copied.append(f"{k} <- {tk}")
        if "model.norm.weight" in target_state:
            own["norm.weight"].copy_(target_state["model.norm.weight"])
            copied.append("norm.weight <- model.norm.weight")
        H, nf = drafter.config.hidden_size, drafter.config.n_features
        own["fc.weight"].copy_(torch.eye(H).repeat(1, nf) / nf)
    return copied


def _init_from_drafter(drafter, folder: Path, target_dir: Path | None = None, target_cfg: dict | None = None
                       ) -> list[str]:
    """Continue from a trained drafter (e.g. one trained with another block size): its weights
    must fit this config; block_size and mask token may differ (neither is a weight). A deeper
    config grows it: the trained layers become the LAST ones (next to the final norm they were
    trained with) and each new layer in front starts as the target's layer at that depth with its
    o_proj and down_proj zeroed, so it adds nothing to the residual stream: the grown drafter
    computes exactly what the trained one did, and training only has to improve it."""
    src = load_drafter(folder, torch.float32)
    if src.config.target_layer_ids != drafter.config.target_layer_ids:
        raise DFlashError(f"--init-from {folder}: target_layer_ids {src.config.target_layer_ids} differ from "
                          f"{drafter.config.target_layer_ids}")
    n_src, n_dst = src.config.num_hidden_layers, drafter.config.num_hidden_layers
    if n_src > n_dst:
        raise DFlashError(f"--init-from {folder}: it has {n_src} layers, more than --layers {n_dst}")
    grow = n_dst - n_src
    notes = []
    if grow:
        if target_dir is not None:   # the new layers' inner weights: the target's at that depth
            L = target_cfg["num_hidden_layers"]
            new = tuple(f"model.layers.{L - n_dst + j}." for j in range(grow))
            notes = init_from_target(drafter, read_target_tensors(target_dir, lambda k: k.startswith(new)),
                                     target_cfg)
        with torch.no_grad():
            for j in range(grow):
                drafter.layers[j].self_attn.o_proj.weight.zero_()
                drafter.layers[j].mlp.down_proj.weight.zero_()
        notes.append(f"layers 0..{grow - 1}: new, o_proj and down_proj zeroed (identity at the start)")
    own = drafter.state_dict()
    moved = {}
    for k, v in src.state_dict().items():
        if k.startswith("layers."):
            i, rest = k[len("layers."):].split(".", 1)
            k = f"layers.{int(i) + grow}.{rest}"
        if k not in own or own[k].shape != v.shape:
            raise DFlashError(f"--init-from {folder}: tensor {k} does not fit this drafter config")
        moved[k] = v
    drafter.load_state_dict(moved, strict=not grow)
    meta = folder.parent / "state" / "state.json"
    earlier = read_json(meta).get("init", []) if meta.is_file() else []
    if grow:
        earlier = [f"(grown from {n_src} to {n_dst} layers: trained layers {grow}..{n_dst - 1} <- {folder})"] + notes \
            + earlier
    return earlier


def read_target_tensors(target_dir: Path, names_wanted) -> dict:
    """The target checkpoint's tensors whose names pass names_wanted, as float32."""
    with CheckpointReader(target_dir) as r:
        return {k: r.get(k).float() for k in r.keys() if names_wanted(k)}


# ------------------------------------------------------------------------------------ batches
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


def block_loss(drafter, frozen: FrozenTarget, batch: Batch, gamma: float) -> torch.Tensor:
    """Decayed CE on the labels (+ the KL to the target's top-K distribution when the batch has it);
    labels outside the draft vocabulary are dropped (the drafter can never propose them)."""
    total, weight = block_loss_terms(drafter, frozen, batch, gamma)
    return total / weight if weight > 0 else total


def block_loss_terms(drafter, frozen: FrozenTarget, batch: Batch, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """block_loss as (weighted sum, sum of weights): ranks add both up, so the loss of a batch split
    over ranks is the loss of the whole batch."""
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


# ------------------------------------------------------------------------------------ state
def _save_state(run_dir: Path, drafter, opt, step: int, tc: TrainConfig, rng: random.Random, extra: dict) -> None:
    """Resume state: weights (fp32) and AdamW moments as safetensors, the rest as JSON. No pickle."""
    with atomic_output_dir(run_dir / "state") as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()},
                  str(tmp / "model.safetensors"))
        names = {id(p): n for n, p in drafter.named_parameters()}
        moments, steps = {}, {}
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                if st:
                    n = names[id(p)]
                    moments[f"exp_avg.{n}"] = st["exp_avg"].cpu().contiguous()
                    moments[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].cpu().contiguous()
                    steps[n] = float(st["step"])
        save_file(moments or {"empty": torch.zeros(1)}, str(tmp / "optimizer.safetensors"))
        py_state = rng.getstate()
        (tmp / "state.json").write_text(json.dumps({
            "step": step, "train_config": asdict(tc), "drafter_config": drafter.config.to_dict(),
            "adam_steps": steps,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]], **extra,
        }, indent=1) + "\n")


def _load_state(run_dir: Path, drafter, opt) -> tuple[int, list, dict]:
    """The state _save_state wrote, whatever world size wrote it: it is the replicated state of
    data parallelism, the same on every rank, so any number of ranks each read all of it."""
    sdir = run_dir / "state"
    meta = read_json(sdir / "state.json")
    drafter.load_state_dict(load_file(str(sdir / "model.safetensors")))
    moments = load_file(str(sdir / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if n in meta["adam_steps"]:
            opt.state[p] = {"step": torch.tensor(meta["adam_steps"][n]), "exp_avg": moments[f"exp_avg.{n}"].to(p.device),
                            "exp_avg_sq": moments[f"exp_avg_sq.{n}"].to(p.device)}
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update(saved)
    return int(meta["step"]), meta["python_rng"], meta


# ------------------------------------------------------------------------------------ driver
CACHED_TOPK = 8
# Settings that make a run what it is: --resume takes them from the run's state, not the command line.
RUN_SETTINGS = ("layers", "block_size", "intermediate_size", "target_layer_ids", "mask_token_id",
                "blocks_per_step", "anchors_per_seq", "gamma", "seed", "init_from_target", "labels", "distill_k",
                "draft_vocab")


@dataclass
class Run:
    """One training session: what setup builds, then the progress that each step advances and
    each save records."""
    out_dir: Path
    world: World
    tc: TrainConfig
    data: Sequences
    eval_data: Sequences | None
    drafter: DFlashDrafter
    frozen: FrozenTarget
    opt: torch.optim.AdamW
    rng: random.Random           # draws the anchors; saved, so a resumed run draws what a straight one would
    gamma: float
    target_dtype: torch.dtype
    init_notes: list[str]        # how the weights started, for the model card
    drafter_files: dict[str, bytes]  # written beside every saved drafter (its draft_vocab.json)
    step: int = 0
    elapsed_before: float = 0.0  # training seconds of the sessions before this one (--resume)
    t_start: float = 0.0         # time.perf_counter() when this session started training
    tau: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    loss_ema: float | None = None
    saved_at: int = -1           # the step last saved (the final save may fall on a periodic one)
    slots_seen: int = 0          # labelled draft slots trained on so far (the learning curve's x axis)
    labelling: dict | None = None  # what this session's labelling pass did (train/features.py)

    def seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of tc.lr at tc.steps."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume and not (out_dir / "state" / "state.json").is_file():
        raise DFlashError(f"{out_dir}/state/state.json: nothing to resume (no checkpoint saved yet)")
    if not resume and (out_dir / "state").exists():
        raise DFlashError(f"{out_dir}: already holds a training run; pass --resume to continue it or choose another --out")


def _load_data(target_dir: Path, path: str | Path, answers_path: Path, tokenizer, max_new_tokens: int,
               progress: bool, dtype: torch.dtype, world: World, engine: str = "auto") -> Sequences:
    """Sequences of a data JSONL; a prompt-only one is answered by the target first (into
    answers_path), on rank 0 while the others wait (vLLM batches the whole set on its own)."""
    if world.main:
        prepare_data(target_dir, Path(path), answers_path, max_new_tokens, progress, dtype, engine)
    world.barrier("waiting for rank 0 to answer the prompts")
    return load_sequences(answers_path if is_prompt_only(Path(path)) else path, tokenizer)[0]


def _initial_weights(drafter, tc: TrainConfig, target_dir: Path, target_cfg: dict) -> list[str]:
    """A new run starts from a trained drafter (--init-from), or from the target's last layers,
    or from the seeded random init. Returns the notes for the model card."""
    if tc.init_from:
        return [f"all weights <- {tc.init_from}"] + _init_from_drafter(drafter, Path(tc.init_from), target_dir,
                                                                        target_cfg)
    if tc.init_from_target:
        want = lambda k: k.startswith("model.layers.") or k == "model.norm.weight"  # noqa: E731
        return init_from_target(drafter, read_target_tensors(target_dir, want), target_cfg)
    return []


def _setup(target_dir: Path, data_path: str | Path, out_dir: Path, tc: TrainConfig, *, eval_path, resume: bool,
           progress: bool, max_new_tokens: int, feature_cache, dtype: str, world: World, engine: str = "auto") -> Run:
    """Data and target features, the drafter and its optimizer; on --resume, the saved state."""
    from transformers import AutoTokenizer

    _check_out_dir(out_dir, resume)
    world.barrier("checking the run folder")   # nobody writes before every rank has looked at it
    if tc.blocks_per_step < world.size:
        raise DFlashError(f"--blocks-per-step {tc.blocks_per_step}: fewer blocks than the {world.size} ranks; each "
                          "rank needs at least one block per step")
    target_cfg = read_json(target_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if resume:  # the run's own settings win: a resumed run is the same run
        saved = read_json(out_dir / "state" / "state.json")["train_config"]
        for k in RUN_SETTINGS:
            setattr(tc, k, saved[k])

    target_dtype = resolve_dtype(dtype)
    data = _load_data(target_dir, data_path, out_dir / "data.jsonl", tokenizer, max_new_tokens, progress, target_dtype,
                      world, engine)
    if tc.mask_token_id is None:
        tc.mask_token_id = choose_mask_token(tokenizer, data.tokens)
    dcfg = drafter_config_for(target_cfg, tc, tc.mask_token_id)
    cache = Path(feature_cache) if feature_cache else out_dir / "features"
    # the cache keeps at least the top 8 whenever labels are needed (96 bytes a token beside 5.8 KB of
    # features), so runs with and without --distill share one labelling pass
    topk = max(tc.distill_k, CACHED_TOPK) if tc.labels == "teacher-forced" or tc.distill_k else 0
    labelling = label_sequences(target_dir, data, dcfg.target_layer_ids, cache, world, progress, target_dtype, topk)
    eval_data = None
    if eval_path is not None:
        eval_data = _load_data(target_dir, eval_path, out_dir / "eval_data.jsonl", tokenizer, max_new_tokens,
                               progress, target_dtype, world, engine)
        label_sequences(target_dir, eval_data, dcfg.target_layer_ids, cache, world, progress, target_dtype)

    torch.manual_seed(tc.seed)  # the drafter's random init
    longest = max(int((d.offsets[1:] - d.offsets[:-1]).max()) for d in (data, eval_data) if d is not None)
    drafter = DFlashDrafter(dcfg, max_len=longest + tc.block_size + 1)
    init_notes = [] if resume else _initial_weights(drafter, tc, target_dir, target_cfg)
    draft_vocab, drafter_files = None, {}
    if tc.draft_vocab:   # a drafter folder or its draft_vocab.json
        vocab_file = Path(tc.draft_vocab)
        vocab_file = vocab_file / DRAFT_VOCAB_FILE if vocab_file.is_dir() else vocab_file
        if vocab_file.name != DRAFT_VOCAB_FILE or not vocab_file.is_file():
            raise DFlashError(f"--draft-vocab {tc.draft_vocab}: no {DRAFT_VOCAB_FILE} there")
        draft_vocab = read_draft_vocab(vocab_file.parent, target_cfg["vocab_size"])
        # shipped with every saved drafter: the runtime then drafts from the vocabulary it was trained on
        drafter_files[DRAFT_VOCAB_FILE] = vocab_file.read_bytes()
    frozen = FrozenTarget(target_dir, target_cfg, draft_vocab, resolve_dtype(tc.train_dtype)).to(world.device)
    drafter.to(world.device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    # every rank draws the same anchors from one seeded RNG and trains on its share (split_picks)
    run = Run(out_dir, world, tc, data, eval_data, drafter, frozen, opt, random.Random(tc.seed),
              tc.gamma or default_gamma(tc.block_size), target_dtype, init_notes, drafter_files, labelling=labelling)
    if resume:
        run.step, py_rng, meta = _load_state(out_dir, drafter, opt)
        run.rng.setstate((py_rng[0], tuple(py_rng[1]), py_rng[2]))
        run.elapsed_before = float(meta.get("train_seconds", 0.0))
        run.init_notes, run.tau = meta.get("init", []), meta.get("tau")
        run.slots_seen = int(meta.get("slots_seen", 0))
    return run


def _train_step(run: Run) -> None:
    """One optimisation step: the scheduled lr, a batch of random anchors (this rank's share of
    it), the decayed CE, gradients summed over the ranks, AdamW."""
    tc, world = run.tc, run.world
    for g in run.opt.param_groups:
        g["lr"] = learning_rate(tc, run.step)
    picks = split_picks(sample_picks(run.data, run.rng, tc.blocks_per_step, tc.anchors_per_seq), world)
    batch = make_batch(run.data, picks, tc.block_size, tc.mask_token_id, tc.labels, tc.distill_k)
    total, weight = block_loss_terms(run.drafter, run.frozen, batch, run.gamma)
    # the loss of the global batch = (sum of the ranks' weighted sums) / (sum of their weights); each
    # rank's gradient of total / global weight, summed over the ranks, is that loss's gradient
    sums = torch.stack([weight.detach().double(), total.detach().double(),
                        (batch.labels >= 0).sum().double().to(weight.device)])
    sums = world.all_reduce(sums, f"the loss all-reduce of step {run.step + 1}")
    run.slots_seen += int(sums[2])
    run.opt.zero_grad(set_to_none=True)
    loss = total / sums[0].float() if sums[0] > 0 else total
    loss.backward()
    if world.distributed:
        _all_reduce_grads(run.drafter, world, run.step + 1)
    torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), 1.0)
    run.opt.step()
    run.step += 1
    run.last_loss = float(sums[1] / sums[0]) if sums[0] > 0 else 0.0
    run.first_loss = run.last_loss if run.first_loss is None else run.first_loss
    run.loss_ema = run.last_loss if run.loss_ema is None else 0.95 * run.loss_ema + 0.05 * run.last_loss


def _all_reduce_grads(drafter, world: World, step: int) -> None:
    """Sum every parameter's gradient over the ranks, as one flat buffer (one collective)."""
    params = list(drafter.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    world.all_reduce(flat, f"the gradient all-reduce of step {step}")
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p)
        i += n


def _held_out_tau(run: Run) -> float:
    run.drafter.eval()
    tau = estimate_tau(run.drafter, run.frozen, run.eval_data, run.tc.eval_max_new_tokens,
                       max_seqs=run.tc.eval_max_seqs, world=run.world)["tau"]
    run.drafter.train()
    return tau


def _save(run: Run) -> None:
    """Checkpoint (at most once per step): the resume state, then the z-lab drafter (bf16), with
    a fresh τ when there is held-out data."""
    if run.saved_at == run.step:
        return
    run.saved_at = run.step
    if run.eval_data is not None:
        run.tau = _held_out_tau(run)
    # the replicas must agree before one of them is written as the run's state
    run.world.check_replicas(list(run.drafter.parameters()), f"the drafter weights at step {run.step}")
    if run.world.main:
        _save_state(run.out_dir, run.drafter, run.opt, run.step, run.tc, run.rng,
                    {"train_seconds": run.seconds(), "tau": run.tau, "init": run.init_notes, "loss": run.last_loss,
                     "slots_seen": run.slots_seen, "world_size": run.world.size})
        drafter = run.drafter if run.world.device.type == "cpu" else copy.deepcopy(run.drafter).cpu()
        save_drafter(drafter, run.out_dir / "drafter", dtype=torch.bfloat16, extra_files=run.drafter_files)
    run.world.barrier(f"the checkpoint of step {run.step}")


def _log(run: Run) -> None:
    if not run.world.main:
        return
    with open(run.out_dir / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": run.step, "loss": run.last_loss, "loss_ema": run.loss_ema,
                            "lr": learning_rate(run.tc, run.step - 1), "tau": run.tau, "seconds": run.seconds(),
                            "slots_seen": run.slots_seen}) + "\n")


def train_drafter(target_dir: str | Path, data_path: str | Path, out_dir: str | Path, tc: TrainConfig, *,
                  eval_path: str | Path | None = None, resume: bool = False, progress: bool = True,
                  max_new_tokens: int = 192, threads: int | None = 2, time_limit_s: float | None = None,
                  stop_after: int | None = None, feature_cache: str | Path | None = None,
                  dtype: str = "auto", world: World | None = None, answer_engine: str = "auto") -> dict:
    """Train (or continue training) a DFlash drafter for the target; returns a summary dict.
    The z-lab checkpoint is written to out_dir/drafter at every save and at the end.
    time_limit_s / stop_after end this session early (after a save); --resume continues it.
    `dtype` is the target's, for its answers and features: "auto" is the runtime's default
    (bfloat16 on CPUs with native bf16), so the drafter learns the target it will run with;
    bf16 also computed features 2.2x faster than float32 here.
    `world`: the process group (train/distributed.py); by default the one torchrun describes in the
    environment, else one process."""
    if threads:
        torch.set_num_threads(threads)
    own_world = world is None
    world = world or init_world()
    try:
        return _train(Path(target_dir), data_path, Path(out_dir), tc, world, eval_path=eval_path, resume=resume,
                      progress=progress, max_new_tokens=max_new_tokens, time_limit_s=time_limit_s,
                      stop_after=stop_after, feature_cache=feature_cache, dtype=dtype, engine=answer_engine)
    finally:
        if own_world:
            close_world(world)


def _train(target_dir: Path, data_path, out_dir: Path, tc: TrainConfig, world: World, *, eval_path, resume: bool,
           progress: bool, max_new_tokens: int, time_limit_s, stop_after, feature_cache, dtype: str, engine: str
           ) -> dict:
    run = _setup(target_dir, data_path, out_dir, tc, eval_path=eval_path, resume=resume, progress=progress,
                 max_new_tokens=max_new_tokens, feature_cache=feature_cache, dtype=dtype, world=world, engine=engine)
    run.t_start = time.perf_counter()
    bar = tqdm(total=tc.steps, initial=run.step, desc="train-drafter" + (f" ({world.size} ranks)" if world.distributed
                                                                          else ""),
               unit="step", disable=not (progress and world.main), file=sys.stderr, dynamic_ncols=True)
    run.drafter.train()
    try:
        stopped_early = _loop(run, bar, time_limit_s, stop_after)
    finally:
        bar.close()   # an error line then starts on a line of its own
    _save(run)
    return _summary(run, stopped_early)


def _loop(run: Run, bar, time_limit_s, stop_after) -> bool:
    """Steps until tc.steps (or the time limit / stop_after: returns True then)."""
    tc, world = run.tc, run.world
    stopped_early = False
    while run.step < tc.steps:
        over = time_limit_s is not None and time.perf_counter() - run.t_start > time_limit_s
        if time_limit_s is not None and world.distributed:   # rank 0's clock decides for every rank
            flag = torch.tensor([float(over and world.main)], device=world.device)
            over = bool(world.all_reduce(flag, "the time-limit check") > 0)
        if over or (stop_after is not None and run.step >= stop_after):
            stopped_early = True
            break
        _train_step(run)
        step = run.step
        if run.eval_data is not None and tc.eval_every and step % tc.eval_every == 0 and step % tc.save_every:
            run.tau = _held_out_tau(run)  # a save estimates τ itself
        if tc.save_every and step % tc.save_every == 0:
            _save(run)
        bar.set_postfix(loss=f"{run.loss_ema:.3f}", tau="-" if run.tau is None else f"{run.tau:.2f}")
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            _log(run)
    return stopped_early


def _summary(run: Run, stopped_early: bool) -> dict:
    tc, cfg = run.tc, run.drafter.config
    return {"drafter": str(run.out_dir / "drafter"), "step": run.step, "steps": tc.steps,
            "first_loss": run.first_loss, "last_loss": run.last_loss, "tau_estimate": run.tau,
            "mask_token_id": tc.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
            "dtype": str(run.target_dtype).removeprefix("torch."),
            "block_size": tc.block_size, "layers": tc.layers, "intermediate_size": cfg.intermediate_size,
            "train_seconds": run.seconds(), "stopped_early": stopped_early, "slots_seen": run.slots_seen,
            "n_sequences": len(run.data), "n_tokens": int(run.data.offsets[-1]), "world_size": run.world.size,
            "labelled_here": run.labelling}
