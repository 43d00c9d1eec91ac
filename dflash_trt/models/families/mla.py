"""Multi-head Latent Attention targets: DeepSeek-V3 (the layout Kimi K2.x ships), Kimi K2.5's text
decoder (kimi_k25) and GLM-5 (glm_moe_dsa: MLA plus DeepSeek Sparse Attention's lightning indexer), as
transformers 5.24 computes them; Hugging Face parameter names.

Static cache, as the serving engines keep MLA: per layer the normed latent and the rotated shared key
(GLM: plus the indexer's key). Attention is computed in the latent space (kv_b_proj absorbed), so the
per-head keys and values are never materialized; it equals transformers' up to rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.kernels import gemm
from dflash_trt.models.attention import pad_to_chunks
from dflash_trt.models.families.family import Family
from dflash_trt.models.layers import Linear, RMSNorm, SwiGLU, linear
from dflash_trt.models.shell import Backbone, TargetShell, hf_config, text_config

WRAPPERS = {"kimi_k25": "deepseek_v3"}   # multimodal -> its text decoder (Kimi_K25Config: kimi_k2 is deepseek_v3)
# The wrapper's multimodal placeholders (Kimi_K25Model.forward): in text-only input embedded as token 0
PLACEHOLDERS = ("image_token_id", "video_token_id")
# What the pipeline asks of each model type (models/families/family.py): a plain decoder's answers; the
# planner sizes them from transformers' model (MLA's latent KV: plan/family_shapes.py)
TRAITS = {"deepseek_v3": Family(), "kimi_k25": Family(), "glm_moe_dsa": Family()}


def softmax_scale(c) -> float:
    """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when the RoPE is scaled."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    p = c.rope_parameters or {}
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim", 0) and p["factor"] > 1:
        scale *= (0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0) ** 2   # yarn's mscale
    return scale


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., T, D], cos/sin [T, D] (cat(freqs, freqs)). interleave: DeepSeek's (x0, x1), (x2, x3)
    pairs, written back de-interleaved (first halves, then second halves) as transformers does."""
    if not interleave:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    """DSA's lightning indexer: per query, the index_topk cached keys attention may look at."""

    def __init__(self, c):
        super().__init__()
        self.nh, self.hd, self.rd, self.topk = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim, c.index_topk
        self.wq_b = Linear(c.q_lora_rank, self.nh * self.hd, bias=False)
        self.wk = Linear(c.hidden_size, self.hd, bias=False)
        self.k_norm = nn.LayerNorm(self.hd, eps=1e-6)
        self.weights_proj = Linear(c.hidden_size, self.nh, bias=False)
        self.k_cache = None

    def forward(self, x, q_resid, cos, sin, start: int, mask) -> torch.Tensor:
        """The selected keys as a bool mask [T, start+T] (True: attend)."""
        T, n = x.shape[0], start + x.shape[0]
        q = self.wq_b(q_resid).view(T, self.nh, self.hd)
        k = self.k_norm(self.wk(x))
        # rope on the first qk_rope_head_dim dims (the main attention ropes its last ones), interleaved
        q = torch.cat([rope(q[..., :self.rd].transpose(0, 1), cos, sin, True).transpose(0, 1), q[..., self.rd:]], -1)
        k = torch.cat([rope(k[:, :self.rd], cos, sin, True), k[:, self.rd:]], -1)
        self.k_cache[start:n] = k
        # float32 scores and a relu, as transformers (whatever the model's dtype); outside the
        # float64 oracle one query row per product, so a verify block selects what AR steps do
        keys = self.k_cache[:n].float().T
        weights = self.weights_proj(x).float() * self.nh ** -0.5                              # [T, nh]

        def score(t):   # rows t: [t, n]
            return (weights[t].unsqueeze(1) @ F.relu((q[t].float() @ keys) * self.hd ** -0.5)).squeeze(1)

        rows = [slice(0, T)] if x.dtype == torch.float64 else [slice(t, t + 1) for t in range(T)]
        index = torch.cat([score(t) for t in rows]).masked_fill(~mask, float("-inf"))
        if n <= self.topk:
            return mask
        # ties (relu zeros) go to the earlier key, whatever the row's length: a verify block and
        # one-token steps select the same keys
        top = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :self.topk]
        return torch.zeros_like(mask).scatter(-1, top, True) & mask


class MLAttention(nn.Module):
    def __init__(self, c, layer_idx: int, glm: bool):
        super().__init__()
        self.nh = c.num_attention_heads
        self.nope, self.rd, self.vd, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        bias = bool(getattr(c, "attention_bias", False))
        qd = self.nh * (self.nope + self.rd)
        self.q_lora = c.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)   # transformers' default eps, not rms_norm_eps
            self.q_b_proj = Linear(c.q_lora_rank, qd, bias=False)
        else:
            self.q_proj = Linear(c.hidden_size, qd, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rd, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = Linear(self.nh * self.vd, c.hidden_size, bias=bias)
        self.interleave = glm or bool(getattr(c, "rope_interleave", True))
        self.scale = softmax_scale(c)
        # GLM: a "shared" layer reuses the previous full layer's selection
        types = getattr(c, "indexer_types", None)
        self.indexer = Indexer(c) if glm and (types is None or types[layer_idx] == "full") else None
        self.uses_index = glm
        self.latent_cache = self.rope_cache = None

    def forward(self, x, cos, sin, start: int, mask, selected):
        T, n = x.shape[0], start + x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = (self.q_b_proj(q_resid) if self.q_lora else self.q_proj(x)).view(T, self.nh, -1).transpose(0, 1)
        q_nope, q_rot = q[..., :self.nope], rope(q[..., self.nope:], cos, sin, self.interleave)
        kv = self.kv_a_proj_with_mqa(x)
        self.latent_cache[start:n] = self.kv_a_layernorm(kv[:, :self.rank])
        self.rope_cache[start:n] = rope(kv[:, self.rank:], cos, sin, self.interleave)
        if self.indexer is not None:
            selected = self.indexer(x, q_resid, cos, sin, start, mask)
        elif self.uses_index and selected is None:
            raise DFlashError("config.json: indexer_types: a 'shared' layer comes before any 'full' one")
        attend = selected if self.uses_index else mask
        o = self._attend(q_nope, q_rot, start, attend)                                          # [nh, T, vd]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.nh * self.vd)), selected

    def _attend(self, q_nope, q_rot, start, mask):
        n = start + q_nope.shape[1]
        w = self.kv_b_proj.weight.reshape(self.nh, self.nope + self.vd, self.rank)
        w_k, w_v = w[:, :self.nope], w[:, self.nope:]             # per head: k_nope = w_k @ latent, v = w_v @ latent
        rows = q_nope.dtype != torch.float64 and q_nope.shape[1] <= gemm.MAX_ROWS
        if rows:
            # Batch invariance (models/attention.py): whole KV_PAD chunks, one query row per product;
            # the padding is masked, so it adds exact zeros
            n = min(pad_to_chunks(n), self.latent_cache.shape[0])
            mask = F.pad(mask, (0, n - mask.shape[1]), value=False)
        latent, k_rot = self.latent_cache[:n], self.rope_cache[:n]

        def block(qn, qr, m):
            s = ((qn @ w_k) @ latent.T + qr @ k_rot.T) * self.scale                           # [nh, t, n]
            p = torch.softmax(s.float().masked_fill(~m, float("-inf")), dim=-1).to(latent.dtype)
            return (p @ latent) @ w_v.transpose(1, 2)                                          # [nh, t, vd]

        if rows:
            return torch.cat([block(q_nope[:, t:t + 1], q_rot[:, t:t + 1], mask[t:t + 1])
                              for t in range(q_nope.shape[1])], 1)
        return block(q_nope, q_rot, mask)


class Router(nn.Module):
    """DeepSeek's routing: sigmoid scores, + e_score_correction_bias for the choice only, the best
    topk_group of n_group groups (a group's score: its top two), top-k experts, weights normed and
    scaled. In float32, as transformers (which keeps gate.weight in float32)."""

    def __init__(self, c):
        super().__init__()
        E = c.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.top_k, self.groups, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm, self.scaling = c.norm_topk_prob, c.routed_scaling_factor
        if E % self.groups or E // self.groups < 2:
            raise DFlashError(f"config.json: n_routed_experts = {E} must split into n_group = {self.groups} groups "
                              "of at least 2")

    def forward(self, x):
        scores = torch.sigmoid(linear(x.float(), self.weight.float()))   # (batch-invariant: see layers.linear)
        choice = scores + self.e_score_correction_bias.float()
        T, E = choice.shape
        group = choice.view(T, self.groups, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group).scatter(1, group.topk(self.topk_group, dim=-1).indices, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.groups, 1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = Router(c)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts))
        self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def forward(self, x):
        idx, weights = self.gate(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, (self.experts[e](x[tok]) * weights[tok, slot, None]).to(out.dtype))
        return out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, c, i: int, glm: bool):
        super().__init__()
        self.self_attn = MLAttention(c, i, glm)
        types = getattr(c, "mlp_layer_types", None)
        sparse = types[i] == "sparse" if types else i >= c.first_k_dense_replace
        self.mlp = MoE(c) if sparse else SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask, selected=None):
        a, selected = self.self_attn(self.input_layernorm(x), cos, sin, start, mask, selected)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), selected


class MLAModel(TargetShell):
    """The runtime model of the MLA families."""

    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__(cfg)
        tc, _ = text_config(cfg, WRAPPERS)
        self.hf = c = hf_config(tc)
        if getattr(c, "hidden_act", "silu") != "silu":
            raise DFlashError(f"config.json: hidden_act {c.hidden_act!r}: the MLA families run silu only")
        self.wrapped = cfg.get("model_type") in WRAPPERS   # kimi_k25
        top = hf_config(cfg) if self.wrapped else c
        if self.wrapped:
            self.placeholders = tuple(i for n in PLACEHOLDERS if (i := getattr(top, n, None)) is not None)
        self.mtp_layers = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
        glm = c.model_type == "glm_moe_dsa"
        self.finish(Backbone(c, lambda i: DecoderLayer(c, i, glm)),
                    bool(getattr(top, "tie_word_embeddings", False)), dtype, max_len)   # kimi_k25: the wrapper's flag
        for m in self.modules():
            if isinstance(m, Router):   # kept in float32, as transformers keeps gate.weight and the bias
                m.float()

    def cache_bytes_per_position(self) -> int:
        per = 0
        for layer in self.model.layers:
            a = layer.self_attn
            per += a.rank + a.rd + (a.indexer.hd if a.indexer is not None else 0)
        return per * self.dtype.itemsize

    def allocate_cache(self, max_len: int) -> None:
        for layer in self.model.layers:
            a = layer.self_attn
            a.latent_cache = torch.zeros(max_len, a.rank, dtype=self.dtype)
            a.rope_cache = torch.zeros(max_len, a.rd, dtype=self.dtype)
            if a.indexer is not None:
                a.indexer.k_cache = torch.zeros(max_len, a.indexer.hd, dtype=self.dtype)

    def state_name(self, name: str) -> str | None:
        """This model's name for a checkpoint tensor; None for one it does not load. kimi_k25 stores
        the decoder as language_model.model.* / language_model.lm_head.weight (transformers 5.24
        writes the layers as language_model.model.blocks.*), next to the vision tower and projector,
        which the text runtime does not use. The multi-token-prediction layers after the last
        decoder layer (num_nextn_predict_layers: DeepSeek-V3's model.layers.61, GLM-5's 78) are
        dropped, as transformers ignores them."""
        k = name
        if self.wrapped:
            for prefix, to in (("language_model.model.", "model."), ("model.language_model.", "model."),
                               ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
                if k.startswith(prefix):
                    rest = k[len(prefix):]
                    k = to + ("layers." + rest[len("blocks."):] if rest.startswith("blocks.") else rest)
                    break
            else:
                return None
        parts = k.split(".", 3)
        if parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
                self.num_layers <= int(parts[2]) < self.num_layers + self.mtp_layers:
            return None
        return k

    def decode(self, tokens, x, start: int, pos, mask):
        cos, sin = self.rope(pos)
        selected = None
        for layer in self.model.layers:
            x, selected = layer(x, cos, sin, start, mask, selected)
            yield x


build = MLAModel   # models/families' entry point for deepseek_v3, kimi_k25 and glm_moe_dsa
