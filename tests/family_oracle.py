"""Oracles for a runtime target family (models/families): a tiny checkpoint built by transformers
itself, and three checks against it, all in float64 (to within 1e-6: a wrong layer is off by 1e-1):

- same_as_transformers: logits at every position and every captured layer's output equal
  transformers' (`output_hidden_states`) for one forward over a random sequence;
- incremental_with_rollback: prefill, then blocks written at positions that go back (a rejected
  draft), then one-token steps: logits equal the full forward's at the same positions;
- lossless: plain AR, DFlash at several block sizes (a random tiny drafter) and transformers'
  generate give the same tokens.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from dflash_trt.models.drafter import DFlashDrafter, save_drafter
from dflash_trt.models.target import load_target
from dflash_trt.models.tiny import build_tokenizer, init_drafter_weights, tiny_drafter_config

MASK_ID = 3      # models/tiny's <|mask|> in build_tokenizer(256)
ATOL = 1e-6   # transformers computes RoPE cos/sin in float32 even for a float64 model: ~5e-8 apart


def build_hf_tiny(model_type: str, fields: dict, folder: Path, seed: int = 0, init=None) -> Path:
    """A random tiny checkpoint of `model_type` written by transformers (float32 weights), with
    models/tiny's tokenizer (vocab_size is set to its length; mask token id MASK_ID).
    init(model) may give parameters transformers leaves at zero a value, so tests see them."""
    from transformers import AutoConfig

    tok = build_tokenizer(256)
    torch.manual_seed(seed)
    if "text_config" in fields:      # a multimodal wrapper: the vocabulary is its decoder's
        fields = {**fields, "text_config": {**fields["text_config"], "vocab_size": len(tok)}}
    else:
        fields = {**fields, "vocab_size": len(tok)}
    cfg = AutoConfig.for_model(model_type, **fields)
    model = _auto_class(cfg).from_config(cfg).eval()
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def _auto_class(cfg):
    """AutoModelForCausalLM, or for a multimodal wrapper (kimi_k25) its image-text-to-text class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText


def hf_float64(folder: Path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    cfg._experts_implementation = "eager"          # torch._grouped_mm has no float64 on CPU
    for sub in ("text_config",):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub)._experts_implementation = "eager"
    return _auto_class(cfg).from_pretrained(folder, config=cfg, dtype=torch.float64,
                                                attn_implementation="eager").eval()


def random_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def same_as_transformers(folder: Path, n: int = 24, capture=(0, 1)) -> None:
    ours = load_target(folder, torch.float64, max_len=n + 8)
    ours.setup_cache(n + 8)
    hf = hf_float64(folder)
    ids = random_ids(ours.vocab_size, n)
    logits, feats = ours(torch.tensor(ids), 0, list(capture), all_logits=True)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits[0], atol=ATOL, rtol=0)
    H = ours.hidden_size
    for j, i in enumerate(capture):
        torch.testing.assert_close(feats[:, j * H:(j + 1) * H], out.hidden_states[i + 1][0], atol=ATOL, rtol=0,
                                   msg=lambda m, i=i: f"layer {i} output: {m}")


def incremental_with_rollback(folder: Path, n: int = 20) -> None:
    """Positions 0..n-1 fed as prefill(6) | block 6..13 (then 'rejected' after 9) | block 10..15 |
    steps 16..n-1: every logit equals the one-pass forward's at its position."""
    ours = load_target(folder, torch.float64, max_len=n + 8)
    ours.setup_cache(n + 8)
    ids = torch.tensor(random_ids(ours.vocab_size, n, seed=1))
    full, _ = ours(ids, 0, all_logits=True)
    wrong = ids.clone()
    wrong[10:14] = (wrong[10:14] + 7) % ours.vocab_size     # the drafts that get rejected
    got = {}
    for s, e, src in ((0, 6, ids), (6, 14, wrong), (10, 16, ids), *((p, p + 1, ids) for p in range(16, n))):
        lg, _ = ours(src[s:e], s, all_logits=True)
        for t in range(s, e):
            if src is ids or t < 10:
                got[t] = lg[t - s]
    for t in range(n):
        torch.testing.assert_close(got[t], full[t], atol=ATOL, rtol=0, msg=lambda m, t=t: f"position {t}: {m}")


def random_drafter(folder: Path, target_cfg: dict, mask_token_id: int = MASK_ID, block_size: int = 8, seed: int = 1):
    dcfg = tiny_drafter_config(target_cfg, mask_token_id, block_size)
    torch.manual_seed(seed)
    d = DFlashDrafter(dcfg)
    init_drafter_weights(d)
    save_drafter(d, folder)
    return folder


def lossless(target_dir: Path, drafter_dir: Path, prompts: int = 6, max_new: int = 16, blocks=(2, 4, 8)) -> None:
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import load_pair

    pair = load_pair(target_dir, drafter_dir, "float64")
    hf = hf_float64(target_dir)
    for k in range(prompts):
        prompt = random_ids(pair.target.vocab_size, 3 + 4 * k, seed=10 + k)
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ar = generate(pair.target, None, prompt, max_new_tokens=max_new, mode="ar", stop_ids=[])
        assert ar.token_ids == want, f"AR differs from transformers on prompt {k}"
        for B in blocks:
            df = generate(pair.target, pair.drafter, prompt, max_new_tokens=max_new, block_size=B, stop_ids=[])
            assert df.token_ids == want, f"DFlash B={B} differs from transformers on prompt {k}"
