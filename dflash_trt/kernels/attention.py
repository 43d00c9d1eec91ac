"""float32 decode attention through csrc/attention.c: row-invariant, so a verify pass matches AR bitwise."""
from __future__ import annotations

import ctypes

import torch

from dflash_trt.kernels import c_loader

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"attend_f32": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int],
               "rope_attend_f32": [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I,
                                   ctypes.c_float, ctypes.c_int]}


def library() -> ctypes.CDLL | None:
    return c_loader.load("attention", _SIGNATURES, openmp=True)


def attend(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
           sinks: torch.Tensor | None, window: int | None, scale: float) -> torch.Tensor:
    """q [nh, T, hd] at positions start..start+T-1 against caches [nkv, L, hd] (rows up to start+T written):
    the attention output [T, nh * hd]. Causal; `window` keys at most (sliding layers); `sinks` [nh] logits."""
    nh, T, hd = q.shape
    nkv, L, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty(T, nh * hd, dtype=torch.float32)
    s = sinks.detach().float().contiguous() if sinks is not None else None
    lib.attend_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), L, s.data_ptr() if s is not None else None,
                   out.data_ptr(), nh, nkv, T, hd, start, window or 0, scale, torch.get_num_threads())
    return out


def rope_attend(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, sinks: torch.Tensor | None,
                window: int | None, scale: float) -> torch.Tensor:
    """attend for q [T, nh, hd], k, v [T, nkv, hd] before RoPE (any row stride): RoPE with cos/sin [T, hd] on q and
    k, k and v into the caches at rows start.., then attend: bitwise apply_rope, the writes and attend, one call."""
    T, nh, hd = q.shape
    nkv, L, _ = k_cache.shape
    q, k, v = (t if t.stride()[1:] == (hd, 1) else t.contiguous() for t in (q, k, v))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(T, nh * hd, dtype=torch.float32)
    s = sinks.detach().float().contiguous() if sinks is not None else None
    lib.rope_attend_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                        cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), L,
                        s.data_ptr() if s is not None else None, out.data_ptr(), nh, nkv, T, hd, start, window or 0,
                        scale, torch.get_num_threads())
    return out
