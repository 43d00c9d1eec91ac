"""KV injection: accepted tokens' target features → K, V of every drafter layer, written into the
drafter's KV cache (docs/decode-loop.md). Three implementations of one semantics:

1. `reference_kv` / `reference_inject_*`: plain PyTorch, mirroring `dflash_trt.models.drafter` line by
   line (fc → hidden_norm → per layer k_proj → k_norm → RoPE, v_proj), then a per-layer write.
2. `FusedKVInjector(..., backend="torch")`: one GEMM for fc, one GEMM over all layers' K and V
   weights concatenated (hidden_norm's weight folded into them, its 1/rms applied after the
   GEMM), a batched k_norm + RoPE over all layers, one scatter into the cache. The CPU runtime's
   default.
3. `FusedKVInjector(..., backend="triton")`: the same with the Triton kernel in
   dflash_trt/kernels/kv_inject_triton.py doing GEMM 2 and the epilogue in one launch (run on this CPU with
   Triton's interpreter; compiled ahead of time for GPUs by `dflash_trt.stacks.trtllm.plugin`).

Cache layouts. Paged (as serving engines use): `k_cache, v_cache [num_pages, L, nkv, page_size,
hd]`, a token's slot = block_table[pos // page_size] * page_size + pos % page_size
(`slots_from_block_table`), slot < 0 = padding, skipped. Contiguous (the CPU runtime's):
`[L, nkv, max_len, hd]`, rows start..start+T-1. Optional FP8 (float8_e4m3fn) caches store
clamp(x / scale, ±448) with one per-tensor scale for K and one for V.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from dflash_trt.errors import DFlashError
from dflash_trt.kernels import c_loader as ckernels
from dflash_trt.kernels import kv_inject_trt
from dflash_trt.models.layers import apply_rope

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CONTIGUOUS_PAGE_SHIFT = 30  # a contiguous cache is one page of 2^30 rows (stride_page 0)


# ------------------------------------------------------------------------------------- validation
def _check_features(cfg, features: torch.Tensor, positions: torch.Tensor, rope_len: int) -> int:
    want = cfg.n_features * cfg.hidden_size
    if features.dim() != 2 or features.shape[1] != want:
        raise DFlashError(f"features: shape {tuple(features.shape)}, the drafter config implies [T, {want}] "
                          f"({cfg.n_features} features x hidden_size {cfg.hidden_size})")
    T = features.shape[0]
    if tuple(positions.shape) != (T,):
        raise DFlashError(f"positions: shape {tuple(positions.shape)}, expected [{T}] (one per feature row)")
    if T and (int(positions.min()) < 0 or int(positions.max()) >= rope_len):
        raise DFlashError(f"positions: values must lie in [0, {rope_len}) (the drafter's RoPE table length)")
    return T


def check_page_size(page_size: int) -> int:
    if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        raise DFlashError(f"page_size: {page_size} is not a power of two (the kernel splits slots with shifts)")
    return page_size.bit_length() - 1


def _check_caches(cfg, k_cache, v_cache, k_scale, v_scale, page_size: int | None = None) -> bool:
    """Both caches against the drafter config (paged [pages, L, nkv, page_size, hd], or contiguous
    [L, nkv, max_len, hd] without page_size), and an FP8 cache's scales; True for an FP8 cache."""
    L, nkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if page_size is not None and (cache.dim() != 5 or tuple(cache.shape[1:]) != (L, nkv, page_size, hd)):
            raise DFlashError(f"{name}: shape {tuple(cache.shape)}, the drafter config implies [num_pages, {L}, "
                              f"{nkv}, {page_size}, {hd}] (pages, layers, kv heads, page_size, head_dim)")
        if page_size is None and (cache.dim() != 4 or cache.shape[0] != L or cache.shape[1] != nkv
                                  or cache.shape[3] != hd):
            raise DFlashError(f"{name}: shape {tuple(cache.shape)}, the drafter config implies "
                              f"[{L}, {nkv}, max_len, {hd}]")
        if not cache.is_contiguous():
            raise DFlashError(f"{name}: must be contiguous")
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 and (k_scale is None or v_scale is None):
        raise DFlashError("k_scale/v_scale: an FP8 KV cache needs both per-tensor scales")
    return fp8


def _check_rows(k_cache, start: int, T: int) -> None:
    if start < 0 or start + T > k_cache.shape[2]:
        raise DFlashError(f"k_cache: rows {start}..{start + T - 1} do not fit max_len {k_cache.shape[2]}")


def slots_from_block_table(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of each position for one sequence: block_table[pos // page] * page + pos % page."""
    check_page_size(page_size)
    page_idx = positions // page_size
    if int(page_idx.max()) >= block_table.numel():
        raise DFlashError(f"block_table: {block_table.numel()} pages do not cover position {int(positions.max())}")
    return block_table[page_idx] * page_size + positions % page_size


# ---------------------------------------------------------------------------------- (1) reference
@torch.no_grad()
def reference_kv(drafter, features: torch.Tensor, positions: torch.Tensor):
    """Per layer (K, V) [nkv, T, hd], written out as the drafter module computes them."""
    T = _check_features(drafter.config, features, positions, drafter.rope.cos.shape[0])
    ctx = drafter.hidden_norm(drafter.fc(features))          # DFlashDrafter.project_context
    cos, sin = drafter.rope(positions)                        # DFlashDrafter.context_kv
    out = []
    for layer in drafter.layers:                              # DrafterAttention.kv
        a = layer.self_attn
        k = a.k_norm(a.k_proj(ctx).view(T, a.nkv, a.hd)).transpose(0, 1)
        v = a.v_proj(ctx).view(T, a.nkv, a.hd).transpose(0, 1)
        out.append((apply_rope(k, cos, sin), v))
    return out


def quantize_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    return (x.float() / float(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _store(cache_rows: torch.Tensor, x: torch.Tensor, scale) -> None:
    cache_rows.copy_(quantize_fp8(x, scale) if cache_rows.dtype == FP8_DTYPE else x)


@torch.no_grad()
def reference_inject_paged(drafter, features, positions, slots, k_cache, v_cache, page_size: int,
                           k_scale=None, v_scale=None) -> None:
    check_page_size(page_size)
    _check_caches(drafter.config, k_cache, v_cache, k_scale, v_scale, page_size)
    kv = reference_kv(drafter, features, positions)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, off = divmod(slot, page_size)
        for l, (k, v) in enumerate(kv):
            _store(k_cache[page, l, :, off], k[:, t], k_scale)
            _store(v_cache[page, l, :, off], v[:, t], v_scale)


@torch.no_grad()
def reference_inject_contiguous(drafter, features, positions, k_cache, v_cache, start: int,
                                k_scale=None, v_scale=None) -> None:
    _check_caches(drafter.config, k_cache, v_cache, k_scale, v_scale)
    kv = reference_kv(drafter, features, positions)
    T = features.shape[0]
    _check_rows(k_cache, start, T)
    for l, (k, v) in enumerate(kv):
        _store(k_cache[l, :, start:start + T], k, k_scale)
        _store(v_cache[l, :, start:start + T], v, v_scale)


# ------------------------------------------------------------------------------- (2)/(3) fused
def rope_weight_tables(k_norm_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_norm's weight folded into rotate-half RoPE: rope(n * w) = n * (w * cos) + roll(n, hd/2) * (s * sin),
    s = roll(w, hd/2) with the first half negated. Returns (w, s) as [L, 1, hd] (broadcast over kv heads)."""
    half = k_norm_w.shape[-1] // 2
    s = k_norm_w.roll(half, -1).clone()
    s[..., :half].neg_()
    return k_norm_w[:, None, :].contiguous(), s[:, None, :].contiguous()


def fused_kv_from_ctx(ctx_raw, w_kv_t, b_kv, k_norm_w, cos_tab, sin_tab, positions, eps: float, L: int, nkv: int,
                      out=None, rope_w=None):
    """Path (2) after fc: one GEMM over all layers' K|V columns (w_kv_t [H, L*2*nkv*hd], hidden_norm's
    weight folded in), then k_norm and RoPE over all layers at once. ctx_raw [T, H] = fc(features) →
    K, V [T, L, nkv, hd] in ctx_raw's dtype, or written into out = (k_dst, v_dst) (views of that shape,
    e.g. cache rows) and returned. rope_w: rope_weight_tables(k_norm_w), precomputed by callers that
    inject repeatedly. Also the onnxruntime implementation of the dflash::KVInject node.
    Few, large ops on purpose: at decode sizes (T ≤ 16) each torch op costs more than its arithmetic,
    so the per-op count, not the FLOPs, sets the epilogue's CPU time (bench/bench_kv_inject.py)."""
    T, hd = ctx_raw.shape[0], k_norm_w.shape[-1]
    kw_cos, kw_sin = rope_w if rope_w is not None else rope_weight_tables(k_norm_w)
    ctx = F.rms_norm(ctx_raw, (ctx_raw.shape[-1],), eps=eps)                     # hidden_norm without its weight
    kv = (torch.addmm(b_kv, ctx, w_kv_t) if b_kv is not None else ctx @ w_kv_t)   # GEMM 2
    kv = kv.view(T, L, 2, nkv, hd)
    k = F.rms_norm(kv[:, :, 0], (hd,), eps=eps)                                   # k_norm without its weight
    cw = cos_tab[positions].view(T, 1, 1, hd) * kw_cos                            # [T, L, 1, hd]
    sw = sin_tab[positions].view(T, 1, 1, hd) * kw_sin
    k_out, v_out = out if out is not None else (torch.empty_like(k), None)
    torch.mul(k, cw, out=k_out).addcmul_(k.roll(hd // 2, -1), sw)                 # RoPE (+ k_norm weight)
    if v_out is None:
        return k_out, kv[:, :, 1]
    v_out.copy_(kv[:, :, 1])
    return k_out, v_out


def scatter_paged(k, v, slots, k_cache, v_cache, page_size: int, k_scale=None, v_scale=None) -> None:
    """Write K, V [T, L, nkv, hd] at slots [T] of paged caches [pages, L, nkv, page_size, hd]; slot < 0 skipped."""
    keep = slots >= 0
    slots, k, v = slots[keep].long(), k[keep], v[keep]
    page, off = slots // page_size, slots % page_size
    # advanced indices on dims 0 and 3 with slices between: the indexed view is [T, L, nkv, hd]
    k_cache[page, :, :, off] = quantize_fp8(k, k_scale) if k_cache.dtype == FP8_DTYPE else k.to(k_cache.dtype)
    v_cache[page, :, :, off] = quantize_fp8(v, v_scale) if v_cache.dtype == FP8_DTYPE else v.to(v_cache.dtype)


# The CPU epilogue of path (2) as one C loop (dflash_trt/kernels/csrc/kv_inject.c, compiled by
# dflash_trt.kernels.c_loader): hidden_norm's 1/rms, bias, k_norm, RoPE and the write into the cache
# rows, ~12 torch ops in one call, which is most of the fused path's gain over the reference at
# decode sizes. Without a C compiler (or for FP8 caches) `fused_kv_from_ctx` does the same in torch.
_EPI_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_EPI_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5


def c_epilogue() -> ctypes.CDLL | None:
    """The C epilogue library, or None without a C compiler."""
    return ckernels.load("kv_inject", {f"kv_epilogue_{n}": _EPI_ARGS for n in _EPI_DTYPES.values()})


@functools.cache
def c_epilogue_max_head_dim(lib: ctypes.CDLL) -> int:
    """The largest head_dim `lib` (c_epilogue()) handles. Read from the library itself: the bound is
    the size of its scratch array (DFLASH_MAX_HEAD_DIM in csrc/dflash_kernels.h), so the number Python
    checks is the one the loaded code was compiled with."""
    return ctypes.c_int32.in_dll(lib, "dflash_max_head_dim").value


class FusedKVInjector:
    """The drafter's injection weights in fused form, built once per drafter.

    w_kv [L*2*nkv*hd, H]: per layer [k_proj rows; v_proj rows], each column scaled by
    hidden_norm.weight, so `(ctx_raw @ w_kvᵀ) * rstd(ctx_raw) + b_kv` equals k_proj/v_proj of
    hidden_norm(ctx_raw) for every layer in one GEMM (stored as w_kv_t = w_kvᵀ)."""

    def __init__(self, drafter):
        c = drafter.config
        self.config = c
        self.L, self.nkv, self.hd, self.H = c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.eps = float(c.rms_norm_eps)
        with torch.no_grad():
            # weights stored transposed ([in, out], contiguous), once: CPU GEMMs run ~1.5x faster
            # on that layout than on nn.Linear's [out, in] (measured in bench/bench_kv_inject.py)
            self.fc_w_t = drafter.fc.weight.detach().T.contiguous()
            hn = drafter.hidden_norm.weight.detach()
            rows, bias = [], []
            for layer in drafter.layers:
                a = layer.self_attn
                for proj in (a.k_proj, a.v_proj):
                    rows.append(proj.weight.detach())
                    bias.append(proj.bias.detach() if proj.bias is not None
                                else torch.zeros(proj.out_features, dtype=proj.weight.dtype))
            self.w_kv_t = (torch.cat(rows) * hn[None, :]).T.contiguous()
            self.b_kv = torch.cat(bias).contiguous()
            self.has_bias = any(layer.self_attn.k_proj.bias is not None for layer in drafter.layers)
            self.k_norm_w = torch.stack([layer.self_attn.k_norm.weight.detach() for layer in drafter.layers]).contiguous()
            self.rope_w = rope_weight_tables(self.k_norm_w)
        self.cos, self.sin = drafter.rope.cos, drafter.rope.sin
        self._fingerprint = _weights_fingerprint(drafter)

    @functools.cached_property
    def w_kv(self) -> torch.Tensor:
        """[L*2*nkv*hd, H] row-major: the Triton kernel's and the plugin's layout."""
        return self.w_kv_t.T.contiguous()

    # -- one semantics, shared by both cache layouts
    def _kv_torch(self, features: torch.Tensor, positions: torch.Tensor, out=None):
        """K, V [T, L, nkv, hd] (features' dtype), or written into out = (k_dst, v_dst)."""
        ctx_raw = features @ self.fc_w_t                                          # GEMM 1: fc
        return fused_kv_from_ctx(ctx_raw, self.w_kv_t, self.b_kv if self.has_bias else None, self.k_norm_w,
                                 self.cos, self.sin, positions, self.eps, self.L, self.nkv, out=out,
                                 rope_w=self.rope_w)

    def _inject_c(self, features, positions, slots, start, k_cache, v_cache, page_shift, strides) -> bool:
        """The C epilogue (see c_epilogue); False when it does not apply (then the torch path runs)."""
        dt = features.dtype
        if (dt not in _EPI_DTYPES or k_cache.dtype != dt or v_cache.dtype != dt
                or self.cos.dtype != dt or k_cache.stride() != v_cache.stride()):
            return False
        lib = c_epilogue()
        if lib is None or self.hd > c_epilogue_max_head_dim(lib):
            return False
        ctx_raw = (features @ self.fc_w_t).contiguous()                          # GEMM 1: fc
        kv = (ctx_raw @ self.w_kv_t).contiguous()                                 # GEMM 2: all layers' K|V
        pos = positions.to(torch.int64).contiguous()
        sl = slots.to(torch.int64).contiguous() if slots is not None else None
        getattr(lib, "kv_epilogue_" + _EPI_DTYPES[dt])(
            ctx_raw.data_ptr(), kv.data_ptr(), self.b_kv.data_ptr() if self.has_bias else None,
            self.k_norm_w.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), pos.data_ptr(),
            sl.data_ptr() if sl is not None else None, start, features.shape[0], self.H, self.L, self.nkv, self.hd,
            self.eps, k_cache.data_ptr(), v_cache.data_ptr(), *strides, page_shift)
        return True

    def _launch_triton(self, features, positions, slots, k_cache, v_cache, page_shift, strides, k_scale, v_scale):
        import triton  # the `plugin` extra, as is the kernel module

        from dflash_trt.kernels.kv_inject_triton import kv_inject_kernel as kern

        interpret = bool(triton.knobs.runtime.interpret)
        if not interpret and not features.is_cuda:
            raise DFlashError("backend triton: tensors are on the CPU; run on a CUDA device, or set "
                              "TRITON_INTERPRET=1 before importing triton to use Triton's interpreter")
        T = features.shape[0]
        ctx_raw = (features @ self.fc_w_t).contiguous()                           # GEMM 1: fc
        cfg = kv_inject_trt.kernel_config(self.hd)
        grid = kv_inject_trt.grid(T, self.L, self.nkv, cfg["BLOCK_T"])
        scal = torch.tensor([self.eps, float(k_scale or 1.0), float(v_scale or 1.0)], dtype=torch.float32,
                            device=features.device)
        # the kernel writes FP8 caches as their bit patterns (see _fp8_e4m3_bits)
        kc = k_cache.view(torch.uint8) if k_cache.dtype == FP8_DTYPE else k_cache
        vc = v_cache.view(torch.uint8) if v_cache.dtype == FP8_DTYPE else v_cache
        args = kv_inject_trt.scalar_args(T=T, H=self.H, n_kv=self.nkv, page_shift=page_shift, stride_ctx=ctx_raw.stride(0),
                                   stride_page=strides[0], stride_layer=strides[1], stride_head=strides[2],
                                   stride_tok=strides[3])
        kern[grid](ctx_raw, self.w_kv, self.b_kv, self.k_norm_w, self.cos.float().contiguous(),
                   self.sin.float().contiguous(), positions.to(torch.int32).contiguous(),
                   slots.to(torch.int32).contiguous(), scal, kc, vc, *args, kc, vc,
                   HEAD_DIM=self.hd, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
                   FP8=k_cache.dtype == FP8_DTYPE, num_warps=cfg["num_warps"])

    # -- public entry points
    @torch.no_grad()
    def inject_paged(self, features, positions, slots, k_cache, v_cache, page_size: int, k_scale=None, v_scale=None,
                     backend: str = "torch") -> None:
        shift = check_page_size(page_size)
        _check_caches(self.config, k_cache, v_cache, k_scale, v_scale, page_size)
        T = _check_features(self.config, features, positions, self.cos.shape[0])
        if tuple(slots.shape) != (T,):
            raise DFlashError(f"slots: shape {tuple(slots.shape)}, expected [{T}] (one per feature row)")
        if T and int(slots.max()) >= k_cache.shape[0] * page_size:
            raise DFlashError(f"slots: {int(slots.max())} is beyond the cache ({k_cache.shape[0]} pages x {page_size})")
        if _check_backend(backend) == "triton":
            s = k_cache.stride()
            return self._launch_triton(features, positions, slots, k_cache, v_cache, shift, (s[0], s[1], s[2], s[3]),
                                       k_scale, v_scale)
        if k_cache.dtype != FP8_DTYPE and self._inject_c(features, positions, slots, 0, k_cache, v_cache, shift,
                                                         k_cache.stride()[:4]):
            return
        k, v = self._kv_torch(features, positions)                  # [T, L, nkv, hd]
        scatter_paged(k, v, slots, k_cache, v_cache, page_size, k_scale, v_scale)

    @torch.no_grad()
    def inject_contiguous(self, features, positions, k_cache, v_cache, start: int, k_scale=None, v_scale=None,
                          backend: str = "torch") -> None:
        """Write K, V of the T feature rows into rows start..start+T-1 of every layer of a contiguous
        cache [L, nkv, max_len, hd] (the CPU runtime's)."""
        fp8 = _check_caches(self.config, k_cache, v_cache, k_scale, v_scale)
        T = _check_features(self.config, features, positions, self.cos.shape[0])
        _check_rows(k_cache, start, T)
        if _check_backend(backend) == "triton":
            s = k_cache.stride()
            slots = torch.arange(start, start + T, dtype=torch.int32, device=features.device)
            return self._launch_triton(features, positions, slots, k_cache, v_cache, CONTIGUOUS_PAGE_SHIFT,
                                       (0, s[0], s[1], s[2]), k_scale, v_scale)
        if not fp8 and self._inject_c(features, positions, None, start, k_cache, v_cache, CONTIGUOUS_PAGE_SHIFT,
                                      (0, *k_cache.stride()[:3])):
            return
        rows = (k_cache[:, :, start:start + T].permute(2, 0, 1, 3), v_cache[:, :, start:start + T].permute(2, 0, 1, 3))
        if not fp8:
            self._kv_torch(features, positions, out=rows)           # straight into the cache rows
            return
        k, v = self._kv_torch(features, positions)                  # [T, L, nkv, hd]
        rows[0].copy_(quantize_fp8(k, k_scale))
        rows[1].copy_(quantize_fp8(v, v_scale))


def _check_backend(backend: str) -> str:
    if backend not in ("torch", "triton"):
        raise DFlashError(f"backend: {backend!r} is not one of torch, triton")
    return backend


def _weights_fingerprint(drafter):
    ps = [drafter.fc.weight, drafter.hidden_norm.weight]
    for layer in drafter.layers:
        a = layer.self_attn
        ps += [a.k_proj.weight, a.v_proj.weight, a.k_norm.weight]
    return tuple((p.data_ptr(), p._version, p.dtype) for p in ps)


def fused_injector(drafter) -> FusedKVInjector:
    """The drafter's FusedKVInjector, built on first use and rebuilt if its weights changed."""
    inj = drafter.__dict__.get("_fused_kv_injector")
    if inj is None or inj._fingerprint != _weights_fingerprint(drafter):
        inj = FusedKVInjector(drafter)
        drafter.__dict__["_fused_kv_injector"] = inj
    return inj


def inject_paged(drafter, features, positions, slots, k_cache, v_cache, page_size: int, k_scale=None, v_scale=None,
                 backend: str = "torch") -> None:
    """Write K, V of the T feature rows at `slots` of a paged cache [pages, L, nkv, page_size, hd], fused path."""
    fused_injector(drafter).inject_paged(features, positions, slots, k_cache, v_cache, page_size, k_scale, v_scale,
                                         backend)
