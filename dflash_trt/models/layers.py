"""Building blocks shared by the target models and the drafter: RMSNorm, RoPE tables, SwiGLU.

Plain modules with Hugging Face parameter names, so state dicts load without renaming.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in at least float32 (as HF does for bf16); float64 stays float64 for oracles.
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for any RoPE variant (default, llama3, yarn, ...),
    computed by transformers' own functions so scaled variants match the reference exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


class RopeTable(nn.Module):
    """cos/sin for positions [0, max_len), precomputed once (static shapes, gpt-fast style).
    Computed in float32 and cast, as transformers does, so float64 runs match its oracle."""

    def __init__(self, hf_config, max_len: int, dtype: torch.dtype):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :].float()
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor):
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D], cos/sin [T, D]: rotate-half RoPE (HF / Qwen3 / Llama / gpt-oss convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
