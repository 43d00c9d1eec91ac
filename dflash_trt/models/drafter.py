"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` semantics, docs/decode-loop.md),
and DFlash2 (z-lab `DFlash2DraftModel`).

A stack of Qwen3 decoder blocks whose attention sees the projected target context ("KV injection":
K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx)) and the block being drafted; Q comes from the block
only. Non-causal unless the config says otherwise (config.layer_attention). No embeddings, no lm_head:
those are the target's. DFlash2 (also vLLM qwen3_dflash2.py) adds a grouped dynamic causal convolution
around attention and the MLP, and drafts through a candidate selector (top-k of the target head's logits,
rescored with a low-rank bilinear term, walked left to right from the anchor).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from dflash_trt.io import compressed_tensors
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.checkpoint import load_config
from dflash_trt.models.config import DrafterConfig, load_drafter_config
from dflash_trt.models.layers import Linear, RMSNorm, RopeTable, SwiGLU, apply_rope
from dflash_trt.models.weights import (
    dequantized_state_dict,
    load_strict,
    read_state_dict,
)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor | None:
    """[N, K] bool (True = attend) for queries at q_pos over keys at k_pos, or None (all visible).
    z-lab/dflash dflash/model.py `_attention_mask`: causal keeps k <= q; a window w keeps q - k < w,
    and when non-causal also k - q < w."""
    if window is None and not causal:
        return None
    d = q_pos[:, None] - k_pos[None, :]
    m = torch.ones(d.shape, dtype=torch.bool)
    if causal:
        m &= d >= 0
    if window is not None:
        m &= d < window
        if not causal:
            m &= -d < window
    return m


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig, layer_idx: int = 0):
        super().__init__()
        self.window, self.causal = c.layer_attention[layer_idx] if c.layer_attention else (None, False)
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b = c.attention_bias
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=b)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin):
        """K, V [nkv, T, hd] of hidden states x [T, H] at the positions of cos/sin."""
        T = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask=None):
        N = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(N, self.nh, self.hd)).transpose(0, 1)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], dim=1)
        v = torch.cat([v_ctx, v_blk], dim=1)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                           enable_gqa=self.nh != self.nkv)[0]
        return self.o_proj(o.transpose(0, 1).reshape(N, self.nh * self.hd))


class GroupedDynamicConv(nn.Module):
    """DFlash2's convolution over the block's positions (row t sees rows t-1.. of the same block,
    never the context). base_kernel [2, taps, H]: side 0 for `prepare`, side 1 for `finish`;
    kernel_projection gives per-token deltas [2, taps, groups] (one per group of group_size
    channels), computed once from `prepare`'s input. out[t] = sum_j (base[j] + delta[t, j]) * x[t-j]
    (z-lab `_grouped_dynamic_convolve`; vLLM `_grouped_conv`, which masks taps that would cross a
    block boundary: position-in-block >= tap)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = Linear(hidden, 2 * taps * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        N, H = x.shape
        blocks = x.view(N, self.groups, self.group_size)
        coef = self.base_kernel[side].to(x.dtype).view(1, self.taps, self.groups, self.group_size) + delta[..., None]
        out = coef[:, 0] * blocks
        for j in range(1, min(self.taps, N)):
            out[j:] += coef[j:, j] * blocks[:-j]
        return out.view(N, H)

    def prepare(self, x: torch.Tensor):
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)
        return self._convolve(x, delta[:, 0], 0), delta[:, 1]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, delta, 1)


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = DrafterAttention(c, layer_idx)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.kind == "dflash2":
            self.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.conv = c.kind == "dflash2"

    def forward(self, h, cos, sin, k_ctx, v_ctx, mask=None):
        """h [N, H]: ONE block's states (DFlash2's convolution runs over its rows)."""
        if not self.conv:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, k_ctx, v_ctx, mask), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)


class CandidateSelector(nn.Module):
    """DFlash2's draft head (z-lab dflash/model.py `CandidateSelector.select`; vLLM
    qwen3_dflash2.py `_score_edges` + spec_decode/dflash2/speculator.py `_selector_walk_kernel`).
    The codebooks are stored without a `.weight` suffix (the z-lab safetensors header; z-lab's
    from_pretrained maps them onto nn.Embedding, vLLM holds them as parameters)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = Linear(hidden, rank, bias=False)

    def scores(self, h: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, predecessor: int, i: int):
        """Scores [K] of position i's candidates given the token chosen before it."""
        pred = self.predecessor_codebook[predecessor].to(h.dtype) * self.hidden_projection(h[i:i + 1])[0]
        return unary[i] + self.successor_codebook[candidates[i]].to(h.dtype) @ pred


def _hf_rope_config(c: DrafterConfig):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                       rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                       max_position_embeddings=c.max_position_embeddings)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, max_len: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        c = cfg
        self.fc = Linear(c.n_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c, i) for i in range(c.num_hidden_layers))
        if c.kind == "dflash2":
            self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RopeTable(_hf_rope_config(c), max_len or c.max_position_embeddings, dtype)
        self.draft_vocab: torch.Tensor | None = None   # token ids to draft from (models/draft_vocab.py)
        self._draft_head = None                        # (lm_head weight, its version, its draft_vocab rows)
        self.to(dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, n_feat*H] (concatenated layer outputs) → context states [T, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV injection, reference form: per layer K, V [nkv, T, hd] of projected context ctx [T, H]."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward_cached(self, h, q_pos, ctx_kv, mask=None, ctx_pos=None):
        """Draft pass over block states h [N, H] at positions q_pos [N], attending to per-layer
        context K/V (e.g. views of the drafter cache, positions 0..T_ctx-1 unless ctx_pos says).
        mask: [N, T_ctx + N] bool (True = attend), the caller's (training batches several blocks);
        None: each layer's own (attention_mask: non-causal full, causal and/or sliding window)."""
        cos, sin = self.rope(q_pos)
        k_pos = None
        for layer, (k, v) in zip(self.layers, ctx_kv):
            m = mask
            if m is None and (layer.self_attn.window is not None or layer.self_attn.causal):
                if k_pos is None:
                    k_pos = torch.cat([torch.arange(k.shape[1]) if ctx_pos is None else ctx_pos, q_pos])
                m = attention_mask(q_pos, k_pos, layer.self_attn.window, layer.self_attn.causal)
            h = layer(h, cos, sin, k, v, m)
        return self.norm(h)

    def forward(self, h, q_pos, ctx, ctx_pos, mask=None):
        """Training / uncached form: ctx [T, H] are projected context states at ctx_pos [T]."""
        return self.forward_cached(h, q_pos, self.context_kv(ctx, ctx_pos), mask, ctx_pos)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """z-lab `DFlashDraftModel.compute_logits`: x output_multiplier, then tanh soft-capping
        (both absent in DFlash (1) configs: logits unchanged). Greedy drafts are unchanged by
        either (both are increasing); sampled drafts are drawn from the scaled distribution."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


# ---------------------------------------------------------------------------------- checkpoint I/O
_IGNORED_SPECULATORS = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "verifier_lm_head.weight")


def load_drafter(folder: str | Path, dtype: torch.dtype | None = None, max_len: int | None = None,
                 allow_pickle: bool = False) -> DFlashDrafter:
    """Load a z-lab (or speculators) DFlash checkpoint folder: config.json + *.safetensors."""
    folder = Path(folder)
    cfg = load_drafter_config(folder)
    if (folder / "hf_quant_config.json").is_file() or compressed_tensors.is_int8_w8a8(load_config(folder)):
        # a quantized drafter (ModelOpt FP8 / NVFP4 from `dflash-trt quantize`, vLLM's INT8 W8A8): its weights
        # read back as the values the engine's kernel multiplies by (models/weights.WEIGHT_FORMATS), so the
        # CPU runtime measures the tau quantization costs
        state = dequantized_state_dict(folder, torch.float32)
        dtype = dtype or torch.float32
    else:
        state = read_state_dict(folder, allow_pickle=allow_pickle)
    # speculators / some exports prefix `model.` and carry the verifier's embeddings: drop those.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if k not in _IGNORED_SPECULATORS}
    if dtype is None:
        dtype = next(iter(state.values())).dtype if state else torch.float32
    model = DFlashDrafter(cfg, max_len=max_len, dtype=dtype)
    load_strict(model, state, folder)
    return model.eval()


def save_drafter(model: DFlashDrafter, folder: str | Path, dtype: torch.dtype | None = None,
                 extra_files: dict[str, bytes] | None = None) -> Path:
    """Write a z-lab checkpoint (config.json + model.safetensors, + extra_files such as a
    draft_vocab.json) atomically."""
    cfg = model.config.to_dict()
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous() for k, v in model.state_dict().items()}
    if dtype is not None or "dtype" in cfg:
        cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    with atomic_output_dir(folder) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, body in (extra_files or {}).items():
            (tmp / name).write_bytes(body)
    return Path(folder)
