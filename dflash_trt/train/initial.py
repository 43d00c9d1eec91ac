"""A run's settings and the drafter it starts from: TrainConfig (train-drafter's flags; --resume takes
RUN_SETTINGS from the run, `--init-from D` what no flag gives from D), the drafter's config (the target's
shapes and those settings) and its first weights: a trained drafter's (--init-from, grown when deeper), the
target's last layers, or random."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import DrafterConfig, default_target_layer_ids, drafter_identity, load_drafter_config
from dflash_trt.models.draft_vocab import FILE as DRAFT_VOCAB_FILE
from dflash_trt.models.draft_vocab import read_draft_vocab
from dflash_trt.models.drafter import load_drafter


@dataclass
class TrainConfig:
    # None: unset (settle() fills it: from --init-from's drafter, else DEFAULTS / the comment's default)
    layers: int | None = None
    block_size: int | None = None
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
    labels: str = "data"                       # "data" | "teacher-forced" (train/objective.py)
    distill_k: int = 0                         # > 0: KL to the target's top-k distribution beside the CE
    draft_vocab: str | None = None             # a draft_vocab.json: logits (and labels) over its tokens only


# Settings that make a run what it is: --resume takes them from the run's state, not the command line.
RUN_SETTINGS = ("layers", "block_size", "intermediate_size", "target_layer_ids", "mask_token_id",
                "blocks_per_step", "anchors_per_seq", "gamma", "seed", "init_from_target", "labels", "distill_k",
                "draft_vocab")

# the settings --init-from D gives a run where no flag does: TrainConfig field -> its flag
FROM_DRAFTER = {"layers": "--layers", "block_size": "--block-size", "intermediate_size": "--intermediate-size",
                "target_layer_ids": "--target-layers", "mask_token_id": "--mask-token-id", "draft_vocab": "--draft-vocab"}
DEFAULTS = {"layers": 1, "block_size": 16}   # without --init-from, for the flags left unset


def settle(tc: TrainConfig) -> str | None:
    """Fill what the flags left unset (None): from --init-from D (its config's layers, block size, intermediate
    size, target layer ids and mask token, its draft_vocab.json), else DEFAULTS. With --init-from, returns the
    line that says which setting came from D and which from a flag."""
    took, flagged = [], []
    if tc.init_from:
        d, vocab = load_drafter_config(tc.init_from), Path(tc.init_from) / DRAFT_VOCAB_FILE
        theirs = {"layers": d.num_hidden_layers, "block_size": d.block_size, "intermediate_size": d.intermediate_size,
                  "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id,
                  "draft_vocab": str(vocab.resolve()) if vocab.is_file() else None}
        for k, flag in FROM_DRAFTER.items():
            if getattr(tc, k) is not None:
                flagged.append(f"{flag} {_shown(getattr(tc, k))}")
            elif theirs[k] is not None:
                setattr(tc, k, theirs[k])
                took.append(f"{flag.removeprefix('--').replace('-', ' ')} {_shown(theirs[k])}")
    for k, v in DEFAULTS.items():
        setattr(tc, k, v if getattr(tc, k) is None else getattr(tc, k))
    return (f"--init-from {tc.init_from}: {', '.join(took) or 'nothing'} (from its config)"
            + (f"; {', '.join(flagged)} (flag)" if flagged else "")) if tc.init_from else None


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


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


def init_from_drafter(drafter, folder: Path, target_dir: Path | None = None, target_cfg: dict | None = None
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



def initial_weights(drafter, tc: TrainConfig, target_dir: Path, target_cfg: dict) -> list[str]:
    """A new run starts from a trained drafter (--init-from), or from the target's last layers,
    or from the seeded random init. Returns the notes for the model card."""
    if tc.init_from:
        notes = init_from_drafter(drafter, Path(tc.init_from), target_dir, target_cfg)
        return [f"all weights <- {tc.init_from}", *notes]
    if tc.init_from_target:
        want = lambda k: k.startswith("model.layers.") or k == "model.norm.weight"  # noqa: E731
        return init_from_target(drafter, read_target_tensors(target_dir, want), target_cfg)
    return []


def draft_vocabulary(tc: TrainConfig, target_cfg: dict) -> tuple[torch.Tensor | None, dict[str, bytes]]:
    """--draft-vocab (a drafter folder or its draft_vocab.json): its token ids, and the file to ship beside
    every saved drafter (the runtime then drafts from the vocabulary it was trained on); (None, {}) without."""
    if not tc.draft_vocab:
        return None, {}
    vocab_file = Path(tc.draft_vocab)
    vocab_file = vocab_file / DRAFT_VOCAB_FILE if vocab_file.is_dir() else vocab_file
    if vocab_file.name != DRAFT_VOCAB_FILE or not vocab_file.is_file():
        raise DFlashError(f"--draft-vocab {tc.draft_vocab}: no {DRAFT_VOCAB_FILE} there")
    return read_draft_vocab(vocab_file.parent, target_cfg["vocab_size"]), {DRAFT_VOCAB_FILE: vocab_file.read_bytes()}
