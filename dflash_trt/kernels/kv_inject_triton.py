"""The drafter KV-injection kernel (Triton): one launch writes K and V of every drafter layer.

Input is the fc output `ctx_raw [T, H]` (fc stays a plain GEMM). One program computes one head of one
layer's K or V for a tile of BLOCK_T tokens:

    acc      = ctx_raw[t] @ (W_kv ⊙ w_hidden_norm)[rows]ᵀ       one GEMM over all layers' K|V rows
    x        = acc * rstd_hidden[t] (+ bias)                      hidden_norm folded in (rms taken as the
                                                                  GEMM streams ctx_raw: no extra pass)
    K        = rope(k_norm(x)),  V = x                            per-head RMSNorm, rotate-half RoPE
    cache[slot[t]] = K | V   (optionally FP8 e4m3 with a per-tensor scale)

Arguments follow TensorRT's AOT plugin convention: input pointers, int32 scalars, output pointers (the
caches are aliased in place; the kernel writes through the outputs only). Cache addressing: slot ->
(page = slot >> page_shift, offset = slot & (2^page_shift - 1)); a contiguous cache is one page
(stride_page 0, page_shift 30). Slots < 0 are padding and are skipped (vLLM's convention).
"""
import triton
import triton.language as tl

FP8_E4M3_MAX = tl.constexpr(448.0)  # largest finite float8 e4m3fn


@triton.jit
def kv_inject_kernel(
    ctx_ptr, w_ptr, b_ptr, knorm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, scal_ptr,
    k_in_ptr, v_in_ptr,
    T, H, n_kv, page_shift, stride_ctx, stride_page, stride_layer, stride_head, stride_tok,
    k_out_ptr, v_out_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)  # flattened (layer, K|V, kv head): weight rows pid_h*HEAD_DIM ...
    layer = pid_h // (2 * n_kv)
    within = pid_h % (2 * n_kv)
    is_v = within >= n_kv
    head = within % n_kv

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, HALF)
    row_lo = (pid_h * HEAD_DIM + d).to(tl.int64) * H
    row_hi = row_lo + HALF * H

    acc_lo = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        a = tl.load(ctx_ptr + t[:, None].to(tl.int64) * stride_ctx + kk[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        af = a.to(tl.float32)
        ssq += tl.sum(af * af, axis=1)
        w_lo = tl.load(w_ptr + row_lo[None, :] + kk[:, None], mask=k_ok[:, None], other=0.0)  # [BK, HALF]
        w_hi = tl.load(w_ptr + row_hi[None, :] + kk[:, None], mask=k_ok[:, None], other=0.0)
        acc_lo = tl.dot(a, w_lo, acc_lo, input_precision="ieee")
        acc_hi = tl.dot(a, w_hi, acc_hi, input_precision="ieee")

    eps = tl.load(scal_ptr)
    rstd = 1.0 / tl.sqrt(ssq / H + eps)  # hidden_norm's 1/rms (its weight is folded into W)
    x_lo = acc_lo * rstd[:, None] + tl.load(b_ptr + pid_h * HEAD_DIM + d).to(tl.float32)[None, :]
    x_hi = acc_hi * rstd[:, None] + tl.load(b_ptr + pid_h * HEAD_DIM + HALF + d).to(tl.float32)[None, :]

    # K only: per-head k_norm then rotate-half RoPE at the token's absolute position.
    r_k = 1.0 / tl.sqrt((tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)) / HEAD_DIM + eps)
    kw_lo = tl.load(knorm_ptr + layer * HEAD_DIM + d).to(tl.float32)
    kw_hi = tl.load(knorm_ptr + layer * HEAD_DIM + HALF + d).to(tl.float32)
    n_lo = kw_lo[None, :] * (x_lo * r_k[:, None])
    n_hi = kw_hi[None, :] * (x_hi * r_k[:, None])
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    tab = pos[:, None] * HEAD_DIM + d[None, :]
    cos_lo = tl.load(cos_ptr + tab, mask=t_ok[:, None], other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + tab + HALF, mask=t_ok[:, None], other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + tab, mask=t_ok[:, None], other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + tab + HALF, mask=t_ok[:, None], other=0.0).to(tl.float32)
    k_lo = n_lo * cos_lo - n_hi * sin_lo
    k_hi = n_hi * cos_hi + n_lo * sin_hi
    out_lo = tl.where(is_v, x_lo, k_lo)
    out_hi = tl.where(is_v, x_hi, k_hi)

    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0)
    page = slot >> page_shift
    offset = slot & ((1 << page_shift) - 1)
    base = page * stride_page + layer.to(tl.int64) * stride_layer + head.to(tl.int64) * stride_head + offset * stride_tok
    dst = base[:, None] + d[None, :]
    if FP8:
        scale = tl.load(scal_ptr + 1 + is_v.to(tl.int32))
        out_lo = _fp8_e4m3_bits(out_lo / scale)
        out_hi = _fp8_e4m3_bits(out_hi / scale)
    is_k = within < n_kv
    tl.store(k_out_ptr + dst, out_lo.to(k_out_ptr.dtype.element_ty), mask=ok[:, None] & is_k)
    tl.store(k_out_ptr + dst + HALF, out_hi.to(k_out_ptr.dtype.element_ty), mask=ok[:, None] & is_k)
    tl.store(v_out_ptr + dst, out_lo.to(v_out_ptr.dtype.element_ty), mask=ok[:, None] & is_v)
    tl.store(v_out_ptr + dst + HALF, out_hi.to(v_out_ptr.dtype.element_ty), mask=ok[:, None] & is_v)


@triton.jit
def _fp8_e4m3_bits(x):
    """float32 -> float8 e4m3fn bit pattern (uint8), round-to-nearest-even, saturating at ±448.

    Written out with integer ops instead of `x.to(tl.float8e4nv)` because Triton's interpreter
    truncates in that cast (and loses the carry into the exponent), so CPU tests could not pin the
    GPU's rounding; this form gives the same bits as torch's float8_e4m3fn cast on both."""
    x = tl.clamp(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)          # binade; below 2^-6 the subnormal step 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # fp8 spacing in this binade: 2^(e-3)
    y = a / step                                              # exact (power-of-two divide), < 16
    r = (y + 8388608.0) - 8388608.0                           # round to nearest even integer (fp32 RNE)
    v = (r * step).to(tl.int32, bitcast=True)                 # the rounded magnitude, as fp32 bits
    ev = ((v >> 23) & 0xFF) - 127
    normal = ((ev + 7) << 3) | ((v >> 20) & 7)
    subnormal = (r * step * 512.0).to(tl.int32)
    code = tl.where(ev >= -6, normal, subnormal) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8)
