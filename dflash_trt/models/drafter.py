"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` semantics, docs/decode-loop.md).

A stack of Qwen3 decoder blocks whose attention sees two key/value sources: the projected
target context ("KV injection": K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx), no input
layernorm on ctx) and the block being drafted; Q comes from the block only; attention is
non-causal. No embeddings, no lm_head: those are the target's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.models.config import DrafterConfig, load_drafter_config
from dflash_trt.models.layers import Linear, RMSNorm, RopeTable, SwiGLU, apply_rope
from dflash_trt.models.weights import dequantized_state_dict, load_strict, read_state_dict


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
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


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, k_ctx, v_ctx, mask=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
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

    def forward_cached(self, h, q_pos, ctx_kv, mask=None):
        """Draft pass over block states h [N, H] at positions q_pos [N], attending to per-layer
        context K/V (e.g. views of the drafter cache). mask: [N, T_ctx + N] bool (True = attend)."""
        cos, sin = self.rope(q_pos)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    def forward(self, h, q_pos, ctx, ctx_pos, mask=None):
        """Training / uncached form: ctx [T, H] are projected context states at ctx_pos [T]."""
        return self.forward_cached(h, q_pos, self.context_kv(ctx, ctx_pos), mask)


# ---------------------------------------------------------------------------------- checkpoint I/O
_IGNORED_SPECULATORS = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "verifier_lm_head.weight")


def load_drafter(folder: str | Path, dtype: torch.dtype | None = None, max_len: int | None = None,
                 allow_pickle: bool = False) -> DFlashDrafter:
    """Load a z-lab (or speculators) DFlash checkpoint folder: config.json + *.safetensors."""
    folder = Path(folder)
    cfg = load_drafter_config(folder)
    if (folder / "hf_quant_config.json").is_file():
        # an FP8 / NVFP4 drafter from `dflash-trt quantize`: its weights read back as the values
        # the quantized checkpoint encodes, so the CPU runtime measures the tau quantization costs
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

