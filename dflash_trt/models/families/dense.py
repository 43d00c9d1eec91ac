"""Llama, Qwen3 and gpt-oss, gpt-fast style, for the CPU reference runtime.

One module per family would repeat 90% of the code, so one decoder handles all three, switched by
config fields (qk-norm for Qwen3; biases, attention sinks, sliding windows and MoE for gpt-oss).
Parameter names are Hugging Face's, so checkpoints load as they are. The static KV cache and the
attention itself are models/attention.py's; the model shell models/shell.py's.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.kernels import gemm
from dflash_trt.models.attention import CachedAttention
from dflash_trt.models.families.family import Family
from dflash_trt.models.layers import Linear, RMSNorm, SwiGLU
from dflash_trt.models.shell import Backbone, TargetShell, hf_config


def gpt_oss_expert_tensors(*, H: int, nh: int, E: int, inter: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss's own tensors per layer: MXFP4 experts (blocks of 32 values in 16 bytes, one scale each),
    router and expert biases, attention sinks (transformers 5.24 GptOssExperts / GptOssAttention)."""
    return {"mlp.router.weight": (E, H), "mlp.router.bias": (E,),
            "self_attn.sinks": (nh,),
            "mlp.experts.gate_up_proj_blocks": (E, 2 * inter, H // 32, 16),
            "mlp.experts.gate_up_proj_scales": (E, 2 * inter, H // 32),
            "mlp.experts.gate_up_proj_bias": (E, 2 * inter),
            "mlp.experts.down_proj_blocks": (E, H, inter // 32, 16),
            "mlp.experts.down_proj_scales": (E, H, inter // 32),
            "mlp.experts.down_proj_bias": (E, H)}


# What the pipeline asks of each model type (models/families/family.py)
TRAITS = {
    "llama": Family(hand_sized=True, tiny={
        "config": "LlamaConfig", "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256}}),
    "qwen3": Family(hand_sized=True, qk_norm=True, tiny={"config": "Qwen3Config", "rope_theta": 1000000.0}),
    "gpt_oss": Family(hand_sized=True, experts=True, attention_sinks=True, expert_biases=True, mxfp4_experts=True,
                      architectures=("GptOssForCausalLM",), expert_tensor_shapes=gpt_oss_expert_tensors, tiny={
                          "config": "GptOssConfig", "intermediate_size": 64, "num_local_experts": 4,
                          "num_experts_per_tok": 2, "attention_bias": True, "sliding_window": 8,
                          "rope_theta": 150000.0, "layer_types": ["sliding_attention", "full_attention"] * 2,
                          "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "original_max_position_embeddings": 64, "truncate": False}}),
}


class Attention(CachedAttention):
    def __init__(self, c, layer_idx: int):
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        types = getattr(c, "layer_types", None)
        window = c.sliding_window if types and types[layer_idx] == "sliding_attention" else None
        super().__init__(c.num_attention_heads, c.num_key_value_heads, hd, window, TRAITS[c.model_type].attention_sinks)
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=bias)
        self.qk_norm = TRAITS[c.model_type].qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        if self.has_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.nh))

    def forward(self, x, cos, sin, start: int, mask):
        T = x.shape[0]
        q, k, v = gemm.linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.store_and_attend(q, k, v, cos, sin, start, mask))


class MoE(nn.Module):
    """gpt-oss MoE: softmax over the top-k router logits, clamped SwiGLU with +1 on `up`."""

    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.top_k, self.alpha, self.limit = c.num_experts_per_tok, c.swiglu_alpha, c.swiglu_limit
        self.router = Linear(H, E, bias=True)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.experts.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.experts.down_proj_bias = nn.Parameter(torch.zeros(E, H))

    def forward(self, x):
        top, idx = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        out = torch.zeros_like(x)
        ex = self.experts
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gu = gemm.stacked_linear(x[tok], ex.gate_up_proj, e, ex.gate_up_proj_bias[e])
            gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(-self.limit, self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            y = gemm.stacked_linear(h, ex.down_proj, e, ex.down_proj_bias[e])
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c, i: int):
        super().__init__()
        self.self_attn = Attention(c, i)
        self.mlp = MoE(c) if TRAITS[c.model_type].experts else SwiGLU(c.hidden_size, c.intermediate_size,
                                                                    bool(getattr(c, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseTarget(TargetShell):
    """The runtime model of a llama / qwen3 / gpt_oss config.json."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__(cfg)
        self.hf = c = hf_config(cfg)
        self.finish(Backbone(c, lambda i: DecoderLayer(c, i)), bool(getattr(c, "tie_word_embeddings", False)),
                    dtype, max_len)


build = DenseTarget   # models/families' entry point for llama, qwen3 and gpt_oss
