"""Training a DFlash drafter for a (small) target: the public recipe (DESIGN.md §4).

    prompts ──target generates──▶ responses (JSONL) ──target forward──▶ cached features (bf16)
            ──▶ random anchors, masked blocks, per-anchor attention, decayed CE ──▶ z-lab drafter

Data: the target's own (greedy) answers, so the labels are exactly the tokens the target emits at
decode time. The target is frozen, so its hidden states at the chosen layers are computed once and
cached on disk; a training step then only runs the drafter and the (frozen) lm_head.

A block = [anchor token, MASK × (B-1)] at positions anchor..anchor+B-1 sees the context strictly
before its anchor and its own block (bidirectionally), never other blocks; slot k predicts the
token at anchor+k, weighted exp(-(k-1)/γ), as z-lab and SpecForge train it.

Run folder (--out DIR): DIR/drafter (the z-lab checkpoint, bfloat16, rewritten at every save),
DIR/state (fp32 weights + AdamW moments as safetensors, step and RNG as JSON: what --resume
reads), DIR/features (the cached target features), DIR/log.jsonl (loss and τ per log step).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
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
from dflash_trt.io.jsonio import read_json, read_jsonl
from dflash_trt.models.config import DrafterConfig, default_target_layer_ids
from dflash_trt.models.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash_trt.models.target import load_target
from dflash_trt.runtime.pair import encode_prompt, resolve_dtype
from dflash_trt.train.prompts import read_prompts


# ------------------------------------------------------------------------------------ data
def generate_responses(target_dir: str | Path, prompts: list[str], out_path: str | Path, *,
                       max_new_tokens: int = 192, batch_size: int = 16, progress: bool = True,
                       threads: int | None = None, dtype: str = "auto") -> Path:
    """Answer each prompt with the target (greedy, chat template) and append rows
    `{"prompt", "prompt_ids", "output_ids"}` to out_path. Resumable: prompts already in the file
    are skipped. Uses transformers' batched generate (left padding): this is data, not the product.
    dtype "auto" is the runtime's default (bfloat16 where the CPU has native bf16): the answers
    are then the ones the deployed target gives, and batched bf16 generate ran 2x faster than
    float32 here (0.98 vs 0.50 prompts/s per core at batch 48)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    out_path = Path(out_path)
    done = {r["prompt"] for r in read_jsonl(out_path)} if out_path.exists() else set()
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    if not todo:
        return out_path
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=resolve_dtype(dtype)).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    encoded = sorted(((p, encode_prompt(tok, p)) for p in todo), key=lambda x: len(x[1]))  # less padding
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(0).shuffle(batches)  # a mix of lengths early, so the progress rate is honest
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="generating responses", unit="prompt", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with open(out_path, "a") as f, torch.no_grad():
        for batch in batches:
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            gen = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            for (prompt, ids), row in zip(batch, gen[:, width:].tolist()):
                row = _strip_after_eos(row, eos)
                f.write(json.dumps({"prompt": prompt, "prompt_ids": ids, "output_ids": row}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return out_path


def _strip_after_eos(row: list[int], eos) -> list[int]:
    stops = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(row):
        if t in stops:
            return row[: i + 1]  # keep the end token: drafting it is part of decoding
    return row


@dataclass
class Sequences:
    """Token sequences (prompt + target response) with the target's features, packed flat."""
    tokens: torch.Tensor       # [N_tok] int64
    offsets: torch.Tensor      # [n_seq + 1] int64: sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens: torch.Tensor  # [n_seq] int64
    features: torch.Tensor | None = None  # [N_tok, n_feat * H] bfloat16

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def load_sequences(path: str | Path, tokenizer=None) -> tuple[Sequences, list[str]]:
    """A data JSONL: rows with `prompt_ids` + `output_ids` (as generate_responses writes), or with
    text `prompt` + `response` (tokenized with the chat template; needs the tokenizer)."""
    rows = read_jsonl(path)
    toks, plens, prompts = [], [], []
    for i, r in enumerate(rows, 1):
        if "prompt_ids" in r and "output_ids" in r:
            p, o = list(r["prompt_ids"]), list(r["output_ids"])
        elif "prompt" in r and "response" in r:
            if tokenizer is None:
                raise DFlashError(f"{path}: text rows need the target's tokenizer")
            p = encode_prompt(tokenizer, r["prompt"])
            o = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
        else:
            raise DFlashError(f"{path}: row {i} has neither prompt_ids/output_ids nor prompt/response")
        if len(o) < 2:
            continue  # nothing to draft
        toks.append(torch.tensor(p + o, dtype=torch.long))
        plens.append(len(p))
        prompts.append(r.get("prompt", ""))
    if not toks:
        raise DFlashError(f"{path}: no usable sequences (each needs at least 2 response tokens)")
    lens = torch.tensor([len(t) for t in toks])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return Sequences(torch.cat(toks), offsets, torch.tensor(plens)), prompts


def target_features(target_dir: str | Path, data: Sequences, layer_ids: list[int], cache_dir: Path,
                    progress: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Features [N_tok, n*H] (bf16) of the captured target layers over every sequence, computed
    with our target runtime in `dtype` (the same code that captures them at decode time). Cached
    per sequence (keyed by its tokens, the layers, the dtype and the target's config), so data
    that grows, as a resumed generation does, only costs the new sequences."""
    cfg_text = (Path(target_dir) / "config.json").read_text()
    salt = hashlib.sha256(json.dumps([layer_ids, cfg_text, str(dtype)]).encode()).hexdigest()[:12]
    folder = cache_dir / f"layers-{salt}"
    folder.mkdir(parents=True, exist_ok=True)
    keys = [hashlib.sha256(data.tokens[data.seq(i)].numpy().tobytes()).hexdigest()[:24] for i in range(len(data))]
    todo = [i for i, k in enumerate(keys) if not (folder / f"{k}.safetensors").is_file()]
    if todo:
        target = load_target(target_dir, dtype=dtype)
        target.setup_cache(max(data.seq(i).stop - data.seq(i).start for i in todo) + 1)
        for i in tqdm(todo, desc="target features", unit="seq", disable=not progress, file=sys.stderr,
                      dynamic_ncols=True):
            if (folder / f"{keys[i]}.safetensors").is_file():
                continue   # another process sharing the cache computed it meanwhile
            _, feats = target(data.tokens[data.seq(i)], 0, capture=layer_ids)
            tmp = folder / f".{keys[i]}.{os.getpid()}.tmp"
            save_file({"features": feats.to(torch.bfloat16).contiguous()}, str(tmp))
            os.replace(tmp, folder / f"{keys[i]}.safetensors")
    return torch.cat([load_file(str(folder / f"{k}.safetensors"))["features"] for k in keys])


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


# ------------------------------------------------------------------------------------ model
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
    eval_max_new_tokens: int = 128
    seed: int = 0
    init_from_target: bool = True
    init_from: str | None = None               # start from an existing drafter checkpoint (fine-tune)


def drafter_config_for(target_cfg: dict, tc: TrainConfig, mask_token_id: int):
    L = target_cfg["num_hidden_layers"]
    ids = tc.target_layer_ids or sorted(set(default_target_layer_ids(L, max(1, min(5, L - 3)))))
    if any(not 0 <= i < L for i in ids):
        raise DFlashError(f"--target-layers {ids}: layer ids must lie in [0, {L - 1}] for this {L}-layer target")
    H = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    rope = target_cfg.get("rope_parameters") or {}
    d = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
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


def _init_from_drafter(drafter, folder: Path) -> list[str]:
    """Continue from a trained drafter (e.g. one trained with another block size): its weights
    must fit this config; block_size and mask token may differ (neither is a weight)."""
    src = load_drafter(folder, torch.float32)
    if src.config.target_layer_ids != drafter.config.target_layer_ids:
        raise DFlashError(f"--init-from {folder}: target_layer_ids {src.config.target_layer_ids} differ from "
                          f"{drafter.config.target_layer_ids}")
    own = drafter.state_dict()
    for k, v in src.state_dict().items():
        if k not in own or own[k].shape != v.shape:
            raise DFlashError(f"--init-from {folder}: tensor {k} does not fit this drafter config")
    drafter.load_state_dict(src.state_dict())
    meta = folder.parent / "state" / "state.json"
    return json.loads(meta.read_text()).get("init", []) if meta.is_file() else []


def _read_target_tensors(target_dir: Path, names_wanted) -> dict:
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


def make_batch(data: Sequences, picks: list[tuple[int, list[int]]], B: int, mask_id: int) -> Batch:
    """picks: (sequence index, anchor positions). Context of each block = its sequence's
    features at positions < anchor; a block sees only itself among the blocks."""
    feats, cpos, cseq = [], [], []
    btok, qpos, qseq, qanchor, labels, slots = [], [], [], [], [], []
    for s, anchors in picks:
        sl = data.seq(s)
        toks = data.tokens[sl]
        T = len(toks)
        keep = max(anchors)  # context beyond the last anchor is never visible
        feats.append(data.features[sl][:keep])
        cpos.append(torch.arange(keep))
        cseq.append(torch.full((keep,), s))
        for a in anchors:
            k = torch.arange(B)
            btok.append(torch.where(k == 0, toks[a], torch.tensor(mask_id)))
            qpos.append(a + k)
            qseq.append(torch.full((B,), s))
            qanchor.append(torch.full((B,), a))
            lab = torch.full((B,), -100, dtype=torch.long)
            valid = (k >= 1) & (a + k < T)
            lab[valid] = toks[(a + k)[valid]]
            labels.append(lab)
            slots.append(k)
    features = torch.cat(feats)
    ctx_pos, ctx_seq = torch.cat(cpos), torch.cat(cseq)
    q_seq, q_anchor = torch.cat(qseq), torch.cat(qanchor)
    N = len(q_seq)
    block_id = torch.arange(N) // B
    ctx_mask = (ctx_seq[None, :] == q_seq[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    blk_mask = block_id[None, :] == block_id[:, None]
    return Batch(features, ctx_pos, torch.cat(btok), torch.cat(qpos), torch.cat([ctx_mask, blk_mask], 1),
                 torch.cat(labels), torch.cat(slots))


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


class FrozenTarget:
    """The target's embeddings and lm_head (frozen; the drafter has none of its own)."""

    def __init__(self, target_dir: Path, target_cfg: dict):
        tied = bool(target_cfg.get("tie_word_embeddings", False))
        st = _read_target_tensors(target_dir, lambda k: k in ("model.embed_tokens.weight", "lm_head.weight"))
        self.embed = st["model.embed_tokens.weight"]
        # bf16 copy for the big matmul: AMX/AVX512-bf16 CPUs run it several times faster.
        self.lm_head = (st["model.embed_tokens.weight"] if tied or "lm_head.weight" not in st
                        else st["lm_head.weight"]).to(torch.bfloat16)


def block_loss(drafter, frozen: FrozenTarget, batch: Batch, gamma: float) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = drafter.project_context(batch.features.float())
        h = drafter(frozen.embed[batch.block_tokens], batch.q_pos, ctx, batch.ctx_pos, batch.mask)
        sel = batch.labels >= 0
        logits = F.linear(h[sel], frozen.lm_head)
    ce = F.cross_entropy(logits, batch.labels[sel], reduction="none").float()  # bf16 logits: 2x less traffic
    w = torch.exp(-(batch.slot[sel].float() - 1) / gamma)
    return (ce * w).sum() / w.sum()


@torch.no_grad()
def estimate_tau(drafter, frozen: FrozenTarget, data: Sequences, max_new_tokens: int = 128,
                 block_size: int | None = None, max_seqs: int = 16) -> dict:
    """τ of greedy DFlash decoding on held-out target responses, simulated offline: the data is
    the target's own greedy output, so a draft slot is accepted iff it equals the next token of
    the response. Walks each response as the decode loop does (anchor → accept m → next anchor
    at +m+1), all sequences in lockstep, one block each per drafter pass. The context K/V are
    projected once (as the drafter cache holds them); the mask hides what lies past each anchor."""
    B = block_size or drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    n = min(len(data), max_seqs)
    plen = [int(data.prompt_lens[i]) for i in range(n)]
    ends = [min(data.seq(i).stop - data.seq(i).start, plen[i] + max_new_tokens) for i in range(n)]
    feats = torch.cat([data.features[data.seq(i)][: ends[i]] for i in range(n)])
    ctx_pos = torch.cat([torch.arange(ends[i]) for i in range(n)])
    ctx_seq = torch.cat([torch.full((ends[i],), i) for i in range(n)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx_kv = drafter.context_kv(drafter.project_context(feats.float()), ctx_pos)
    anchors = {i: plen[i] for i in range(n) if ends[i] - plen[i] >= 2}
    accepted = []
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
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = drafter.forward_cached(frozen.embed[block.view(-1)], q_pos, ctx_kv, mask)
            pred = F.linear(h, frozen.lm_head).argmax(-1).view(-1, B)
        nxt = {}
        for r, ((i, a), t) in enumerate(zip(rows, toks)):
            m = 0
            while m < min(B - 1, ends[i] - a - 1) and int(pred[r, m + 1]) == int(t[a + m + 1]):
                m += 1
            accepted.append(m)
            if a + m + 1 < ends[i] - 1:
                nxt[i] = a + m + 1
        anchors = nxt
    acc = torch.tensor(accepted, dtype=torch.float)
    return {"tau": float(acc.mean() + 1) if len(acc) else float("nan"), "blocks": len(accepted),
            "histogram": torch.bincount(acc.long(), minlength=B).tolist()}


# ------------------------------------------------------------------------------------ state
def _save_state(run_dir: Path, drafter, opt, step: int, tc: TrainConfig, rng: random.Random, extra: dict) -> None:
    """Resume state: weights (fp32) and AdamW moments as safetensors, the rest as JSON. No pickle."""
    with atomic_output_dir(run_dir / "state") as tmp:
        _write_state(tmp, drafter, opt, step, tc, rng, extra)


def _write_state(tmp: Path, drafter, opt, step: int, tc: TrainConfig, rng: random.Random, extra: dict) -> None:
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in drafter.named_parameters()}
    moments, steps = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                moments[f"exp_avg.{n}"] = st["exp_avg"].contiguous()
                moments[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].contiguous()
                steps[n] = float(st["step"])
    save_file(moments or {"empty": torch.zeros(1)}, str(tmp / "optimizer.safetensors"))
    py_state = rng.getstate()
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "train_config": asdict(tc), "drafter_config": drafter.config.to_dict(),
        "adam_steps": steps, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]], **extra,
    }, indent=1) + "\n")


def _load_state(run_dir: Path, drafter, opt) -> tuple[int, list, dict]:
    sdir = run_dir / "state"
    meta = json.loads((sdir / "state.json").read_text())
    drafter.load_state_dict(load_file(str(sdir / "model.safetensors")))
    moments = load_file(str(sdir / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if n in meta["adam_steps"]:
            opt.state[p] = {"step": torch.tensor(meta["adam_steps"][n]), "exp_avg": moments[f"exp_avg.{n}"],
                            "exp_avg_sq": moments[f"exp_avg_sq.{n}"]}
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update(saved)
    return int(meta["step"]), meta["python_rng"], meta


# ------------------------------------------------------------------------------------ driver
def _is_prompt_only(path: Path) -> bool:
    rows = read_jsonl(path)
    return bool(rows) and all("prompt" in r and "output_ids" not in r and "response" not in r for r in rows)


def prepare_data(target_dir: Path, path: Path, out_path: Path, max_new_tokens: int, progress: bool,
                 dtype: torch.dtype = torch.float32) -> Path:
    """A prompt-only JSONL is answered by the target first (resumable, into out_path)."""
    if _is_prompt_only(path):
        return generate_responses(target_dir, read_prompts(path), out_path, max_new_tokens=max_new_tokens,
                                  progress=progress, dtype=dtype)
    return path


def train_drafter(target_dir: str | Path, data_path: str | Path, out_dir: str | Path, tc: TrainConfig, *,
                  eval_path: str | Path | None = None, resume: bool = False, progress: bool = True,
                  max_new_tokens: int = 192, threads: int | None = 2, time_limit_s: float | None = None,
                  stop_after: int | None = None, feature_cache: str | Path | None = None,
                  dtype: str = "auto") -> dict:
    """Train (or continue training) a DFlash drafter for the target; returns a summary dict.
    The z-lab checkpoint is written to out_dir/drafter at every save and at the end.
    time_limit_s / stop_after end this session early (after a save); --resume continues it.
    `dtype` is the target's, for its answers and features: "auto" is the runtime's default
    (bfloat16 on CPUs with native bf16), so the drafter learns the target it will run with;
    bf16 also computed features 2.2x faster than float32 here."""
    from transformers import AutoTokenizer


    if threads:
        torch.set_num_threads(threads)
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume and not (out_dir / "state" / "state.json").is_file():
        raise DFlashError(f"{out_dir}/state/state.json: nothing to resume (no checkpoint saved yet)")
    if not resume and (out_dir / "state").exists():
        raise DFlashError(f"{out_dir}: already holds a training run; pass --resume to continue it or choose another --out")
    target_cfg = read_json(target_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))

    meta = {}
    if resume:  # the run's own settings win: a resumed run is the same run
        meta = json.loads((out_dir / "state" / "state.json").read_text())
        saved = meta["train_config"]
        for k in ("layers", "block_size", "intermediate_size", "target_layer_ids", "mask_token_id",
                  "blocks_per_step", "anchors_per_seq", "gamma", "seed", "init_from_target"):
            setattr(tc, k, saved[k])

    target_dtype = resolve_dtype(dtype)
    data_path = prepare_data(target_dir, Path(data_path), out_dir / "data.jsonl", max_new_tokens, progress,
                             target_dtype)
    data, _ = load_sequences(data_path, tokenizer)
    mask_id = tc.mask_token_id if tc.mask_token_id is not None else choose_mask_token(tokenizer, data.tokens)
    tc.mask_token_id = mask_id
    dcfg = drafter_config_for(target_cfg, tc, mask_id)
    ids = dcfg.target_layer_ids
    cache = Path(feature_cache) if feature_cache else out_dir / "features"
    data.features = target_features(target_dir, data, ids, cache, progress, target_dtype)

    eval_data = None
    if eval_path is not None:
        eval_path = prepare_data(target_dir, Path(eval_path), out_dir / "eval_data.jsonl", max_new_tokens, progress,
                                 target_dtype)
        eval_data, _ = load_sequences(eval_path, tokenizer)
        eval_data.features = target_features(target_dir, eval_data, ids, cache, progress, target_dtype)

    torch.manual_seed(tc.seed)
    max_len = int((data.offsets[1:] - data.offsets[:-1]).max()) + tc.block_size + 1
    if eval_data is not None:
        max_len = max(max_len, int((eval_data.offsets[1:] - eval_data.offsets[:-1]).max()) + tc.block_size + 1)
    drafter = DFlashDrafter(dcfg, max_len=max_len)
    init_notes = []
    if tc.init_from and not resume:
        init_notes = [f"all weights <- {tc.init_from}"] + _init_from_drafter(drafter, Path(tc.init_from))
    elif tc.init_from_target and not resume:
        want = lambda k: k.startswith("model.layers.") or k == "model.norm.weight"  # noqa: E731
        init_notes = init_from_target(drafter, _read_target_tensors(target_dir, want), target_cfg)
    frozen = FrozenTarget(target_dir, target_cfg)
    gamma = tc.gamma or default_gamma(tc.block_size)
    opt = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    rng = random.Random(tc.seed)
    step, elapsed_before = 0, 0.0
    if resume:
        step, py_rng, meta = _load_state(out_dir, drafter, opt)
        rng.setstate((py_rng[0], tuple(py_rng[1]), py_rng[2]))
        elapsed_before = float(meta.get("train_seconds", 0.0))
        init_notes = meta.get("init", [])

    def lr_at(s):  # linear warm-up, then cosine to 10%
        if s < tc.warmup:
            return tc.lr * (s + 1) / tc.warmup
        frac = min(1.0, (s - tc.warmup) / max(1, tc.steps - tc.warmup))
        return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log_path = out_dir / "log.jsonl"
    first_loss = last_loss = None
    tau = meta.get("tau")
    t_start = time.perf_counter()
    bar = tqdm(total=tc.steps, initial=step, desc="train-drafter", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    ema = None

    saved_at = -1

    def save():
        nonlocal tau, saved_at
        if saved_at == step:
            return
        saved_at = step
        if eval_data is not None:
            drafter.eval()
            tau = estimate_tau(drafter, frozen, eval_data, tc.eval_max_new_tokens)["tau"]
            drafter.train()
        secs = elapsed_before + time.perf_counter() - t_start
        _save_state(out_dir, drafter, opt, step, tc, rng, {"train_seconds": secs, "tau": tau, "init": init_notes,
                                                            "loss": last_loss})
        save_drafter(drafter, out_dir / "drafter", dtype=torch.bfloat16)

    drafter.train()
    stopped_early = False
    while step < tc.steps:
        if (time_limit_s is not None and time.perf_counter() - t_start > time_limit_s) or \
                (stop_after is not None and step >= stop_after):
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = make_batch(data, sample_picks(data, rng, tc.blocks_per_step, tc.anchors_per_seq),
                           tc.block_size, mask_id)
        loss = block_loss(drafter, frozen, batch, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        last_loss = loss.detach().item()
        first_loss = last_loss if first_loss is None else first_loss
        ema = last_loss if ema is None else 0.95 * ema + 0.05 * last_loss
        if eval_data is not None and tc.eval_every and step % tc.eval_every == 0 and step % tc.save_every:
            drafter.eval()
            tau = estimate_tau(drafter, frozen, eval_data, tc.eval_max_new_tokens)["tau"]
            drafter.train()
        if tc.save_every and step % tc.save_every == 0:
            save()
        bar.set_postfix(loss=f"{ema:.3f}", tau="-" if tau is None else f"{tau:.2f}")
        bar.update(1)
        if step % 10 == 0 or step == tc.steps:
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": step, "loss": last_loss, "loss_ema": ema, "lr": lr_at(step - 1),
                                    "tau": tau, "seconds": elapsed_before + time.perf_counter() - t_start}) + "\n")
    bar.close()
    save()
    return {"drafter": str(out_dir / "drafter"), "step": step, "steps": tc.steps, "first_loss": first_loss,
            "last_loss": last_loss, "tau_estimate": tau, "mask_token_id": mask_id, "target_layer_ids": ids,
            "dtype": str(target_dtype).removeprefix("torch."),
            "block_size": tc.block_size, "layers": tc.layers, "intermediate_size": dcfg.intermediate_size,
            "train_seconds": elapsed_before + time.perf_counter() - t_start, "stopped_early": stopped_early,
            "n_sequences": len(data), "n_tokens": int(data.offsets[-1])}
