"""The float32 decode kernels (kernels/gemm.py, kernels/attention.py): correct against float64
torch, and batch-invariant bitwise (row i of an M-row call equals the one-row call), on every build
of the C source this CPU runs: its native one, AVX2 (where the CPU has AVX-512) and portable C."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.hardware import cpu
from dflash_trt.kernels import attention, c_loader, gemm

BUILDS = {"native": ()}
if "avx512f" in cpu()["features"]:
    BUILDS["avx2"] = ("-mno-avx512f",)
BUILDS["portable"] = ("-DDFLASH_PORTABLE",)


@pytest.fixture(params=list(BUILDS))
def gemm_lib(request):
    lib = c_loader.load("gemm", gemm._SIGNATURES, openmp=True, cflags=BUILDS[request.param])
    if lib is None:
        pytest.fail(f"csrc/gemm.c did not build ({request.param}): {c_loader.build_error('gemm')}")
    return lib


def _run(lib, x, w, b=None):
    return gemm.matmul(lib, x, gemm.PackedWeight(lib, w), b)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (33, 17), (100, 576), (1536, 96)])
def test_gemm_matches_float64(gemm_lib, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in (1, 2, 7, 13, 17, gemm.MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        want = F.linear(x.double(), w.double(), b.double())
        got = _run(gemm_lib, x, w, b)
        assert got.shape == (m, n)
        # one float32 chain of k products: |error| <= k * eps * sum|x w| (a loose, safe bound)
        bound = k * 2 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30
        assert ((got.double() - want).abs() <= bound + 2 ** -23 * b.double().abs()).all()


def test_gemm_rows_are_batch_invariant_at_any_thread_count(gemm_lib):
    g = torch.Generator().manual_seed(3)
    n, k = 200, 1536   # K > 1024: where oneDNN's bf16 kernel blocks M=1 differently
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(gemm.MAX_ROWS, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = [_run(gemm_lib, x[i:i + 1], w, b)[0] for i in range(x.shape[0])]
        for m in range(1, gemm.MAX_ROWS + 1):
            block = _run(gemm_lib, x[:m], w, b)
            assert all(torch.equal(block[i], rows[i]) for i in range(m)), m
        torch.set_num_threads(2)
        assert torch.equal(_run(gemm_lib, x[:9], w, b), torch.stack(rows[:9]))
    finally:
        torch.set_num_threads(threads)


def test_linear_uses_the_kernel_only_where_it_is_exact_to_do_so():
    if gemm.library() is None:
        pytest.fail(f"csrc/gemm.c did not build: {c_loader.build_error('gemm')}")
    assert gemm.path(torch.float32).startswith("dflash-") and gemm.path(torch.bfloat16) == "torch-onednn"
    w = torch.randn(48, 40)
    x = torch.randn(3, 5, 40)            # leading dims are flattened and restored
    out = gemm.linear(x, w)
    assert out.shape == (3, 5, 48)
    assert torch.equal(out[1, 2], gemm.linear(x[1, 2:3], w)[0])
    big = torch.randn(gemm.MAX_ROWS + 1, 40)   # prefill-sized: torch's GEMM, exactly
    assert torch.equal(gemm.linear(big, w), F.linear(big, w))
    wg = torch.randn(48, 40, requires_grad=True)   # autograd: torch, so training gets gradients
    gemm.linear(x, wg).sum().backward()
    assert wg.grad is not None and torch.allclose(wg.grad, x.reshape(-1, 40).sum(0).expand(48, 40))


def test_packed_copy_follows_in_place_updates():
    w = torch.randn(40, 24)
    x = torch.randn(2, 24)
    before = gemm.linear(x, w)
    with torch.no_grad():
        w.mul_(2)                        # e.g. load_state_dict's copy_ into a live module
    assert torch.allclose(gemm.linear(x, w), 2 * before, rtol=1e-6)


def test_stacked_linear_matches_per_expert_matmul():
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(3, 24, 40, generator=g), torch.randn(40, generator=g)
    x = torch.randn(4, 24, generator=g)
    for e in range(3):
        got = gemm.stacked_linear(x, w, e, b)
        assert torch.allclose(got, x @ w[e] + b, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2], gemm.stacked_linear(x[2:3], w, e, b)[0])


def _attention_reference(q, kc, vc, start, sinks, window, scale):
    """float64 torch: the oracle for attention.attend."""
    nh, T, hd = q.shape
    rep = nh // kc.shape[0]
    k = kc[:, :start + T].double().repeat_interleave(rep, 0)
    v = vc[:, :start + T].double().repeat_interleave(rep, 0)
    s = (q.double() @ k.transpose(1, 2)) * scale
    pos = torch.arange(start, start + T)[:, None]
    j = torch.arange(start + T)[None, :]
    keep = (j <= pos) & ((j > pos - window) if window else True)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([sinks.double().view(-1, 1, 1).expand(-1, T, 1), s], -1)
    p = torch.softmax(s, -1)[..., 1:] if sinks is not None else torch.softmax(s, -1)
    return (p @ v).transpose(0, 1).reshape(T, nh * hd)


@pytest.mark.parametrize("sinks,window", [(False, None), (True, 3)])
def test_rope_attend_is_bitwise_rope_cache_writes_and_attend(sinks, window):
    """The fused call (q|k|v rows of one GEMM, before RoPE) against the torch steps it replaces: RoPE by
    apply_rope, the cache writes, then attend: the same output and the same caches, bit for bit."""
    from dflash_trt.models.layers import apply_rope

    lib = attention.library()
    g = torch.Generator().manual_seed(3)
    nh, nkv, hd, L, start, T = 6, 2, 16, 64, 20, 9
    kc, vc = torch.randn(nkv, L, hd, generator=g), torch.randn(nkv, L, hd, generator=g)
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g)
    q, k, v = (t.view(T, -1, hd) for t in qkv.split([nh * hd, nkv * hd, nkv * hd], -1))
    cos, sin = torch.randn(T, hd, generator=g), torch.randn(T, hd, generator=g)
    s = torch.randn(nh, generator=g) if sinks else None
    kc2, vc2 = kc.clone(), vc.clone()
    got = attention.rope_attend(lib, q, k, v, cos, sin, kc, vc, start, s, window, hd ** -0.5)
    kc2[:, start:start + T] = apply_rope(k.transpose(0, 1), cos, sin)
    vc2[:, start:start + T] = v.transpose(0, 1)
    want = attention.attend(lib, apply_rope(q.transpose(0, 1), cos, sin), kc2, vc2, start, s, window, hd ** -0.5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and torch.equal(got, want)


@pytest.mark.parametrize("sinks,window", [(False, None), (True, None), (False, 5), (True, 3)])
def test_attention_matches_float64_and_is_row_invariant(sinks, window):
    lib = attention.library()
    if lib is None:
        pytest.fail(f"csrc/attention.c did not build: {c_loader.build_error('attention')}")
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, L = 6, 2, 16, 64
    kc, vc = torch.randn(nkv, L, hd, generator=g), torch.randn(nkv, L, hd, generator=g)
    s = torch.randn(nh, generator=g) if sinks else None
    for start, T in ((0, 1), (0, 9), (20, 16), (40, 1)):
        q = torch.randn(nh, T, hd, generator=g)
        got = attention.attend(lib, q, kc, vc, start, s, window, hd ** -0.5)
        want = _attention_reference(q, kc, vc, start, s, window, hd ** -0.5)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), (start, T)
        for t in range(T):   # each row equals the one-row call at its position, bitwise
            one = attention.attend(lib, q[:, t:t + 1], kc, vc, start + t, s, window, hd ** -0.5)
            assert torch.equal(one[0], got[t]), (start, T, t)
