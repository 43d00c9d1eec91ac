"""`convert` against ModelOpt 0.47's `export_tensorrt_llm_checkpoint` (the oracle), tp = 1 and 2,
unquantized, FP8 and NVFP4 (+ FP8 KV cache).

The tiny Llama has 1 KV head (so tp=2 duplicates it) and a vocabulary of 251 (so tp=2 pads it).
Byte-for-byte: every tensor of every rank, except (by design):
- activation_scaling_factor: ModelOpt calibrates with transformers' bf16 forward, we with the
  reference runtime's bf16 decoder layer (different kernels), one layer at a time (within 2%).
config.json is equal except (by design):
- rank: ModelOpt writes the last rank's number into the one shared config.json; we write 0.
- rotary_base: ModelOpt 0.47 under transformers 5 drops it (rope_theta moved into
  rope_parameters), which would make TensorRT-LLM use 10000; we always write it.
- qwen_type (Qwen3 only): ModelOpt's export (decoder_type "qwen") omits it, so TensorRT-LLM
  would build Qwen v1 and ignore the q/k norms; we write "qwen3".
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import safetensors.torch as st
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.stacks.trtllm.convert import convert_checkpoint

IDS = [[5, 17, 99, 3, 250, 42, 7, 7, 130, 64, 200, 11, 90, 1, 33, 77],
       [8, 1, 240, 66, 12, 13, 150, 151, 2, 99, 180, 23, 45, 67, 89, 101]]


def modelopt_trtllm(model, out, quant: str, tp: int, decoder: str = "llama"):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if quant != "none":
            qc = copy.deepcopy(mtq.FP8_DEFAULT_CFG if quant == "fp8" else mtq.NVFP4_DEFAULT_CFG)
            qc["quant_cfg"] = qc["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
            m = mtq.quantize(m, qc, lambda mm: mm(torch.tensor(IDS)))
        export_tensorrt_llm_checkpoint(m, decoder_type=decoder, dtype=torch.bfloat16, export_dir=out,
                                       inference_tensor_parallel=tp)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("conv")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=251, max_position_embeddings=128, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(root / "src")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in IDS))
    return root, m, calib


def compare(ours, ref, tp, skip=()):
    for r in range(tp):
        a, b = st.load_file(ours / f"rank{r}.safetensors"), st.load_file(ref / f"rank{r}.safetensors")
        assert sorted(a) == sorted(b), (set(a) ^ set(b))
        for k in b:
            if any(s in k for s in skip):
                continue
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            if k.endswith("activation_scaling_factor"):
                assert a[k].item() == pytest.approx(b[k].item(), rel=0.02), k
            else:
                assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), f"rank{r} {k}"
    ca, cb = json.loads((ours / "config.json").read_text()), json.loads((ref / "config.json").read_text())
    assert ca.pop("rank") == 0 and cb.pop("rank") == tp - 1
    assert "rotary_base" not in cb and ca.pop("rotary_base") == 10000.0
    return ca, cb


@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_llama_matches_modelopt(llama, quant, tp):
    root, m, calib = llama
    ref = modelopt_trtllm(m, root / f"ref-{quant}-{tp}", quant, tp)
    kw = dict(kv_cache="fp8", calib=calib) if quant != "none" else {}
    ours = root / f"ours-{quant}-{tp}"
    convert_checkpoint(root / "src", ours, tp=tp, quant=quant, progress=False, **kw)
    ca, cb = compare(ours, ref, tp)
    assert ca == cb
    a = st.load_file(ours / "rank0.safetensors")
    assert a["lm_head.weight"].shape[0] == (252 if tp == 2 else 251) // tp


@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_qwen3_matches_modelopt(tmp_path, quant):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    q = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
                                     tie_word_embeddings=True)).to(torch.bfloat16)
    with torch.no_grad():
        for layer in q.model.layers:   # non-trivial q/k norms so their copy is checked
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    q.save_pretrained(tmp_path / "src")
    ref = modelopt_trtllm(q, tmp_path / "ref", quant, 2, decoder="qwen")
    calib = tmp_path / "c.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in IDS))
    kw = dict(kv_cache="fp8", calib=calib) if quant == "fp8" else {}
    convert_checkpoint(tmp_path / "src", tmp_path / "ours", tp=2, quant=quant, progress=False, **kw)
    ca, cb = compare(tmp_path / "ours", ref, 2)
    # by design: ModelOpt omits qwen_type, without which TensorRT-LLM builds Qwen v1 (no q/k norms)
    assert ca.pop("qwen_type") == "qwen3" and "qwen_type" not in cb
    assert ca == cb
    a = st.load_file(tmp_path / "ours" / "rank1.safetensors")
    for i in range(2):
        for src_name, dst in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            w = getattr(q.model.layers[i].self_attn, src_name).weight
            assert torch.equal(a[f"transformer.layers.{i}.attention.{dst}.weight"], w)


def test_nvfp4_weights_dequantize_to_source(llama, tmp_path):
    from dflash_trt.io import formats
    from dflash_trt.io.checkpoint import CheckpointReader

    root, _, calib = llama
    convert_checkpoint(root / "src", tmp_path / "o", tp=2, quant="nvfp4", calib=calib, progress=False)
    a = st.load_file(tmp_path / "o" / "rank1.safetensors")
    with CheckpointReader(root / "src") as src:
        w = src.get("model.layers.0.mlp.down_proj.weight").float()[:, 64:]
    p = "transformer.layers.0.mlp.proj."
    back = formats.nvfp4_dequantize(a[p + "weight"], a[p + "weights_scaling_factor"], a[p + "weights_scaling_factor_2"])
    s = (a[p + "weights_scaling_factor"].float() * a[p + "weights_scaling_factor_2"]).repeat_interleave(16, -1)
    assert bool(((back - w).abs() <= s).all())


def test_convert_refusals(tmp_path, llama, tiny_pairs):
    root, _, _ = llama
    gpt_oss, _ = tiny_pairs["gpt-oss"]
    with pytest.raises(DFlashError, match="gpt-oss: TensorRT-LLM has no engine .* PyTorch backend"):
        convert_checkpoint(gpt_oss, tmp_path / "o", tp=1, progress=False)
    with pytest.raises(DFlashError, match="--tp 3: num_attention_heads 4"):
        convert_checkpoint(root / "src", tmp_path / "o", tp=3, progress=False)
    with pytest.raises(DFlashError, match="--ep 2: llama is a dense model"):
        convert_checkpoint(root / "src", tmp_path / "o", tp=1, ep=2, progress=False)
    with pytest.raises(DFlashError, match="--calib"):
        convert_checkpoint(root / "src", tmp_path / "o", tp=1, quant="fp8", progress=False)
    assert not (tmp_path / "o").exists()
