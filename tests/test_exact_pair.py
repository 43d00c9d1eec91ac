"""A pair built so the draft is exact reaches tau = block size: proof the acceptance
bookkeeping (accepted prefix + bonus, cache crop, context injection) is right."""
from __future__ import annotations

import torch

from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.families.dense import DenseTarget as TargetModel
from dflash_trt.runtime.decode import generate

V, H = 64, 32


def _exact_pair():
    """Target and drafter both reduce to logits = E · norm(E[token]) (attention and MLP outputs
    zeroed, tied embeddings E[t] = a_t·e + noise with a unique largest a_c): every position of
    both models predicts token c, so every draft is right."""
    cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True}
    torch.manual_seed(0)
    t = TargetModel(cfg, torch.float64, max_len=256)
    e = torch.randn(H, dtype=torch.float64)
    a = torch.linspace(1.0, 2.0, V, dtype=torch.float64)
    a[17] = 3.0
    with torch.no_grad():
        t.model.embed_tokens.weight.copy_(a[:, None] * e + 0.01 * torch.randn(V, H, dtype=torch.float64))
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    d = DFlashDrafter(DrafterConfig.from_dict({
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "intermediate_size": 64, "vocab_size": V, "block_size": 8,
        "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}}), max_len=256, dtype=torch.float64)
    with torch.no_grad():
        for layer in d.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return t, d


def test_exact_drafter_reaches_tau_equal_block_size():
    t, d = _exact_pair()
    for B in (2, 4, 8, 16):
        n = 1 + 5 * B  # first token from prefill, then 5 full blocks
        r = generate(t, d, [1, 2, 3, 4], max_new_tokens=n, block_size=B)
        ar = generate(t, None, [1, 2, 3, 4], max_new_tokens=n, mode="ar")
        assert r.token_ids == ar.token_ids == [17] * n
        assert r.accepted_per_block == [B] * 5
        assert r.tau == B and r.blocks == 5


def test_random_drafter_gets_bonus_only():
    """With drafts that are (almost) always wrong, each target pass yields exactly one token."""
    t, _ = _exact_pair()
    _, d = _exact_pair()
    with torch.no_grad():
        d.norm.weight.mul_(-1.0)  # flips the drafter's logits: it now proposes the least likely token
    r = generate(t, d, [1, 2, 3], max_new_tokens=9, block_size=4)
    assert r.accepted_per_block == [1] * 8 and r.tau == 1.0
