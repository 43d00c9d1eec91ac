"""Whole-model state-dict loading for the CPU runtime, on top of the validating streaming
reader in `checkpoint` (which refuses truncated files, bad offsets and pickles)."""
from __future__ import annotations

from pathlib import Path

import torch


def read_state_dict(folder: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    from dflash_trt.checkpoint import CheckpointReader

    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        return {name: r.get(name) for name in r.keys()}
