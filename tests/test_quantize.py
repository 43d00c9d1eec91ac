"""`quantize` against NVIDIA ModelOpt 0.47 (the oracle): tiny Llama and Qwen3 checkpoints built
with transformers, quantized by ModelOpt (`mtq.quantize` + `export_hf_checkpoint`) and by us.

Byte-for-byte: every weight, weight_scale and weight_scale_2 (FP8 and NVFP4), every tensor we
leave unquantized, hf_quant_config.json and config.json's quantization_config.
Differs by design, compared with a tolerance instead:
- input_scale, k_scale, v_scale: ModelOpt calibrates with transformers' bf16 forward; ours runs
  the reference runtime's decoder layer (also bf16, different kernels), one layer at a time;
  the amaxes agree to rounding (tests allow 2%).

NVFP4 on CPU: with ModelOpt 0.47 here, `mtq.quantize(NVFP4_DEFAULT_CFG)` with its max-calibration
forward and `export_hf_checkpoint` both run on a CPU-only machine (observed, no CUDA present),
so the oracle is ModelOpt's unmodified quantize + export path; the test asserts the model is on
CPU. Nothing of ModelOpt's is patched or stubbed.
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import safetensors.torch as st
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.quant.linear import HF_EXPORT, TRTLLM_EXPORT, linear_specs, per_tensor_scale, quantize_linear
from dflash_trt.quant.quantize import quantize_checkpoint

CALIB_IDS = [[5, 17, 99, 3, 250, 42, 7, 7, 130, 64, 200, 11, 90, 1, 33, 77],
             [8, 1, 240, 66, 12, 13, 150, 151, 2, 99, 180, 23, 45, 67, 89, 101]]


def build(arch: str, folder):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        m = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
                          tie_word_embeddings=True)
        m = Qwen3ForCausalLM(cfg)
    m = m.to(torch.bfloat16)
    m.save_pretrained(folder)
    return folder


def modelopt_export(src, out, fmt: str):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert next(m.parameters()).device.type == "cpu"
    qc = copy.deepcopy(mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    qc["quant_cfg"] = qc["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    ids = torch.tensor(CALIB_IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = mtq.quantize(m, qc, lambda model: model(ids))
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{(arch, fmt): (ours_dir, modelopt_dir, src_dir)}"""
    root = tmp_path_factory.mktemp("q")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in CALIB_IDS))
    out = {}
    for arch in ("llama", "qwen3"):
        src = build(arch, root / f"src-{arch}")
        for fmt in ("fp8", "nvfp4"):
            ref = modelopt_export(src, root / f"modelopt-{arch}-{fmt}", fmt)
            ours = root / f"ours-{arch}-{fmt}"
            quantize_checkpoint(src, ours, fmt, kv_cache="fp8", calib=calib, progress=False)
            out[arch, fmt] = (ours, ref, src)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


CASES = [(a, f) for a in ("llama", "qwen3") for f in ("fp8", "nvfp4")]


@pytest.mark.parametrize("arch,fmt", CASES)
def test_tensors_byte_identical_to_modelopt(pairs, arch, fmt):
    ours, ref, _ = pairs[arch, fmt]
    a, b = st.load_file(ours / "model.safetensors"), st.load_file(ref / "model.safetensors")
    assert sorted(a) == sorted(b)
    calibrated = (".input_scale", ".k_scale", ".v_scale")
    exact = [k for k in b if not k.endswith(calibrated)]
    assert any(k.endswith(".weight_scale") for k in exact)
    for k in exact:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bytes(a[k]), _bytes(b[k])), f"{k} differs from ModelOpt"
    # by design: calibration forward precision (see module docstring)
    for k in b:
        if k.endswith(calibrated):
            assert a[k].dtype == b[k].dtype == torch.float32 and a[k].shape == b[k].shape == ()
            assert a[k].item() == pytest.approx(b[k].item(), rel=0.02), k


@pytest.mark.parametrize("arch,fmt", CASES)
def test_configs_identical_to_modelopt(pairs, arch, fmt):
    ours, ref, src = pairs[arch, fmt]
    assert json.loads((ours / "hf_quant_config.json").read_text()) == json.loads((ref / "hf_quant_config.json").read_text())
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert qa == qb
    # ModelOpt's own converter agrees with ours on the hf_quant_config -> quantization_config step
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    assert convert_hf_quant_config_format(json.loads((ours / "hf_quant_config.json").read_text())) == qa
    # the rest of config.json is the source's, unchanged
    cfg = json.loads((ours / "config.json").read_text())
    cfg.pop("quantization_config")
    assert cfg == json.loads((src / "config.json").read_text())


def test_nvfp4_fused_groups_share_global_scale(pairs):
    ours, _, _ = pairs["llama", "nvfp4"]
    with CheckpointReader(ours) as r:
        p = "model.layers.1."
        g = [r.get(p + f"self_attn.{x}_proj.weight_scale_2") for x in "qkv"]
        assert g[0] == g[1] == g[2]
        assert r.get(p + "mlp.gate_proj.weight_scale_2") == r.get(p + "mlp.up_proj.weight_scale_2")
        assert r.get(p + "mlp.gate_proj.input_scale") == r.get(p + "mlp.up_proj.input_scale")
        assert r.get(p + "self_attn.o_proj.weight_scale_2") != g[0]


def test_uncalibrated_output_says_so(tmp_path, pairs):
    _, _, src = pairs["llama", "fp8"]
    rep = quantize_checkpoint(src, tmp_path / "o", "fp8", kv_cache="fp8", progress=False)
    assert not rep.calibrated
    assert any("input_scale" in s for s in rep.not_calibrated) and any("k_scale" in s for s in rep.not_calibrated)
    with CheckpointReader(tmp_path / "o") as r:
        assert not any(k.endswith("input_scale") for k in r.keys())
        assert r.get("model.layers.0.self_attn.k_proj.k_scale").item() == 1.0


def test_cli_json_and_exclude_and_shards(tmp_path, pairs, capsys):
    from dflash_trt.cli import main

    _, _, src = pairs["qwen3", "fp8"]
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", str(src), "--format", "nvfp4", "--exclude", "*layers.1.mlp.*",
              "--max-shard-size", "30KB", "--out", str(tmp_path / "o"), "--json"])
    assert e.value.code == 0
    rep = json.loads(capsys.readouterr().out)
    assert "model.layers.1.mlp.down_proj" in rep["exclude_modules"] and "lm_head" in rep["exclude_modules"]
    assert len([f for f in rep["files"] if f.endswith(".safetensors")]) > 1
    with CheckpointReader(tmp_path / "o") as r:
        assert r.meta("model.layers.1.mlp.down_proj.weight")[0] == torch.bfloat16
        assert r.meta("model.layers.0.mlp.down_proj.weight")[0] == torch.uint8
    hfq = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())
    assert "model.layers.1.mlp.gate_proj" in hfq["quantization"]["exclude_modules"]


def test_drafter_fp8_weights_only(tmp_path, tiny_pairs):
    _, drafter = tiny_pairs["qwen3"]
    rep = quantize_checkpoint(drafter, tmp_path / "d", "fp8", progress=False)
    with CheckpointReader(tmp_path / "d") as r, CheckpointReader(drafter) as src:
        assert r.meta("fc.weight")[0] == torch.float8_e4m3fn
        assert r.meta("layers.0.self_attn.q_proj.weight")[0] == torch.float8_e4m3fn
        assert r.meta("hidden_norm.weight")[0] == src.meta("hidden_norm.weight")[0]
        w = src.get("fc.weight")
        back = r.get("fc.weight").float() * r.get("fc.weight_scale")
        assert float((back - w.float()).abs().max()) <= float(w.abs().max()) * 2 ** -4
    assert rep.quantized_modules > 0
    # read back as float weights (what the runtime needs to run an FP8 drafter on CPU)
    from dflash_trt.models.weights import dequantized_state_dict
    deq = dequantized_state_dict(tmp_path / "d")
    with CheckpointReader(drafter) as src:
        assert sorted(deq) == sorted(src.keys())
        w = src.get("layers.0.mlp.down_proj.weight").float()
        assert float((deq["layers.0.mlp.down_proj.weight"] - w).abs().max()) <= float(w.abs().max()) * 2 ** -4
    # and load_drafter runs it (the weights FP8 encodes): `bench --drafter FP8_DIR` measures its tau
    from dflash_trt.models.drafter import load_drafter
    d = load_drafter(tmp_path / "d")
    torch.testing.assert_close(d.layers[0].mlp.down_proj.weight, deq["layers.0.mlp.down_proj.weight"], rtol=0, atol=0)
    assert not torch.equal(d.fc.weight, load_drafter(drafter, torch.float32).fc.weight)
    with pytest.raises(DFlashError, match="--calib is for targets"):
        quantize_checkpoint(drafter, tmp_path / "d2", "fp8", calib=tmp_path / "x.jsonl", progress=False)


def test_gpt_oss_nvfp4_refused_fp8_keeps_mxfp4_experts(tmp_path, tiny_pairs):
    target, _ = tiny_pairs["gpt-oss"]
    with pytest.raises(DFlashError, match="gpt-oss: --format nvfp4 refused: its experts ship as MXFP4"):
        quantize_checkpoint(target, tmp_path / "o", "nvfp4", progress=False)
    assert not (tmp_path / "o").exists()
    quantize_checkpoint(target, tmp_path / "o8", "fp8", kv_cache="fp8", progress=False)
    with CheckpointReader(tmp_path / "o8") as r, CheckpointReader(target) as src:
        assert r.meta("model.layers.0.self_attn.q_proj.weight")[0] == torch.float8_e4m3fn
        for k in src.keys():
            if "experts" in k or "router" in k:
                assert torch.equal(_bytes(r.get(k)), _bytes(src.get(k))), k


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("export", [HF_EXPORT, TRTLLM_EXPORT], ids=["hf", "trtllm"])
def test_linear_specs_describe_quantize_linear(export, fmt):
    """quantize and convert plan their files with linear_specs and fill them with quantize_linear."""
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    got = quantize_linear(export, "m", w, fmt, per_tensor_scale(fmt, w.abs().amax().float()), input_amax=3.0)
    want = linear_specs(export, "m", fmt, 48, 64, input_scale=True)
    assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == [(s.name, s.dtype, s.shape) for s in want]
