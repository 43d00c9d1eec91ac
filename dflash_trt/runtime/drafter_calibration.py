"""A drafter's activation ranges, measured where they arise: in DFlash decoding with its target.

An engine runs a ModelOpt FP8 / NVFP4 Linear with a static activation scale (input_scale, from the
amax of what the Linear reads). A drafter's Linears read its target's hidden states (fc) and
states derived from them, so they are calibrated by running the pair, not the drafter alone
(`quantize --calib` calibrates a target's layers one by one and refuses a drafter). Here every
Linear of the drafter records the largest |x| it is fed while our runtime decodes the calibration
prompts (greedy DFlash, the reference KV injection so that k_proj / v_proj see the context states
through their own forward); quant/quantize.py turns the maxima into input_scale, shared across
each fused group as ModelOpt does.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.pair import generate, load_pair


def drafter_input_amax(target_dir: str | Path, drafter_dir: str | Path, prompts: Iterable[str | list[int]],
                       max_new_tokens: int = 32, progress: bool = False) -> dict[str, float]:
    """{Linear module name (as in the drafter checkpoint, e.g. layers.0.self_attn.q_proj): the max |input|
    it saw} over DFlash decoding of `prompts` (text, or token ids) with the unquantized pair, in float32."""
    pair = load_pair(target_dir, drafter_dir, dtype="float32")
    amax: dict[str, float] = {}

    def record(name):
        def hook(_module, args):
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().amax()))
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in pair.drafter.named_modules()
             if isinstance(m, torch.nn.Linear)]
    try:
        prompts = list(prompts)
        if not prompts:
            raise DFlashError("drafter calibration: no prompts")
        for p in tqdm(prompts, desc="calibrate drafter", disable=not progress, unit="prompt"):
            generate(pair, p, max_new_tokens=max_new_tokens, fused_inject=False)
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n, m in pair.drafter.named_modules() if isinstance(m, torch.nn.Linear) and n not in amax]
    if missing:
        raise DFlashError(f"drafter calibration: {missing[0]} saw no input (and {len(missing) - 1} more)")
    return amax
