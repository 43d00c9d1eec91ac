"""The served model measured: the CPU runtime runs a bundle's own quantized target (ModelOpt FP8,
NVFP4 with weight_scale_2, gpt-oss MXFP4 experts), decoded to the values the engines' GEMMs
multiply by, so `generate` / `bench --bundle` measure tau and losslessness of what the engines load.

Oracles: NVIDIA ModelOpt 0.47 writes the checkpoint (`mtq.quantize` + `export_hf_checkpoint`, on CPU)
and decodes it (its own `FP8QTensor` / `NVFP4QTensor.dequantize`); losslessness is DFlash against
AR decoding of the same quantized weights; `check` and the loader are held to the same verdicts.
"""
from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.errors import DFlashError
from dflash_trt.models.check import check_pair
from dflash_trt.models.target import load_target
from dflash_trt.quant.quantize import quantize_checkpoint
from dflash_trt.runtime.pair import generate, load_pair

from helpers import run_cli

PROMPTS = ([5, 17, 99, 3, 250, 42], [8, 1, 240, 66, 12, 13, 150, 151])
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def _modelopt_export(src, out, fmt: str):
    """ModelOpt's own quantize + unified HF export of a transformers checkpoint (bf16, on CPU)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert next(m.parameters()).device.type == "cpu"
    qc = copy.deepcopy(mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    ids = torch.tensor([list(p) + [7] * (8 - len(p)) for p in PROMPTS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = mtq.quantize(m, qc, lambda model: model(ids))
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out)
    for name in TOKENIZER_FILES:   # the export writes the model only; the runtime needs the tokenizer
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    return out


def _modelopt_decode(state: dict, module: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ModelOpt's own dequantize of one exported weight: (its result, for NVFP4 also the block part
    alone: double_scale 1, i.e. e2m1 * E4M3 block scale, exact in fp32)."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = state[module + ".weight"]
    if fmt == "fp8":
        q = FP8QTensor(w.shape, torch.float32, w)
        return q.dequantize(torch.float32, scale=state[module + ".weight_scale"].float()), None
    shape = torch.Size([w.shape[0], w.shape[1] * 2])
    q = NVFP4QTensor(shape, torch.float32, w)
    full = q.dequantize(torch.float32, scale=state[module + ".weight_scale"],
                        double_scale=state[module + ".weight_scale_2"].float(), block_sizes={-1: 16})
    block = q.dequantize(torch.float32, scale=state[module + ".weight_scale"],
                         double_scale=torch.tensor(1.0), block_sizes={-1: 16})
    return full, block


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_runtime_weights_are_modelopts_decode_and_dflash_is_ar(tiny_pairs, tmp_path, fmt):
    pytest.importorskip("modelopt")
    pytest.importorskip("requests")   # modelopt.torch.export imports it
    t, d = tiny_pairs["llama"]
    q = _modelopt_export(t, tmp_path / "modelopt", fmt)
    state = load_file(str(next(q.glob("*.safetensors"))))
    modules = [n[: -len(".weight_scale")] for n in state if n.endswith(".weight_scale")]
    assert len(modules) >= 7, modules   # every decoder Linear of the tiny llama
    model = load_target(q, torch.float32)
    params = dict(model.named_parameters())
    for m in modules:
        ours = params[m + ".weight"].detach()
        full, block = _modelopt_decode(state, m, fmt)
        if fmt == "fp8":
            assert torch.equal(ours, full), m
        else:
            # the GEMM's order: block part (exact) then the global scale; ModelOpt multiplies the scales first
            assert torch.equal(ours, block * state[m + ".weight_scale_2"].float()), m
            assert torch.allclose(ours, full, rtol=2 ** -22, atol=0), m
    # check accepts ModelOpt's export, and DFlash over the quantized target is AR over it
    assert check_pair(q, d)["ok"], check_pair(q, d)["problems"]
    pair = load_pair(q, d, dtype="auto")
    assert pair.target.dtype == torch.float32   # auto: the exact decoded values for a quantized target
    unquantized = load_pair(t, None, dtype="float32")
    for ids in PROMPTS:
        ar = generate(pair, ids, max_new_tokens=24, mode="ar").token_ids
        assert generate(pair, ids, max_new_tokens=24).token_ids == ar
    generate(unquantized, PROMPTS[0], max_new_tokens=1, mode="ar")   # (allocates its cache)
    logits_q = pair.target.forward(torch.tensor(PROMPTS[0]), 0)[0]
    assert not torch.equal(logits_q, unquantized.target.forward(torch.tensor(PROMPTS[0]), 0)[0])   # really quantized


@pytest.mark.parametrize("arch,fmt", [("llama", "nvfp4"), ("qwen3", "fp8"), ("gpt-oss", "fp8")])
def test_our_quantized_targets_run_losslessly(tiny_pairs, tmp_path, arch, fmt):
    """quantize's output (what build puts in target/) runs; gpt-oss keeps its MXFP4 experts."""
    t, d = tiny_pairs[arch]
    q = tmp_path / "q"
    quantize_checkpoint(t, q, fmt, kv_cache="fp8", progress=False)
    stored = load_file(str(next(q.glob("*.safetensors"))))
    assert any(k.endswith(".k_scale") for k in stored)
    if arch == "gpt-oss":
        assert any(k.endswith("_blocks") and v.dtype == torch.uint8 for k, v in stored.items())
    assert check_pair(q, d)["ok"]
    pair = load_pair(q, d)
    for ids in PROMPTS:
        ar = generate(pair, ids, max_new_tokens=20, mode="ar").token_ids
        res = generate(pair, ids, max_new_tokens=20)
        assert res.token_ids == ar and res.tau >= 1.0


def _damaged(src, dst, edit):
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f))
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.0.mlp.down_proj.weight_scale_2"),
     "tensor 'model.layers.0.mlp.down_proj.weight' is torch.uint8 without the scales of a known format"),
    (lambda s: s.__setitem__("model.layers.1.self_attn.q_proj.weight_scale",
                             s["model.layers.1.self_attn.q_proj.weight_scale"][:, :1].contiguous()),
     "tensor model.layers.1.self_attn.q_proj.weight_scale has shape"),
    (lambda s: s.__setitem__("model.layers.0.mlp.up_proj.weight", s["model.layers.0.mlp.up_proj.weight"][:, :4].contiguous()),
     "tensor 'model.layers.0.mlp.up_proj.weight' has shape"),
])
def test_check_and_the_loader_refuse_the_same_damage(tiny_pairs, tmp_path, edit, message):
    t, d = tiny_pairs["llama"]
    q = tmp_path / "q"
    quantize_checkpoint(t, q, "nvfp4", progress=False)
    bad = _damaged(q, tmp_path / "bad", edit)
    report = check_pair(bad, d, scan=False)
    assert not report["ok"] and message in report["problems"][0], report["problems"]
    with pytest.raises(DFlashError) as e:
        load_pair(bad, d)
    assert message in str(e.value)


@pytest.fixture(scope="module")
def nvfp4_bundle(tmp_path_factory):
    """build --arch blackwell of a tiny llama pair: an NVFP4 target/ (the default Blackwell bundle's layout)."""
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("qbundle")
    make_tiny("llama", root / "t", root / "d", seed=3)
    code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", "blackwell",
                           "--out", str(root / "bundle"), "--json")
    assert code == 0, err
    return root / "bundle"


def test_bench_and_generate_bundle_run_the_served_nvfp4_target(nvfp4_bundle, tmp_path):
    meta = json.loads((nvfp4_bundle / "manifest.json").read_text())
    assert meta["quant"]["target"] == "nvfp4"
    code, out, err = run_cli("check", "--bundle", str(nvfp4_bundle), "--json")
    assert code == 0 and json.loads(out)["ok"], err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "count to five")))
    code, out, err = run_cli("bench", "--bundle", str(nvfp4_bundle), "--prompts", str(prompts),
                             "--max-new-tokens", "16", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["target"] == str(nvfp4_bundle / "target") and report["target_quantized"] is True
    assert report["lossless"] is True and report["dtype"] == "float32"
    code, out, err = run_cli("generate", "--bundle", str(nvfp4_bundle), "-p", "hello there", "--max-new-tokens", "16",
                             "--json")
    assert code == 0, err
    code, ar, err = run_cli("generate", "--bundle", str(nvfp4_bundle), "-p", "hello there", "--max-new-tokens", "16",
                            "--mode", "ar", "--json")
    assert json.loads(out)["token_ids"] == json.loads(ar)["token_ids"]


def test_bundle_option_errors_are_one_line(nvfp4_bundle, tmp_path):
    code, _, err = run_cli("generate", "--bundle", str(nvfp4_bundle), "--target", "x", "-p", "hi")
    assert code == 1 and "drop --target / --drafter" in err
    code, _, err = run_cli("bench", "--endpoint", "http://127.0.0.1:9", "--bundle", str(nvfp4_bundle))
    assert code == 1 and "--bundle measures our CPU runtime" in err
    empty = tmp_path / "b"
    shutil.copytree(nvfp4_bundle, empty)
    for f in (empty / "target").glob("*.safetensors"):
        f.unlink()
    code, _, err = run_cli("check", "--bundle", str(empty))
    assert code == 1 and "the bundle holds no target weights" in err and len(err.strip().splitlines()) == 1
