"""Building blocks shared by the target models and the drafter: RMSNorm, RoPE tables (full and partial), SwiGLU.

Plain modules with Hugging Face parameter names, so state dicts load without renaming.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.kernels import c_loader, gemm


def _rmsnorm_library():
    return c_loader.load("rmsnorm", {"rmsnorm_f32": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() \
                and not c_loader.capturing() and (lib := _rmsnorm_library()) is not None:
            x = x.contiguous()   # every float32 row through this path alike, whatever its layout (invariance)
            out = torch.empty_like(x)
            lib.rmsnorm_f32(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                            x.shape[-1], self.eps)
            return out
        # Normalize in at least float32 (as HF does for bf16); float64 stays float64 for oracles.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariant: row i of an M-row product equals the one-row product bitwise, so an
    AR step matches its row of a verify pass. float32 runs the packed C kernel (kernels/gemm.py),
    invariant by construction. bf16/fp16 run torch's oneDNN with one row run as two: its brgemm blocks
    K differently for M=1 than for M>=2 once K > 1024 (AVX512-BF16 without AMX: SmolLM2's down_proj
    576x1536 gives ~1 output in 6000 one ulp off); every M>=2 agrees (measured M=2..32)."""
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16):
        return F.linear(x.expand(2, -1), w, b)[:1]
    return gemm.linear(x, w, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x):
        gate, up = gemm.linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for any RoPE variant (default, llama3, yarn, ...),
    computed by transformers' own functions so scaled variants match the reference exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise DFlashError(f"config.json: rope_type {rope_type!r} is not a RoPE variant transformers knows "
                          f"({', '.join(['default', *sorted(ROPE_INIT_FUNCTIONS)])})")
    try:
        if rope_type == "default":
            base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        # the variant's parameters (factor, original_max_position_embeddings, ...) missing or of the wrong type
        raise DFlashError(f"config.json: the {rope_type} RoPE parameters are incomplete or invalid "
                          f"({type(e).__name__}: {e})") from None


def partial_rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """rope_inv_freq for RoPE on the first head_dim * partial_rotary_factor features of each head
    (Qwen3-Next / Qwen3.5 gated attention, MiniMax-M2): transformers' default variant of the shared
    helper ignores the partial factor, the families' own rotary embeddings do not."""
    p = getattr(hf_config, "rope_parameters", None) or {}
    if p.get("rope_type", "default") != "default":
        return rope_inv_freq(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    return 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, max_len: int, dtype: torch.dtype):
    """cos/sin [max_len, 2 * len(inv_freq)] (cat(freqs, freqs)), in float32 and then cast, as
    transformers computes them, so float64 runs match its oracle."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :].float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class RopeTable(nn.Module):
    """cos/sin for positions [0, max_len), precomputed once (static shapes, gpt-fast style), from
    `frequencies(hf_config)` -> (inv_freq, attention scaling) (default: rope_inv_freq)."""

    def __init__(self, hf_config, max_len: int, dtype: torch.dtype, frequencies=rope_inv_freq):
        super().__init__()
        cos, sin = rope_cos_sin(*frequencies(hf_config), max_len, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def length(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor):
        return self.cos[positions], self.sin[positions]


class PartialRope(RopeTable):
    """RopeTable over the first rotary_dim = head_dim * partial_rotary_factor features (apply_partial_rope)."""

    def __init__(self, hf_config, max_len: int, dtype: torch.dtype):
        super().__init__(hf_config, max_len, dtype, partial_rope_inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D], cos/sin [T, D]: rotate-half RoPE (HF / Qwen3 / Llama / gpt-oss convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope on the first cos.shape[-1] features of each head; the rest pass through."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
