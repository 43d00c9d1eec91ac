"""Greedy losslessness: DFlash == our AR baseline == transformers' own generate (an oracle we
did not write), on tiny Llama, Qwen3 and gpt-oss pairs, float64, block sizes 2/4/8/16."""
from __future__ import annotations

import random

import pytest
import torch

from dflash_trt.runtime.decode import generate
from dflash_trt.runtime.pair import load_pair

N_PROMPTS = 20
MAX_NEW = 24


def _prompts(vocab: int, n: int = N_PROMPTS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def _hf_oracle(target_dir, prompts, max_new, stop_ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(target_dir)
    cfg._experts_implementation = "eager"  # torch._grouped_mm has no float64 on CPU
    if getattr(cfg, "quantization_config", None):
        # transformers' MXFP4 path needs a GPU; the oracle gets the same weights dequantized by
        # transformers' own converter (convert_moe_packed_tensors), not by our code.
        return _hf_oracle_dequantized(target_dir, cfg, prompts, max_new, stop_ids)
    model = AutoModelForCausalLM.from_pretrained(target_dir, config=cfg, dtype=torch.float64).eval()
    return [_hf_generate(model, p, max_new, stop_ids) for p in prompts]


def _hf_oracle_dequantized(target_dir, cfg, prompts, max_new, stop_ids):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    state = load_file(target_dir / "model.safetensors")
    dense = {}
    for k, v in state.items():
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            dense[base] = convert_moe_packed_tensors(v, state[base + "_scales"], dtype=torch.float64)
        elif not k.endswith("_scales"):
            dense[k] = v.double()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return [_hf_generate(model, p, max_new, stop_ids) for p in prompts]


def _hf_generate(model, prompt, max_new, stop_ids):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
def test_greedy_lossless_against_ar_and_transformers(tiny_pairs, arch):
    tdir, ddir = tiny_pairs[arch]
    pair = load_pair(tdir, ddir, "float64")
    prompts = _prompts(pair.target.vocab_size)
    oracle = _hf_oracle(tdir, prompts, MAX_NEW, pair.stop_ids)
    for prompt, want in zip(prompts, oracle):
        ar = generate(pair.target, None, prompt, max_new_tokens=MAX_NEW, mode="ar", stop_ids=pair.stop_ids)
        assert ar.token_ids == want, f"AR differs from transformers on prompt {prompt}"
        for B in (2, 4, 8, 16):
            df = generate(pair.target, pair.drafter, prompt, max_new_tokens=MAX_NEW, block_size=B,
                          stop_ids=pair.stop_ids)
            assert df.token_ids == want, f"DFlash B={B} differs on prompt {prompt}"
            assert sum(df.accepted_per_block) + 1 >= len(df.token_ids)


def test_stop_token_mid_block_matches_ar(tiny_pairs):
    """A stop token inside an accepted block ends the output exactly where AR ends it."""
    tdir, ddir = tiny_pairs["qwen3"]
    pair = load_pair(tdir, ddir, "float64")
    prompt = _prompts(pair.target.vocab_size, 1, seed=7)[0]
    free = generate(pair.target, None, prompt, max_new_tokens=30, mode="ar")
    stop = [free.token_ids[9]]
    ar = generate(pair.target, None, prompt, max_new_tokens=30, mode="ar", stop_ids=stop)
    assert ar.token_ids[-1] == stop[0] and len(ar.token_ids) <= 10
    for B in (2, 4, 8, 16):
        df = generate(pair.target, pair.drafter, prompt, max_new_tokens=30, block_size=B, stop_ids=stop)
        assert df.token_ids == ar.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
def test_verify_pass_is_batch_invariant(tiny_pairs, arch, dtype):
    """A T-token verify pass gives bitwise the logits of T one-token AR steps (what makes greedy
    DFlash exactly lossless), at lengths that cross the attention's KV_PAD chunks. float32: by
    construction of the C kernels (csrc/gemm.c, csrc/attention.c), on every x86 CPU. bfloat16: where
    the CPU has native bf16, oneDNN's kernels are invariant at these sizes (the tiny configs get
    head_dim 64, as SmolLM2 and gpt-oss), not at every size (head_dim 16 is not on an AVX512-BF16
    CPU), so bench and make run report `lossless` measured, never assumed."""
    import json

    from dflash_trt.kernels import attention, c_loader, gemm
    from dflash_trt.models.attention import KV_PAD
    from dflash_trt.models.families.dense import DenseTarget as TargetModel
    from dflash_trt.runtime.pair import native_bf16

    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("this CPU has no native bf16 (AVX512-BF16 / AMX): oneDNN's emulated bf16 GEMMs are not "
                    "batch-invariant")
    if dtype == torch.float32 and (gemm.library() is None or attention.library() is None):
        pytest.fail(f"the float32 decode kernels did not build: {c_loader.build_error('gemm')} "
                    f"{c_loader.build_error('attention')}")
    tdir, _ = tiny_pairs[arch]
    cfg = dict(json.loads((tdir / "config.json").read_text()), head_dim=64)
    cfg.pop("quantization_config", None)
    g = torch.Generator().manual_seed(1)
    t = TargetModel(cfg, dtype, max_len=4 * KV_PAD)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    t.setup_cache(4 * KV_PAD)
    for start in (1, KV_PAD - 3, KV_PAD, 2 * KV_PAD - 8, 2 * KV_PAD + 5):
        for T in (2, 8, 16):
            ids = torch.randint(4, t.vocab_size, (start + T,), generator=g)
            t(ids[:start], 0)
            block, _ = t(ids[start:], start, all_logits=True)
            steps = torch.cat([t(ids[start + i:start + i + 1], start + i)[0] for i in range(T)])
            assert torch.equal(block, steps), (start, T)


def test_float32_runs_lossless(tiny_pairs):
    tdir, ddir = tiny_pairs["llama"]
    pair = load_pair(tdir, ddir, "float32")
    prompt = _prompts(pair.target.vocab_size, 1)[0]
    ar = generate(pair.target, None, prompt, max_new_tokens=16, mode="ar", stop_ids=pair.stop_ids)
    df = generate(pair.target, pair.drafter, prompt, max_new_tokens=16, stop_ids=pair.stop_ids)
    assert ar.token_ids == df.token_ids
