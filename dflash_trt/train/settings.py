"""A training run's settings: TrainConfig (train-drafter's flags), the ones --resume takes from the run
(RUN_SETTINGS), the ones `--init-from D` takes from D where no flag gives them (settle), and the schedules of
the loss decay and the learning rate."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.models.config import load_drafter_config
from dflash_trt.models.draft_vocab import FILE as DRAFT_VOCAB_FILE


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

# what --init-from D gives a setting its flag left unset: TrainConfig field -> (its flag, how the report names it)
FROM_DRAFTER = {"layers": ("--layers", "layers"), "block_size": ("--block-size", "block size"),
                "intermediate_size": ("--intermediate-size", "intermediate size"),
                "target_layer_ids": ("--target-layers", "target layers"),
                "mask_token_id": ("--mask-token-id", "mask token"), "draft_vocab": ("--draft-vocab", "draft vocabulary")}
DEFAULTS = {"layers": 1, "block_size": 16}   # without --init-from, for the flags left unset


def settle(tc: TrainConfig) -> str | None:
    """Fill what the flags left unset (None): from --init-from D's config (its layers, block size, intermediate
    size, target layer ids, mask token, and its draft_vocab.json), else DEFAULTS. Returns, with --init-from, the
    line that says which setting came from D and which from a flag."""
    took, flags = [], []
    if tc.init_from:
        d = load_drafter_config(tc.init_from)
        vocab = Path(tc.init_from) / DRAFT_VOCAB_FILE
        theirs = {"layers": d.num_hidden_layers, "block_size": d.block_size, "intermediate_size": d.intermediate_size,
                  "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id,
                  "draft_vocab": str(vocab.resolve()) if vocab.is_file() else None}
        for k, (flag, name) in FROM_DRAFTER.items():
            if getattr(tc, k) is not None:
                flags.append(f"{flag} {_shown(getattr(tc, k))}")
            elif theirs[k] is not None:
                setattr(tc, k, theirs[k])
                took.append(f"{name} {_shown(theirs[k])}")
    for k, v in DEFAULTS.items():
        if getattr(tc, k) is None:
            setattr(tc, k, v)
    if not tc.init_from:
        return None
    return (f"--init-from {tc.init_from}: {', '.join(took) or 'nothing'} (from its config)"
            + (f"; {', '.join(flags)} (flag)" if flags else ""))


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def default_gamma(block_size: int) -> float:
    """Loss decay γ of the DFlash recipe: 7 for B=16, 5 for B=10, 4 for B=8 (linear in between)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of tc.lr at tc.steps."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

