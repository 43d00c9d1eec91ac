"""Every serving file a bundle writes, checked against the code of the stack that loads it.

- vLLM 0.33.0 and SGLang 0.5.23: their PyPI wheels are fetched with `pip download --no-deps`
  into tests/.cache/wheels (never installed: their dependencies pull a CUDA torch). Their config
  modules do not import without those dependencies, so the definitions are read with `ast`
  from the wheel's own files, and the DFlash rule functions (SGLang `_handle_dflash`, vLLM
  `_verify_and_get_draft_tp`) are compiled from that source and RUN on our arguments. Only the
  environment around them is supplied (a CUDA device name, SGLang's resolution bookkeeping).
- TensorRT-LLM: no wheel with DFlash on PyPI; tests/upstream_trtllm.py is its contract, read
  from its source at the cited commits, as pydantic models with extra="forbid".
"""
from __future__ import annotations

import ast
import json
import logging
import types
from pathlib import Path

import pytest
import torch
import upstream_trtllm as trt
import yaml
from pydantic import ValidationError

from helpers import run_cli, wheel_source

WHEELS = {"vllm": "vllm==0.33.0", "sglang": "sglang==0.5.23"}


# ------------------------------------------------------------------------- upstream sources
def _source(name: str, path: str) -> str:
    return wheel_source(WHEELS[name], path)


def _function(src: str, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = ast.parse(src)
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def _compile_function(src: str, name: str, namespace: dict, cls: str | None = None):
    """Upstream's function, compiled from its own source text, with `namespace` as its globals."""
    fn = _function(src, name, cls)
    fn.decorator_list = []  # staticmethod etc.
    code = compile(ast.Module(body=[fn], type_ignores=[]), filename=f"<upstream {name}>", mode="exec")
    exec(code, namespace)  # noqa: S102 (the wheel's own code, on our arguments)
    return namespace[name]


def _class_fields(src: str, cls: str) -> dict[str, ast.AST | None]:
    """{field: default expression} of a dataclass / msgspec.Struct body."""
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id: s.value for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _literal_values(src: str, name: str) -> set[str]:
    """The strings of a module-level `X = Literal[...]` alias, following aliases of aliases."""
    aliases = {}
    for n in ast.parse(src).body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            aliases[n.targets[0].id] = n.value
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            aliases[n.target.id] = n.value

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.Name) and node.id in aliases:
            yield from walk(aliases[node.id])
        elif isinstance(node, ast.Subscript):
            yield from walk(node.slice)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                yield from walk(e)
        elif isinstance(node, ast.BinOp):
            yield from walk(node.left)
            yield from walk(node.right)
    return set(walk(aliases[name]))


# ------------------------------------------------------------------------------ the bundles
# a draft schedule for the tiny drafters (block 8): K 7 up to 8 sequences, 3 up to 32, none from 33 on
SCHEDULE = {"max_k": 7, "ranges": [[1, 8, 7], [9, 32, 3], [33, 64, 0]]}

@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_pairs):
    """Default bundles of a dense and a MoE/sliding-window pair, a tp=2 and a pp=2 one (which
    SGLang cannot serve: its config must be absent, and any it got would fail its rule below)."""
    root = tmp_path_factory.mktemp("conf")
    (root / "schedule.json").write_text(json.dumps(SCHEDULE))
    out = {}
    for name, pair, args in (("llama", "llama", ["--arch", "hopper"]),
                             # a draft schedule from a file (build --draft-schedule), written into each control
                             ("llama-sched", "llama", ["--arch", "hopper", "--draft-schedule",
                                                       str(root / "schedule.json")]),
                             ("gptoss", "gpt-oss", ["--arch", "blackwell", "--tp", "2", "--ep", "2"]),
                             ("llama-tp2", "llama", ["--arch", "blackwell", "--tp", "2", "--quant", "none"]),
                             ("llama-pp2", "llama", ["--arch", "hopper", "--pp", "2", "--quant", "none"]),
                             # NVIDIA's curated gpt-oss throughput settings (attention DP, stream_interval, ...)
                             ("gptoss-thr", "gpt-oss", ["--arch", "hopper", "--tp", "2", "--ep", "2", "--profile",
                                                        "throughput", "--max-batch-size", "32"])):
        t, d = tiny_pairs[pair]
        code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), *args, "--out", str(root / name))
        assert code == 0, err
        out[name] = root / name
    return out


def _trtllm_files(bundle: Path) -> list[tuple[str, dict]]:
    serve = yaml.safe_load((bundle / "configs/trtllm-serve.yaml").read_text())
    model_yaml = yaml.safe_load((bundle / "triton/tensorrt_llm/1/model.yaml").read_text())
    model_yaml.pop("triton_config")  # upstream's model.py reads it apart (get_model_config include_keys)
    return [("configs/trtllm-serve.yaml", serve), ("triton/tensorrt_llm/1/model.yaml", model_yaml)]


# --------------------------------------------------------------------------------- TensorRT-LLM
@pytest.mark.parametrize("name", ["llama", "llama-sched", "gptoss", "llama-tp2", "llama-pp2", "gptoss-thr"])
def test_trtllm_files_validate_against_the_contract(bundles, name):
    arch = json.loads((bundles[name] / "manifest.json").read_text())["arch"]
    for rel, cfg in _trtllm_files(bundles[name]):
        args = trt.TorchLlmArgs(**cfg)  # extra="forbid" at every level: an unknown key fails
        assert args.speculative_config.decoding_type == "DFlash", rel
        assert args.speculative_config.max_draft_len > 0
        # the drafter attention backend each GPU family runs (serving_profiles.DRAFTER_ATTENTION_BACKEND)
        assert args.speculative_config.attention_backend == {"hopper": "FA4", "blackwell": "TRTLLM"}[arch], rel
    if name == "gptoss-thr":
        assert args.enable_attention_dp and args.stream_interval == 20 and args.max_batch_size == 32
        assert args.attention_dp_config.enable_balance and args.max_num_tokens == 16384


def test_trtllm_contract_catches_unknown_key_wrong_literal_and_zero_draft(bundles):
    """Negative controls: the contract is not vacuous."""
    _, cfg = _trtllm_files(bundles["llama"])[0]
    for mutate, field in ((lambda c: c.__setitem__("speculative_decoding", True), "speculative_decoding"),
                          (lambda c: c["speculative_config"].__setitem__("draft_model", "x"), "draft_model"),
                          (lambda c: c["speculative_config"].__setitem__("attention_backend", "FLASHINFER"),
                           "attention_backend"),
                          (lambda c: c["kv_cache_config"].__setitem__("dtype", "fp8_e4m3"), "dtype"),
                          (lambda c: c["speculative_config"].__setitem__("max_draft_len", 0), "max_draft_len"),
                          (lambda c: c.__setitem__("backend", "trt"), "pytorch backend")):
        bad = json.loads(json.dumps(cfg))
        mutate(bad)
        with pytest.raises(ValidationError, match=field):
            trt.TorchLlmArgs(**bad)


def test_trtllm_drafter_loads_as_upstreams_loader_builds_it(bundles):
    """DFlashForCausalLM.load_weights: fc = nn.Linear(in, out, dtype=fc.weight.dtype) then
    copy_ of the checkpoint's fc.weight. Run here on CPU with the bundle's own tensor (the
    dtype check behind the FP8 failure is device-independent)."""
    from safetensors import safe_open

    for name in ("llama", "gptoss"):
        drafter = bundles[name] / "drafter"
        assert trt.drafter_loader_problems(drafter) == []
        [f] = list(drafter.glob("*.safetensors"))
        with safe_open(str(f), "pt") as st:
            w = st.get_tensor("fc.weight")
        fc = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        fc.weight.data.copy_(w)
    with pytest.raises(NotImplementedError, match="Float8_e4m3fn"):
        torch.nn.Linear(8, 8, bias=False, dtype=torch.float8_e4m3fn)


def test_an_fp8_drafter_breaks_the_trtllm_loader_rule(tiny_pairs, tmp_path):
    """Mutation: the FP8 drafter a vLLM-only bundle carries is what TensorRT-LLM could not load."""
    t, d = tiny_pairs["llama"]
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [5, 17, 99, 3, 250, 42]}\n')
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--drafter-quant",
                           "fp8", "--stacks", "vllm", "--calib", str(calib), "--out", str(tmp_path / "b"))
    assert code == 0, err
    problems = trt.drafter_loader_problems(tmp_path / "b" / "drafter")
    assert any("fc.weight: F8_E4M3" in p for p in problems) and any("weight_scale" in p for p in problems)


def test_trtllm_max_attention_window_for_sliding_layers(bundles):
    serve = yaml.safe_load((bundles["gptoss"] / "configs/trtllm-serve.yaml").read_text())
    kv = trt.KvCacheConfig(**serve["kv_cache_config"])
    assert kv.max_attention_window and len(kv.max_attention_window) == serve_layers(bundles["gptoss"])
    assert "max_attention_window" not in yaml.safe_load(
        (bundles["llama"] / "configs/trtllm-serve.yaml").read_text())["kv_cache_config"]


def serve_layers(bundle: Path) -> int:
    return json.loads((bundle / "target/config.json").read_text())["num_hidden_layers"]


# --------------------------------------------------------------------------------------- vLLM
VLLM_SPEC = "vllm/config/speculative.py"


def test_vllm_speculative_config_uses_only_its_fields_and_method(bundles):
    src = _source("vllm", VLLM_SPEC)
    fields = _class_fields(src, "SpeculativeConfig")
    methods = _literal_values(src, "SpeculativeMethod")
    assert "dflash" in methods
    for name in bundles:
        v = json.loads((bundles[name] / "configs/vllm.json").read_text())
        spec = v["speculative_config"]
        assert set(spec) <= set(fields), set(spec) - set(fields)
        assert spec["method"] in methods
        assert spec["num_speculative_tokens"] > 0  # Field(default=None, gt=0)
        assert json.loads((bundles[name] / "configs/vllm-speculative-config.json").read_text()) == spec


def test_vllm_draft_tensor_parallel_rule_runs_on_our_config(bundles):
    verify = _compile_function(_source("vllm", VLLM_SPEC), "_verify_and_get_draft_tp", {}, cls="SpeculativeConfig")
    for name in bundles:
        v = json.loads((bundles[name] / "configs/vllm.json").read_text())
        argv = v["argv"]
        tp = int(argv[argv.index("--tensor-parallel-size") + 1])
        target = types.SimpleNamespace(tensor_parallel_size=tp)
        assert verify(target, v["speculative_config"].get("draft_tensor_parallel_size")) in (1, tp)
    with pytest.raises(ValueError, match="cannot be other value than 1"):  # their rule, live
        verify(types.SimpleNamespace(tensor_parallel_size=4), 2)


def test_vllm_cli_flags_and_kv_cache_dtype_exist(bundles):
    args_src = _source("vllm", "vllm/engine/arg_utils.py")
    engine_fields = _class_fields(args_src, "EngineArgs")
    cache_dtypes = _literal_values(_source("vllm", "vllm/config/cache.py"), "CacheDType")
    for name in bundles:
        argv = json.loads((bundles[name] / "configs/vllm.json").read_text())["argv"]
        assert argv[:2] == ["vllm", "serve"]
        for flag in (a for a in argv if a.startswith("--")):
            assert flag[2:].replace("-", "_") in engine_fields, flag
        if "--kv-cache-dtype" in argv:
            assert argv[argv.index("--kv-cache-dtype") + 1] in cache_dtypes


# -------------------------------------------------------------------------------------- SGLang
SGL_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
SGL_FIELDS = [f"sglang/srt/arg_groups/fields/{m}.py" for m in
              ("device", "disagg", "exec_", "lora", "memory", "mm", "model", "observability", "parallel", "schedule",
               "serving", "spec")]


def _sglang_fields() -> tuple[dict, dict]:
    """({field: default}, {--flag or alias: field}) from SGLang's field modules."""
    defaults, flags = {}, {}
    for path in SGL_FIELDS:
        for cls in ast.walk(ast.parse(_source("sglang", path))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for s in cls.body:
                if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)) or s.target.id.startswith("_"):
                    continue
                name = s.target.id
                try:
                    defaults[name] = ast.literal_eval(s.value) if s.value is not None else None
                except ValueError:
                    defaults[name] = None
                flags["--" + name.replace("_", "-")] = name  # arg_utils: "--" + name.replace("_", "-")
                for kw in (k for c in ast.walk(s.annotation) if isinstance(c, ast.Call) for k in c.keywords):
                    if kw.arg == "aliases":
                        flags |= {a: name for a in ast.literal_eval(kw.value)}
    return defaults, flags


def _sglang_args(argv: list[str]) -> tuple[types.SimpleNamespace, dict]:
    defaults, flags = _sglang_fields()
    args = dict(defaults)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    rest = list(argv[3:])
    while rest:
        flag = rest.pop(0)
        assert flag in flags, f"{flag}: not an SGLang 0.5.23 server argument"
        field = flags[flag]
        if isinstance(defaults.get(field), bool):   # a bool field is a flag without a value (store_true)
            assert defaults[field] is False, f"{flag}: defaults to True, a flag cannot turn it off"
            args[field] = True
            continue
        value = rest.pop(0)
        args[field] = int(value) if isinstance(defaults.get(field), int) or value.isdigit() else value
    args["device"] = "cuda"  # the GPU node it will run on (SGLang resolves "auto" there)
    return types.SimpleNamespace(**args), flags


def _handle_dflash():
    """SGLang's `_handle_dflash`, compiled from its source; the bookkeeping it calls records the
    values it resolves onto the namespace (declare_resolution), as SGLang's does."""
    def declare_resolution(server_args, _who, **kw):
        for k, v in kw.items():
            setattr(server_args, k, v)

    env = types.SimpleNamespace(get=lambda: False)
    ns = {"json": json, "logger": logging.getLogger("sglang-under-test"),
          "resolving_view": lambda sa: sa, "declare_resolution": declare_resolution,
          "current_platform": types.SimpleNamespace(is_out_of_tree=lambda: False),
          "attn_dp_enabled_of": lambda cfg: bool(getattr(cfg, "enable_dp_attention", False)),
          "envs": types.SimpleNamespace(SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION=env),
          # picks the draft attention kernel for the GPU found at start: nothing to check here
          "_resolve_dflash_draft_attention_backend": lambda server_args: None,
          "ServerArgs": object}
    return _compile_function(_source("sglang", SGL_HOOK), "_handle_dflash", ns)


def test_sglang_handle_dflash_accepts_our_arguments(bundles):
    handle = _handle_dflash()
    assert not (bundles["llama-pp2"] / "configs/sglang.json").exists()
    for name in bundles:
        if not (bundles[name] / "configs/sglang.json").exists():
            continue
        g = json.loads((bundles[name] / "configs/sglang.json").read_text())
        args, _ = _sglang_args(g["argv"])
        handle(args)  # raises ValueError on any DFLASH rule our arguments break
        assert args.speculative_num_draft_tokens == int(g["argv"][g["argv"].index("--speculative-dflash-block-size")
                                                                  + 1])


def test_sglang_handle_dflash_refuses_pp2():
    """Mutation: the --pp-size 2 an unchecked build used to write fails SGLang's own rule."""
    handle = _handle_dflash()
    args, _ = _sglang_args(["python", "-m", "sglang.launch_server", "--model-path", "t", "--speculative-algorithm",
                            "DFLASH", "--speculative-draft-model-path", "d", "--speculative-dflash-block-size", "8",
                            "--tp-size", "2", "--pp-size", "2"])
    with pytest.raises(ValueError, match="only supports pp_size == 1"):
        handle(args)


def test_sglang_kv_cache_dtype_and_drafter_precision(bundles):
    model_src = _source("sglang", "sglang/srt/arg_groups/fields/model.py")
    field = next(s for s in ast.walk(ast.parse(model_src)) if isinstance(s, ast.AnnAssign)
                 and isinstance(s.target, ast.Name) and s.target.id == "kv_cache_dtype")
    choices = next(ast.literal_eval(k.value) for c in ast.walk(field.annotation) if isinstance(c, ast.Call)
                   for k in c.keywords if k.arg == "choices")
    dflash_src = _source("sglang", "sglang/srt/models/dflash.py")
    fields = _class_fields(dflash_src, "DFlashDraftModel")
    cls = next(n for n in ast.walk(ast.parse(dflash_src)) if isinstance(n, ast.ClassDef) and n.name == "DFlashDraftModel")
    supports = next(ast.literal_eval(s.value) for s in cls.body if isinstance(s, ast.Assign)
                    and s.targets[0].id == "supports_quantization")
    assert supports is False and "fp8" not in choices and "fp8_e4m3" in choices
    del fields
    for name in (n for n in bundles if (bundles[n] / "configs/sglang.json").exists()):
        argv = json.loads((bundles[name] / "configs/sglang.json").read_text())["argv"]
        if "--kv-cache-dtype" in argv:
            assert argv[argv.index("--kv-cache-dtype") + 1] in choices
        # supports_quantization = False: the drafter it points to must be unquantized
        drafter = json.loads((bundles[name] / "drafter/config.json").read_text())
        assert "quantization_config" not in drafter
        assert trt.drafter_loader_problems(bundles[name] / "drafter") == []


# ------------------------------------------------------------------------------ draft schedules
def _trtllm_draft_len(spec: trt.DFlashDecodingConfig, batch: int) -> int:
    """TensorRT-LLM's draft length at a batch size (LLM_ARGS_NEW's field description, speculative/utils.py
    get_draft_len_for_batch_size): the length of the smallest key >= batch, 0 above the largest key; with
    max_concurrency instead, max_draft_len up to it and 0 above."""
    if spec.max_concurrency is not None:
        return spec.max_draft_len if batch <= spec.max_concurrency else 0
    if spec.draft_len_schedule is None:
        return spec.max_draft_len
    keys = sorted(spec.draft_len_schedule)
    return next((spec.draft_len_schedule[k] for k in keys if k >= batch), 0)


def test_trtllm_draft_schedule_is_written_and_accepted(bundles):
    """The schedule lands in both TensorRT-LLM files, passes its validators, and TensorRT-LLM's own reading
    of it drafts what the schedule says at every batch size."""
    from dflash_trt.plan.draft_schedule import from_dict

    sched = from_dict(SCHEDULE, 8, "test")
    m = json.loads((bundles["llama-sched"] / "manifest.json").read_text())
    assert m["draft_schedule"]["schedule"]["ranges"] == SCHEDULE["ranges"]
    assert m["draft_schedule"]["stacks"]["trtllm"] == {"fields": {"max_draft_len": 7,
                                                                  "draft_len_schedule": {"8": 7, "32": 3}}}
    for rel, cfg in _trtllm_files(bundles["llama-sched"]):
        spec = trt.TorchLlmArgs(**cfg).speculative_config
        assert spec.draft_len_schedule == {8: 7, 32: 3} and spec.max_concurrency is None, rel
        for batch in range(1, 80):
            want = sched.k_at(batch) if batch <= sched.ranges[-1][1] else 0
            assert _trtllm_draft_len(spec, batch) == want, (rel, batch)
    for rel, cfg in _trtllm_files(bundles["llama"]):   # without a schedule (CPU bundle): nothing written
        assert "draft_len_schedule" not in cfg["speculative_config"] and "max_concurrency" not in cfg["speculative_config"]


def test_trtllm_draft_schedule_cutoff_and_refusals():
    """A cutoff is max_concurrency; every shape the stack writes passes the contract, and the contract
    (TensorRT-LLM's validators) refuses what TensorRT-LLM refuses."""
    from dflash_trt.stacks.trtllm.serve_config import trtllm_draft_schedule

    base = {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "drafter"}
    fields, why = trtllm_draft_schedule([(1, 16, 7), (17, 64, 0)])
    assert why is None and fields == {"max_draft_len": 7, "max_concurrency": 16}
    assert trt.DFlashDecodingConfig(**{**base, **fields}).max_concurrency == 16
    fields, why = trtllm_draft_schedule([(1, 9, 5), (10, 64, 2)])   # drafts to the end: key 64 kept
    assert why is None and fields == {"max_draft_len": 5, "draft_len_schedule": {9: 5, 64: 2}}
    trt.DFlashDecodingConfig(**{**base, **fields})
    fields, why = trtllm_draft_schedule([(1, 1, 6), (2, 4, 5), (5, 64, 7)])   # rises past its first: not expressible
    assert fields == {} and "smallest key at max_draft_len" in why
    for bad, message in (({"draft_len_schedule": {8: 6, 32: 3}}, "must equal max_draft_len"),
                         ({"draft_len_schedule": {8: 7, 32: 9}}, "must be <= max_draft_len"),
                         ({"draft_len_schedule": {0: 7}}, "must be >= 1"),
                         ({"draft_len_schedule": {8: 7}, "max_concurrency": 8}, "mutually exclusive"),
                         ({"max_concurrency": 0}, "greater than 0")):
        with pytest.raises(ValidationError, match=message):
            trt.DFlashDecodingConfig(**{**base, **bad})


def test_sglang_refuses_adaptive_for_dflash_by_its_own_code(bundles):
    """SGLang's adaptive_unsupported_reason, compiled from the wheel and run on our arguments, turns
    --speculative-adaptive off for DFLASH: build writes no adaptive flag and says why (with the
    lines cited, which are checked here against the wheel)."""
    from dflash_trt.stacks.sglang import ADAPTIVE_REFUSED

    src = _source("sglang", "sglang/srt/speculative/adaptive_spec_params.py")
    reason_of = _compile_function(src, "adaptive_unsupported_reason",
                                  {"resolving_view": lambda a: a, "resolved_view": lambda a: a})
    g = json.loads((bundles["llama-sched"] / "configs/sglang.json").read_text())
    args, _ = _sglang_args(g["argv"])
    reason = reason_of(args)
    assert reason is not None and "DFLASH" in reason and "only EAGLE/EAGLE3" in reason
    assert not any(a.startswith("--speculative-adaptive") for a in g["argv"])
    m = json.loads((bundles["llama-sched"] / "manifest.json").read_text())
    assert m["draft_schedule"]["stacks"]["sglang"] == {"skipped": ADAPTIVE_REFUSED}
    lines = src.splitlines()
    assert lines[55].startswith("def adaptive_unsupported_reason") and "only EAGLE/EAGLE3" in lines[63]
    hook = _source("sglang", SGL_HOOK).splitlines()
    assert "_maybe_disable_adaptive(server_args)" in hook[261] and hook[1373].startswith("def _maybe_disable_adaptive")


# ------------------------------------------------------------- activation dtype per quantization method
# vLLM refuses at start a --dtype its quantization method does not take as activations
# (vllm/config/vllm.py:937-943 in 0.33.0: `get_supported_act_dtypes`); SGLang 0.5.23 declares the same
# lists (ModelOpt*Config / Mxfp4Config) and resolves "auto" by its own `_get_and_verify_dtype`.
VLLM_QUANT_FILES = {"ModelOptFp8Config": "modelopt.py", "ModelOptNvFp4Config": "modelopt.py", "Mxfp4Config": "mxfp4.py"}
SGLANG_METHOD = {"fp8": ("modelopt_quant.py", "ModelOptFp8Config"), "nvfp4": ("modelopt_quant.py", "ModelOptFp4Config"),
                 "mxfp4": ("mxfp4.py", "Mxfp4Config")}


def _act_dtypes(src: str, cls: str) -> set[str]:
    """The torch dtypes a quantization config's get_supported_act_dtypes returns, by name (half -> float16)."""
    ret = _function(src, "get_supported_act_dtypes", cls).body[-1].value
    return {{"half": "float16"}.get(e.attr, e.attr) for e in ret.elts}


@pytest.fixture(scope="module")
def float32_bundles(tmp_path_factory):
    """A float32 target (as the embedded SmolLM2 is) quantized to NVFP4 (Blackwell) and FP8 (Hopper)."""
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("f32")
    make_tiny("llama", root / "t", root / "d", seed=4)
    cfg = json.loads((root / "t/config.json").read_text())
    cfg.pop("torch_dtype", None)
    (root / "t/config.json").write_text(json.dumps({**cfg, "dtype": "float32"}))
    out = {}
    for arch, gpu in (("blackwell", "b300"), ("hopper", "h200")):
        code, _, err = run_cli("build", "--target", str(root / "t"), "--drafter", str(root / "d"), "--arch", arch,
                               "--gpu", gpu, "--out", str(root / arch))
        assert code == 0, err
        out[arch] = root / arch
    return out


def test_our_dtype_table_is_vllms_own():
    from dflash_trt.stacks.vllm.launch import QUANT_ACT_DTYPES

    refusal = _source("vllm", "vllm/config/vllm.py")
    assert "supported_dtypes = quant_config.get_supported_act_dtypes()" in refusal
    assert "if model_config.dtype not in supported_dtypes:" in refusal
    cli_dtypes = _literal_values(_source("vllm", "vllm/config/model.py"), "ModelDType")
    for fmt, (cls, ours) in QUANT_ACT_DTYPES.items():
        src = _source("vllm", f"vllm/model_executor/layers/quantization/{VLLM_QUANT_FILES[cls]}")
        assert set(ours) == _act_dtypes(src, cls) & cli_dtypes, fmt


def test_every_served_activation_dtype_is_one_the_quant_method_takes(bundles, float32_bundles):
    sglang_cfg = _source("sglang", "sglang/srt/configs/model_config.py")
    table = next(n for n in ast.parse(sglang_cfg).body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "_STR_DTYPE_TO_TORCH_DTYPE")
    ns = {"torch": torch, "logger": logging.getLogger("sglang"), "PretrainedConfig": dict, "Union": object}
    ns["_STR_DTYPE_TO_TORCH_DTYPE"] = eval(compile(ast.Expression(table.value), "<sglang>", "eval"), ns)  # noqa: S307
    sglang_dtype = _compile_function(sglang_cfg, "_get_and_verify_dtype", ns)
    seen = set()
    for bundle in [*float32_bundles.values(), bundles["llama"], bundles["gptoss"]]:
        quant = json.loads((bundle / "manifest.json").read_text())["quant"]["target"]
        tcfg = json.loads((bundle / "target/config.json").read_text())
        seen.add((quant, tcfg.get("dtype")))
        vllm = json.loads((bundle / "configs/vllm.json").read_text())
        cls = {"fp8": "ModelOptFp8Config", "nvfp4": "ModelOptNvFp4Config", "mxfp4": "Mxfp4Config"}[quant]
        accepted = _act_dtypes(_source("vllm", f"vllm/model_executor/layers/quantization/{VLLM_QUANT_FILES[cls]}"),
                               cls)
        assert vllm["engine_args"]["dtype"] in accepted, (bundle.name, vllm["engine_args"]["dtype"], accepted)
        assert vllm["argv"][vllm["argv"].index("--dtype") + 1] == vllm["engine_args"]["dtype"]
        argv = json.loads((bundle / "configs/sglang.json").read_text())["argv"]
        asked = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "auto"
        file, scls = SGLANG_METHOD[quant]
        resolved = str(sglang_dtype(tcfg, asked)).removeprefix("torch.")
        assert resolved in _act_dtypes(_source("sglang", f"sglang/srt/layers/quantization/{file}"), scls), bundle.name
    assert ("nvfp4", "float32") in seen and ("fp8", "float32") in seen   # the case vLLM refused
