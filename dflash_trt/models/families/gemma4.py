"""Gemma 4 (12B, 31B, 26B-A4B; E2B/E4B's extras too): transformers 5.24 models/gemma4's text
decoder (Gemma4TextModel / Gemma4ForCausalLM), for the CPU reference runtime.

What it does, as modeling_gemma4.py does it:
- layers are sliding_attention (a window of `sliding_window` keys, head_dim, num_key_value_heads,
  default RoPE) or full_attention (their own head_dim / KV heads from per_layer_config, i.e.
  config.json's global_head_dim / num_global_key_value_heads, and proportional partial RoPE whose
  tables span the whole head); RoPE tables are transformers' own frequencies per layer type;
- q, k and v RMSNorms per head (v's without a weight), attention scale 1 (the norms set it);
  attention_k_eq_v: full layers have no v_proj, the key projection is also the value (before k's
  norm and RoPE);
- Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 * weight, in float32 (float64 for the oracles), weights
  stored as they apply (not 1 + w);
- the embedding scaled by sqrt(hidden_size) (in the weights' dtype), sandwich norms around attention
  and the MLP (GELU-tanh gated), each layer's output times its stored layer_scalar, and the final
  logits soft-capped: cap * tanh(logits / cap);
- enable_moe_block (26B-A4B): beside the dense MLP, routed experts read the layer's residual: a
  scale-free RMSNorm, * router.scale / sqrt(hidden), softmax over router.proj, top-k renormalized,
  times per_expert_scale; fused experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I]; the two
  branches' outputs each normed, summed, normed again;
- per-layer inputs (hidden_size_per_layer_input > 0, E2B/E4B): a second embedding plus a projection
  of the first, mixed into every layer through per_layer_input_gate / per_layer_projection;
- KV sharing (num_kv_shared_layers): the last layers reuse the K/V of the last earlier layer of
  their type (they own no k/v projections; here they read its cache), and use_double_wide_mlp
  doubles their MLP.
The multimodal wrapper (model_type gemma4: Gemma 4 as released) runs its text decoder: config.json's
text_config, tensors model.language_model.* (the vision / audio towers are not loaded: text in).
A bidirectional text config (use_bidirectional_attention "all") is refused: decoding is causal.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.models.layers import Linear, apply_rope, linear
from dflash_trt.models.target import KV_PAD, Attention

WRAPPERS = {"gemma4": "gemma4_text"}   # multimodal -> its text decoder


def text_config(cfg: dict) -> tuple[dict, str]:
    """The decoder's config.json fields (with model_type) and the checkpoint prefix of its tensors."""
    mt = cfg.get("model_type")
    if mt not in WRAPPERS:
        return cfg, "model."
    tc = cfg.get("text_config")
    if not isinstance(tc, dict):
        raise DFlashError(f"config.json: model_type {mt!r} keeps its decoder's fields in text_config, which is missing")
    return {**tc, "model_type": WRAPPERS[mt]}, "model.language_model."


def hf_text_config(tc: dict):
    from transformers import AutoConfig

    kw = {k: v for k, v in tc.items() if k not in ("model_type", "transformers_version", "quantization_config")}
    try:
        return AutoConfig.for_model(tc["model_type"], **kw)
    except Exception as e:  # noqa: BLE001  transformers validates fields with many exception types
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise DFlashError(f"config.json: transformers refuses this {tc['model_type']} config ({msg})") from None


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
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        for t in self.types:
            freqs = pos * getattr(ref, f"{t}_inv_freq")[None, :].float()
            emb = torch.cat([freqs, freqs], dim=-1)
            scaling = getattr(ref, f"{t}_attention_scaling")
            self.register_buffer(f"{t}_cos", (emb.cos() * scaling).to(dtype), persistent=False)
            self.register_buffer(f"{t}_sin", (emb.sin() * scaling).to(dtype), persistent=False)

    @property
    def length(self) -> int:
        return getattr(self, f"{self.types[0]}_cos").shape[0]

    def forward(self, positions) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {t: (getattr(self, f"{t}_cos")[positions], getattr(self, f"{t}_sin")[positions]) for t in self.types}


class Gemma4Attention(Attention):
    """One layer's attention; the cache and the attention itself are target.Attention's
    (attend_cached). A KV-sharing layer (`source` set) reads another layer's cache."""

    def __init__(self, c, i: int):
        nn.Module.__init__(self)
        lc = c.per_layer_config[i]
        self.kind = c.layer_types[i]
        self.nh, self.nkv, self.hd = c.num_attention_heads, lc.num_key_value_heads, lc.head_dim
        self.window = c.sliding_window if self.kind == "sliding_attention" else None
        self.has_sinks = False
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
        self.k_cache = self.v_cache = None

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


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        P = c.hidden_size_per_layer_input
        if P:
            L = c.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(c.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = Linear(c.hidden_size, L * P, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(P, c.rms_norm_eps)


class Gemma4Target(nn.Module):
    """TargetModel's interface (models/families) for Gemma 4's text decoder."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        tc, self.prefix = text_config(cfg)
        self.hf = c = hf_text_config(tc)
        if c.use_bidirectional_attention == "all":
            raise DFlashError("config.json: use_bidirectional_attention 'all' makes Gemma 4 attend both ways; the "
                              "runtime decodes causally")
        if c.enable_moe_block and not (c.num_experts and c.top_k_experts and c.moe_intermediate_size):
            raise DFlashError("config.json: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        self.model = Backbone(c)
        self.tied = bool(c.tie_word_embeddings) and bool(cfg.get("tie_word_embeddings", True))   # (as released)
        if not self.tied:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.softcap = c.final_logit_softcapping
        self.per_layer_dim = c.hidden_size_per_layer_input or 0
        self.rope = RopeTables(c, max(max_len, 1), dtype)
        self.num_layers, self.hidden_size, self.vocab_size = c.num_hidden_layers, c.hidden_size, c.vocab_size
        self.max_len = 0
        self.to(dtype)

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def state_name(self, name: str) -> str | None:
        """This model's name for a checkpoint tensor; None for one it does not load (the wrapper's
        vision / audio towers, the tied lm_head)."""
        if name == "lm_head.weight":
            return None if self.tied else name
        if name.startswith(self.prefix):
            return "model." + name[len(self.prefix):]
        return None

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, h):
        out = linear(h, self.lm_head_weight())
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

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

    def _owners(self):
        return [layer.self_attn for layer in self.model.layers if not layer.self_attn.shared]

    def cache_bytes_per_position(self) -> int:
        """K and V of every layer that stores them (KV-sharing layers read another's)."""
        return sum(2 * a.nkv * a.hd * self.dtype.itemsize for a in self._owners())

    def setup_cache(self, max_len: int):
        if max_len <= self.max_len:
            return
        max_len = -(-max_len // KV_PAD) * KV_PAD   # whole KV_PAD chunks: see target.Attention.attend_cached
        if max_len > self.rope.length:
            self.rope = RopeTables(self.hf, max_len, self.dtype)
        last_of_kind = {}
        for layer in self.model.layers:
            a = layer.self_attn
            if a.shared:   # the last earlier layer of its type that stores K/V (transformers' kv_sharing_modes)
                a.k_cache, a.v_cache = last_of_kind[a.kind].k_cache, last_of_kind[a.kind].v_cache
                continue
            a.k_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
            a.v_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
            last_of_kind[a.kind] = a
        self.max_len = max_len

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, capture: list[int] = (), all_logits: bool = False):
        T = tokens.shape[0]
        if start + T > self.max_len:
            raise DFlashError(f"sequence of {start + T} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        pos = torch.arange(start, start + T)
        rope = self.rope(pos)
        mask = torch.arange(start + T)[None, :] <= pos[:, None]
        x = self.embed(tokens)
        per_layer = self._per_layer_inputs(tokens, x) if self.per_layer_dim else None
        feats, last = {}, self.num_layers - 1
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope[layer.kind]
            x = layer(x, cos, sin, start, mask, per_layer[:, i] if per_layer is not None else None)
            if i in capture and i != last:
                feats[i] = x
        x = self.model.norm(x)
        if last in capture:   # HF's last hidden state is taken after the final norm
            feats[last] = x
        logits = self.logits(x if all_logits else x[-1:])
        return logits, (torch.cat([feats[i] for i in capture], dim=-1) if capture else None)


def build(cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096) -> Gemma4Target:
    """models/families' entry point for gemma4_text and gemma4 (its text decoder)."""
    return Gemma4Target(cfg, dtype=dtype, max_len=max_len)
