"""The hybrid Gated DeltaNet families (models/families/qwen3_hybrid.py): Qwen3-Next, dense Qwen3.5,
Qwen3.5/3.6 MoE, and the multimodal wrappers qwen3_5 / qwen3_5_moe (their text decoder), each a tiny
checkpoint written by transformers 5.24, checked against transformers in float64
(tests/family_oracle.py: same logits and layer outputs, incremental with rollback inside a verify
pass, lossless AR == DFlash B=2,4,8 == generate).

The oracle's path: without flash-linear-attention / causal-conv1d, transformers runs its torch
fallbacks (torch_chunk_gated_delta_rule for a whole sequence, torch_recurrent_gated_delta_rule for
a cached one-token step, causal_conv1d_fn / causal_conv1d_update). Those, the (1 + weight) RMSNorm,
the gated RMSNorm, the router softmax and the eager attention softmax compute in float32 even in a
float64 model (`.float()`, `.to(torch.float32)`): `hf_in_float64` runs transformers' own source of them with those casts made
float64, and counts the calls, so each test says which path it ran. Unpatched, transformers agrees
to ~1e-7 (test_unpatched_transformers_agrees_to_float32_precision)."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import textwrap
from collections import Counter

import pytest
import torch
from family_oracle import (
    build_hf_tiny,
    hf_float64,
    incremental_with_rollback,
    lossless,
    random_drafter,
    random_ids,
    same_as_transformers,
)

from dflash_trt.errors import DFlashError
from dflash_trt.models.check import runtime_coverage
from dflash_trt.models.config import decoder_config
from dflash_trt.models.target import load_target

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
TEXT = {
    "qwen3_next": {**BASE, **MOE, "mlp_only_layers": [1]},       # layer 1 dense, 0 and 2 MoE
    "qwen3_5_text": BASE,
    "qwen3_5_moe_text": {**BASE, **MOE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5,
                                                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
}
WRAPPED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}   # multimodal config -> text decoder
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2}
FAMILIES = [*TEXT, *WRAPPED]
HF_MODULES = {
    "qwen3_next": ("Qwen3NextRMSNorm", "Qwen3NextRMSNormGated", "Qwen3NextTopKRouter", "Qwen3NextGatedDeltaNet"),
    "qwen3_5": ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe": ("Qwen3_5MoeRMSNorm", "Qwen3_5MoeRMSNormGated", "Qwen3_5MoeTopKRouter", "Qwen3_5MoeGatedDeltaNet"),
}
KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
           "causal_conv1d_update", "eager_attention_forward")
IN_FLOAT32 = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "eager_attention_forward")
FLOAT64 = ((".float()", ".double()"), ("torch.float32", "torch.float64"), ("dtype=torch.float,", "dtype=torch.float64,"),
           ("dtype=torch.float)", "dtype=torch.float64)"))


def _transformers_function(fn):
    """The plain function transformers wrote for a kernel name of its module. transformers <= 5.24 wraps
    it with functools.wraps (inspect.unwrap finds it); 5.25 turns it into an instance of the `kernels`
    package's Func module (kernels 0.19 _internals/layer/layer.py `_create_func_module`), whose forward
    closes over the functools-wrapped function (transformers/integrations/hub_kernels.py
    `use_kernel_func_from_hub_with_fallback`)."""
    if not inspect.isfunction(fn):
        closed_over = [cell.cell_contents for cell in type(fn).forward.__closure__ or ()]
        (fn,) = [f for f in closed_over if inspect.isfunction(f)]
    return inspect.unwrap(fn)


def _float64_copy(fn, namespace: dict):
    """transformers' own source of fn (decorators included) with its float32 casts made float64."""
    fn = _transformers_function(fn)
    src = textwrap.dedent(inspect.getsource(fn))
    for a, b in FLOAT64:
        src = src.replace(a, b)
    scope = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), namespace, scope)   # noqa: S102 (transformers' own source)
    return scope[fn.__name__]


@contextlib.contextmanager
def hf_in_float64(calls: Counter):
    """transformers' qwen3_next / qwen3_5 / qwen3_5_moe torch paths with their float32 casts made
    float64; calls counts the gated-delta-rule and conv fallbacks run."""
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
    undo = []
    for family, classes in HF_MODULES.items():
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in KERNELS:
            orig = getattr(mod, name)
            f64 = _float64_copy(orig, mod.__dict__) if name in IN_FLOAT32 else orig

            def counted(*a, _f=f64, _n=name, **k):
                calls[_n] += 1
                return _f(*a, **k)
            undo.append((mod, name, orig))
            setattr(mod, name, counted)
        for cls_name in classes:
            cls = getattr(mod, cls_name)
            undo.append((cls, "forward", cls.__dict__["forward"]))
            cls.forward = _float64_copy(cls.__dict__["forward"], mod.__dict__)
    try:
        yield calls
    finally:
        for owner, name, orig in reversed(undo):
            setattr(owner, name, orig)


def _init(model):
    """Give what transformers initializes to a constant a random value (else (1 + w) vs w, dt_bias,
    the gate norm would go untested)."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _build(family: str, folder):
    if family in TEXT:
        return build_hf_tiny(family, TEXT[family], folder, init=_init)
    from transformers import AutoConfig, AutoModelForImageTextToText

    from dflash_trt.models.tiny import build_tokenizer

    tok = build_tokenizer(256)
    torch.manual_seed(0)
    text = {**TEXT[WRAPPED[family]], "vocab_size": len(tok)}
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(family, text_config=text,
                                                                         vision_config=VISION)).eval()
    with torch.no_grad():
        _init(model)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {f: _build(f, root / f) for f in FAMILIES}


def test_the_wrappers_store_what_the_released_checkpoints_do(targets):
    """qwen3_5 / qwen3_5_moe as released (Qwen3.5, Qwen3.6-35B-A3B): text_config, model.language_model.*
    and model.visual.* tensors; the runtime loads the decoder alone."""
    import safetensors

    for family in WRAPPED:
        cfg = json.loads((targets[family] / "config.json").read_text())
        assert cfg["model_type"] == family and cfg["text_config"]["model_type"] == WRAPPED[family]
        with safetensors.safe_open(targets[family] / "model.safetensors", "pt") as f:
            names = list(f.keys())
        assert any(n.startswith("model.visual.") for n in names)
        assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
        load_target(targets[family], torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_as_transformers(targets, family):
    """Logits at every position and layers 0 (linear attention), 1 (full attention), 2 (the last,
    after the final norm) equal transformers' in float64 (its chunked gated delta rule)."""
    with hf_in_float64(Counter()) as calls:
        same_as_transformers(targets[family], capture=(0, 1, 2))
    assert calls["torch_chunk_gated_delta_rule"] == 2 and calls["causal_conv1d_fn"] == 2, calls


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_unpatched_transformers_agrees_to_float32_precision(targets, family):
    """transformers as installed (its float32 casts kept) is the same model, to float32's precision."""
    ours = load_target(targets[family], torch.float64, max_len=32)
    ours.setup_cache(32)
    ids = random_ids(ours.vocab_size, 24)
    logits, _ = ours(torch.tensor(ids), 0, all_logits=True)
    with torch.no_grad():
        want = hf_float64(targets[family])(torch.tensor([ids])).logits[0]
    diff = float((logits - want).abs().max())
    assert 1e-9 < diff < 1e-6, diff      # float32 rounding shows, nothing larger
    with hf_in_float64(Counter()), torch.no_grad():
        want64 = hf_float64(targets[family])(torch.tensor([ids])).logits[0]
    assert float((logits - want64).abs().max()) < diff / 100


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_with_rollback(targets, family):
    """prefill | an 8-token pass | a pass starting inside it (drafts 10..13 rejected) | one-token steps."""
    incremental_with_rollback(targets[family])


def test_a_start_the_saved_states_cannot_reach_is_refused(targets):
    ours = load_target(targets["qwen3_next"], torch.float64, max_len=32)
    ours.setup_cache(32)
    ids = torch.tensor(random_ids(ours.vocab_size, 20))
    ours(ids[:6], 0)
    ours(ids[6:14], 6)
    with pytest.raises(DFlashError, match=r"^start 3: the linear-attention state is kept for positions 6\.\.14 "):
        ours(ids[3:5], 3)
    with pytest.raises(DFlashError, match=r"^start 15: "):
        ours(ids[15:16], 15)
    ours(ids[:4], 0)          # position 0 is always reachable (the zero state)


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless(targets, tmp_path, family):
    """AR == DFlash (B = 2, 4, 8; the drafter reads layers 0 and 1) == transformers' generate, which
    runs the chunked rule on the prompt and the recurrent rule + conv update per new token."""
    cfg = json.loads((targets[family] / "config.json").read_text())
    drafter = random_drafter(tmp_path / "d", decoder_config(cfg))
    with hf_in_float64(Counter()) as calls:
        lossless(targets[family], drafter, prompts=4, max_new=12)
    assert calls["torch_recurrent_gated_delta_rule"] > 0 and calls["causal_conv1d_update"] > 0, calls


@pytest.mark.parametrize("family", FAMILIES)
def test_check_covers_it_and_counts_the_full_attention_kv(targets, family):
    """check has no runtime note; KV per position is the full-attention layers' (the planner's
    count, from config alone), and the recurrent state is a fixed size on top."""
    from dflash_trt.plan.planner import kv_bytes_per_token, target_shape

    cfg = json.loads((targets[family] / "config.json").read_text())
    assert runtime_coverage(cfg) is None
    model = load_target(targets[family], torch.bfloat16)
    assert model.cache_bytes_per_position() == 2 * kv_bytes_per_token(target_shape(cfg), "fp8") == 2 * 2 * 2 * 16
    tc = decoder_config(cfg)
    conv = (2 * 2 * 16 + 4 * 8) * (4 - 1) * 2             # bf16 conv window
    assert model.recurrent_state_bytes() == 2 * (4 * 16 * 8 * 4 + conv)   # 2 layers, float32 state
    assert tc["layer_types"].count("linear_attention") == 2


def test_check_cli_on_a_wrapped_pair(targets, tmp_path):
    """`check` on a Qwen3.6-style (qwen3_5_moe) pair: ok, and no "does not cover" note."""
    from helpers import run_cli

    cfg = json.loads((targets["qwen3_5_moe"] / "config.json").read_text())
    drafter = random_drafter(tmp_path / "d", decoder_config(cfg))
    code, out, err = run_cli("check", "--target", str(targets["qwen3_5_moe"]), "--drafter", str(drafter))
    assert code == 0, err
    assert "does not cover" not in out + err


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe_text"])
def test_convert_refuses_the_hybrids_naming_the_pytorch_backend(targets, tmp_path, family):
    """TensorRT-LLM's legacy engine-checkpoint path has no Gated DeltaNet layout (stacks/trtllm/convert.py
    NO_ENGINE_LAYOUT says where that was read): one line naming the path that serves them."""
    from dflash_trt.stacks.trtllm.convert import convert_checkpoint

    with pytest.raises(DFlashError, match=rf"^{family}: TensorRT-LLM has no engine \(TensorRT\) checkpoint layout "
                                          r"for the Gated DeltaNet hybrids .*PyTorch backend .*trtllm-serve <dir>") as e:
        convert_checkpoint(targets[family], tmp_path / "o", tp=1, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()
