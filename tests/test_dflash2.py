"""DFlash2 drafters and sliding-window / causal drafter layers: the format (against z-lab's own
fixture config and safetensors header), every config variant's attention as vLLM resolves it,
losslessness in the CPU runtime (greedy against AR in float64; sampling by the chi-square test of
test_sampling.py), make-tiny, and each stack's serving rules for them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_sampling import ALPHA, H, V, _counts, _p_value, _target

from dflash_trt.errors import DFlashError
from dflash_trt.models.config import DrafterConfig, drafter_config_problems, layer_attention
from dflash_trt.models.drafter import DFlashDrafter, attention_mask
from dflash_trt.runtime.decode import generate
from dflash_trt.runtime.pair import load_pair
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.stacks import get as get_stack
from dflash_trt.stacks.sglang import sglang_drafter_args
from dflash_trt.stacks.trtllm.serve_config import trtllm_drafter_options
from dflash_trt.stacks.vllm.launch import vllm_drafter_env

from helpers import run_cli

DATA = Path(__file__).parent / "data" / "zlab"
FIXTURE = json.loads((DATA / "dflash2-config.json").read_text())


# ------------------------------------------------------------------------------------------ format
def test_zlab_dflash2_config_reads_as_published():
    c = DrafterConfig.from_dict(FIXTURE)
    assert c.kind == "dflash2" and c.block_size == 16 and c.target_layer_ids == [1, 13, 25, 37, 49]
    assert c.layer_attention == [(2048, False)] * 5        # every layer sliding, is_causal false
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 256, 16)
    assert c.rope_theta == 500000.0                          # from rope_parameters (transformers 5 style)
    assert c.final_logit_softcapping == 20.0 and abs(c.output_multiplier - 0.19611613513818404) < 1e-15
    assert c.to_dict()["architectures"] == ["DFlash2DraftModel"]


def test_drafter_tensors_are_the_zlab_checkpoints():
    """Our module's state dict = the names and shapes of z-lab's DFlash2 safetensors header."""
    with torch.device("meta"):
        m = DFlashDrafter(DrafterConfig.from_dict(FIXTURE), max_len=1)
    got = {k: list(v.shape) for k, v in m.state_dict().items()}
    assert got == json.loads((DATA / "dflash2-tensor-shapes.json").read_text())


def _cfg(**kw):
    d = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "block_size": 8,
         "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1]}}
    dc = kw.pop("dflash_config", {})
    d.update(kw)
    d["dflash_config"] = {**d["dflash_config"], **dc}
    return d


# The variants vLLM 0.32.0 lists (vllm/model_executor/models/qwen3_dflash.py _resolve_layer_attention's
# table and _dflash_layer_causal), with what each resolves to per layer: (window, causal).
VARIANTS = {
    "plain": (_cfg(), [(None, False)] * 2),
    "layer_types mixed (gemma-4 / Qwen3.6 drafters)": (
        _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True),
        [(64, True), (None, False)]),
    "all sliding + is_causal false (DFlash2 fixture)": (
        _cfg(layer_types=["sliding_attention"] * 2, sliding_window=64, use_sliding_window=True, is_causal=False),
        [(64, False)] * 2),
    "use_swa without layer_types (MiMo)": (
        _cfg(dflash_config={"use_swa": True, "swa_window_size": 32}), [(32, False)] * 2),
    "use_swa over all-full layer_types": (
        _cfg(layer_types=["full_attention"] * 2, dflash_config={"use_swa": True, "swa_window_size": 32}),
        [(32, False)] * 2),
    "swa_window_size over sliding_window": (
        _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True,
             dflash_config={"swa_window_size": 16}), [(16, True), (None, False)]),
    "dflash_config.causal overrides layer types": (
        _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True,
             dflash_config={"causal": False}), [(64, False), (None, False)]),
    "max_window_layers derives layer_types": (
        _cfg(sliding_window=64, use_sliding_window=True, max_window_layers=1), [(None, False), (64, True)]),
    "is_causal overrides dflash_config.causal": (
        _cfg(is_causal=True, dflash_config={"causal": False}), [(None, True)] * 2),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_layer_attention_variants(name):
    cfg, want = VARIANTS[name]
    assert drafter_config_problems(cfg) == []
    assert layer_attention(cfg) == want


def test_attention_mask_is_zlabs():
    q, k = torch.arange(10, 13), torch.arange(13)
    m = attention_mask(q, k, 4, False)     # |q - k| < 4
    assert m[0].nonzero().flatten().tolist() == [7, 8, 9, 10, 11, 12]
    assert attention_mask(q, k, 4, True)[0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert attention_mask(q, k, None, True)[2].all() and not attention_mask(q, k, None, True)[0, 11]
    assert attention_mask(q, k, None, False) is None


@pytest.mark.parametrize("cfg, message", [
    (_cfg(architectures=["DFlash2DraftModel"]), "needs dflash_config.conv_kernel_size"),
    (_cfg(architectures=["DFlash2DraftModel"], dflash_config={"conv_kernel_size": 2, "conv_group_size": 24,
                                                              "selector_rank": 8, "selector_top_k": 4}),
     "conv_group_size = 24 does not divide hidden_size = 64"),
    (_cfg(architectures=["DFlash2DraftModel"], dflash_config={"conv_kernel_size": 2, "conv_group_size": 16,
                                                              "selector_rank": 8, "selector_top_k": 600}),
     "selector_top_k = 600 exceeds vocab_size = 512"),
    (_cfg(dflash_config={"selector_top_k": 4}), "architectures is not DFlash2DraftModel"),
    (_cfg(dflash_config={"use_swa": True}), "neither dflash_config.swa_window_size nor sliding_window"),
    (_cfg(layer_types=["sliding_attention"] * 2, sliding_window=64),
     "use_sliding_window is not true: transformers' Qwen3Config"),
    (_cfg(dflash_config={"attention_value_scale": 0.5}), "does not implement a scale on the drafter's V"),
    (_cfg(dflash_config={"attention_sink_bias": True}), "does not implement per-head attention sinks"),
])
def test_bad_configs_are_refused_in_one_line(cfg, message):
    problems = drafter_config_problems(cfg, "d/config.json")
    assert any(message in p and p.startswith("d/config.json: ") for p in problems), problems
    with pytest.raises(DFlashError, match="d/config.json"):
        DrafterConfig.from_dict(cfg, "d/config.json")


# ------------------------------------------------------------------------------ lossless, CPU runtime
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("dflash2")
    out = {}
    for kind in ("dflash2", "dflash-swa"):
        make_tiny("qwen3", root / kind / "t", root / kind / "d", seed=3, drafter_kind=kind)
        out[kind] = (root / kind / "t", root / kind / "d")
    return out


@pytest.mark.parametrize("kind", ["dflash2", "dflash-swa"])
def test_greedy_lossless_against_ar(pairs, kind):
    """Prompts up to 30 tokens against a window of 8: drafts attend across the window's edge."""
    import random

    pair = load_pair(*pairs[kind], "float64")
    assert pair.drafter.config.kind == ("dflash2" if kind == "dflash2" else "dflash")
    rng = random.Random(1)
    for _ in range(5):
        prompt = [rng.randrange(4, pair.target.vocab_size) for _ in range(rng.randint(1, 30))]
        want = generate(pair.target, None, prompt, max_new_tokens=20, mode="ar", stop_ids=pair.stop_ids).token_ids
        for B in (2, 4, 8):
            got = generate(pair.target, pair.drafter, prompt, max_new_tokens=20, block_size=B, stop_ids=pair.stop_ids)
            assert got.token_ids == want, f"{kind} B={B} differs from AR on {prompt}"


def _dflash2_drafter(good: bool) -> DFlashDrafter:
    d = {"architectures": ["DFlash2DraftModel"], "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": V,
         "layer_types": ["sliding_attention"], "sliding_window": 4, "use_sliding_window": True, "is_causal": False,
         "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [0, 1], "block_size": 4,
                           "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4,
                           **({} if good else {"output_multiplier": 0.7, "final_logit_softcapping": 3.0})}}
    torch.manual_seed(1)
    m = DFlashDrafter(DrafterConfig.from_dict(d), max_len=64, dtype=torch.float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
            elif n.endswith("base_kernel"):
                p.normal_(0, 0.3)
                p[:, 0] += 1
        if good:   # drafter state = norm(token embedding), no bilinear term: the context-free target's own top-4
            for layer in m.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            m.candidate_selector.hidden_projection.weight.zero_()
    return m


@pytest.mark.parametrize("good", [False, True], ids=["poor-drafter", "good-drafter"])
def test_sampling_distribution_matches_ar(good):
    """Proposals come from the selector's top-4 walk (q is zero outside the candidates):
    speculative sampling must still give the target's distribution."""
    target, drafter = _target(good), _dflash2_drafter(good)
    sp = SamplingParams(1.0)
    _, ar_pairs, _ = _counts(target, None, "ar", sp)
    _, df_pairs, tau = _counts(target, drafter, "dflash", sp)
    p = _p_value(ar_pairs, df_pairs)
    assert p > ALPHA, f"DFlash2 token distribution differs from AR (chi-square p = {p:.2e})"
    if good:
        assert tau > 1.5, f"a near-exact DFlash2 drafter should be accepted often (tau = {tau})"


# ------------------------------------------------------------------------- make-tiny, check, stacks
def test_make_tiny_dflash2_pair_passes_check(tmp_path):
    code, out, err = run_cli("make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "t"), "--drafter-out",
                             str(tmp_path / "d"), "--drafter-kind", "dflash2", "--block-size", "16", "--json")
    assert code == 0, err
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 8
    code, out, err = run_cli("check", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--json")
    assert code == 0 and json.loads(out)["ok"], out + err


def test_stack_rules_for_the_zlab_fixture():
    c = DrafterConfig.from_dict(FIXTURE)
    # TensorRT-LLM: non-causal sliding window -> the VANILLA drafter attention backend, which its
    # DFlashDecodingConfig (tests/upstream_trtllm.py, extra="forbid") accepts
    from upstream_trtllm import DFlashDecodingConfig

    opts = trtllm_drafter_options(c)
    assert opts == {"attention_backend": "VANILLA"}
    DFlashDecodingConfig(max_draft_len=15, speculative_model="drafter", **opts)
    assert sglang_drafter_args(c) == ["--speculative-draft-attention-backend", "flashinfer"]
    assert vllm_drafter_env(c) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}   # V1 has no candidate head
    assert all(get_stack(s).drafter_problems(c) == [] for s in ("trtllm", "vllm", "sglang"))


def test_stack_rules_for_variants():
    mixed = DrafterConfig.from_dict(VARIANTS["layer_types mixed (gemma-4 / Qwen3.6 drafters)"][0])
    assert vllm_drafter_env(mixed) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert trtllm_drafter_options(mixed) == {}          # its sliding layers are causal
    mimo = DrafterConfig.from_dict(VARIANTS["use_swa without layer_types (MiMo)"][0])
    assert "dflash_config.use_swa" in get_stack("sglang").drafter_problems(mimo)[0]
    top = {**FIXTURE, **{k: FIXTURE["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size",
                                                                  "selector_rank", "selector_top_k")}}
    top["dflash_config"] = {k: v for k, v in FIXTURE["dflash_config"].items() if not k.startswith(("conv", "sel"))}
    assert "from dflash_config only" in get_stack("vllm").drafter_problems(DrafterConfig.from_dict(top))[0]


def test_build_writes_each_stacks_dflash2_settings(pairs, tmp_path):
    t, d = pairs["dflash2"]
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--gpu", "h200",
                             "--out", str(tmp_path / "b"), "--json")
    assert code == 0, err
    b = tmp_path / "b"
    trt = yaml.safe_load((b / "configs" / "trtllm-serve.yaml").read_text())
    assert trt["speculative_config"]["attention_backend"] == "VANILLA"
    sg = json.loads((b / "configs" / "sglang.json").read_text())
    assert sg["argv"][-2:] == ["--speculative-draft-attention-backend", "flashinfer"]
    v = json.loads((b / "configs" / "vllm.json").read_text())
    assert v["speculative_config"]["method"] == "dflash" and v["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert v["command"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ")
    assert json.loads((b / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


def test_check_names_a_family_the_runtime_does_not_cover(pairs, tmp_path):
    """A target of a family the CPU runtime does not run (here: a qwen3 checkpoint relabelled
    model_type mixtral) passes check with one note line; the note says what needs the runtime."""
    import shutil

    t, d = pairs["dflash2"]
    shutil.copytree(t, tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli("check", "--target", str(tmp_path / "t"), "--drafter", str(d))
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "does not cover model_type 'mixtral'" in notes[0] and out.startswith("ok:")
