"""KV injection: the fused PyTorch path (2) and the Triton kernel (3, under Triton's interpreter)
equal the plain reference (1), which itself equals the drafter module's own context_kv, over a
grid of shapes; the runtime gives identical tokens with the fused path on and off; bad input gives
one-line errors.

The Triton cases run in a child process started with TRITON_INTERPRET=1 (triton reads it when it
is imported), so the other test files in this pytest process keep the normal triton.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.kernels import c_loader
from dflash_trt.models.config import DrafterConfig
from dflash_trt.runtime.kv_inject import c_epilogue, c_epilogue_max_head_dim

C_KERNEL = ("kv_inject", c_epilogue)  # the c_or_torch fixture (conftest.py): C epilogue and torch epilogue

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}

# T, layers, heads, kv heads (GQA ratio heads/kv), head_dim, page size, FP8 cache, rope scaling, bias
CASES = [
    dict(T=1, L=1, nh=4, nkv=4, hd=64, page=1, fp8=False, rope=None, bias=False),
    dict(T=7, L=2, nh=8, nkv=2, hd=64, page=4, fp8=False, rope=YARN, bias=False),
    dict(T=16, L=3, nh=8, nkv=1, hd=128, page=16, fp8=True, rope=None, bias=False),
    dict(T=100, L=8, nh=4, nkv=2, hd=64, page=16, fp8=False, rope=LLAMA3, bias=False),
    dict(T=100, L=1, nh=16, nkv=4, hd=128, page=32, fp8=True, rope=YARN, bias=False),
    dict(T=7, L=8, nh=6, nkv=3, hd=128, page=8, fp8=True, rope=None, bias=True),
    dict(T=16, L=4, nh=2, nkv=2, hd=64, page=2, fp8=False, rope=None, bias=True),
    dict(T=1, L=5, nh=12, nkv=4, hd=64, page=64, fp8=True, rope=LLAMA3, bias=False),
]
H, N_FEAT, MAX_POS = 96, 3, 1024
K_SCALE, V_SCALE = 0.02, 0.05


def _ids(c):
    return f"T{c['T']}-L{c['L']}-{c['nh']}x{c['nkv']}-hd{c['hd']}-p{c['page']}" + ("-fp8" if c["fp8"] else "") + (
        f"-{c['rope']['rope_type']}" if c["rope"] else "") + ("-bias" if c["bias"] else "")


def make_case(c: dict, seed: int = 0):
    """A random drafter of the case's shape, inputs, and empty caches (pages > needed, shuffled)."""
    from dflash_trt.models.drafter import DFlashDrafter

    cfg = DrafterConfig.from_dict(dict(
        hidden_size=H, num_hidden_layers=c["L"], num_attention_heads=c["nh"], num_key_value_heads=c["nkv"],
        head_dim=c["hd"], intermediate_size=2 * H, vocab_size=64, block_size=4, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=c["rope"], max_position_embeddings=MAX_POS, attention_bias=c["bias"],
        dflash_config=dict(mask_token_id=1, target_layer_ids=list(range(N_FEAT)))))
    g = torch.Generator().manual_seed(seed)
    d = DFlashDrafter(cfg, max_len=MAX_POS)
    with torch.no_grad():
        for n, p in d.named_parameters():  # norms away from 1, biases non-zero: every weight matters
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1 and "norm" in n
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    T = c["T"]
    feats = torch.randn(T, N_FEAT * H, generator=g)
    pos = torch.randint(0, MAX_POS, (T,), generator=g)
    n_pages = -(-T // c["page"]) * 2 + 3
    order = torch.randperm(n_pages * c["page"], generator=g)  # slots scattered over non-contiguous pages
    slots = order[:T].clone()
    if T > 2:
        slots[T // 2] = -1  # a padding slot: must stay untouched
    dt = torch.float8_e4m3fn if c["fp8"] else torch.float32
    shape = (n_pages, c["L"], c["nkv"], c["page"], c["hd"])
    return d, feats, pos, slots, torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)


def run_reference(c, d, feats, pos, slots, k0, v0):
    from dflash_trt.runtime.kv_inject import reference_inject_paged

    kf, vf = torch.zeros(k0.shape), torch.zeros(v0.shape)  # float32 values before quantization
    reference_inject_paged(d, feats, pos, slots, kf, vf, c["page"])
    return kf, vf


def compare(c, got_k, got_v, ref_k, ref_v) -> dict:
    """Max |got - ref| (float32 caches), or for FP8 caches the number of codes outside the
    rounding of [ref - 1e-5, ref + 1e-5] (quantization is monotonic, so that interval's codes
    are the ones a 1e-5 difference before rounding can legitimately produce)."""
    from dflash_trt.runtime.kv_inject import quantize_fp8

    out = {}
    for name, got, ref, scale in (("k", got_k, ref_k, K_SCALE), ("v", got_v, ref_v, V_SCALE)):
        if not c["fp8"]:
            out[name] = float((got - ref).abs().max())
            continue
        lo = quantize_fp8(ref - 1e-5, scale).float()
        hi = quantize_fp8(ref + 1e-5, scale).float()
        g = got.float()
        out[name] = int(((g < lo) | (g > hi)).sum())
        out[name + "_exact_codes"] = int((got.view(torch.uint8) == quantize_fp8(ref, scale).view(torch.uint8)).sum())
    out["numel"] = ref_k.numel()
    return out


def run_fused(c, backend: str):
    from dflash_trt.runtime.kv_inject import inject_paged

    d, feats, pos, slots, k0, v0 = make_case(c)
    ref_k, ref_v = run_reference(c, d, feats, pos, slots, k0, v0)
    scales = (K_SCALE, V_SCALE) if c["fp8"] else (None, None)
    inject_paged(d, feats, pos, slots, k0, v0, c["page"], *scales, backend=backend)
    return compare(c, k0, v0, ref_k, ref_v)


def _check(c, res):
    if c["fp8"]:
        assert res["k"] == 0 and res["v"] == 0, res
    else:
        assert res["k"] <= 1e-5 and res["v"] <= 1e-5, res


# ------------------------------------------------------------------------------------ (1) and (2)
@pytest.mark.parametrize("c", CASES, ids=_ids)
def test_reference_is_the_drafter_module(c):
    from dflash_trt.runtime.kv_inject import reference_kv

    d, feats, pos, *_ = make_case(c)
    with torch.no_grad():
        want = d.context_kv(d.project_context(feats), pos)
    for (k, v), (k2, v2) in zip(reference_kv(d, feats, pos), want):
        torch.testing.assert_close(k, k2, rtol=0, atol=0)
        torch.testing.assert_close(v, v2, rtol=0, atol=0)


@pytest.mark.parametrize("c", CASES, ids=_ids)
def test_fused_torch_equals_reference(c, c_or_torch):
    res = run_fused(c, "torch")
    _check(c, res)
    if not c["fp8"]:
        assert res["k"] > 0 or res["v"] > 0 or c["T"] == 1  # a different computation, not a copy of (1)


def test_c_epilogue_head_dim_bound_agrees_with_the_header():
    """The head_dim bound Python checks is read from the C library, whose scratch row is sized by
    DFLASH_MAX_HEAD_DIM in csrc/dflash_kernels.h; at the bound the C epilogue runs, beyond it the
    torch path, with the reference's results either way."""
    lib = c_epilogue()
    if lib is None:
        pytest.skip("no C compiler")
    bound = int(re.search(r"#define DFLASH_MAX_HEAD_DIM (\d+)", c_loader.HEADER.read_text()).group(1))
    assert c_epilogue_max_head_dim(lib) == bound
    for hd in (bound, bound + 64):
        c = dict(CASES[1], nh=2, nkv=1, hd=hd)
        _check(c, run_fused(c, "torch"))


def test_padding_slot_untouched_and_pages_written():
    c = CASES[3]
    from dflash_trt.runtime.kv_inject import inject_paged

    d, feats, pos, slots, k0, v0 = make_case(c)
    k0.fill_(7.0)
    inject_paged(d, feats, pos, slots, k0, v0, c["page"])
    written = torch.zeros(k0.shape[0] * c["page"], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = k0.permute(0, 3, 1, 2, 4).reshape(-1, c["L"] * c["nkv"] * c["hd"])  # [slot, ...]
    assert (flat[~written] == 7.0).all() and (flat[written] != 7.0).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_contiguous_equals_reference(fp8, c_or_torch):
    from dflash_trt.runtime.kv_inject import fused_injector, reference_inject_contiguous

    c = dict(CASES[1], fp8=fp8)
    d, feats, pos, *_ = make_case(c)
    dt = torch.float8_e4m3fn if fp8 else torch.float32
    shape = (c["L"], c["nkv"], 40, c["hd"])
    kr, vr = torch.zeros(shape), torch.zeros(shape)
    reference_inject_contiguous(d, feats, pos, kr, vr, start=5)
    kf, vf = torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)
    scales = (K_SCALE, V_SCALE) if fp8 else (None, None)
    fused_injector(d).inject_contiguous(feats, pos, kf, vf, 5, *scales)
    _check(c, compare(c, kf, vf, kr, vr))
    assert kf[:, :, :5].float().abs().sum() == 0 and kf[:, :, 5 + c["T"]:].float().abs().sum() == 0


def test_bfloat16_as_close_to_float32_as_the_reference(c_or_torch):
    """bfloat16 (the CPU runtime's dtype on bf16-capable CPUs): the fused path's error against a
    float32 computation with the same bf16 weights is no worse than the bf16 reference's own."""
    from dflash_trt.runtime.kv_inject import fused_injector, reference_inject_contiguous

    c = dict(CASES[6], fp8=False)
    d, feats, pos, *_ = make_case(c)
    d = d.to(torch.bfloat16)
    d32 = type(d)(d.config, max_len=MAX_POS)
    d32.load_state_dict({k: v.float() for k, v in d.state_dict().items()})
    feats = feats.bfloat16()
    shape = (c["L"], c["nkv"], 40, c["hd"])
    exact = [torch.zeros(shape) for _ in range(2)]
    reference_inject_contiguous(d32, feats.float(), pos, *exact, start=5)
    ref = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    reference_inject_contiguous(d, feats, pos, *ref, start=5)
    got = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    fused_injector(d).inject_contiguous(feats, pos, *got, 5)
    for e, r, g in zip(exact, ref, got):
        err_ref, err_got = float((r.float() - e).abs().max()), float((g.float() - e).abs().max())
        assert 0 < err_got <= 1.5 * err_ref, (err_got, err_ref)


def test_injector_cached_and_rebuilt_on_weight_change():
    from dflash_trt.runtime.kv_inject import fused_injector

    d, *_ = make_case(CASES[0])
    a = fused_injector(d)
    assert fused_injector(d) is a
    with torch.no_grad():
        d.layers[0].self_attn.k_proj.weight.mul_(2)
    assert fused_injector(d) is not a


# ------------------------------------------------------------------------- (3) Triton interpreter
@pytest.fixture(scope="module")
def triton_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[_ids(c) for c in CASES])
def test_triton_kernel_equals_reference(triton_results, i):
    res = triton_results["paged"][i]
    assert res["interpreted"] is True
    _check(CASES[i], res)


def test_triton_kernel_contiguous(triton_results):
    _check(dict(fp8=True), triton_results["contiguous_fp8"])
    _check(dict(fp8=False), triton_results["contiguous"])


def _main():
    """Child process (TRITON_INTERPRET=1): run (3) on every case, print JSON results on the last line."""
    import triton

    from dflash_trt.runtime.kv_inject import fused_injector, reference_inject_contiguous

    interpreted = bool(triton.knobs.runtime.interpret)
    out = {"paged": []}
    for c in CASES:
        res = run_fused(c, "triton")
        res["interpreted"] = interpreted
        out["paged"].append(res)
    for fp8 in (False, True):
        c = dict(CASES[1], fp8=fp8)
        d, feats, pos, *_ = make_case(c)
        shape = (c["L"], c["nkv"], 40, c["hd"])
        kr, vr = torch.zeros(shape), torch.zeros(shape)
        reference_inject_contiguous(d, feats, pos, kr, vr, start=3)
        dt = torch.float8_e4m3fn if fp8 else torch.float32
        kf, vf = torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)
        fused_injector(d).inject_contiguous(feats, pos, kf, vf, 3, *((K_SCALE, V_SCALE) if fp8 else (None, None)),
                                            backend="triton")
        out["contiguous_fp8" if fp8 else "contiguous"] = compare(c, kf, vf, kr, vr)
    print(json.dumps(out))


# ------------------------------------------------------------------------------------- bad input
def test_bad_inputs_one_line_errors():
    from dflash_trt.runtime.kv_inject import fused_injector, inject_paged, slots_from_block_table

    c = CASES[1]
    d, feats, pos, slots, k0, v0 = make_case(c)
    bad = [
        (lambda: inject_paged(d, feats, pos, slots, k0, v0, 6), "page_size: 6 is not a power of two"),
        (lambda: inject_paged(d, feats[:, :-1], pos, slots, k0, v0, c["page"]), r"features: shape .* implies \[T, 288\]"),
        (lambda: inject_paged(d, feats, pos, slots, k0[:, :1], v0, c["page"]), "k_cache: shape"),
        (lambda: inject_paged(d, feats, pos, slots[:-1], k0, v0, c["page"]), "slots: shape"),
        (lambda: inject_paged(d, feats, pos + MAX_POS, slots, k0, v0, c["page"]), "positions: values must lie"),
        (lambda: inject_paged(d, feats, pos, slots + 10_000, k0, v0, c["page"]), "slots: .* beyond the cache"),
        (lambda: inject_paged(d, feats, pos, slots, k0.to(torch.float8_e4m3fn), v0.to(torch.float8_e4m3fn),
                              c["page"]), "FP8 KV cache needs both per-tensor scales"),
        (lambda: inject_paged(d, feats, pos, slots, k0, v0, c["page"], backend="cuda"), "backend"),
        (lambda: fused_injector(d).inject_contiguous(feats, pos, torch.zeros(c["L"], c["nkv"], 8, c["hd"]),
                                                     torch.zeros(c["L"], c["nkv"], 8, c["hd"]), 4),
         "do not fit max_len 8"),
        (lambda: slots_from_block_table(torch.tensor([3, 1]), torch.arange(9), 4), "block_table: 2 pages"),
        (lambda: inject_paged(d, feats, pos, slots, k0, v0, c["page"], backend="triton"),
         "tensors are on the CPU"),
    ]
    for fn, msg in bad:
        with pytest.raises(DFlashError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)


def test_slots_from_block_table():
    from dflash_trt.runtime.kv_inject import slots_from_block_table

    s = slots_from_block_table(torch.tensor([5, 2, 9]), torch.arange(10), 4)
    assert s.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]


# ------------------------------------------------------------------------------------- runtime
def test_runtime_tokens_identical_fused_on_and_off(tmp_path):
    from dflash_trt.models.tiny import make_tiny
    from dflash_trt.runtime.decode import SamplingParams, generate
    from dflash_trt.runtime.pair import load_pair

    make_tiny("qwen3", tmp_path / "t", tmp_path / "d", seed=5)
    pair = load_pair(tmp_path / "t", tmp_path / "d", "float32", max_len=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 500, (int(n),), generator=g).tolist() for n in (3, 11, 25)]
    n_accept = 0
    for p in prompts:
        for sp in (SamplingParams(), SamplingParams(temperature=0.8)):
            off = generate(pair.target, pair.drafter, p, max_new_tokens=24, sampling=sp, seed=2, fused_inject=False)
            on = generate(pair.target, pair.drafter, p, max_new_tokens=24, sampling=sp, seed=2, fused_inject=True)
            assert on.token_ids == off.token_ids
            assert on.accepted_per_block == off.accepted_per_block
            n_accept += off.blocks
    assert n_accept > 0  # speculative steps happened, so injection ran after verify


if __name__ == "__main__":
    _main()
