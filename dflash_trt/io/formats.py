"""Low-precision number formats: FP8 (E4M3), NVFP4 (E2M1 + FP8 block scales + fp32 global
scale) and MXFP4 (E2M1 + E8M0 block scales, gpt-oss). docs/formats.md.

The FP8 and NVFP4 encoders reproduce NVIDIA ModelOpt's export arithmetic operation for operation,
because the output must be byte-identical to `export_hf_checkpoint`'s (tests/test_quantize.py). Large
tensors go in row chunks so temporaries stay small. Packing: two E2M1 codes per byte, low nibble even.
"""
from __future__ import annotations

import ctypes

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.kernels import c_loader as ckernels

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127

# E2M1 code -> value. Codes 8..15 are the negatives (code 8 is -0).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Midpoints between neighbouring magnitudes. A magnitude exactly on a midpoint rounds to the
# neighbour with the even code (round half to even on codes): 0.25->0, 0.75->1.0, 1.25->1.0,
# 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0; i.e. ties at 0.75, 1.75 and 3.5 round up (>=), the
# others down (>). The code is the number of midpoints passed; seven vectorized comparisons
# measured faster on CPU than torch.bucketize (a binary search per element).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

_CHUNK_ELEMS = 1 << 22  # rows per chunk chosen so a chunk has about this many elements


def _row_chunks(n_rows: int, row_elems: int):
    step = max(1, _CHUNK_ELEMS // max(1, row_elems))
    for i in range(0, n_rows, step):
        yield slice(i, min(n_rows, i + step))


# ----------------------------------------------------------------------------------------------
# E2M1 codes and nibble packing

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already scaled into [-6, 6]) to E2M1 codes (uint8, 0..15); beyond 6 saturates.
    The sign bit is set for x < 0, so a small negative value that rounds to zero gives -0, as ModelOpt does."""
    x = x.float()
    a = x.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8)
    for t, up in _E2M1_MIDPOINTS:
        code += (a >= t) if up else (a > t)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return E2M1_VALUES.to(dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, low nibble = even element."""
    if codes.shape[-1] % 2:
        raise DFlashError(f"cannot pack {codes.shape[-1]} 4-bit codes: the last dimension must be even")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of pack_nibbles)."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# FP8 (per-tensor E4M3)

def fp8_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """weight_scale / input_scale = amax / 448 as an fp32 scalar, divided in fp32 (as ModelOpt
    does for its 0-dim per-tensor amax)."""
    return torch.as_tensor(amax, dtype=torch.float32).reshape(()) / FP8_E4M3_MAX


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """E4M3 bytes of w / scale. ModelOpt's HF export divides in w's dtype (`compute_dtype=None`), its
    TensorRT-LLM export in fp32 (`torch.float32`): a 0-dim vs a [1]-shaped scale."""
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = scale.reshape(())
    cast = (lambda t: t) if compute_dtype is None else (lambda t: t.to(compute_dtype))
    if w.dim() < 2:
        return (cast(w) / scale).to(torch.float8_e4m3fn)
    for rows in _row_chunks(w.shape[0], w[0].numel()):
        out[rows] = (cast(w[rows]) / scale).to(torch.float8_e4m3fn)
    return out


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4: E2M1 values, E4M3 scale per 16 elements, fp32 global scale

def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """weight_scale_2 = amax / (6 * 448), fp32 scalar."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return amax.float() / (E2M1_MAX * FP8_E4M3_MAX)


def nvfp4_block_scales(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-16-element block scales (float8_e4m3fn, [..., in/16]) = block_amax / (6 * global),
    all-zero blocks get 1.0, clamped to [2^-9, 448] before the cast."""
    if w.shape[-1] % NVFP4_BLOCK:
        raise DFlashError(f"NVFP4 needs the input dimension to be a multiple of {NVFP4_BLOCK}, got {w.shape[-1]}")
    nb = w.shape[-1] // NVFP4_BLOCK
    out = torch.empty((*w.shape[:-1], nb), dtype=torch.float8_e4m3fn)
    denom = E2M1_MAX * global_scale.float()
    flat_w, flat_o = w.reshape(-1, w.shape[-1]), out.view(-1, nb)
    for rows in _row_chunks(flat_w.shape[0], w.shape[-1]):  # (the C kernel does this in nvfp4_quantize_*)
        amax = flat_w[rows].reshape(-1, nb, NVFP4_BLOCK).abs().amax(-1).float()
        s = amax / denom
        s[s == 0] = 1.0
        flat_o[rows] = s.clamp(min=2.0 ** -9, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return out


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   block_amax: torch.Tensor | None = None,
                   scales_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-encode w [..., in] -> (packed uint8 [..., in/2], weight_scale fp8 [..., in/16],
    weight_scale_2 fp32 scalar). Pass `global_scale` to share one across a fused group, `out`
    and `scales_out` (contiguous uint8 with numel/2 and numel/16 elements) to encode into (e.g.
    a writer's buffers), and `block_amax` (from `block_abs_max(w)`) to skip finding the block
    maxima again."""
    if global_scale is None:
        global_scale = nvfp4_global_scale(w.abs().amax().float())
    n = w.shape[-1]
    nb = n // NVFP4_BLOCK
    if out is not None:
        if out.dtype != torch.uint8 or out.numel() != w.numel() // 2 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous uint8 with {w.numel() // 2} elements")
        packed = out.view(*w.shape[:-1], n // 2)
    else:
        packed = torch.empty((*w.shape[:-1], n // 2), dtype=torch.uint8)
    if scales_out is not None:
        if scales_out.dtype != torch.uint8 or scales_out.numel() != w.numel() // NVFP4_BLOCK or not scales_out.is_contiguous():
            raise ValueError(f"scales_out must be contiguous uint8 with {w.numel() // NVFP4_BLOCK} elements")
        scales_out = scales_out.view(torch.float8_e4m3fn).view(*w.shape[:-1], nb)
    kernel = c_kernels() if w.dtype in C_KERNEL_DTYPES and w.is_contiguous() and n % NVFP4_BLOCK == 0 else None
    if kernel is not None:  # block scales and codes in one pass over w
        block_scales = torch.empty((*w.shape[:-1], nb), dtype=torch.float8_e4m3fn) if scales_out is None else scales_out
        if block_amax is not None and (block_amax.dtype != torch.float32 or not block_amax.is_contiguous()
                                       or block_amax.numel() != w.numel() // NVFP4_BLOCK):
            raise ValueError(f"block_amax must be contiguous fp32 with {w.numel() // NVFP4_BLOCK} elements")
        getattr(kernel, "nvfp4_quantize_" + C_KERNEL_DTYPES[w.dtype])(
            w.data_ptr(), w.numel() // NVFP4_BLOCK, ctypes.c_float(float(global_scale)),
            None if block_amax is None else block_amax.data_ptr(), block_scales.data_ptr(), packed.data_ptr())
        return packed, block_scales, global_scale
    block_scales = nvfp4_block_scales(w, global_scale)
    flat_w, flat_s, flat_p = w.reshape(-1, n), block_scales.reshape(-1, nb), packed.view(-1, n // 2)
    kernel = c_kernels() if w.dtype in C_KERNEL_DTYPES and w.is_contiguous() else None
    for rows in _row_chunks(flat_w.shape[0], n):
        denom = (flat_s[rows].to(torch.float32) * global_scale).unsqueeze(-1)
        if kernel is not None:
            chunk, out = flat_w[rows], flat_p[rows]
            denom = denom.contiguous()
            getattr(kernel, "nvfp4_encode_" + C_KERNEL_DTYPES[w.dtype])(chunk.data_ptr(), denom.numel(), denom.data_ptr(), out.data_ptr())
            continue
        scaled = flat_w[rows].reshape(-1, nb, NVFP4_BLOCK) / denom  # fp32 (ModelOpt: same op)
        flat_p[rows] = pack_nibbles(e2m1_encode(scaled.reshape(-1, n)))
    if scales_out is not None:
        block_scales = scales_out.copy_(block_scales)
    return packed, block_scales, global_scale


def nvfp4_dequantize(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = e2m1_decode(unpack_nibbles(packed), torch.float32)
    n = vals.shape[-1]
    vals = vals.reshape(*vals.shape[:-1], n // NVFP4_BLOCK, NVFP4_BLOCK)
    vals = vals * (block_scales.to(torch.float32) * global_scale.float()).unsqueeze(-1)
    return vals.reshape(*packed.shape[:-1], n).to(dtype)


# ----------------------------------------------------------------------------------------------
# MXFP4 (OCP microscaling, gpt-oss experts): E2M1 values, E8M0 scale per 32 elements

def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gpt-oss MXFP4 -> floats. blocks uint8 [..., G, 16] (32 codes per block, low nibble =
    even element), scales uint8 E8M0 [..., G] (value 2^(s-127)); returns [..., G*32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise DFlashError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise DFlashError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                          f"(expected blocks [..., G, 16] and scales [..., G])")
    vals = e2m1_decode(unpack_nibbles(blocks), torch.float32)          # [..., G, 32]
    exp = scales.to(torch.int32) - E8M0_BIAS
    vals = torch.ldexp(vals, exp.unsqueeze(-1).to(torch.float32))
    return vals.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK).to(dtype)


def mxfp4_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """floats [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).
    Block scale 2^ceil(log2(amax / 6)): no saturation (the OCP spec's choice may saturate; both decode alike)."""
    if x.shape[-1] % MXFP4_BLOCK:
        raise DFlashError(f"MXFP4 needs the last dimension to be a multiple of {MXFP4_BLOCK}, got {x.shape[-1]}")
    g = x.shape[-1] // MXFP4_BLOCK
    xb = x.float().reshape(*x.shape[:-1], g, MXFP4_BLOCK)
    amax = xb.abs().amax(-1)
    e = torch.ceil(torch.log2(amax / E2M1_MAX))
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS)).clamp(-E8M0_BIAS, 127)
    scaled = torch.ldexp(xb, -e.unsqueeze(-1))
    codes = e2m1_encode(scaled)
    return pack_nibbles(codes), (e + E8M0_BIAS).to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Fused CPU kernels for the NVFP4 hot loops: dflash_trt/kernels/csrc/formats.c, compiled by
# dflash_trt.kernels.c_loader; the torch code above runs without a compiler, to the same bytes.
C_KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}   # dtype -> the C functions' suffix


def c_kernels(portable: bool = False) -> ctypes.CDLL | None:
    """The compiled kernels (ctypes library, compiled once per process), or None if unavailable.
    `portable` builds the portable loops only (-DDFLASH_PORTABLE), which tests compare the CPU-specific
    ones against."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    sigs = {"e4m3_codes": [ptr, i64, ptr]}
    for name in C_KERNEL_DTYPES.values():
        sigs.update({"nvfp4_encode_" + name: [ptr, i64, ptr, ptr], "abs_max_" + name: [ptr, i64, ptr, ptr],
                     "nvfp4_quantize_" + name: [ptr, i64, ctypes.c_float, ptr, ptr, ptr],
                     "block_abs_max_" + name: [ptr, i64, ptr, ptr, ptr]})
    return ckernels.load("formats", sigs, openmp=True, cflags=("-DDFLASH_PORTABLE",) if portable else ())


def block_abs_max(t: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """abs_max, plus the max |x| of each NVFP4 block of 16 as fp32 [numel / 16] (None without
    the C kernels): the encode pass (`nvfp4_quantize(block_amax=)`) then reads them instead of
    finding them again (a 117 MB bf16 weight, 2 threads: 24 -> 19.5 ms)."""
    kernel = c_kernels() if t.dtype in C_KERNEL_DTYPES and t.is_contiguous() and t.numel() % NVFP4_BLOCK == 0 else None
    if kernel is None or not t.numel():
        return (*abs_max(t), None)

    bmax = torch.empty(t.numel() // NVFP4_BLOCK, dtype=torch.float32)
    out, bad = torch.zeros((), dtype=torch.float32), ctypes.c_int32(0)
    getattr(kernel, "block_abs_max_" + C_KERNEL_DTYPES[t.dtype])(t.data_ptr(), bmax.numel(), bmax.data_ptr(), out.data_ptr(),
                                                           ctypes.byref(bad))
    return out, not bad.value, bmax


def abs_max(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(max |t| as an fp32 scalar, whether every value is finite), in one pass."""
    kernel = c_kernels() if t.dtype in C_KERNEL_DTYPES and t.is_contiguous() and t.numel() else None
    if kernel is None:
        m = t.abs().amax().float() if t.numel() else torch.zeros((), dtype=torch.float32)
        return m, bool(torch.isfinite(m))

    out, bad = torch.zeros((), dtype=torch.float32), ctypes.c_int32(0)
    getattr(kernel, "abs_max_" + C_KERNEL_DTYPES[t.dtype])(t.data_ptr(), t.numel(), out.data_ptr(), ctypes.byref(bad))
    return out, not bad.value
