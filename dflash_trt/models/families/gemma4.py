"""Gemma 4 (12B, 31B, 26B-A4B; E2B/E4B's extras too): transformers 5.24 models/gemma4's text
decoder (Gemma4TextModel / Gemma4ForCausalLM), for the CPU reference runtime, as modeling_gemma4.py
computes it: sliding and full-attention layers (each with its own head_dim, KV heads and RoPE tables),
per-head q/k/v RMSNorms (Gemma4RMSNorm: weights stored as they apply, not 1 + w), a scaled embedding,
sandwich norms, per-layer scalars and soft-capped logits; the 26B-A4B's routed experts beside the dense
MLP; E2B/E4B's per-layer inputs and KV sharing (the last layers read an earlier layer's cache).
The multimodal wrapper (model_type gemma4) runs its text decoder (model.language_model.*; its image /
video / audio placeholder ids are embedded as pad_token_id, as Gemma4Model does for text-only input).
A bidirectional text config (use_bidirectional_attention "all") is refused: decoding is causal.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.models.attention import CachedAttention
from dflash_trt.models.families.family import Family
from dflash_trt.models.layers import Linear, apply_rope, linear, rope_cos_sin
from dflash_trt.models.shell import Backbone, TargetShell, hf_config, text_config

WRAPPERS = {"gemma4": "gemma4_text"}   # multimodal -> its text decoder
# The wrapper's multimodal placeholders (Gemma4Model.forward): in text-only input embedded as the text
# decoder's pad_token_id
PLACEHOLDERS = ("image_token_id", "video_token_id", "audio_token_id")


def layer_attention_dims(c: dict, layer: int, hd: int | None, nkv: int | None) -> tuple[int | None, int | None]:
    """(head_dim, num_key_value_heads) of one layer, from a config.json dict (hd, nkv: the config's
    head_dim and num_key_value_heads, the sliding layers')."""
    per_layer = c.get("per_layer_config")
    if isinstance(per_layer, dict):
        o = per_layer.get(str(layer), per_layer.get(layer)) or {}
        return o.get("head_dim", hd), o.get("num_key_value_heads", nkv)
    types = c.get("layer_types") or []
    if layer < len(types) and types[layer] == "full_attention":
        kv = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v", False) else None
        return c.get("global_head_dim", 512), kv or nkv
    return hd, nkv


def layer_intermediate_size(c: dict, layer: int, inter: int) -> int:
    """One layer's MLP width, from a config.json dict: the KV-sharing layers' MLP is double-wide
    (use_double_wide_mlp)."""
    if c.get("use_double_wide_mlp") and layer >= c["num_hidden_layers"] - (c.get("num_kv_shared_layers") or 0):
        return inter * 2
    return inter


# What the pipeline asks of each model type (models/families/family.py). The text decoder's full-attention
# layers have their own head_dim / KV heads (transformers 5.24 gemma4 configuration: global_head_dim,
# num_global_key_value_heads when attention_k_eq_v; written back to config.json as per_layer_config
# {layer: {head_dim, num_key_value_heads}}); models/shapes.py reads them per layer. ModelOpt 0.47 gives the
# scaled word embedding (an nn.Embedding subclass) no quantizer and so does not list it
# (quant/quantize.py _listed_exclusion; measured in tests/test_family_gemma4_minimax.py).
TRAITS = {
    "gemma4_text": Family(layer_attention_dims=layer_attention_dims, layer_intermediate_size=layer_intermediate_size,
                          unlisted_excluded=("*embed_tokens",)),
    "gemma4": Family(unlisted_excluded=("*embed_tokens",)),   # its text decoder (Gemma 4 as released)
}


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))
        self.with_scale = with_scale

    def forward(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)   # at least float32, as transformers; float64 stays
        y = x.to(dt)
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            y = y * self.weight.to(dt)
        return y.type_as(x)


class RopeTables(nn.Module):
    """cos/sin [max_len, head_dim] per layer type, from transformers' own Gemma4TextRotaryEmbedding
    frequencies (float32, then cast, as transformers computes them)."""

    def __init__(self, c, max_len: int, dtype: torch.dtype):
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        ref = Gemma4TextRotaryEmbedding(c)
        self.types = sorted(ref.rope_init_fns)
        for t in self.types:
            cos, sin = rope_cos_sin(getattr(ref, f"{t}_inv_freq"), getattr(ref, f"{t}_attention_scaling"), max_len, dtype)
            self.register_buffer(f"{t}_cos", cos, persistent=False)
            self.register_buffer(f"{t}_sin", sin, persistent=False)

    @property
    def length(self) -> int:
        return getattr(self, f"{self.types[0]}_cos").shape[0]

    def forward(self, positions) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {t: (getattr(self, f"{t}_cos")[positions], getattr(self, f"{t}_sin")[positions]) for t in self.types}


class Gemma4Attention(CachedAttention):
    """One layer's attention; the cache and the attention itself are CachedAttention's
    (attend_cached). A KV-sharing layer (`shared`) reads another layer's cache."""

    def __init__(self, c, i: int):
        lc = c.per_layer_config[i]
        kind = c.layer_types[i]
        super().__init__(c.num_attention_heads, lc.num_key_value_heads, lc.head_dim,
                         c.sliding_window if kind == "sliding_attention" else None)
        self.kind = kind
        self.shared = c.kv_sharing_modes[i] == "reuse"
        bias = bool(c.attention_bias)
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.hd, c.rms_norm_eps)
        if not self.shared:
            self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
            self.k_eq_v = bool(c.attention_k_eq_v) and self.kind != "sliding_attention"
            if not self.k_eq_v:
                self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.hd, c.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.hd, c.rms_norm_eps, with_scale=False)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=bias)

    def forward(self, x, cos, sin, start: int, mask):
        T = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, self.nh, self.hd)).transpose(0, 1), cos, sin)
        if not self.shared:
            k = self.k_proj(x).view(T, self.nkv, self.hd)
            v = k if self.k_eq_v else self.v_proj(x).view(T, self.nkv, self.hd)
            self.k_cache[:, start:start + T] = apply_rope(self.k_norm(k).transpose(0, 1), cos, sin)
            self.v_cache[:, start:start + T] = self.v_norm(v).transpose(0, 1)
        # Gemma 4 attends with scale 1 (its q/k norms set the logits' range); attend_cached scales by
        # head_dim^-0.5, so q comes in times head_dim^0.5
        return self.o_proj(self.attend_cached(q * self.hd ** 0.5, start, mask))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)
        self.proj = Linear(c.hidden_size, c.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(c.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(c.num_experts))
        self.top_k, self.root = c.top_k_experts, c.hidden_size ** -0.5

    def forward(self, x):
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1,
                              dtype=torch.promote_types(x.dtype, torch.float32))
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Experts(nn.Module):
    """Fused experts as transformers stores them: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self._views: dict = {}

    def _weight(self, name: str, e: int) -> torch.Tensor:
        # one view object per expert, so the packed float32 kernel weights (kernels/gemm) are made once
        w = getattr(self, name)
        hit = self._views.get((name, e))
        if hit is None or hit[0] is not w:
            hit = self._views[(name, e)] = (w, w[e])
        return hit[1]

    def forward(self, x, weights, idx):
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():   # ascending: each token's experts summed in transformers' order
            tok, slot = torch.where(idx == e)
            gate, up = linear(x[tok], self._weight("gate_up_proj", e)).chunk(2, dim=-1)
            y = linear(F.gelu(gate, approximate="tanh") * up, self._weight("down_proj", e))
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c, i: int):
        super().__init__()
        H, eps = c.hidden_size, c.rms_norm_eps
        self.kind = c.layer_types[i]
        self.self_attn = Gemma4Attention(c, i)
        wide = bool(c.use_double_wide_mlp) and self.self_attn.shared
        self.mlp = MLP(H, c.intermediate_size * (2 if wide else 1))
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            setattr(self, n, Gemma4RMSNorm(H, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer = bool(c.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = Linear(H, c.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = Linear(c.hidden_size_per_layer_input, H, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(H, eps)
        self.moe = bool(c.enable_moe_block)
        if self.moe:
            self.router = Router(c)
            self.experts = Experts(c)
            for n in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, n, Gemma4RMSNorm(H, eps))

    def forward(self, x, cos, sin, start, mask, per_layer_input):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, start, mask))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, idx = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, idx)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Target(TargetShell):
    """The runtime model of Gemma 4's text decoder (gemma4_text, or the gemma4 wrapper's)."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__(cfg)
        tc, self.prefix = text_config(cfg, WRAPPERS)
        self.hf = c = hf_config(tc)
        if c.use_bidirectional_attention == "all":
            raise DFlashError("config.json: use_bidirectional_attention 'all' makes Gemma 4 attend both ways; the "
                              "runtime decodes causally")
        if c.enable_moe_block and not (c.num_experts and c.top_k_experts and c.moe_intermediate_size):
            raise DFlashError("config.json: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if cfg.get("model_type") in WRAPPERS and c.pad_token_id is not None:
            top = hf_config(cfg)
            self.placeholders = tuple(i for n in PLACEHOLDERS if (i := getattr(top, n, None)) is not None)
            self.placeholder_id = c.pad_token_id
        model = Backbone(c, lambda i: DecoderLayer(c, i), Gemma4RMSNorm)
        if P := c.hidden_size_per_layer_input:   # per-layer inputs (E2B / E4B)
            L = c.num_hidden_layers
            model.embed_tokens_per_layer = nn.Embedding(c.vocab_size_per_layer_input, L * P)
            model.per_layer_model_projection = Linear(c.hidden_size, L * P, bias=False)
            model.per_layer_projection_norm = Gemma4RMSNorm(P, c.rms_norm_eps)
        self.softcap = c.final_logit_softcapping
        self.per_layer_dim = c.hidden_size_per_layer_input or 0
        self.finish(model, bool(c.tie_word_embeddings) and bool(cfg.get("tie_word_embeddings", True)),  # (as released)
                    dtype, max_len)

    def state_name(self, name: str) -> str | None:
        """This model's name for a checkpoint tensor; None for one it does not load (the wrapper's
        vision / audio towers, the tied lm_head)."""
        if name == "lm_head.weight":
            return None if self.tied else name
        if name.startswith(self.prefix):
            return "model." + name[len(self.prefix):]
        return None

    def rope_table(self, max_len: int, dtype: torch.dtype):
        return RopeTables(self.hf, max_len, dtype)

    def embed(self, tokens):
        """Gemma4TextScaledWordEmbedding: times sqrt(hidden_size), rounded to the weights' dtype."""
        w = self.model.embed_tokens.weight
        return self.model.embed_tokens(tokens) * torch.tensor(math.sqrt(self.hidden_size), dtype=w.dtype)

    def _per_layer_inputs(self, tokens, x):
        m, L, P = self.model, self.num_layers, self.per_layer_dim
        w = m.embed_tokens_per_layer.weight
        tok = (m.embed_tokens_per_layer(tokens) * torch.tensor(math.sqrt(P), dtype=w.dtype)).view(-1, L, P)
        proj = m.per_layer_projection_norm((m.per_layer_model_projection(x) * self.hidden_size ** -0.5).view(-1, L, P))
        return (proj + tok) * 2.0 ** -0.5

    def kv_layers(self):
        """The layers that store K and V (KV-sharing layers read another's)."""
        return [layer.self_attn for layer in self.model.layers if not layer.self_attn.shared]

    def allocate_cache(self, max_len: int) -> None:
        super().allocate_cache(max_len)
        last_of_kind = {}
        for layer in self.model.layers:
            a = layer.self_attn
            if a.shared:   # the last earlier layer of its type that stores K/V (transformers' kv_sharing_modes)
                a.k_cache, a.v_cache = last_of_kind[a.kind].k_cache, last_of_kind[a.kind].v_cache
            else:
                last_of_kind[a.kind] = a

    def decode(self, tokens, x, start: int, pos, mask):
        rope = self.rope(pos)
        per_layer = self._per_layer_inputs(tokens, x) if self.per_layer_dim else None
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope[layer.kind]
            x = layer(x, cos, sin, start, mask, per_layer[:, i] if per_layer is not None else None)
            yield x


build = Gemma4Target   # models/families' entry point for gemma4_text and gemma4 (its text decoder)
