"""The KV-cached attention every target family's softmax attention runs (models/families).

Static KV cache: a layer owns k/v buffers [n_kv, max_len, head_dim]; a forward writes its tokens at
[start, start+T) and attends to [0, start+T), so cropping a rejected draft is O(1): the next forward's
smaller `start`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.kernels import attention, gemm
from dflash_trt.models.layers import apply_rope

KV_PAD = 64  # attention length granularity of the low-precision path (batch invariance)


def pad_to_chunks(n: int) -> int:
    """n rounded up to whole KV_PAD chunks."""
    return -(-n // KV_PAD) * KV_PAD


def padded_masks(mask: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [T, n] with `extra` masked columns appended, its inverse), made once per pass and kept on the mask."""
    memo = getattr(mask, "_dflash_padded", None)
    if memo is None or memo[0] != extra:
        padded = F.pad(mask, (0, extra), value=False) if extra else mask
        memo = mask._dflash_padded = (extra, padded, ~padded)
    return memo[1], memo[2]


class CachedAttention(nn.Module):
    """Attention of queries against a layer's static K/V cache: nh heads, nkv KV heads of head_dim
    hd, a sliding `window` or None; has_sinks (gpt-oss): the subclass adds a `sinks` parameter [nh].
    The caches k_cache / v_cache are None until TargetShell.setup_cache."""

    def __init__(self, nh: int, nkv: int, hd: int, window: int | None = None, has_sinks: bool = False):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.window, self.has_sinks = window, has_sinks
        self.k_cache = self.v_cache = None

    def store_and_attend(self, q, k, v, cos, sin, start: int, mask):
        """q, k, v [T, heads, hd] before RoPE: RoPE, k and v into the cache at start, attend_cached -> [T, nh*hd]."""
        T = q.shape[0]
        if q.dtype == torch.float32 and q.device.type == "cpu" and T <= gemm.MAX_ROWS \
                and (lib := attention.library()) is not None:
            return attention.rope_attend(lib, q, k, v, cos, sin, self.k_cache, self.v_cache, start,
                                         self.sinks if self.has_sinks else None, self.window, self.hd ** -0.5)
        self.k_cache[:, start:start + T] = apply_rope(k.transpose(0, 1), cos, sin)
        self.v_cache[:, start:start + T] = v.transpose(0, 1)
        return self.attend_cached(apply_rope(q.transpose(0, 1), cos, sin), start, mask)

    def attend_cached(self, q, start: int, mask):
        """q [nh, T, hd] (RoPE applied) against the cache [0, start+T) -> [T, nh*hd], before o_proj."""
        T = q.shape[1]
        decode_sized = T <= gemm.MAX_ROWS   # verify blocks and AR steps; a long prefill runs SDPA in float32
        if q.dtype == torch.float32 and q.device.type == "cpu" and decode_sized \
                and (lib := attention.library()) is not None:
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
            n = min(pad_to_chunks(n), self.k_cache.shape[1])
        mask, blocked = padded_masks(mask, n - start - T)
        k, v = self.k_cache[:, :n], self.v_cache[:, :n]
        if self.window is not None:
            mask = mask & (torch.arange(n)[None, :] > torch.arange(start, start + T)[:, None] - self.window)
            blocked = ~mask
        if not (invariant or self.has_sinks):
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                               enable_gqa=self.nh != self.nkv)[0]
        elif q.dtype == torch.float32 and decode_sized:
            # (without a C compiler) oneDNN's bf16 bmm is row-invariant at these shapes, MKL's float32
            # bmm is not (measured): one query row per call, each the very call an AR step makes
            o = torch.cat([self._attend_rows(q[:, t:t + 1], k, v, blocked[t:t + 1]) for t in range(T)], 1)
        else:
            o = self._attend_rows(q, k, v, blocked)
        return o.transpose(0, 1).reshape(T, self.nh * self.hd)

    def _attend_rows(self, q, k, v, blocked):
        """q [nh, T, hd] against k, v [nkv, n, hd] (blocked [T, n]: keys a row must not see). A KV group's
        nh/nkv query heads are one bmm of rep*T rows: no repeat_interleave copy of K/V per layer and step."""
        (nh, T, hd), rep = q.shape, self.nh // self.nkv
        s = (q.reshape(self.nkv, rep * T, hd) @ k.transpose(1, 2)).view(self.nkv, rep, T, -1) * hd ** -0.5
        if not self.has_sinks:
            p = torch.softmax(s.float().masked_fill(blocked, float("-inf")), dim=-1)
        else:
            # gpt-oss: a learned per-head logit joins the softmax denominator and is then dropped. It goes
            # first, so a row's entries keep their places whatever the row's length (batch invariance).
            s = s.masked_fill(blocked, float("-inf"))
            s = torch.cat([self.sinks.to(s.dtype).view(self.nkv, rep, 1, 1).expand(-1, -1, T, 1), s], dim=-1)
            p = torch.softmax(s - s.max(-1, keepdim=True).values, dim=-1)[..., 1:]
        return (p.to(v.dtype).view(self.nkv, rep * T, -1) @ v).view(nh, T, hd)
