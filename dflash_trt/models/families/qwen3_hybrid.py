"""Qwen3-Next, Qwen3.5 and Qwen3.5/3.6 MoE: the hybrid decoders of transformers 5.24
models/qwen3_next, qwen3_5 and qwen3_5_moe, for the CPU reference runtime.

Layers alternate (config `layer_types`) between Gated DeltaNet linear attention and gated full attention
(q_proj also emits a sigmoid output gate; partial RoPE: Qwen3.5's M-RoPE is plain RoPE for text only).
The MLP is dense or routed experts plus a sigmoid-gated shared expert. The multimodal wrappers
(qwen3_5 / qwen3_5_moe) run their text decoder (model.language_model.*; no vision, no MTP head).

State: a linear-attention layer's state after position p depends on every token before it, so a
rollback cannot just move a pointer: each layer keeps its last forward's inputs to the recurrence, and
a later call starting inside that forward replays the recurrence up to its start (bitwise the states the
forward computed). A start before the last forward (other than 0) is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.models.attention import CachedAttention
from dflash_trt.models.families.family import Family
from dflash_trt.models.layers import Linear, PartialRope, SwiGLU, apply_partial_rope
from dflash_trt.models.shell import Backbone, TargetShell, hf_config, text_config

WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}   # multimodal -> its text decoder
FUSED_IN_PROJ = ("qwen3_next",)       # in_proj_qkvz / in_proj_ba; Qwen3.5 splits them
ALWAYS_MOE = ("qwen3_5_moe_text",)
NEVER_MOE = ("qwen3_5_text",)
# What the pipeline asks of each model type (models/families/family.py): q_proj also emits the attention-output
# gate (nh * head_dim * 2 outputs; transformers 5.24 qwen3_next / qwen3_5 / qwen3_5_moe Attention:
# q_proj = Linear(hidden, heads * head_dim * 2)).
TRAITS = {mt: Family(q_proj_with_gate=True)
          for mt in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")}


def _compute_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.promote_types(dt, torch.float32)   # bf16 -> float32 (as HF / FLA); float64 stays


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight) (Qwen3NextRMSNorm: Gemma's convention; weight stored centered at 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        dt = _compute_dtype(x.dtype)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(dt))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * SiLU(gate) (Qwen3NextRMSNormGated: plain weight, norm before gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        dt = _compute_dtype(x.dtype)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(gate.to(dt))).to(x.dtype)


class GatedAttention(CachedAttention):
    """Full attention with an output gate: q_proj gives [query | gate] per head; out = o_proj(attn * sigmoid(gate)).
    The cache and the attention itself are CachedAttention's (attend_cached)."""

    def __init__(self, c):
        super().__init__(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = Linear(c.hidden_size, 2 * self.nh * self.hd, bias=bias)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin, start: int, mask):
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.nh, 2 * self.hd).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q).transpose(0, 1), cos, sin)
        k = self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)).transpose(0, 1)
        self.k_cache[:, start:start + T] = apply_partial_rope(k, cos, sin)
        self.v_cache[:, start:start + T] = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        o = self.attend_cached(q, start, mask)
        return self.o_proj(o * torch.sigmoid(gate.reshape(T, self.nh * self.hd)))


def _l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)   # as FLA / transformers' l2norm


def delta_rule_step(S, k, v, decay, beta):
    """One token of the gated delta rule: S [h, dk, dv] decays by exp(g), then writes beta * (v - k^T S) at k."""
    S = S * decay.exp()[:, None, None]
    delta = (v - (S * k[:, :, None]).sum(-2)) * beta[:, None]
    return S + k[:, :, None] * delta[:, None, :]


class GatedDeltaNet(nn.Module):
    def __init__(self, c, fused_in_proj: bool):
        super().__init__()
        self.nv, self.nk = c.linear_num_value_heads, c.linear_num_key_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        if self.nv % self.nk:
            raise DFlashError(f"config.json: linear_num_value_heads {self.nv} is not a multiple of "
                              f"linear_num_key_heads {self.nk}")
        self.K = c.linear_conv_kernel_dim
        if c.hidden_act != "silu":
            raise DFlashError(f"config.json: hidden_act {c.hidden_act!r}: the Gated DeltaNet runtime applies silu")
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.fused = fused_in_proj
        H = c.hidden_size
        if fused_in_proj:
            self.in_proj_qkvz = Linear(H, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = Linear(H, 2 * self.nv, bias=False)
        else:
            self.in_proj_qkv = Linear(H, self.conv_dim, bias=False)
            self.in_proj_z = Linear(H, value_dim, bias=False)
            self.in_proj_b = Linear(H, self.nv, bias=False)
            self.in_proj_a = Linear(H, self.nv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.K))   # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = Linear(value_dim, H, bias=False)
        self.last = None   # the last forward, for rollback (see the module docstring)

    def _project(self, x):
        """-> conv input [T, conv_dim] ([q | k | v]), z [T, nv, dv], b [T, nv], a [T, nv]."""
        T, r = x.shape[0], self.nv // self.nk
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.nv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        # Qwen3-Next groups by key head: [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)] per group
        q, k, v, z = self.in_proj_qkvz(x).view(T, self.nk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).view(T, self.nk, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.nv, self.dv), b.reshape(T, self.nv), a.reshape(T, self.nv)

    def state_at(self, offset: int | None):
        """(conv window [K-1, conv_dim], recurrent state) `offset` tokens into the last forward
        (None: the zero state of position 0)."""
        dt = _compute_dtype(self.out_proj.weight.dtype)
        if offset is None or self.last is None:
            return (torch.zeros(self.K - 1, self.conv_dim, dtype=self.out_proj.weight.dtype),
                    torch.zeros(self.nv, self.dk, self.dv, dtype=dt))
        r = self.last
        conv = torch.cat([r["conv_prev"], r["conv_in"]])[offset:offset + self.K - 1]
        if offset == r["conv_in"].shape[0]:
            return conv, r["S_end"]
        S = r["S_start"]
        for t in range(offset):   # the forward's own steps, replayed
            S = delta_rule_step(S, r["k"][t], r["v"][t], r["decay"][t], r["beta"][t])
        return conv, S

    def forward(self, x, offset: int | None):
        T = x.shape[0]
        dt = _compute_dtype(x.dtype)
        conv_prev, S = self.state_at(offset)
        mixed, z, b, a = self._project(x)
        # causal depthwise conv over [the K-1 inputs before | this forward's], each output the same
        # per-channel sum whatever T is (a verify pass and AR steps agree bitwise)
        window = torch.cat([conv_prev, mixed]).to(dt).unfold(0, self.K, 1)          # [T, C, K]
        conv = F.silu((window * self.conv1d.weight[:, 0, :].to(dt)).sum(-1))
        q, k, v = conv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        rep = self.nv // self.nk       # each key head serves rep consecutive value heads
        q = (_l2norm(q.view(T, self.nk, self.dk)) * self.dk ** -0.5).repeat_interleave(rep, 1)
        k = _l2norm(k.view(T, self.nk, self.dk)).repeat_interleave(rep, 1)
        v = v.reshape(T, self.nv, self.dv)
        beta = torch.sigmoid(b).to(dt)
        decay = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias.to(dt))
        S_start, out = S, []
        for t in range(T):
            S = delta_rule_step(S, k[t], v[t], decay[t], beta[t])
            out.append((S * q[t][:, :, None]).sum(-2))
        self.last = {"conv_prev": conv_prev, "conv_in": mixed, "S_start": S_start, "S_end": S,
                     "k": k, "v": v, "decay": decay, "beta": beta}
        o = self.norm(torch.stack(out).to(x.dtype), z)
        return self.out_proj(o.reshape(T, self.nv * self.dv))

    def state_bytes(self) -> int:
        return (self.nv * self.dk * self.dv * _compute_dtype(self.out_proj.weight.dtype).itemsize
                + (self.K - 1) * self.conv_dim * self.out_proj.weight.dtype.itemsize)


class SparseMoE(nn.Module):
    """Routed experts (softmax over all, top-k, renormalized when norm_topk) + a sigmoid-gated shared expert."""

    def __init__(self, c, norm_topk: bool):
        super().__init__()
        H, E = c.hidden_size, c.num_experts
        self.top_k, self.norm_topk = c.num_experts_per_tok, norm_topk
        self.gate = Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SwiGLU(H, c.moe_intermediate_size) for _ in range(E))
        self.shared_expert = SwiGLU(H, c.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(H, 1, bias=False)

    def forward(self, x):
        probs = torch.softmax(self.gate(x).to(_compute_dtype(x.dtype)), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():    # ascending, as transformers: a token's sum order does not depend on T
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * top[tok, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, c, i: int):
        super().__init__()
        self.kind = c.layer_types[i]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, c.model_type in FUSED_IN_PROJ)
        elif self.kind == "full_attention":
            self.self_attn = GatedAttention(c)
        else:
            raise DFlashError(f"config.json: layer_types[{i}] = {self.kind!r}: expected linear_attention or "
                              "full_attention")
        mt = c.model_type
        sparse = mt in ALWAYS_MOE or (mt not in NEVER_MOE and c.num_experts > 0 and i not in (c.mlp_only_layers or [])
                                      and (i + 1) % c.decoder_sparse_step == 0)
        self.mlp = (SparseMoE(c, mt in ALWAYS_MOE or bool(getattr(c, "norm_topk_prob", True))) if sparse
                    else SwiGLU(c.hidden_size, c.intermediate_size))
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask, offset):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            x = x + self.linear_attn(h, offset)
        else:
            x = x + self.self_attn(h, cos, sin, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridTarget(TargetShell):
    """The runtime model of the Qwen3-Next / Qwen3.5 hybrid decoders."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__(cfg)
        tc, self.prefix = text_config(cfg, WRAPPERS)
        self.hf = c = hf_config(tc)
        types = list(c.layer_types or [])
        if len(types) != c.num_hidden_layers:
            raise DFlashError(f"config.json: layer_types has {len(types)} entries for {c.num_hidden_layers} layers")
        self.last_pass = (0, 0)   # (start, T) of the last forward: where the linear-attention states can resume
        self.finish(Backbone(c, lambda i: DecoderLayer(c, i), ZeroCenteredRMSNorm),
                    bool(tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))), dtype, max_len)

    def state_name(self, name: str) -> str | None:
        """This model's name for a checkpoint tensor; None for one it does not load (a multimodal
        wrapper's vision tower, the MTP head, a tied lm_head)."""
        if name.startswith("mtp.") or (name == "lm_head.weight" and self.tied):
            return None
        if name.startswith(self.prefix):
            return "model." + name[len(self.prefix):]
        return name if name == "lm_head.weight" or self.prefix == "model." else None

    def rope_table(self, max_len: int, dtype: torch.dtype):
        return PartialRope(self.hf, max_len, dtype)

    def kv_layers(self):
        """The full-attention layers (the linear-attention layers' state: recurrent_state_bytes)."""
        return [layer.self_attn for layer in self.model.layers if layer.kind == "full_attention"]

    def recurrent_state_bytes(self) -> int:
        """The fixed per-sequence state of the linear-attention layers (recurrent + conv window)."""
        return sum(layer.linear_attn.state_bytes() for layer in self.model.layers if layer.kind == "linear_attention")

    def _offset(self, start: int) -> int | None:
        if start == 0:
            return None
        s0, n = self.last_pass
        if not s0 <= start <= s0 + n:
            raise DFlashError(f"start {start}: the linear-attention state is kept for positions {s0}..{s0 + n} "
                              "(the last forward) only; start again from position 0")
        return start - s0

    def decode(self, tokens, x, start: int, pos, mask):
        offset = self._offset(start)
        cos, sin = self.rope(pos)
        for layer in self.model.layers:
            x = layer(x, cos, sin, start, mask, offset)
            yield x
        self.last_pass = (start, tokens.shape[0])


build = HybridTarget   # models/families' entry point for qwen3_next, qwen3_5(_text) and qwen3_5_moe(_text)
