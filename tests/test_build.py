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

from dflash_trt.cli import main
from dflash_trt.manifest import MANIFEST_SCHEMA, read_manifest, verify

STAGES = ["check", "quantize", "convert", "plugin", "export-onnx", "compile", "package"]
ENGINE_SUFFIXES = (".plan", ".engine")


def cli(capsys, *args):
    """Run the real CLI in-process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_trt.tiny import make_tiny

    root = tmp_path_factory.mktemp("pairs")
    make_tiny("llama", root / "llama", root / "llama-drafter", seed=1)
    make_tiny("gpt-oss", root / "gptoss", root / "gptoss-drafter", seed=2)
    return root


def _drafter_for_other_target(target: Path, dst: Path, **changes) -> Path:
    """A consistent random drafter (config and tensors agree) made for a target that differs
    from `target` in the given config fields."""
    from dflash_trt.drafter import DFlashDrafter, save_drafter
    from dflash_trt.tiny import tiny_drafter_config

    other = json.loads((target / "config.json").read_text())
    other.update(changes)
    save_drafter(DFlashDrafter(tiny_drafter_config(other, mask_token_id=3)), dst)
    return dst


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, message", [
    (["--target", "no-such-model"], "not a preset"),
    (["--target", "qwen3-8b"], "huggingface-cli download Qwen/Qwen3-8B"),
])
def test_unknown_or_missing_preset(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    code, out, err = cli(capsys, "build", *args, "--arch", "hopper", "--out", str(tmp_path / "b"))
    assert code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_missing_weights(capsys, tiny, tmp_path):
    t = tmp_path / "t"
    shutil.copytree(tiny / "llama", t)
    for f in t.glob("*.safetensors"):
        f.unlink()
    code, _, err = cli(capsys, "build", "--target", str(t), "--drafter", str(tiny / "llama-drafter"),
                       "--arch", "hopper", "--out", str(tmp_path / "b"))
    assert code == 1 and "no *.safetensors weights" in err and not (tmp_path / "b").exists()


@pytest.mark.parametrize("field, value", [("hidden_size", 96), ("vocab_size", 1000)])
def test_drafter_for_another_target(capsys, tiny, tmp_path, field, value):
    d = _drafter_for_other_target(tiny / "llama", tmp_path / "d", **{field: value})
    code, _, err = cli(capsys, "build", "--target", str(tiny / "llama"), "--drafter", str(d), "--arch", "hopper",
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
def test_impossible_requests_are_refused(capsys, tiny, tmp_path, pair, args, message):
    code, _, err = cli(capsys, "build", "--target", str(tiny / pair), "--drafter", str(tiny / f"{pair}-drafter"),
                       "--arch", "hopper", "--out", str(tmp_path / "b"), *args)
    assert code == 1 and message in err, err
    assert not (tmp_path / "b").exists()


def test_existing_non_bundle_folder_needs_force(capsys, tiny, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("not a bundle")
    code, _, err = cli(capsys, "build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                       "--arch", "hopper", "--quant", "none", "--out", str(out))
    assert code == 1 and "is not a dflash-trt bundle" in err and "--force" in err
    assert (out / "notes.txt").read_text() == "not a bundle"


def test_arch_auto_without_gpu_says_what_to_pass(capsys, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    code, _, err = cli(capsys, "build", "--target", str(tiny / "llama"), "--drafter", str(tiny / "llama-drafter"),
                       "--out", str(tmp_path / "b"))
    assert code == 1 and "no NVIDIA GPU found" in err and "--arch blackwell" in err
