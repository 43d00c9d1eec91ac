"""The multimodal wrappers' placeholder ids in text-only input, against transformers 5.24 in float64.

Kimi K2.5 (kimi_k25, Kimi_K25Model.forward) embeds its image / video placeholder ids as token 0; Gemma 4
(gemma4, Gemma4Model.forward) embeds its image / video / audio placeholder ids as the text decoder's
pad_token_id (also for the per-layer inputs). Here those ids lie inside the vocabulary and stand in the
prompt: our logits equal transformers' at every position, and differ from embedding the ids as ordinary
tokens (so the test sees the mapping). The text-only model types map nothing.
"""
from __future__ import annotations

import json

import pytest
import torch
from family_oracle import ATOL, build_hf_tiny, hf_float64, random_ids
from test_family_gemma4_minimax import GEMMA4_PLE, _gemma4_init, hf_in_float64
from test_family_mla import BASE, MLA, VISION, _randomize

from dflash_trt.models.target import load_target

KIMI_IDS = {"image_token_id": 200, "video_token_id": 201}
GEMMA4_IDS = {"image_token_id": 210, "video_token_id": 211, "audio_token_id": 212}
GEMMA4_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
                 "position_embedding_size": 64}


def _prompt(vocab: int, placeholders: list[int], n: int = 24) -> list[int]:
    ids = random_ids(vocab, n, seed=3)
    for j, p in enumerate(placeholders):    # each placeholder twice, one of them at the last position
        ids[3 + 5 * j], ids[-1 - j] = p, p
    return ids


def _against_transformers(folder, placeholders: list[int]) -> float:
    """max |our logits - transformers'| over a prompt holding the placeholders (asserted <= ATOL), and
    that embedding them as ordinary tokens would differ."""
    ours = load_target(folder, torch.float64, max_len=32)
    ours.setup_cache(32)
    assert sorted(ours.placeholders) == sorted(placeholders)
    ids = _prompt(ours.vocab_size, placeholders)
    logits, _ = ours(torch.tensor(ids), 0, all_logits=True)
    with torch.no_grad():
        want = hf_float64(folder)(torch.tensor([ids])).logits[0]
    diff = float((logits - want).abs().max())
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
    ours.placeholders = ()                       # the ids as ordinary tokens: what the runtime did before
    plain, _ = ours(torch.tensor(ids), 0, all_logits=True)
    assert float((plain - want).abs().max()) > 1e-3
    print(f"{folder.name}: max |ours - transformers| = {diff:.3g}")
    return diff


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    fields = {"text_config": {"model_type": "kimi_k2", **BASE, **MLA}, "vision_config": VISION,
              "projection_hidden_size": 32, "tie_word_embeddings": False, **KIMI_IDS}
    return build_hf_tiny("kimi_k25", fields, tmp_path_factory.mktemp("kimi") / "kimi_k25", init=_randomize)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    fields = {"text_config": {**GEMMA4_PLE, "pad_token_id": 5}, "vision_config": GEMMA4_VISION,
              "audio_config": None, **GEMMA4_IDS}
    return build_hf_tiny("gemma4", fields, tmp_path_factory.mktemp("gemma4") / "gemma4", init=_gemma4_init)


def test_kimi_k25_embeds_its_placeholders_as_token_0(kimi):
    assert json.loads((kimi / "config.json").read_text())["image_token_id"] == KIMI_IDS["image_token_id"]
    _against_transformers(kimi, list(KIMI_IDS.values()))
    assert load_target(kimi, torch.float64).placeholder_id == 0


def test_gemma4_embeds_its_placeholders_as_pad(gemma4):
    with hf_in_float64("gemma4"):
        _against_transformers(gemma4, list(GEMMA4_IDS.values()))
    assert load_target(gemma4, torch.float64).placeholder_id == 5


def test_the_text_only_model_types_map_nothing():
    from dflash_trt.models.families import gemma4 as g
    from dflash_trt.models.families import mla

    for module, cfg in ((mla, {"model_type": "deepseek_v3", **BASE, **MLA, "vocab_size": 260, **KIMI_IDS}),
                        (g, {"model_type": "gemma4_text", **GEMMA4_PLE, "vocab_size": 260, **GEMMA4_IDS})):
        assert module.build(cfg, torch.float64, max_len=8).placeholders == ()
