"""Sampling losslessness: with speculative sampling, the distribution of DFlash's output equals
the target's. Empirical test over thousands of seeds on a tiny target with an 8-token vocabulary:
chi-square homogeneity test (DFlash counts vs AR counts) at significance alpha = 0.001, for a
drafter whose proposals are poor (random) and one that is good (near the target's distribution).
A deliberately broken acceptance rule must be caught by the same test (the test has power)."""
from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chi2_contingency

from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.families.dense import DenseTarget as TargetModel
from dflash_trt.runtime import decode
from dflash_trt.runtime.decode import generate
from dflash_trt.runtime.sampling import SamplingParams

V, H, ALPHA, SEEDS, N_TOK = 8, 32, 1e-3, 2500, 3
TARGET_CFG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _target(context_free: bool) -> TargetModel:
    torch.manual_seed(0)
    t = TargetModel(TARGET_CFG, torch.float64, max_len=64)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
        if context_free:  # next-token distribution ~ independent of context: a drafter can match it
            e = torch.randn(H, dtype=torch.float64)
            t.model.embed_tokens.weight.copy_(e + 0.05 * torch.randn(V, H, dtype=torch.float64))
            for layer in t.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return t


def _drafter(zero_layers: bool) -> DFlashDrafter:
    cfg = DrafterConfig.from_dict({
        "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "vocab_size": V, "block_size": 4,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [0, 1]}})
    torch.manual_seed(1)
    d = DFlashDrafter(cfg, max_len=64, dtype=torch.float64)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
        if zero_layers:  # drafter output = norm(token embedding): the context-free target's own distribution
            for layer in d.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return d


def _counts(target, drafter, mode, sp):
    first, pairs, taus = collections.Counter(), collections.Counter(), []
    for seed in range(SEEDS):
        r = generate(target, drafter, [1, 2, 3], max_new_tokens=N_TOK, sampling=sp, seed=seed, mode=mode)
        first[tuple(r.token_ids[:1])] += 1
        pairs[tuple(r.token_ids[1:3])] += 1
        taus.extend(r.accepted_per_block)
    return first, pairs, (sum(taus) / len(taus) if taus else None)


def _p_value(a: collections.Counter, b: collections.Counter) -> float:
    keys = sorted(set(a) | set(b))
    table = [[a[k] for k in keys], [b[k] for k in keys]]
    return chi2_contingency(table)[1]


CASES = {
    "poor-drafter": (False, False, SamplingParams(1.0)),
    "good-drafter": (True, True, SamplingParams(1.0)),
    "poor-drafter-topk-topp": (False, False, SamplingParams(0.8, top_k=5, top_p=0.9)),
}


@pytest.mark.parametrize("case", CASES)
def test_sampling_distribution_matches_ar(case):
    context_free, zero, sp = CASES[case]
    target, drafter = _target(context_free), _drafter(zero)
    _, ar_pairs, _ = _counts(target, None, "ar", sp)
    _, df_pairs, tau = _counts(target, drafter, "dflash", sp)
    p = _p_value(ar_pairs, df_pairs)
    assert p > ALPHA, f"{case}: DFlash token distribution differs from AR (chi-square p = {p:.2e})"
    if case == "good-drafter":
        assert tau > 2.0, f"a near-exact drafter should be accepted often (tau = {tau})"


def test_broken_acceptance_is_detected(monkeypatch):
    """Accept every draft token without the p/q test: the chi-square test must reject it."""
    target, drafter = _target(False), _drafter(False)
    sp = SamplingParams(1.0)
    _, ar_pairs, _ = _counts(target, None, "ar", sp)
    monkeypatch.setattr(decode, "speculative_accept",
                        lambda draft, q, p, gen: draft.tolist() + [int(torch.multinomial(p[len(draft)], 1, generator=gen))])
    _, bad_pairs, _ = _counts(target, drafter, "dflash", sp)
    assert _p_value(ar_pairs, bad_pairs) < ALPHA
