"""MiniMax-M2 (M2.5, M2.7): transformers 5.24 models/minimax_m2, for the CPU reference runtime.

A Llama-shaped decoder (pre-norm, GQA, static KV caches as models/target.py) with
- q/k RMSNorms over all heads' features at once (q_norm [heads * head_dim], k_norm [kv_heads *
  head_dim]), before the heads are split;
- partial RoPE: the first rotary_dim features of each head rotate (rope_parameters'
  partial_rotary_factor, from config.json's `rotary_dim`), the rest pass through;
- every layer's MLP a routed MoE (block_sparse_moe): sigmoid scores, top-k chosen on score +
  e_score_correction_bias, weighted by the chosen sigmoid scores renormalized; SwiGLU experts
  w1 (gate) / w3 (up) / w2 (down), stored per expert.
The MTP modules of the released checkpoints (use_mtp) are not part of transformers' model, and
not loaded here (text in, no MTP drafting).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.models.layers import Linear, RMSNorm, apply_rope, linear
from dflash_trt.models.target import KV_PAD, Attention


def hf_text_config(cfg: dict):
    from transformers import AutoConfig

    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version", "quantization_config",
                                                     "auto_map", "architectures")}
    try:
        return AutoConfig.for_model(cfg["model_type"], **kw)
    except Exception as e:  # noqa: BLE001  transformers validates fields with many exception types
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise DFlashError(f"config.json: transformers refuses this {cfg['model_type']} config ({msg})") from None


class PartialRope(nn.Module):
    """cos/sin [max_len, rotary_dim], from transformers' own MiniMaxM2RotaryEmbedding frequencies
    (float32, then cast: as transformers computes them)."""

    def __init__(self, c, max_len: int, dtype: torch.dtype):
        super().__init__()
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

        ref = MiniMaxM2RotaryEmbedding(c)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * ref.inv_freq[None, :].float()
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * ref.attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * ref.attention_scaling).to(dtype), persistent=False)

    def forward(self, positions):
        return self.cos[positions], self.sin[positions]


def apply_partial_rope(x, cos, sin):
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class MiniMaxAttention(Attention):
    """GQA with all-heads q/k norms and partial RoPE; cache and attention are target.Attention's."""

    def __init__(self, c):
        nn.Module.__init__(self)
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.nh * self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.nkv * self.hd, c.rms_norm_eps)
        self.has_sinks, self.window = False, None
        self.k_cache = self.v_cache = None

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


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MiniMaxM2Target(nn.Module):
    """TargetModel's interface (models/families) for MiniMax-M2."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.hf = c = hf_text_config(cfg)
        self.model = Backbone(c)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = PartialRope(c, max(max_len, 1), dtype)
        self.num_layers, self.hidden_size, self.vocab_size = c.num_hidden_layers, c.hidden_size, c.vocab_size
        self.max_len = 0
        self.to(dtype)

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, h):
        return linear(h, self.lm_head_weight())

    def embed(self, tokens):
        return self.model.embed_tokens(tokens)

    def cache_bytes_per_position(self) -> int:
        return sum(2 * a.nkv * a.hd * self.dtype.itemsize for a in (layer.self_attn for layer in self.model.layers))

    def setup_cache(self, max_len: int):
        if max_len <= self.max_len:
            return
        max_len = -(-max_len // KV_PAD) * KV_PAD   # whole KV_PAD chunks: see target.Attention.attend_cached
        if max_len > self.rope.cos.shape[0]:
            self.rope = PartialRope(self.hf, max_len, self.dtype)
        for layer in self.model.layers:
            a = layer.self_attn
            a.k_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
            a.v_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
        self.max_len = max_len

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, capture: list[int] = (), all_logits: bool = False):
        T = tokens.shape[0]
        if start + T > self.max_len:
            raise DFlashError(f"sequence of {start + T} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        pos = torch.arange(start, start + T)
        cos, sin = self.rope(pos)
        mask = torch.arange(start + T)[None, :] <= pos[:, None]
        x = self.model.embed_tokens(tokens)
        feats, last = {}, self.num_layers - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start, mask)
            if i in capture and i != last:
                feats[i] = x
        x = self.model.norm(x)
        if last in capture:   # HF's last hidden state is taken after the final norm
            feats[last] = x
        logits = self.logits(x if all_logits else x[-1:])
        return logits, (torch.cat([feats[i] for i in capture], dim=-1) if capture else None)


def build(cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096) -> MiniMaxM2Target:
    """models/families' entry point for minimax_m2."""
    return MiniMaxM2Target(cfg, dtype=dtype, max_len=max_len)
