"""Quantized DFlash drafters (issue 35): ModelOpt's unified format with what each engine's DFlash
loader needs unquantized, its bytes against ModelOpt 0.47's own export; the runtime's dequantizing
loader against an independent decode; DFlash with a quantized drafter still == AR; build's rules.

The oracle: ModelOpt's `mtq.quantize` + `export_hf_checkpoint`, unmodified, on a stand-in of the
drafter it can export: transformers' Qwen3Model (the drafter's `layers.N.*` and `norm` names) with
the drafter's `fc` and `hidden_norm` attached and its weights loaded. The stand-in's embed_tokens
(the drafter has none: it shares the target's) is left out of the comparison. What an engine keeps
unquantized is a disabled quantizer there, an --exclude glob here. Activation maxima: both sides get
the same per-Linear amax (ModelOpt through its calibration forward, each Linear fed an input whose
max is that amax; bf16-exact values, so that its bf16 forward sees them as given), so input_scale is
compared byte for byte too, shared over q/k/v and gate/up by ModelOpt's own fusion pass.
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import safetensors.torch as st
import torch

from dflash_trt import stacks
from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.models.drafter import load_drafter
from dflash_trt.quant.quantize import quantize_checkpoint

from helpers import run_cli

PROFILES = {name: stacks.get(name).drafter_unquantized() for name in ("trtllm", "sglang")}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def bf16_drafter(tiny_pairs, tmp_path_factory):
    """The tiny Qwen3 pair's drafter in bf16 (what ModelOpt's bf16 stand-in holds too)."""
    t, d = tiny_pairs["qwen3"]
    out = tmp_path_factory.mktemp("bf16") / "drafter"
    out.mkdir()
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in st.load_file(d / "model.safetensors").items()}
    st.save_file(sd, out / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, dtype="bfloat16"), indent=2))
    return t, out


def amax_of(folder) -> dict[str, float]:
    """A distinct bf16-exact activation amax per Linear (members of a fused group differ)."""
    with CheckpointReader(folder) as r:
        mods = sorted(n[: -len(".weight")] for n in r.keys() if n.endswith("_proj.weight") or n == "fc.weight")
    return {m: 2.0 ** (i % 5 - 2) * (1 + (i % 8) / 8) for i, m in enumerate(mods)}


def modelopt_export(drafter, out, fmt: str, keep: list[str], amax: dict[str, float]):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import Qwen3Config, Qwen3Model
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    c = json.loads((drafter / "config.json").read_text())
    cfg = Qwen3Config(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                      num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                      num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], vocab_size=c["vocab_size"],
                      rms_norm_eps=c["rms_norm_eps"], architectures=["DFlashDraftModel"])
    sd = st.load_file(drafter / "model.safetensors")
    m = Qwen3Model(cfg)
    m.fc = torch.nn.Linear(sd["fc.weight"].shape[1], sd["fc.weight"].shape[0], bias=False)
    m.hidden_norm = Qwen3RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
    m = m.to(torch.bfloat16)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    assert next(m.parameters()).device.type == "cpu"
    qc = copy.deepcopy(mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    qc["quant_cfg"] = qc["quant_cfg"] + [{"quantizer_name": f"{g}*", "enable": False} for g in keep]

    def calibrate(model):
        for name, mod in model.named_modules():
            if name in amax:
                x = torch.zeros(1, mod.in_features, dtype=torch.bfloat16)
                x[0, 0] = amax[name]
                mod(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = mtq.quantize(m, qc, calibrate)
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out)
    return out


CASES = [(fmt, stack) for fmt in ("fp8", "nvfp4") for stack in PROFILES]


@pytest.mark.parametrize("fmt,stack", CASES)
def test_drafter_bytes_identical_to_modelopt(bf16_drafter, tmp_path, fmt, stack):
    pytest.importorskip("modelopt")
    pytest.importorskip("requests")   # modelopt.torch.export imports it
    _, drafter = bf16_drafter
    keep, amax = PROFILES[stack], amax_of(drafter)
    ours = tmp_path / "ours"
    quantize_checkpoint(drafter, ours, fmt, exclude=keep, input_amax=amax, progress=False)
    ref = modelopt_export(drafter, tmp_path / "modelopt", fmt, keep, amax)
    a = st.load_file(ours / "model.safetensors")
    b = {k: v for k, v in st.load_file(ref / "model.safetensors").items() if k != "embed_tokens.weight"}
    assert sorted(a) == sorted(b)
    assert any(k.endswith(".input_scale") for k in b) and any(k.endswith(".weight_scale") for k in b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), \
            f"{k} differs from ModelOpt"
    # what the engine keeps unquantized is unquantized, the rest is not
    assert a["fc.weight"].dtype == torch.bfloat16
    qkv_dtype = a["layers.0.self_attn.q_proj.weight"].dtype
    assert (qkv_dtype == torch.bfloat16) == (stack == "trtllm")
    assert a["layers.1.mlp.down_proj.weight"].dtype != torch.bfloat16
    # configs: ModelOpt's, less the stand-in's embed_tokens
    hq_a, hq_b = (json.loads((d / "hf_quant_config.json").read_text()) for d in (ours, ref))
    hq_b["quantization"]["exclude_modules"].remove("embed_tokens")
    assert hq_a == hq_b
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((ref / "config.json").read_text())["quantization_config"]
    qb["ignore"].remove("embed_tokens")
    assert qa == qb


def _independent_decode(r: CheckpointReader, module: str) -> torch.Tensor:
    """The format's decode, written out from its definition (not io/formats.py)."""
    w = r.get(module + ".weight")
    if w.dtype == torch.float8_e4m3fn:
        return w.to(torch.float32) * r.get(module + ".weight_scale").float()
    lo, hi = (w & 0xF).long(), (w >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(w.shape[0], -1)   # low nibble first
    vals = torch.tensor(E2M1)[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    block = r.get(module + ".weight_scale").float().repeat_interleave(16, dim=1)
    return (vals * block) * r.get(module + ".weight_scale_2").float()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_loader_weights_are_the_formats_decode_and_dflash_stays_ar(tiny_pairs, tmp_path, fmt):
    from dflash_trt.runtime.pair import generate, load_pair

    t, d = tiny_pairs["qwen3"]
    q = tmp_path / fmt
    quantize_checkpoint(d, q, fmt, exclude=PROFILES["sglang"], progress=False)
    model = load_drafter(q)
    params = dict(model.named_parameters())
    with CheckpointReader(q) as r, CheckpointReader(d) as src:
        quantized = [n[: -len(".weight_scale")] for n in r.keys() if n.endswith(".weight_scale")]
        assert "layers.0.self_attn.q_proj" in quantized and "fc" not in quantized
        for m in quantized:
            w = params[m + ".weight"].detach()
            assert w.dtype == torch.float32 and torch.equal(w, _independent_decode(r, m)), m
            assert not torch.equal(w, src.get(m + ".weight").float())   # really quantized
        assert torch.equal(params["fc.weight"].detach(), src.get("fc.weight").float())
    pair = load_pair(t, q, dtype="float32")
    for ids in ([5, 17, 99, 3, 250, 42], [8, 1, 240, 66, 12, 13, 150, 151]):
        ar = generate(pair, ids, max_new_tokens=24, mode="ar").token_ids
        res = generate(pair, ids, max_new_tokens=24)
        assert res.token_ids == ar
        assert res.tau >= 1.0


def test_drafter_quant_facts_and_refusals(tiny_pairs, tmp_path):
    for name in ("trtllm", "vllm", "sglang"):
        q = stacks.get(name).facts["drafter_quant"]
        assert q["source"] and q["why"] and set(q["schemes"]) <= {"fp8", "nvfp4", "int8"}
    assert stacks.get("trtllm").drafter_quant_problem("nvfp4") is None
    assert stacks.get("vllm").drafter_quant_problem("nvfp4") is None   # vLLM 0.33.0 carries both fixes
    msg = stacks.get("trtllm").drafter_quant_problem("int8")
    assert msg.startswith("TensorRT-LLM 1.4.0rc4's DFlash loader takes no INT8 drafter") and "no release loads one yet" in msg
    assert "\n" not in msg
    t, d = tiny_pairs["qwen3"]
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [5, 17, 99, 3, 250, 42]}\n')
    base = ["build", "--target", str(t), "--drafter", str(d), "--quant", "none", "--out", str(tmp_path / "b")]
    for args, message in (
            (["--arch", "blackwell", "--drafter-quant", "nvfp4", "--stacks", "trtllm,sglang", "--calib", str(calib)],
             "SGLang 0.5.23 quantizes every decoder Linear of a DFlash drafter"),
            (["--arch", "blackwell", "--drafter-quant", "fp8", "--stacks", "trtllm"], "pass --calib FILE.jsonl"),
            (["--arch", "hopper", "--drafter-quant", "nvfp4", "--stacks", "sglang", "--calib", str(calib)],
             "NVFP4 needs Blackwell"),
            (["--arch", "blackwell", "--drafter-quant", "int8", "--stacks", "trtllm"], "no release loads one yet")):
        code, _, err = run_cli(*base, *args)
        assert code == 1 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("stack", ["trtllm", "sglang"])
def test_build_writes_the_drafter_each_engine_loads(tiny_pairs, tmp_path, stack):
    import upstream_trtllm as trt

    t, d = tiny_pairs["qwen3"]
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [5, 17, 99, 3, 250, 42]}\n{"input_ids": [8, 1, 240, 66, 12]}\n')
    bundle = tmp_path / "b"
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "blackwell", "--quant", "none",
                           "--drafter-quant", "nvfp4", "--stacks", stack, "--calib", str(calib), "--out", str(bundle))
    assert code == 0, err
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["quant"]["drafter"] == "nvfp4"
    hq = json.loads((bundle / "drafter/hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4"
    with CheckpointReader(bundle / "drafter") as r:
        scales = [n for n in r.keys() if n.endswith(".input_scale")]
        assert scales and all(float(r.get(n)) > 0 for n in scales)
        assert r.meta("fc.weight")[0] == torch.float32            # the tiny drafter's own dtype, kept
    assert (trt.drafter_loader_problems(bundle / "drafter") == []) == (stack == "trtllm")
    cmd = m["stages"]["quantize"]["commands"][-1]
    assert "--format nvfp4" in cmd and "--exclude fc" in cmd and "--target" in cmd


def test_measured_amax_must_cover_every_quantized_linear(tiny_pairs, tmp_path):
    _, d = tiny_pairs["qwen3"]
    amax = amax_of(d)
    amax.pop("layers.1.mlp.up_proj")
    with pytest.raises(DFlashError, match="no activation amax measured for layers.1.mlp.up_proj"):
        quantize_checkpoint(d, tmp_path / "o", "fp8", exclude=["fc"], input_amax=amax, progress=False)
    assert not (tmp_path / "o").exists()


def test_plan_reads_the_drafters_format_into_its_bytes():
    """plan --drafter-quant: the draft pass reads the quantized drafter's bytes (fc kept bf16), so at
    concurrency 1 a smaller drafter is a faster step; the tau is the same (the speed model's input)."""
    from dflash_trt.plan import planner
    from dflash_trt.plan import speed as speed_model

    name, tcfg, dcfg = planner.target_configs("gpt-oss-120b")
    got = {}
    for dq in ("none", "fp8", "nvfp4"):
        p = planner.plan(tcfg, dcfg, "dgx-b300", target_name=name, drafter_name="d", drafter_quant=dq, tp=1, ep=1)
        pt = speed_model.speed_for(p, tcfg, dcfg).layouts[0].points[0]
        assert pt.concurrency == 1
        got[dq] = (p.weights_bytes["drafter"], pt.dflash_tokens_per_s_per_user, pt.ar_tokens_per_s_per_user)
    assert got["none"][0] > got["fp8"][0] > got["nvfp4"][0]
    assert got["none"][1] < got["fp8"][1] < got["nvfp4"][1]
    assert got["none"][2] == got["fp8"][2] == got["nvfp4"][2]        # AR does not read the drafter
    with pytest.raises(DFlashError, match="--drafter-quant nvfp4: .* no FP4 tensor cores"):
        planner.plan(tcfg, dcfg, "hgx-h200", target_name=name, drafter_quant="nvfp4")
