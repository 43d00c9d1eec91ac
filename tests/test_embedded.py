"""The embedded default: the GGUF → safetensors conversion is faithful (transformers' own GGUF
loader is the oracle), and the committed drafter is the trained one (lossless, τ well above 1)."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.presets.embedded import (
    convert_gguf,
    embedded_drafter_path,
    ensure_embedded_gguf,
    ensure_embedded_target,
    load_gguf_model,
)
from dflash_trt.train.prompts import read_prompts

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


@pytest.fixture(scope="module")
def target_dir():
    return ensure_embedded_target()


def test_conversion_matches_transformers_gguf_loader(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ensure_embedded_gguf()
    ref, ref_tok = load_gguf_model(gguf)
    out = convert_gguf(gguf, tmp_path / "converted", (ref, ref_tok))  # the conversion itself, not a cached result
    conv = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == ref_tok.chat_template and "<|im_start|>" in tok.chat_template
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        ref_ids = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_tensors="pt")
        ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
        assert torch.equal(ids, ref_ids)
        with torch.no_grad():
            a, b = conv(ids).logits, ref(ids).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_converted_folder_is_plain_and_matches_the_preset(target_dir):
    from dflash_trt.presets.catalog import get_preset

    cfg = json.loads((target_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    preset = get_preset("smollm2-135m").config()
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "head_dim"):
        assert cfg[k] == preset[k], k
    assert cfg["rope_parameters"]["rope_theta"] == preset["rope_theta"]
    gen = json.loads((target_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2  # <|im_end|>: chat turns end there
    assert ensure_embedded_target() == target_dir  # second call reuses the folder


def test_committed_drafter_is_trained_and_lossless(target_dir):
    from safetensors import safe_open

    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import encode_prompt, load_pair

    ddir = embedded_drafter_path()
    assert (ddir / "model.safetensors").stat().st_size <= 40 * 1024 * 1024
    with safe_open(str(ddir / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    cfg = json.loads((ddir / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["num_target_layers"] == 30
    pair = load_pair(target_dir, ddir)
    taus = []
    for p in read_prompts(ddir.parent.parent / "data" / "heldout_prompts.jsonl")[:3]:
        ids = encode_prompt(pair.tokenizer, p)
        d = generate(pair.target, pair.drafter, ids, max_new_tokens=48, mode="dflash", stop_ids=pair.stop_ids)
        a = generate(pair.target, None, ids, max_new_tokens=48, mode="ar", stop_ids=pair.stop_ids)
        assert d.token_ids == a.token_ids
        taus.append(d.tau)
    # an untrained drafter accepts ~nothing (τ ≈ 1); the trained one must do clearly better
    assert sum(taus) / len(taus) > 1.5, taus
