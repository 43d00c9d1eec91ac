"""MiniMax-M2 (M2.5, M2.7): transformers 5.24 models/minimax_m2, for the CPU reference runtime.

A Llama-shaped decoder with q/k RMSNorms over all heads' features at once, partial RoPE (config.json's
`rotary_dim`), and a routed MoE in every layer (sigmoid scores, top-k on score + e_score_correction_bias,
SwiGLU experts w1 / w3 / w2 stored per expert). The MTP modules (use_mtp) are not transformers' and are
not loaded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.models.attention import CachedAttention
from dflash_trt.models.families.family import Family
from dflash_trt.models.layers import Linear, PartialRope, RMSNorm, apply_partial_rope, linear
from dflash_trt.models.shell import Backbone, TargetShell, hf_config

# What the pipeline asks of it (models/families/family.py): the q/k RMSNorms span all heads' features, not one
# head's (transformers 5.24 modeling_minimax_m2.py: MiniMaxM2Attention q_norm = RMSNorm(head_dim * num_heads)).
TRAITS = {"minimax_m2": Family(qk_norm_over_all_heads=True)}


class MiniMaxAttention(CachedAttention):
    """GQA with all-heads q/k norms and partial RoPE; cache and attention are CachedAttention's."""

    def __init__(self, c):
        super().__init__(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.nh * self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.nkv * self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin, start: int, mask):
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(T, self.nh, self.hd).transpose(0, 1)
        k = self.k_norm(self.k_proj(x)).view(T, self.nkv, self.hd).transpose(0, 1)
        self.k_cache[:, start:start + T] = apply_partial_rope(k, cos, sin)
        self.v_cache[:, start:start + T] = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        return self.o_proj(self.attend_cached(apply_partial_rope(q, cos, sin), start, mask))


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = Linear(hidden, inter, bias=False)   # gate
        self.w2 = Linear(inter, hidden, bias=False)   # down
        self.w3 = Linear(hidden, inter, bias=False)   # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class SparseMoE(nn.Module):
    """Sigmoid routing with a selection bias (MiniMaxM2SparseMoeBlock). The router's scores are
    float32 whatever the model dtype, as transformers computes them."""

    def __init__(self, c):
        super().__init__()
        E = c.num_local_experts
        self.top_k = c.num_experts_per_tok
        self.gate = Router(c.hidden_size, E)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.intermediate_size) for _ in range(E))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):
        scores = torch.sigmoid(linear(x, self.gate.weight).float())
        _, idx = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1)
        weights = scores.gather(1, idx)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():   # ascending: each token's experts summed in transformers' order
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, (self.experts[e](x[tok]) * weights[tok, slot, None]).to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = MiniMaxAttention(c)
        self.block_sparse_moe = SparseMoE(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MiniMaxM2Target(TargetShell):
    """The runtime model of a minimax_m2 config.json."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__(cfg)
        self.hf = c = hf_config(cfg)
        self.finish(Backbone(c, lambda i: DecoderLayer(c)), bool(getattr(c, "tie_word_embeddings", False)),
                    dtype, max_len)

    def rope_table(self, max_len: int, dtype: torch.dtype):
        return PartialRope(self.hf, max_len, dtype)


build = MiniMaxM2Target   # models/families' entry point for minimax_m2
