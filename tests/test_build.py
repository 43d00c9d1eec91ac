"""`dflash-trt build`, `compile`, `verify`: the pipeline end to end on CPU.

No GPU, TensorRT or TensorRT-LLM is installed here, so every build must finish with the compile
stage `deferred` (its commands recorded) and no engine file anywhere in the bundle.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_trt.io.manifest import Manifest, verify

from helpers import generate_json, load_model_module, make_pb_utils, run_cli, triton_args

STAGES = ["check", "quantize", "convert", "plugin", "export-onnx", "compile", "package"]
ENGINE_SUFFIXES = (".plan", ".engine")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("pairs")
    make_tiny("llama", root / "llama", root / "llama-drafter", seed=1)
    make_tiny("gpt-oss", root / "gptoss", root / "gptoss-drafter", seed=2)
    return root


def _drafter_for_other_target(target: Path, dst: Path, **changes) -> Path:
    """A consistent random drafter (config and tensors agree) made for a target that differs
    from `target` in the given config fields."""
    from dflash_trt.models.drafter import DFlashDrafter, save_drafter
    from dflash_trt.models.tiny import tiny_drafter_config

    other = json.loads((target / "config.json").read_text())
    other.update(changes)
    save_drafter(DFlashDrafter(tiny_drafter_config(other, mask_token_id=3)), dst)
    return dst


# ------------------------------------------------------------------------------- the pipeline
def test_declared_pipeline_is_the_manifests_stage_list():
    from dflash_trt.bundle.stages import PIPELINE, code_hash
    from dflash_trt.io.manifest import STAGES as MANIFEST_STAGES
    from dflash_trt.paths import package_path

    assert [st.name for st in PIPELINE] == list(MANIFEST_STAGES) == STAGES
    for st in PIPELINE:
        assert callable(st.run), st.name
        for rel in st.code:
            assert (package_path() / rel).exists(), f"{st.name}: {rel}"
        if st.code:
            code_hash(*st.code)  # raises for a missing path
        assert all(name in STAGES[:STAGES.index(st.name)] for _, name in st.after), st.name



def test_code_hash_refuses_a_moved_source_file():
    """A stage naming a file that no longer exists must fail, not hash what is left (which would
    let a stale stage be reused after a move)."""
    from dflash_trt.bundle.stages import code_hash

    assert code_hash("io/formats.py") != code_hash("io/formats.py", "kernels/csrc")
    with pytest.raises(FileNotFoundError, match="formats.py"):
        code_hash("formats.py")

def test_gpu_facts_come_from_the_hardware_catalog():
    from dflash_trt.commands.build import build_cmd
    from dflash_trt.commands.deploy import deploy_cmd
    from dflash_trt.commands.plugin import ARCHS_HELP
    from dflash_trt.hardware import arch_has_fp4, arch_sms, gpus
    from dflash_trt.io.manifest import MANIFEST_SCHEMA

    ids = ["b300", "b200", "gb200", "h200", "h100"]
    assert list(gpus()) == ids
    assert arch_sms() == {"blackwell": [100, 103], "hopper": [90]}
    assert arch_has_fp4("blackwell") and not arch_has_fp4("hopper")
    assert MANIFEST_SCHEMA["properties"]["gpu"]["enum"] == [*ids, None]
    assert MANIFEST_SCHEMA["properties"]["arch"]["enum"] == ["blackwell", "hopper"]
    choices = {p.name: list(p.type.choices) for p in build_cmd.params if p.name in ("gpu", "arch")}
    assert choices == {"gpu": [*ids, "none"], "arch": ["blackwell", "hopper", "auto"]}
    # without --gpu, a bundle deploys on its architecture's DGX / HGX node (issue 33 item 5)
    from dflash_trt.hardware import arch_default_node
    assert {a: (arch_default_node(a).gpu, arch_default_node(a).name) for a in arch_sms()} == {
        "blackwell": ("b300", "dgx-b300"), "hopper": ("h200", "hgx-h200")}
    assert MANIFEST_SCHEMA["properties"]["node"]["enum"][-1] is None
    assert [list(p.type.choices) for p in deploy_cmd.params if p.name == "gpu"] == [[*ids, "none"]]
    assert ARCHS_HELP == "blackwell (sm_100 + sm_103) or hopper (sm_90)"


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, message", [
    (["--target", "no-such-model"], "not a preset"),
    (["--target", "qwen3-8b"], "hf download Qwen/Qwen3-8B"),
])
def test_unknown_or_missing_preset(tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli("build", *args, "--arch", "hopper", "--out", str(tmp_path / "b"))
    assert code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_missing_weights(tiny, tmp_path):
    t = tmp_path / "t"
    shutil.copytree(tiny / "llama", t)
    for f in t.glob("*.safetensors"):
        f.unlink()
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(tiny / "llama-drafter"),
                           "--arch", "hopper", "--out", str(tmp_path / "b"))
    assert code == 1 and "no *.safetensors weights" in err and not (tmp_path / "b").exists()


@pytest.mark.parametrize("field, value", [("hidden_size", 96), ("vocab_size", 1000)])
def test_drafter_for_another_target(tiny, tmp_path, field, value):
    d = _drafter_for_other_target(tiny / "llama", tmp_path / "d", **{field: value})
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(d), "--arch", "hopper",
                           "--out", str(tmp_path / "b"))
    assert code == 1 and "check: the drafter does not fit the target" in err and field in err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))  # nothing half-written


@pytest.mark.parametrize("pair, args, message", [
    ("llama", ["--tp", "3"], "--tp 3 does not divide the target's num_attention_heads = 4"),
    ("gptoss", ["--ep", "3"], "--ep 3 does not divide the target's number of experts = 4"),
    ("llama", ["--ep", "2", "--tp", "2"], "not a mixture-of-experts model"),
    ("llama", ["--quant", "nvfp4"], "NVFP4 needs Blackwell"),
    ("gptoss", ["--backend", "engine"], "no engine (TensorRT checkpoint) layout"),
    ("gptoss", ["--quant", "fp8"], "MXFP4"),
])
def test_impossible_requests_are_refused(tiny, tmp_path, pair, args, message):
    code, _, err = run_cli("build", "--target", str(tiny / pair), "--drafter", str(tiny / f"{pair}-drafter"),
                           "--arch", "hopper", "--out", str(tmp_path / "b"), *args)
    assert code == 1 and message in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("gpu_args", [["--gpu", "h200"], ["--arch", "hopper"]], ids=["gpu", "arch-default-node"])
def test_a_draft_context_over_tensorrt_llms_budget_is_refused_with_the_numbers(tiny, tmp_path, gpu_args):
    """TensorRT-LLM keeps the drafter's context of max_batch_size requests per rank
    (stacks/trtllm/budget.py); build refuses a layout whose buffer exceeds the budget, before any
    stage runs, naming the sizes and the largest max_batch_size that fits. `--arch hopper` alone
    checks it too, on the architecture's default node (H200)."""
    from dflash_trt.hardware import hardware_for_gpu
    from dflash_trt.stacks.trtllm.budget import draft_context_budget
    dcfg = json.loads((tiny / "llama-drafter" / "config.json").read_text())
    tcfg = json.loads((tiny / "llama" / "config.json").read_text())
    weights = sum(f.stat().st_size for f in (tiny / "llama").glob("*.safetensors"))
    b = draft_context_budget(max_batch=1, max_seq_len=min(tcfg["max_position_embeddings"], 32768), drafter_cfg=dcfg,
                             gpu_memory_bytes=hardware_for_gpu("h200").reported_memory_bytes,
                             weights_bytes_per_rank=weights // 2, free_gpu_memory_fraction=0.85)
    args = ["--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), *gpu_args,
            "--quant", "none", "--tp", "2"]
    code, _, err = run_cli("build", *args, "--max-batch-size", str(b.largest_batch + 1), "--out", str(tmp_path / "b"))
    assert code == 1 and "DFlash draft-context buffer" in err and "vs budget" in err, err
    assert err.startswith("error: h200 (hgx-h200), --tp 2") and err.count("\n") == 1, err
    assert f"pass --max-batch-size {b.largest_batch} or less" in err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))
    if gpu_args[0] == "--arch":
        return
    m = json.loads(Path(build_json(*args, "--max-batch-size", str(b.largest_batch), "--out",
                                   str(tmp_path / "ok"))["manifest"]).read_text())
    assert m["serving_profile"]["max_batch_size"] == b.largest_batch
    serve = yaml.safe_load((tmp_path / "ok" / "configs" / "trtllm-serve.yaml").read_text())
    assert serve["max_batch_size"] == b.largest_batch and serve["speculative_config"]["attention_backend"] == "FA4"
    assert m["engines"]["trtllm"]["servers"]["trtllm-serve"]["image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4"


def test_existing_non_bundle_folder_needs_force(tiny, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("not a bundle")
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                           "--arch", "hopper", "--quant", "none", "--out", str(out))
    assert code == 1 and "is not a dflash-trt bundle" in err and "--force" in err
    assert (out / "notes.txt").read_text() == "not a bundle"


def test_help_says_cpu_only_needs_gpu_none():
    code, out, _ = run_cli("build", "--help")
    text = " ".join(out.split())
    assert code == 0 and "blackwell -> b300 (dgx-b300)" in text and "hopper -> h200 (hgx-h200)" in text
    assert "none = a CPU-only bundle" in text and "only this does" in text


def test_arch_auto_without_gpu_says_what_to_pass(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                           "--out", str(tmp_path / "b"))
    assert code == 1 and "no NVIDIA GPU found" in err and "--arch blackwell" in err


# --------------------------------------------------------------------------- full builds
def build_json(*args):
    code, out, err = run_cli("build", *args, "--json")
    assert code == 0, err
    return json.loads(out)  # --json: nothing but JSON on stdout


@pytest.fixture(scope="module")
def hopper(tiny, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("engines") / "llama-hopper"
    res = build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
                     "--gpu", "h200", "--trt-drafter-engine", "--out", str(bundle))  # every stage runs
    return bundle, res


def _engine_files(bundle: Path):
    return [p for p in bundle.rglob("*") if p.suffix in ENGINE_SUFFIXES]


def test_build_completes_with_compile_deferred(hopper):
    bundle, res = hopper
    m = Manifest.read(bundle)  # schema-checked
    status = {k: v.status for k, v in m.stages.items()}
    assert list(status) == STAGES
    assert status == {"check": "done", "quantize": "done", "convert": "not-needed", "plugin": "done",
                      "export-onnx": "done", "compile": "deferred", "package": "done"}
    c = m.stages["compile"]
    assert "no NVIDIA GPU" in c.reason and "TensorRT" in c.reason
    assert c.commands[0] == "dflash-trt compile --bundle <bundle>"
    assert any("dflash_trt.stacks.trtllm.engine drafter --onnx onnx/drafter.onnx --plugins plugins" in x for x in c.commands)
    assert _engine_files(bundle) == []  # never a faked engine
    assert (m.arch, m.gpu, m.sm, m.quant.target, m.quant.drafter, m.quant.kv_cache) == \
        ("hopper", "h200", [90], "fp8", "none", "fp8")
    assert (m.parallel.tp, m.parallel.ep, m.parallel.pp) == (1, 1, 1) and m.backend == "pytorch"
    assert m.triton_model_repository == "triton" and m.triton_models == ["tensorrt_llm", "dflash_reference"]
    assert not (bundle / "drafter/hf_quant_config.json").exists()  # bf16: what every stack's DFlash loader takes
    for rel in ("target/hf_quant_config.json", "plugins/plugin.json",
                "onnx/drafter.onnx", "configs/trtllm-serve.yaml", "configs/vllm.json", "configs/sglang.json",
                "triton/tensorrt_llm/config.pbtxt", "triton/tensorrt_llm/1/model.py", "triton/tensorrt_llm/1/model.yaml",
                "triton/dflash_reference/config.pbtxt", "triton/dflash_reference/1/model.py", "engines/README.txt"):
        assert (bundle / rel).is_file(), rel
    assert json.loads((bundle / "target/hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    assert json.loads((bundle / "plugins/plugin.json").read_text())["sms"] == [90]
    assert verify(bundle) == []
    listed = {a.path for a in m.artifacts}
    assert listed == {p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                      if p.is_file() and p.name != "manifest.json"}
    assert res["bundle"] == str(bundle) and [s["name"] for s in res["stages"]] == STAGES


def test_no_schedule_is_written_without_acceptance_and_the_manifest_says_why(hopper):
    """auto with a GPU but no acceptance figure for the drafter (a non-preset pair): no stack's control
    gets a schedule, and the manifest and the summary say why; the stacks' configs carry none."""
    bundle, res = hopper
    m = Manifest.read(bundle)
    rec = m.draft_schedule
    assert rec.schedule is None and "no acceptance figure for llama's drafter" in rec.source
    assert set(rec.stacks) == set(m.served_stacks)
    assert all(v.fields is None and v.skipped for v in rec.stacks.values())
    assert rec.stacks["trtllm"].skipped == f"no draft schedule: {rec.source}" and rec.stacks["trtllm"].fields is None
    assert rec.stacks["sglang"].skipped.startswith("SGLang 0.5.23 adapts the draft length")
    serve = yaml.safe_load((bundle / "configs/trtllm-serve.yaml").read_text())["speculative_config"]
    assert "draft_len_schedule" not in serve and "max_concurrency" not in serve
    assert res["draft_schedule"] == m.to_dict()["draft_schedule"]


def test_a_cpu_bundle_plans_no_schedule():
    from dflash_trt.plan.schedule_cost import build_schedule

    sched, why = build_schedule("auto", target_name="gpt-oss-120b", target_config={}, drafter_config={}, gpu=None,
                                quant="mxfp4", kv_cache="fp8", drafter_quant="none", tp=8, ep=1, block_size=10,
                                max_batch_size=128, max_seq_len=32768)
    assert sched is None and why.startswith("no GPU (a CPU bundle)")
    assert build_schedule("off", target_name="x", target_config={}, drafter_config={}, gpu="b300", quant="nvfp4",
                          kv_cache="fp8", drafter_quant="none", tp=1, ep=1, block_size=8, max_batch_size=8,
                          max_seq_len=8) == (None, "--draft-schedule off")


@pytest.mark.parametrize("content,message", [
    ("{not json", "invalid JSON"),
    ('{"ranges": [[1, 8, 7], [10, 64, 0]]}', "ranges[1] starts at concurrency 10, expected 9"),
    ('{"ranges": [[1, 64, 8]]}', "ranges[0] drafts k = 8, outside 0..7 (block size 8 - 1)"),
    (None, "s.json: not found"),
])
def test_draft_schedule_file_errors_are_one_line_and_write_nothing(tiny, tmp_path, content, message):
    f = tmp_path / "s.json"
    if content is not None:
        f.write_text(content)
    code, out, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                             "--arch", "hopper", "--draft-schedule", str(f), "--out", str(tmp_path / "b"))
    assert code == 1 and message in err and f"--draft-schedule {f}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


def test_serving_files_hold_the_drafters_real_settings(tiny, hopper):
    bundle, _ = hopper
    d = json.loads((tiny / "llama-drafter" / "config.json").read_text())  # read independently of our code
    B, mask, ids = d["block_size"], d["dflash_config"]["mask_token_id"], d["dflash_config"]["target_layer_ids"]
    for spec in (yaml.safe_load((bundle / "triton/tensorrt_llm/1/model.yaml").read_text())["speculative_config"],
                 yaml.safe_load((bundle / "configs/trtllm-serve.yaml").read_text())["speculative_config"]):
        assert spec == {"decoding_type": "DFlash", "speculative_model": "drafter", "max_draft_len": B - 1,
                        "mask_token_id": mask, "target_layer_ids": ids,
                        "attention_backend": "FA4"}   # the Hopper drafter path (PR #18553)
    ref = yaml.safe_load((bundle / "triton/dflash_reference/1/model.yaml").read_text())
    assert ref["block_size"] == B and (bundle / ref["target"] / "config.json").is_file()
    v = json.loads((bundle / "configs/vllm.json").read_text())
    assert v["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert v["speculative_config"]["num_speculative_tokens"] == B - 1
    assert json.loads((bundle / "configs/vllm-speculative-config.json").read_text()) == v["speculative_config"]
    g = json.loads((bundle / "configs/sglang.json").read_text())
    assert g["dflash_config"]["target_layer_ids"] == ids and g["capture_before_layer"] == [i + 1 for i in ids]
    m = Manifest.read(bundle)
    assert m.drafter.block_size == B and m.drafter.mask_token_id == mask
    assert m.drafter.target_layer_ids == {"zlab": ids, "trtllm": ids, "speculators": [i + 1 for i in ids],
                                                "vllm": [i + 1 for i in ids], "sglang": ids}


def test_every_bundle_config_pbtxt_parses(hopper):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    bundle, _ = hopper
    names = []
    for p in sorted((bundle / "triton").glob("*/config.pbtxt")):
        names.append(text_format.Parse(p.read_text(), model_config_pb2.ModelConfig()).name)
    assert names == ["dflash_reference", "tensorrt_llm", "vllm"]  # vllm: Triton's vLLM backend interface


def test_second_run_skips_every_stage_and_force_redoes_them(tiny, hopper):
    bundle, first = hopper
    args = ["--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
            "--gpu", "h200", "--trt-drafter-engine", "--out", str(bundle)]
    code, out, err = run_cli("build", *args)
    assert code == 0, err
    m = Manifest.read(bundle)
    assert all(e.skipped for e in m.stages.values())
    # status keeps each stage's outcome (a skipped stage stays deferred, so `compile` still runs it)
    assert m.stages["compile"].status == "deferred" and m.stages["quantize"].status == "done"
    assert "skipped (unchanged)" in out and "skipped (unchanged, deferred)" in out
    assert err.count("skipped (inputs unchanged") == len(STAGES)
    assert verify(bundle) == []
    assert {a.path: a.sha256 for a in m.artifacts} == {a["path"]: a["sha256"] for a in first_artifacts(first)}

    assert [s["status"] for s in json.loads(run_cli("build", *args, "--json")[1])["stages"]] == ["skipped"] * 7
    forced = build_json(*args, "--force")
    assert [s["status"] for s in forced["stages"]] == ["done", "done", "not-needed", "done", "done", "deferred", "done"]
    assert verify(bundle) == []
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def first_artifacts(res):
    return res["artifacts"]


def test_changed_input_reruns_only_what_depends_on_it(tiny, hopper, tmp_path):
    """A different --block-size changes the serving configs, not the checkpoints or kernels."""
    bundle, _ = hopper
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    res = build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
                     "--gpu", "h200", "--trt-drafter-engine", "--out", str(copy), "--block-size", "4")
    status = {s["name"]: s["status"] for s in res["stages"]}
    assert status == {"check": "skipped", "quantize": "skipped", "convert": "skipped", "plugin": "skipped",
                      "export-onnx": "skipped", "compile": "deferred", "package": "done"}
    spec = yaml.safe_load((copy / "configs/trtllm-serve.yaml").read_text())["speculative_config"]
    assert spec["max_draft_len"] == 3
    assert verify(copy) == []


def test_verify_detects_tampered_missing_and_unlisted_files(hopper, tmp_path):
    bundle, _ = hopper
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    assert run_cli("verify", "--bundle", str(copy))[0] == 0
    onnx = copy / "onnx" / "drafter.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    (copy / "configs" / "sglang.json").unlink()
    (copy / "configs" / "extra.txt").write_text("x")
    code, out, err = run_cli("verify", "--bundle", str(copy))
    assert code == 1
    assert "onnx/drafter.onnx: sha256" in err and "configs/sglang.json: missing" in err
    assert "configs/extra.txt: not listed" in err and "Traceback" not in err
    code, out, _ = run_cli("verify", "--bundle", str(copy), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and len(report["problems"]) == 3


def test_compile_without_gpu_is_refused_with_the_reason(hopper, tmp_path):
    bundle, _ = hopper
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    code, _, err = run_cli("compile", "--bundle", str(copy))
    assert code == 1 and "cannot run here" in err and "no NVIDIA GPU" in err
    assert _engine_files(copy) == [] and verify(copy) == []


def test_default_bundle_holds_only_what_its_serving_files_load(tiny, tmp_path):
    """No --trt-drafter-engine / --backend engine: no plugins/, onnx/ or engines to compile, and a
    bf16 drafter (the serving stacks' DFlash loaders run the Hugging Face drafter as it is)."""
    bundle = tmp_path / "plain"
    res = build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "blackwell",
                     "--out", str(bundle))
    assert [s["status"] for s in res["stages"]] == ["done", "done", "not-needed", "not-needed", "not-needed",
                                                    "not-needed", "done"]
    m = Manifest.read(bundle)
    assert m.quant.drafter == "none" and m.trt_drafter_engine is False
    assert "--trt-drafter-engine" in m.stages["plugin"].reason
    for gone in ("plugins", "onnx", "trtllm_ckpt", "drafter/hf_quant_config.json"):
        assert not (bundle / gone).exists(), gone
    assert m.served_stacks == ["trtllm", "vllm", "sglang"] and m.skipped_stacks == {}
    code, _, err = run_cli("compile", "--bundle", str(bundle))
    assert code == 1 and "nothing to compile" in err


@pytest.mark.parametrize("args, message", [
    (["--drafter-quant", "fp8"], "pass --calib FILE.jsonl"),
    (["--drafter-quant", "fp8", "--stacks", "vllm,sglang"], "vLLM: its quantized Linears read a static input_scale"),
    (["--drafter-quant", "int8"], "TensorRT-LLM 1.4.0rc4's DFlash loader takes no INT8 drafter"),
    (["--drafter-quant", "int8", "--stacks", "vllm,sglang"], "SGLang 0.5.23's DFlash loader takes no INT8 drafter"),
    (["--stacks", "sglang", "--pp", "2"], "only supports pp_size == 1"),
    (["--stacks", "tensorrt"], "expected a comma list of trtllm, vllm, sglang"),
])
def test_a_stack_that_cannot_load_the_bundle_is_refused_before_writing(tiny, tmp_path, args, message):
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                           "--arch", "hopper", "--out", str(tmp_path / "b"), *args)
    assert code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_stack_whose_rules_the_layout_breaks_is_skipped_with_the_reason(tiny, tmp_path):
    bundle = tmp_path / "pp2"
    code, out, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                             "--arch", "hopper", "--quant", "none", "--pp", "2", "--out", str(bundle))
    assert code == 0, err
    m = Manifest.read(bundle)
    assert m.served_stacks == ["trtllm", "vllm"]
    assert "pp_size == 1" in m.skipped_stacks["sglang"]
    assert "no SGLang config: --pp 2" in out
    assert not (bundle / "configs/sglang.json").exists() and "sglang" not in m.serving_configs
    assert (bundle / "configs/trtllm-serve.yaml").is_file()


def test_fp8_drafter_for_vllm_alone(tiny, tmp_path):
    """vLLM 0.33.0 reads a ModelOpt FP8 drafter with static input scales (engines.json), so --calib."""
    bundle = tmp_path / "v"
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [5, 17, 99, 3, 250, 42]}\n')
    build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
               "--drafter-quant", "fp8", "--stacks", "vllm", "--calib", str(calib), "--out", str(bundle))
    m = Manifest.read(bundle)
    assert m.quant.drafter == "fp8" and m.served_stacks == ["vllm"]
    assert sorted(p.name for p in (bundle / "configs").iterdir()) == ["vllm-speculative-config.json", "vllm.json"]
    assert m.triton_models == ["dflash_reference"] and not (bundle / "triton/tensorrt_llm").exists()
    assert (bundle / "drafter/hf_quant_config.json").is_file()


def test_int8_drafter_only_for_vllm_and_our_runtime_reads_it(tiny, tmp_path):
    """--drafter-quant int8: drafter/ in compressed-tensors W8A8 (int8 projections, float fc and
    norms), vLLM's drafter form beside it; our runtime loads it as int8 codes x float32 scales.
    (The bytes against the library's own export, and vLLM serving it: tests/test_vllm_qdrafter.py.)"""
    import torch
    from safetensors.torch import load_file

    from dflash_trt.models.drafter import load_drafter

    bundle = tmp_path / "v"
    build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
               "--drafter-quant", "int8", "--stacks", "vllm", "--out", str(bundle))
    m = Manifest.read(bundle)
    assert m.quant.drafter == "int8" and m.served_stacks == ["vllm"]
    assert m.reference_runtime.layout == "copy"   # the reference model runs the float drafter
    cfg = json.loads((bundle / "drafter/config.json").read_text())
    assert cfg["quantization_config"]["format"] == "int-quantized"
    q = load_file(str(bundle / "drafter/model.safetensors"))
    src = load_file(str(tiny / "llama-drafter/model.safetensors"))
    assert q["layers.0.self_attn.q_proj.weight"].dtype == torch.int8 and "fc.weight_scale" not in q
    assert torch.equal(q["fc.weight"], src["fc.weight"])
    w = load_drafter(bundle / "drafter").layers[0].self_attn.q_proj.weight
    scale = q["layers.0.self_attn.q_proj.weight_scale"].float()
    assert torch.equal(w, q["layers.0.self_attn.q_proj.weight"].float() * scale)
    # the int8 grid is fine enough: each weight within half a step of the float one
    assert ((w - src["layers.0.self_attn.q_proj.weight"].float()).abs() <= scale / 2 + 1e-6).all()


def test_gpt_oss_builds_with_pytorch_backend_keeping_mxfp4(tiny, tmp_path):
    from safetensors import safe_open

    from dflash_trt.io.manifest import sha256_file

    bundle = tmp_path / "gptoss"
    build_json("--target", str(tiny / "gptoss"), "--drafter", str(tiny / "gptoss-drafter"), "--arch", "blackwell",
               "--tp", "2", "--ep", "2", "--out", str(bundle))
    m = Manifest.read(bundle)
    assert (m.quant.target, m.quant.drafter, m.quant.kv_cache) == ("mxfp4", "none", "fp8")
    assert (m.parallel.tp, m.parallel.ep, m.parallel.pp) == (2, 2, 1) and m.sm == [100, 103]
    assert m.stages["compile"].status == "not-needed" and _engine_files(bundle) == []
    assert not (bundle / "plugins").exists() and not (bundle / "onnx").exists()
    # the experts are the shipped MXFP4 bytes, unchanged
    with safe_open(bundle / "target" / "model.safetensors", "pt") as f:
        blocks = [k for k in f.keys() if k.endswith("_blocks")]
        assert blocks and all(str(f.get_slice(k).get_dtype()) == "U8" for k in blocks)
    assert sha256_file(bundle / "target/model.safetensors") == sha256_file(tiny / "gptoss/model.safetensors")
    serve = yaml.safe_load((bundle / "configs/trtllm-serve.yaml").read_text())
    assert serve["moe_config"] == {"backend": "TRTLLM"} and serve["moe_expert_parallel_size"] == 2
    assert serve["tensor_parallel_size"] == 2 and serve["kv_cache_config"]["dtype"] == "fp8"
    # per-layer windows from the target's own layer_types / sliding_window (read independently here)
    tcfg = json.loads((tiny / "gptoss" / "config.json").read_text())
    assert serve["kv_cache_config"]["max_attention_window"] == [
        tcfg["sliding_window"] if t == "sliding_attention" else serve["max_seq_len"] for t in tcfg["layer_types"]]
    assert serve["max_batch_size"] > 0


def test_engine_backend_converts_and_defers_trtllm_build(tiny, tmp_path):
    bundle = tmp_path / "eng"
    build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
               "--quant", "none", "--backend", "engine", "--tp", "2", "--out", str(bundle))
    m = Manifest.read(bundle)
    assert m.stages["convert"].status == "done" and m.quant.target == "none"
    cfg = json.loads((bundle / "trtllm_ckpt/config.json").read_text())
    assert cfg["mapping"]["tp_size"] == 2
    assert (bundle / "trtllm_ckpt/rank0.safetensors").is_file() and (bundle / "trtllm_ckpt/rank1.safetensors").is_file()
    c = m.stages["compile"]
    assert c.status == "deferred" and any(x.startswith("trtllm-build --checkpoint_dir trtllm_ckpt") for x in c.commands)
    assert "trtllm-build" in c.reason
    assert _engine_files(bundle) == []


def test_bundles_reference_model_serves_the_same_text_as_generate(tiny, hopper, pb_cleanup):
    """The bundle's own triton/dflash_reference, with its bundle-relative paths, run in-process
    through the Triton API test double of tests/helpers.py (no Triton server runs here)."""
    import numpy as np

    bundle, _ = hopper
    repo = bundle / "triton"
    pb = make_pb_utils(repo / "dflash_reference" / "1")
    mod = load_model_module(repo / "dflash_reference" / "1" / "model.py", pb)
    model = mod.TritonPythonModel()
    model.initialize(triton_args(repo, "dflash_reference"))
    assert model.target_dir == (bundle / "reference" / "target").resolve()
    req = pb.InferenceRequest([pb.Tensor("text_input", np.array([b"hello there"], dtype=np.object_)),
                               pb.Tensor("sampling_param_max_tokens", np.array([16], dtype=np.int32))])
    model.execute([req])
    model.finalize()  # the decode slot answers, then stops
    [(resp, flags)] = req.get_response_sender().sent
    text = {t.name(): t.as_numpy() for t in resp.output_tensors()}["text_output"][0].decode()
    assert text == generate_json(tiny / "llama", tiny / "llama-drafter", "hello there", 16)["text"]


# ----------------------------------------------------------------------- the embedded pair
def _embedded_pair(tmp_path_factory):
    """The embedded target (SmolLM2-135M, converted once into $DFLASH_TRT_HOME) and our trained
    drafter; while the drafter is not committed yet, a random drafter shaped for the same target
    stands in (every stage still runs on the real 135M target)."""
    from dflash_trt.errors import DFlashError
    from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target

    try:
        target = ensure_embedded_target(progress=False)
    except DFlashError as e:
        pytest.skip(f"embedded target unavailable: {e}")
    try:
        return None, embedded_drafter_path()
    except DFlashError:
        from dflash_trt.models.drafter import DFlashDrafter, save_drafter
        from dflash_trt.models.tiny import tiny_drafter_config

        d = tmp_path_factory.mktemp("smol") / "drafter"
        cfg = json.loads((target / "config.json").read_text())
        save_drafter(DFlashDrafter(tiny_drafter_config(cfg, mask_token_id=0, block_size=8, layers=1)), d)
        return "smollm2-135m", d


@pytest.mark.slow
@pytest.mark.parametrize("arch, quant", [("blackwell", "nvfp4"), ("hopper", "fp8")])
def test_embedded_pair_builds_with_compile_deferred(tmp_path_factory, arch, quant):
    target, drafter = _embedded_pair(tmp_path_factory)
    bundle = tmp_path_factory.mktemp("emb") / f"smollm2-{arch}"
    args = (["--target", target] if target else []) + ["--drafter", str(drafter), "--arch", arch, "--out", str(bundle)]
    res = build_json(*args)
    m = Manifest.read(bundle)
    assert m.target.name == "smollm2-135m" and m.quant.target == quant and m.quant.drafter == "none"
    # nothing to compile: the serving files load target/ and drafter/ as they are
    assert [s["status"] for s in res["stages"]] == ["done", "done", "not-needed", "not-needed", "not-needed",
                                                    "not-needed", "done"]
    d = json.loads((Path(drafter) / "config.json").read_text())
    spec = yaml.safe_load((bundle / "triton/tensorrt_llm/1/model.yaml").read_text())["speculative_config"]
    assert (spec["max_draft_len"], spec["mask_token_id"], spec["target_layer_ids"]) == \
        (d["block_size"] - 1, d["dflash_config"]["mask_token_id"], d["dflash_config"]["target_layer_ids"])
    algo = json.loads((bundle / "target/hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    assert algo == quant.upper()
    assert _engine_files(bundle) == [] and verify(bundle) == []
    again = build_json(*args)
    assert [s["status"] for s in again["stages"]] == ["skipped"] * 7


def test_arch_auto_reads_the_gpu_from_nvidia_smi(tiny, tmp_path, monkeypatch):
    """A GPU node without TensorRT: `nvidia-smi` here is a stand-in script printing what the real
    one prints for `--query-gpu=name,compute_cap --format=csv,noheader` on a B300; the build
    picks Blackwell / b300 from it and still defers compile, now for TensorRT alone."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA B300 SXM6 AC, 10.3'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    bundle = tmp_path / "auto"
    build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--quant", "none",
               "--trt-drafter-engine", "--out", str(bundle))
    m = Manifest.read(bundle)
    assert (m.arch, m.gpu, m.sm) == ("blackwell", "b300", [103])
    c = m.stages["compile"]
    assert c.status == "deferred" and "TensorRT" in c.reason and "no NVIDIA GPU" not in c.reason


def test_failed_rebuild_leaves_the_previous_bundle_intact(tiny, hopper, tmp_path):
    bundle, _ = hopper
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    before = Manifest.read(copy)
    # engine backend + FP8 needs calibration prompts: the convert stage fails after check and
    # quantize have already written into the temporary folder
    code, _, err = run_cli("build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                           "--arch", "hopper", "--gpu", "h200", "--backend", "engine", "--out", str(copy))
    assert code == 1 and "--calib" in err
    assert Manifest.read(copy) == before and verify(copy) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary folder left beside it


def test_preset_found_in_the_local_hub_cache_is_used(tmp_path, monkeypatch):
    """`--target qwen3-8b` resolves to a snapshot in the Hugging Face cache layout
    (models--org--name/snapshots/<rev>, the preset's pinned commits); here tiny stand-ins sit where
    the real files would (tests/test_hub.py: the full layout, blobs and refs)."""
    from dflash_trt.models.tiny import make_tiny
    from dflash_trt.presets.catalog import PRESETS

    hub = tmp_path / "hub"
    t = hub / "models--Qwen--Qwen3-8B" / "snapshots" / PRESETS["qwen3-8b"].revision
    d = hub / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / PRESETS["qwen3-8b"].drafter_revision
    make_tiny("qwen3", t, d, seed=4)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    res = build_json("--target", "qwen3-8b", "--arch", "hopper", "--quant", "none")
    assert res["bundle"] == "engines/qwen3-8b-hopper-none"  # default --out under engines/
    m = Manifest.read(tmp_path / res["bundle"])
    assert m.target.name == "qwen3-8b" and m.target.hf_id == "Qwen/Qwen3-8B"
    assert m.target.path == str(t.resolve()) and m.drafter.path == str(d.resolve())


def test_rebuild_remakes_a_stage_whose_output_was_edited(hopper, tiny, tmp_path):
    bundle, _ = hopper
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    before = Manifest.read(copy)
    sg = copy / "configs" / "sglang.json"
    sg.write_text(sg.read_text().replace("DFLASH", "EAGLE3"))  # same stage inputs, edited output
    res = build_json("--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"), "--arch", "hopper",
                     "--gpu", "h200", "--trt-drafter-engine", "--out", str(copy))
    status = {s["name"]: s["status"] for s in res["stages"]}
    assert status["package"] == "done" and status["quantize"] == "skipped"
    assert "DFLASH" in sg.read_text() and verify(copy) == []
    sha = {a.path: a.sha256 for a in Manifest.read(copy).artifacts}
    assert sha == {a.path: a.sha256 for a in before.artifacts}


def test_hash_cache_knows_hard_links_of_what_it_hashed(tmp_path):
    """A bundle's hard link of a multi-GB input reuses the input's sha256 (not read twice), and
    only while the bytes are the same."""
    from dflash_trt.io.manifest import HashCache, sha256_file

    src, link = tmp_path / "w.safetensors", tmp_path / "link.safetensors"
    src.write_bytes(b"x" * 1000)
    cache = HashCache()
    digest = cache.sha256(src)
    os.link(src, link)
    assert cache.linked(link) == digest == sha256_file(link)
    (tmp_path / "copy").write_bytes(src.read_bytes())
    assert cache.linked(tmp_path / "copy") is None          # same bytes, another inode: not known
    with open(link, "r+b") as f:
        f.write(b"y")
    st = link.stat()   # the kernel's mtime clock is coarse (a few ms): make sure this edit shows in it
    os.utime(link, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert cache.linked(link) is None                       # edited since (mtime moved)
