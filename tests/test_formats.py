"""FP8 / NVFP4 / MXFP4 codecs: hand-computed examples pin the bit layouts; ModelOpt's own
NVFP4QTensor is the oracle for NVFP4 rounding; dequantization stays within the format's bound."""
import ctypes

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io import formats

C_KERNEL = ("formats", formats.c_kernels)  # the c_or_torch fixture (conftest.py) runs tests both ways


def test_e2m1_codes_and_ties_hand_computed():
    # grid 0 .5 1 1.5 2 3 4 6 -> codes 0..7; ties round to the even code (0.25->0, 0.75->1.0,
    # 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0); beyond 6 saturates; negatives +8.
    x = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -1.0, -6.0, -0.1])
    want = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 4, 4, 6, 6, 7, 10, 15, 8]
    assert formats.e2m1_encode(x).tolist() == want


def test_nvfp4_packing_low_nibble_is_even_element():
    # values 0.5 (code 1), -1.0 (code 10), 6.0 (code 7), 0 (code 0): bytes 0xA1, 0x07
    codes = formats.e2m1_encode(torch.tensor([0.5, -1.0, 6.0, 0.0]))
    packed = formats.pack_nibbles(codes)
    assert packed.tolist() == [0xA1, 0x07]
    assert formats.unpack_nibbles(packed).tolist() == codes.tolist()


def test_nvfp4_full_pipeline_hand_computed(c_or_torch):
    # One row, one block of 16 with amax 6: weight_scale_2 = 6/(6*448) = 1/448,
    # block scale = 6 / (6 * 1/448) = 448 (the E4M3 max), so w / (448 * 1/448) = w.
    w = torch.zeros(1, 16)
    w[0, :4] = torch.tensor([0.5, -1.0, 6.0, 3.0])
    packed, bscale, gscale = formats.nvfp4_quantize(w)
    assert gscale.item() == pytest.approx(1 / 448)
    assert bscale.float().item() == 448.0
    assert packed[0, :2].tolist() == [0xA1, 0x57]
    assert torch.equal(formats.nvfp4_dequantize(packed, bscale, gscale), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_bytes_equal_modelopt(dtype, c_or_torch):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = (torch.randn(48, 128) * 0.02).to(dtype)
    w[5, 16:32] = 0  # an all-zero block (scale 1.0)
    w[7, 3] = 0.3   # an outlier
    w[9, :8] = torch.tensor([-0.0, 1e-9, -1e-9, 0.0, 1e-3, -1e-3, 2e-3, -2e-3])  # signed zeros, tiny values
    w[11, :64] = torch.randn(64) * torch.tensor([2e-7, 1e-6, 3e-6, 8e-6]).repeat_interleave(16)  # subnormal scales
    packed, bscale, gscale = formats.nvfp4_quantize(w)
    assert (bscale.float() < 2 ** -6).any()  # the subnormal E4M3 range of the block scales is exercised
    ref_g = NVFP4QTensor.get_weights_scaling_factor_2(w)
    ref_s, _ = NVFP4QTensor.get_weights_scaling_factor(w, 16, ref_g)
    ref_q = NVFP4QTensor.quantize(w, 16, ref_s, ref_g)[0]._quantized_data
    assert torch.equal(gscale, ref_g.reshape(()))
    assert torch.equal(bscale.view(torch.uint8), ref_s.view(torch.uint8))
    assert torch.equal(packed, ref_q)


def test_nvfp4_dequant_within_format_bound(c_or_torch):
    w = torch.randn(64, 256) * torch.logspace(-3, 0, 64)[:, None]  # rows of very different scales
    packed, bscale, gscale = formats.nvfp4_quantize(w)
    err = (formats.nvfp4_dequantize(packed, bscale, gscale) - w).abs()
    # Per element: at most half the widest E2M1 gap (4 -> 6: 1.0) times the block's scale, plus
    # saturation when the E4M3 rounding of the scale pushes |w|/s past 6 (<= 6 * 2^-4 = 0.375).
    s = (bscale.float() * gscale).repeat_interleave(16, dim=-1)
    assert bool((err <= 1.0 * s + 1e-12).all())
    # and the error is genuinely small relative to each block's range: s <= amax/6 * (1 + 2^-4)
    block_amax = w.abs().reshape(64, -1, 16).amax(-1).repeat_interleave(16, dim=-1)
    assert float((err / block_amax).max()) <= (1 + 2 ** -4) / 6


def test_fp8_quantize_roundtrip_and_modes():
    w = (torch.randn(32, 64) * 0.05).bfloat16()
    s = formats.fp8_scale_from_amax(w.abs().amax().float())
    assert s.dtype == torch.float32 and s.shape == ()
    q = formats.fp8_quantize(w, s)
    assert q.dtype == torch.float8_e4m3fn
    back = formats.fp8_dequantize(q, s)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal values (plus bf16 rounding)
    big = w.float().abs() > 0.01
    assert float(((back - w.float()).abs() / w.float().abs())[big].max()) <= 2 ** -4 + 2 ** -8
    # ModelOpt's HF export divides in bf16 (0-dim scale), its TensorRT-LLM export in fp32
    assert torch.equal(q.view(torch.uint8), (w / s).to(torch.float8_e4m3fn).view(torch.uint8))
    q32 = formats.fp8_quantize(w, s, torch.float32)
    assert torch.equal(q32.view(torch.uint8), (w.float() / s).to(torch.float8_e4m3fn).view(torch.uint8))


def test_mxfp4_decode_hand_computed():
    # gpt-oss layout: blocks [..., G, 16] bytes (32 codes), scales [..., G] E8M0 (bias 127).
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)      # 2^1, 2^-2
    blocks[0, 0, 0] = 0x21   # elements 0,1 = codes 1 (0.5), 2 (1.0)
    blocks[0, 0, 1] = 0xF7   # elements 2,3 = codes 7 (6.0), 15 (-6.0)
    blocks[0, 1, 15] = 0x9B  # elements 62,63 of the row = codes 11 (-1.5), 9 (-0.5)
    out = formats.mxfp4_decode(blocks, scales)
    assert out.shape == (1, 64)
    assert out[0, :4].tolist() == [1.0, 2.0, 12.0, -12.0]
    assert out[0, 62:].tolist() == [-1.5 / 4, -0.5 / 4]
    assert out[0, 4:62].abs().sum().item() == 0


def test_mxfp4_encode_decode_roundtrip():
    # representable values survive exactly; others within half a grid step of their block
    x = torch.tensor([0.5, -1.0, 6.0, 3.0] * 8 + [0.0] * 32).reshape(1, 64) * 4
    b, s = formats.mxfp4_encode(x)
    assert b.shape == (1, 2, 16) and s.shape == (1, 2)
    assert torch.equal(formats.mxfp4_decode(b, s), x)
    y = torch.randn(3, 5, 96)
    b, s = formats.mxfp4_encode(y)
    d = formats.mxfp4_decode(b, s)
    scale = torch.ldexp(torch.ones(()), (s.int() - 127)).repeat_interleave(32, dim=-1)
    assert bool(((d - y).abs() <= scale * 1.0 + 1e-7).all())


def test_mxfp4_rejects_bad_shapes():
    with pytest.raises(DFlashError, match="do not match"):
        formats.mxfp4_decode(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_abs_max_detects_nan_and_inf(dtype, c_or_torch):
    t = (torch.randn(1000) * 3).to(dtype)
    m, finite = formats.abs_max(t)
    assert finite and m.item() == t.float().abs().max().item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[777] = bad
        assert formats.abs_max(u)[1] is False


def test_c_e4m3_rounding_equals_torch_on_every_float_in_range():
    """The C kernels round NVFP4 block scales to E4M3 themselves: every fp32 value in the range the
    scales are clamped to, [2^-9, 448], gives torch's float8_e4m3fn cast bit for bit."""
    import ctypes

    lib = formats.c_kernels()
    if lib is None:
        pytest.skip("no C compiler: block scales are cast by torch")
    lo = int(torch.tensor(2.0 ** -9).view(torch.int32))
    hi = int(torch.tensor(448.0).view(torch.int32))
    step = 1 << 24
    for start in range(lo, hi + 1, step):
        x = torch.arange(start, min(start + step, hi + 1), dtype=torch.int32).view(torch.float32)
        got = torch.empty(x.numel(), dtype=torch.uint8)
        lib.e4m3_codes(x.data_ptr(), ctypes.c_int64(x.numel()), got.data_ptr())
        want = x.to(torch.float8_e4m3fn).view(torch.uint8)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{x[bad[0]].item()!r}: C {got[bad[0]].item():#x}, torch {want[bad[0]].item():#x}"


def test_c_nvfp4_every_bf16_value_under_every_block_scale():
    """Exhaustive for bf16 inputs: every finite bf16 value x, in blocks whose maximum sets each
    of the block scales in turn, encodes to the same bytes in the AVX-512 build (which divides
    through a reciprocal and one correction step) as in the portable build (IEEE division), at
    global scales inside and outside the range where the reciprocal path is used."""
    lib, portable = formats.c_kernels(), formats.c_kernels(portable=True)
    if lib is None or portable is None:
        pytest.skip("no C compiler")
    allx = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    allx = allx[torch.isfinite(allx)].float()
    for gscale in (1.0, 37.5, 2.0 ** -20, 0.02 / 2688, 63.9, 1.5 * 2.0 ** -80, 100.0, 2.0 ** -85):
        rows = []
        for code in range(1, 127):
            scale = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            mb = (scale * 6 * gscale).to(torch.bfloat16).float()   # a block maximum near that scale
            xs = allx[allx.abs() <= mb]
            xs = torch.cat([xs, xs[: -len(xs) % 15]])
            rows.append(torch.cat([mb.expand(len(xs) // 15, 1), xs.reshape(-1, 15)], dim=1))
        w = torch.cat(rows).to(torch.bfloat16).contiguous()
        outs = []
        for k in (lib, portable):
            packed = torch.empty(w.numel() // 2, dtype=torch.uint8)
            scales = torch.empty(w.numel() // 16, dtype=torch.uint8)
            k.nvfp4_quantize_bf16(w.data_ptr(), w.numel() // 16, ctypes.c_float(gscale), None, scales.data_ptr(),
                                  packed.data_ptr())
            outs.append((packed, scales))
        assert torch.equal(outs[0][1], outs[1][1]), f"block scales differ at g={gscale}"
        bad = (outs[0][0] != outs[1][0]).nonzero()
        assert bad.numel() == 0, f"g={gscale}: byte {bad[0].item()} differs ({len(bad)} bytes)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_nvfp4_vector_build_equals_portable_build(dtype):
    """The CPU-specific loops (AVX-512 where compiled for it) and the portable loop give the same
    bytes, on blocks chosen to hit every rounding path: E2M1 ties at each threshold, all-zero
    blocks, and block scales that clamp (2^-9, 448), go subnormal or round up across a binade."""
    lib, portable = formats.c_kernels(), formats.c_kernels(portable=True)
    if lib is None or portable is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(1)
    n_blocks = 4099   # not a multiple of 16: the tail of a tile
    w = torch.randn(n_blocks, 16, generator=g) * torch.logspace(-6, 3, n_blocks).unsqueeze(1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0.0, -0.0, 1.0, 3.0, 4.0, 0.5])
    w[::7] = ties * torch.logspace(-8, 2, len(w[::7])).unsqueeze(1)   # block max 6: the values land on ties
    w[3::11] = 0.0
    # either side of each threshold (one ulp), with the block max 6 so that at g=1 the divisor is 1
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype).repeat(3)
    near = torch.cat([t[:7], torch.nextafter(t[7:14], torch.zeros_like(t[7:14])),
                      torch.nextafter(t[14:], torch.full_like(t[14:], 9.0))]).float()
    pick = torch.randint(0, len(near), (len(w[5::13]), 15), generator=g)
    sign = torch.randint(0, 2, pick.shape, generator=g).float() * 2 - 1
    w[5::13] = torch.cat([near[pick] * sign, torch.full((len(pick), 1), 6.0)], dim=1)
    w = w.to(dtype).contiguous()
    name = formats.C_KERNEL_DTYPES[dtype]
    # the amax pass's block maxima: the same in both builds, and equal to torch's
    maxima = []
    for k in (lib, portable):
        bmax, amax, bad = torch.empty(n_blocks, dtype=torch.float32), torch.zeros(()), ctypes.c_int32(0)
        getattr(k, "block_abs_max_" + name)(w.data_ptr(), n_blocks, bmax.data_ptr(), amax.data_ptr(), ctypes.byref(bad))
        assert torch.equal(bmax, w.float().abs().amax(-1)) and amax.item() == w.float().abs().max().item()
        assert bad.value == 0
        maxima.append(bmax)
    for gscale in (1.0, 1e-3, 37.5, 2.0 ** -20):
        outs = []
        # vector build finding the maxima, vector build given them, portable build given them
        for k, bmax in ((lib, None), (lib, maxima[0]), (portable, maxima[1])):
            packed = torch.empty(n_blocks * 8, dtype=torch.uint8)
            scales = torch.empty(n_blocks, dtype=torch.uint8)
            getattr(k, "nvfp4_quantize_" + name)(w.data_ptr(), n_blocks, ctypes.c_float(gscale),
                                                 None if bmax is None else bmax.data_ptr(), scales.data_ptr(),
                                                 packed.data_ptr())
            outs.append((packed, scales))
        for o in outs[1:]:
            assert torch.equal(outs[0][1], o[1]), f"block scales differ at g={gscale}"
            assert torch.equal(outs[0][0], o[0]), f"codes differ at g={gscale}"
    x = torch.rand(1 << 20, generator=g) * 448
    a, b = (torch.empty(x.numel(), dtype=torch.uint8) for _ in range(2))
    lib.e4m3_codes(x.data_ptr(), ctypes.c_int64(x.numel()), a.data_ptr())
    portable.e4m3_codes(x.data_ptr(), ctypes.c_int64(x.numel()), b.data_ptr())
    assert torch.equal(a, b)
