"""Target models for the CPU reference runtime: Llama, Qwen3 and gpt-oss, gpt-fast style (the other
families are modules of their own, models/families; load_target looks a config's family up there).

One module per family would repeat 90% of the code, so one decoder handles all three, switched by
config fields (qk-norm for Qwen3; biases, attention sinks, sliding windows and MoE for gpt-oss).
Parameter names are Hugging Face's, so checkpoints load as they are.

Static KV cache: every layer owns k/v buffers [n_kv, max_len, head_dim]; a forward writes its
tokens at [start, start+T) and attends to [0, start+T). Cropping after a rejected draft is just
calling the next forward with a smaller `start` (O(1), no copy).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json
from dflash_trt.kernels import attention, gemm
from dflash_trt.models.config import require_target_config
from dflash_trt.models.families import RUNTIME_FAMILIES, family_module
from dflash_trt.models.layers import Linear, RMSNorm, RopeTable, SwiGLU, apply_rope, linear
from dflash_trt.models.weights import dequantize_mxfp4, load_strict, read_state_dict

SUPPORTED = tuple(RUNTIME_FAMILIES)   # the model types the CPU runtime runs (models/families)


def hf_config(cfg: dict):
    """The transformers config object for a config.json dict (used for RoPE and the oracles)."""
    from transformers import AutoConfig

    mt = cfg.get("model_type")
    if RUNTIME_FAMILIES.get(mt) != __name__:   # this decoder's families (quant/calibrate runs its layers too)
        ours = [t for t, m in RUNTIME_FAMILIES.items() if m == __name__]
        raise DFlashError(f"config.json: model_type {mt!r} is not supported (supported: {', '.join(ours)})")
    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version", "quantization_config")}
    try:
        return AutoConfig.for_model(mt, **kw)
    except Exception as e:  # noqa: BLE001  transformers validates fields with many exception types
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise DFlashError(f"config.json: transformers refuses this {mt} config ({msg})") from None


KV_PAD = 64  # attention length granularity of the low-precision path (batch invariance)


class Attention(nn.Module):
    def __init__(self, c, layer_idx: int):
        super().__init__()
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=bias)
        self.qk_norm = c.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.has_sinks = c.model_type == "gpt_oss"
        if self.has_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.nh))
        types = getattr(c, "layer_types", None)
        self.window = c.sliding_window if types and types[layer_idx] == "sliding_attention" else None
        self.k_cache = self.v_cache = None

    def forward(self, x, cos, sin, start: int, mask):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd)
        k = self.k_proj(x).view(T, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        self.k_cache[:, start:start + T] = apply_rope(k.transpose(0, 1), cos, sin)
        self.v_cache[:, start:start + T] = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        return self.o_proj(self.attend_cached(q, start, mask))

    def attend_cached(self, q, start: int, mask):
        """q [nh, T, hd] (RoPE applied) against the cache [0, start+T) -> [T, nh*hd], before o_proj.
        (models/families reuse it for their own projections.)"""
        T = q.shape[1]
        decode_sized = T <= gemm.MAX_ROWS   # verify blocks and AR steps; a long prefill runs SDPA in float32
        if q.dtype == torch.float32 and decode_sized and (lib := attention.library()) is not None:
            sinks = self.sinks if self.has_sinks else None
            return attention.attend(lib, q, self.k_cache, self.v_cache, start, sinks, self.window, self.hd ** -0.5)
        n = start + T
        # float64 is for oracles: SDPA, as transformers runs it
        invariant = q.dtype in (torch.bfloat16, torch.float16) or (q.dtype == torch.float32 and decode_sized)
        if invariant:
            # Batch invariance: a query row's result must not depend on how many rows are computed
            # together, so that a T-token verify pass and T one-token AR steps give bitwise identical
            # logits and greedy DFlash is exactly lossless (tests/test_runtime_lossless.py). SDPA's CPU
            # kernel is not invariant; HF's eager attention (bmm, float32 softmax, bmm) is, once the
            # P·V reduction runs over whole KV_PAD chunks (the K-loop tail otherwise changes the
            # summation order with the length; masked rows add exact zeros).
            n = min(-(-n // KV_PAD) * KV_PAD, self.k_cache.shape[1])
            mask = F.pad(mask, (0, n - start - T), value=False)
        k, v = self.k_cache[:, :n], self.v_cache[:, :n]
        if self.window is not None:
            mask = mask & (torch.arange(n)[None, :] > torch.arange(start, start + T)[:, None] - self.window)
        if invariant or self.has_sinks:
            o = self._attend_eager(q, k, v, mask)
        else:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                               enable_gqa=self.nh != self.nkv)[0]
        return o.transpose(0, 1).reshape(T, self.nh * self.hd)

    def _attend_eager(self, q, k, v, mask):
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        if q.dtype == torch.float32 and q.shape[1] <= gemm.MAX_ROWS:
            # (without a C compiler) oneDNN's bf16 bmm is row-invariant at these shapes, MKL's float32
            # bmm is not (measured): one query row per call, each the very call an AR step makes
            return torch.cat([self._attend_rows(q[:, t:t + 1], k, v, mask[t:t + 1]) for t in range(q.shape[1])], 1)
        return self._attend_rows(q, k, v, mask)

    def _attend_rows(self, q, k, v, mask):
        s = (q @ k.transpose(1, 2)) * self.hd ** -0.5
        if not self.has_sinks:
            p = torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=-1)
            return p.to(v.dtype) @ v
        # gpt-oss: a learned per-head logit joins the softmax denominator and is then dropped. It goes
        # first, so a row's entries keep their places whatever the row's length (batch invariance).
        s = s.masked_fill(~mask, float("-inf"))
        s = torch.cat([self.sinks.to(s.dtype).view(-1, 1, 1).expand(-1, s.shape[1], 1), s], dim=-1)
        p = torch.softmax(s - s.max(-1, keepdim=True).values, dim=-1)[..., 1:]
        return p.to(v.dtype) @ v


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
        self.mlp = MoE(c) if c.model_type == "gpt_oss" else SwiGLU(c.hidden_size, c.intermediate_size,
                                                                    bool(getattr(c, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096):
        super().__init__()
        self.cfg = cfg
        self.hf = c = hf_config(cfg)
        self.model = Backbone(c)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = RopeTable(c, max(max_len, 1), dtype)
        self.num_layers = c.num_hidden_layers
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.max_len = 0
        self.to(dtype)

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.lm_head_weight())   # a tied embedding gets its packed copy too

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def cache_bytes_per_position(self) -> int:
        return sum(2 * a.nkv * a.hd * self.dtype.itemsize for a in (layer.self_attn for layer in self.model.layers))

    def setup_cache(self, max_len: int):
        """Allocate (or keep, if large enough) the static KV cache."""
        if max_len <= self.max_len:
            return
        max_len = -(-max_len // KV_PAD) * KV_PAD  # whole KV_PAD chunks: see Attention._attend_eager
        if max_len > self.rope.cos.shape[0]:
            self.rope = RopeTable(self.hf, max_len, self.dtype)
        for layer in self.model.layers:
            a = layer.self_attn
            a.k_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
            a.v_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
        self.max_len = max_len

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, capture: list[int] = (), all_logits: bool = False):
        """tokens [T] at positions [start, start+T). Returns (logits [T or 1, V], features [T, len(capture)*H]).
        features are the outputs of the captured decoder layers (HF hidden_states[i + 1])."""
        T = tokens.shape[0]
        if start + T > self.max_len:
            raise DFlashError(f"sequence of {start + T} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        pos = torch.arange(start, start + T)
        cos, sin = self.rope(pos)
        mask = torch.arange(start + T)[None, :] <= pos[:, None]
        x = self.model.embed_tokens(tokens)
        feats = {}
        last = self.num_layers - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start, mask)
            if i in capture and i != last:
                feats[i] = x
        x = self.model.norm(x)
        if last in capture:  # HF's last hidden state is taken after the final norm
            feats[last] = x
        logits = self.logits(x if all_logits else x[-1:])
        features = torch.cat([feats[i] for i in capture], dim=-1) if capture else None
        return logits, features


def build(cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096) -> TargetModel:
    """models/families' entry point for llama, qwen3 and gpt_oss."""
    return TargetModel(cfg, dtype=dtype, max_len=max_len)


# ---------------------------------------------------------------------------------- loading
def build_target(cfg: dict, dtype: torch.dtype = torch.float32, max_len: int = 4096) -> nn.Module:
    """The runtime's model of a target config (any family of models/families)."""
    module = family_module(cfg.get("model_type"))
    if module is None:
        raise DFlashError(f"config.json: model_type {cfg.get('model_type')!r} is not supported by the CPU runtime "
                          f"(supported: {', '.join(SUPPORTED)})")
    return module.build(cfg, dtype=dtype, max_len=max_len)


def load_target(folder: str | Path, dtype: torch.dtype = torch.float32, max_len: int = 4096,
                allow_pickle: bool = False) -> TargetModel:
    folder = Path(folder)
    cfg = require_target_config(read_json(folder / "config.json"), str(folder / "config.json"))
    if "model_type" not in cfg:
        raise DFlashError(f"{folder / 'config.json'}: missing field model_type")
    model = build_target(cfg, dtype=dtype, max_len=max_len)
    state = dequantize_mxfp4(read_state_dict(folder, allow_pickle=allow_pickle))
    if getattr(model, "tied", False):
        state.pop("lm_head.weight", None)
    if (rename := getattr(model, "state_name", None)) is not None:   # a family whose checkpoint wraps its decoder
        state = {n: t for name, t in state.items() if (n := rename(name)) is not None}
    load_strict(model, state, folder)
    return model.eval()


def stop_token_ids(folder: str | Path) -> list[int]:
    """End-of-sequence ids, from generation_config.json when present (as HF generate does)."""
    folder = Path(folder)
    src = folder / "generation_config.json"
    path = src if src.exists() else folder / "config.json"
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise DFlashError(f"{path}: eos_token_id = {eos!r:.60}: must be a token id or a list of token ids")
    return list(ids)
