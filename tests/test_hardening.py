"""Hardening (issue 16): every bad input ends in one `error:` line naming the field or path, sizes
are bounded before allocation, and a failed or killed run leaves nothing behind.

The oracle for "generate refuses what check refuses" is check itself: the same first message."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.io import atomic
from dflash_trt.io.checkpoint import CheckpointReader, nonfinite_tensors
from dflash_trt.models.config import MAX_BLOCK, drafter_config_problems, target_config_problems

from helpers import run_cli


def edit_config(folder: Path, fn) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err
    return lines[-1].removeprefix("error: ")


def gen(t, d, *extra):
    return run_cli("generate", "--target", str(t), "--drafter", str(d), "-p", "hi", "--max-new-tokens", "4", *extra)


def paths_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ------------------------------------------------------------------------------ 1. one validation layer
def _set(key, value):
    def f(c):
        node = c
        *parents, last = key.split(".")
        for k in parents:
            node = node[k]
        node[last] = value
    return f


TARGET_EDITS = [  # (edit, a needle of check's message)
    (_set("hidden_size", "64"), "hidden_size = '64': must be an integer"),
    (_set("hidden_size", None), "missing field(s) hidden_size"),
    (_set("hidden_size", True), "hidden_size = True: must be an integer"),
    (_set("rms_norm_eps", "x"), "rms_norm_eps = 'x': must be a finite number"),
    (_set("num_attention_heads", 0), "num_attention_heads = 0: must be between 1"),
    (_set("num_key_value_heads", 3), "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    (_set("head_dim", 0), "head_dim = 0: must be between 2"),
    (_set("head_dim", 15), "head_dim = 15: must be even"),
    (_set("vocab_size", 10**15), "vocab_size = 1000000000000000: must be between 1 and"),
    (_set("num_hidden_layers", -1), "num_hidden_layers = -1"),
    (_set("max_position_embeddings", 0), "max_position_embeddings = 0"),
    (_set("layer_types", ["full_attention"] * 3), "layer_types has 3 entries but num_hidden_layers = 4"),
    (_set("layer_types", ["sliding_attention"] * 4), "sliding_window is not set"),
    (_set("tie_word_embeddings", "yes"), "tie_word_embeddings = 'yes': must be true or false"),
    (_set("vocab_size", 500), "implies [500, 64]"),   # in range, but not what the tensors hold
]
DRAFTER_EDITS = [
    (_set("block_size", 1), "block_size = 1: must be between 2 and 64"),
    (_set("block_size", 10**9), "block_size = 1000000000"),
    (_set("dflash_config.target_layer_ids", "0,1"), "target_layer_ids = '0,1': must be a list of integers"),
    (_set("dflash_config.target_layer_ids", [0, 99]), "target_layer_ids [99] out of range"),
    (_set("dflash_config.target_layer_ids", [1, 1]), "has a repeated id"),
    (_set("dflash_config.target_layer_ids", [1, 0]), "is not in ascending order"),
    (_set("dflash_config.target_layer_ids", []), "target_layer_ids is empty"),
    (_set("dflash_config.mask_token_id", 512), "mask_token_id = 512 outside the target vocabulary"),
    (_set("dflash_config.mask_token_id", 3.5), "mask_token_id = 3.5: must be an integer"),
    (_set("dflash_config", [1]), "dflash_config = [1]: must be an object"),
    (_set("layer_types", ["full_attention"]), "layer_types has 1 entries but num_hidden_layers = 2"),
    (_set("num_attention_heads", "4"), "num_attention_heads = '4': must be an integer"),
    (_set("rms_norm_eps", float("nan")), "rms_norm_eps = nan: must be a finite number"),
    (_set("num_target_layers", 3), "num_target_layers = 3 but the target has num_hidden_layers = 4"),
    (_set("hidden_size", 32), "hidden_size: drafter 32 != target 64"),
]


@pytest.mark.parametrize("which,edit,needle", [("t", *e) for e in TARGET_EDITS] + [("d", *e) for e in DRAFTER_EDITS])
def test_generate_refuses_what_check_refuses_with_its_message(pair, which, edit, needle):
    t, d = pair
    edit_config(t if which == "t" else d, edit)
    code, _, err = run_cli("check", "--target", str(t), "--drafter", str(d))
    problems = [line.removeprefix("problem: ") for line in err.strip().splitlines()]
    assert code == 1 and any(needle in p for p in problems), err
    code, _, err = gen(t, d)
    msg = one_error(err)
    assert code == 1 and msg.split(" (and ")[0] == problems[0], (msg, problems)


def test_non_utf8_configs_and_a_file_as_target(pair):
    t, d = pair
    (d / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    for argv in (("check", "--target", str(t), "--drafter", str(d)), ("generate", "--target", str(t), "--drafter",
                                                                      str(d), "-p", "x")):
        code, _, err = run_cli(*argv)
        assert code == 1 and "config.json: not UTF-8 text" in err and "Traceback" not in err
    code, _, err = run_cli("check", "--target", str(t / "config.json"), "--drafter", str(d))
    assert code == 1 and "the target is a file; expected a checkpoint folder" in err


def test_the_rules_accept_every_shipped_config():
    from importlib import resources

    folder = resources.files("dflash_trt.presets.configs")
    for f in folder.iterdir():
        if f.name.endswith(".json"):
            cfg = json.loads(f.read_text())
            drafter = "DFlashDraftModel" in (cfg.get("architectures") or [])
            assert (drafter_config_problems if drafter else target_config_problems)(cfg, f.name) == [], f.name
    ours = json.loads(resources.files("dflash_trt").joinpath("assets", "smollm2-135m-dflash", "config.json").read_text())
    assert drafter_config_problems(ours) == []


# -------------------------------------------------------------------------------------- 2. bounds
def test_max_new_tokens_and_prompt_length_are_bounded_by_the_context(pair):
    t, d = pair
    code, _, err = run_cli("generate", "--target", str(t), "--drafter", str(d), "-p", "hi", "--max-new-tokens",
                           str(10**12))
    assert code == 1 and "exceed the target's context of 2048 tokens (max_position_embeddings)" in one_error(err)
    assert "at most" in err
    code, _, err = run_cli("generate", "--target", str(t), "--drafter", str(d), "--raw", "-p", "hi " * 3000)
    assert code == 1 and "the prompt has" in one_error(err) and "2048" in err
    prompts = t.parent / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "hi " * 3000}) + "\n")
    code, _, err = run_cli("bench", "--target", str(t), "--drafter", str(d), "--prompts", str(prompts),
                           "--max-new-tokens", "4")
    assert code == 1 and one_error(err).startswith("prompt 2: the prompt has")


def test_api_block_size_and_token_ids_are_bounded(tiny_pairs):
    from dflash_trt.errors import DFlashError
    from dflash_trt.runtime.pair import generate, load_pair

    p = load_pair(*tiny_pairs["llama"], "float32")
    with pytest.raises(DFlashError, match=f"between 2 and {MAX_BLOCK}"):
        generate(p, [1, 2], max_new_tokens=2, block_size=10**9)
    with pytest.raises(DFlashError, match="in 0..511"):
        generate(p, [1, 10**6], max_new_tokens=2)
    assert len(generate(p, [1, 2], max_new_tokens=3).token_ids) == 3


# ------------------------------------------------------------------------------- 3. I/O errors
def test_export_onnx_io_errors_are_one_line(pair, tmp_path):
    t, d = pair
    (tmp_path / "a_file").write_text("x")
    before = paths_under(tmp_path)
    code, _, err = run_cli("export-onnx", "--drafter", str(d), "--target", str(t), "--out",
                           str(tmp_path / "a_file" / "x.onnx"))
    assert code == 1 and "a_file is a file, not a folder" in one_error(err)
    if not os.access("/sys", os.W_OK) or not _can_mkdir("/sys/dflash-trt-probe"):   # read-only to root as well
        code, _, err = run_cli("export-onnx", "--drafter", str(d), "--target", str(t), "--out", "/sys/dflash-x/y.onnx")
        assert code == 1 and one_error(err).startswith("/sys/dflash-x: cannot write")
    assert paths_under(tmp_path) == before


def _can_mkdir(p: str) -> bool:
    try:
        os.mkdir(p)
    except OSError:
        return False
    os.rmdir(p)
    return True


def _file_size_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


@pytest.mark.parametrize("argv", [
    ["quantize", "--model", "{t}", "--format", "fp8", "--out", "{out}/q"],
    ["export-onnx", "--drafter", "{d}", "--target", "{t}", "--out", "{out}/x.onnx"],
    ["make-tiny", "--arch", "qwen3", "--out", "{out}/tiny"],
])
def test_a_write_the_file_system_refuses_is_one_line_and_leaves_nothing(pair, tmp_path, argv):
    """A real failed write (RLIMIT_FSIZE: the kernel refuses bytes past 100 kB, EFBIG), in a child process."""
    t, d = pair
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.format(t=t, d=d, out=out) for a in argv]
    r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], capture_output=True, text=True,
                       preexec_fn=_file_size_limit, check=False)
    assert r.returncode == 1 and str(out) in one_error(r.stderr)
    assert list(out.iterdir()) == []


def test_outputs_inside_inputs_are_refused_up_front(pair, tmp_path):
    t, d = pair
    before = paths_under(tmp_path)
    code, _, err = run_cli("quantize", "--model", str(d), "--format", "fp8", "--out", str(d / "q"))
    assert code == 1 and "lies inside --model" in one_error(err)
    code, _, err = run_cli("quantize", "--model", str(d), "--format", "fp8", "--out", str(tmp_path))
    assert code == 1 and "contains --model" in one_error(err)
    code, _, err = run_cli("convert", "--model", str(t), "--out", str(t / "trt"))
    assert code == 1 and "lies inside --model" in one_error(err)
    t0 = time.perf_counter()
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--out", str(t / "b"))
    assert code == 1 and "lies inside --target" in one_error(err) and "check: running" not in err
    assert time.perf_counter() - t0 < 30 and paths_under(tmp_path) == before


def test_bad_sizes_and_data_files(pair, tmp_path):
    t, d = pair
    for size in ("0", "-5GB", "inf", "nan", "12XB"):
        code, _, err = run_cli("quantize", "--model", str(d), "--format", "fp8", "--max-shard-size", size,
                               "--out", str(tmp_path / "q"))
        assert code == 1 and "--max-shard-size" in one_error(err)
    data = tmp_path / "data.jsonl"
    for content in (b'{"prompt_ids": [1, 2], "output_ids": [3, 4, 5]}\n\xff\xfe\n',
                    b'{"prompt_ids": [1, "x"], "output_ids": [3, 4, 5]}\n', b'[1, 2]\n',
                    b'{"prompt_ids": [1, 2], "output_ids": [3, 4, 99999]}\n'):
        data.write_bytes(content)
        code, _, err = run_cli("train-drafter", "--target", str(t), "--data", str(data), "--out",
                               str(tmp_path / "run"), "--steps", "1")
        assert code == 1 and str(data) in one_error(err) and not (tmp_path / "run").exists(), err
    data.write_text('{"prompt_ids": [1, 2], "output_ids": [3, 4, 5]}\n')
    code, _, err = run_cli("train-drafter", "--target", str(t), "--data", str(data), "--out", str(tmp_path / "run"),
                           "--steps", "1", "--mask-token-id", "100000")
    assert code == 1 and "--mask-token-id 100000: outside the target vocabulary" in one_error(err)
    assert not (tmp_path / "run").exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "a"}\n' + bytes(range(256)) + b"\n")
    code, _, err = run_cli("bench", "--target", str(t), "--drafter", str(d), "--prompts", str(prompts))
    assert code == 1 and "not UTF-8 text" in one_error(err)


# ------------------------------------------------------------------------------------ 4. leftovers
def test_a_killed_build_leaves_a_marked_temp_that_the_next_run_removes(pair, tmp_path):
    t, d = pair
    work = tmp_path / "w"
    work.mkdir()
    argv = [sys.executable, "-m", "dflash_trt.cli", "build", "--target", str(t), "--drafter", str(d), "--arch",
            "hopper", "--out", "b"]
    proc = subprocess.Popen(argv, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(work.glob(".b.tmp-*/reports")):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    (left,) = work.glob(".b.tmp-*")
    assert json.loads((left / atomic.MARKER).read_text())["pid"] == proc.pid
    # look-alikes that are not ours, or not stale, are left alone
    (work / ".b.tmp-notours").mkdir()
    live = work / ".b.tmp-live"
    live.mkdir()
    (live / atomic.MARKER).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                  "started": atomic.PROCESS_START}))
    r = subprocess.run(argv, cwd=work, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert f"removed {Path('.') / left.name}, left behind by an interrupted run (pid {proc.pid})" in r.stderr
    assert sorted(p.name for p in work.iterdir()) == [".b.tmp-live", ".b.tmp-notours", "b"]
    assert atomic.MARKER not in {p.name for p in (work / "b").iterdir()}
    code, _, err = run_cli("verify", "--bundle", str(work / "b"))
    assert code == 0, err


def test_an_interrupted_swap_is_put_back(tmp_path):
    """Killed between moving the old output aside and moving the new one in: the next run restores it."""
    dest = tmp_path / "out"
    old = tmp_path / ".out.old-x"
    (old / "out").mkdir(parents=True)
    (old / "out" / "kept.txt").write_text("previous output")
    (old / atomic.MARKER).write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename, "started": 0}))
    said = []
    atomic.remove_stale_temps(dest, log=said.append)
    assert (dest / "kept.txt").read_text() == "previous output" and not old.exists()
    assert said[0].startswith(f"restored {dest}")


def test_a_failed_command_leaves_no_new_folder(pair, tmp_path):
    t, d = pair
    code, _, err = run_cli("quantize", "--model", str(t), "--format", "nvfp4", "--out", str(tmp_path / "a" / "b" / "q"),
                           "--calib", str(tmp_path / "missing.jsonl"))
    assert code == 1 and not (tmp_path / "a").exists(), err


# ------------------------------------------------------------------------------ 5. shard resolution
def test_a_shard_symlinked_outside_the_checkpoint_is_refused(pair, tmp_path):
    t, d = pair
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)
    code, _, err = gen(t, d)
    assert code == 1 and "outside the checkpoint folder" in one_error(err)
    (d / "model.safetensors").unlink()
    shutil.move(outside, d / "real.bin.safetensors.data")
    (d / "model.safetensors").symlink_to("real.bin.safetensors.data")   # inside: fine
    assert gen(t, d)[0] == 0


def test_a_hugging_face_cache_snapshot_reads_through_its_blob_symlinks(pair, tmp_path):
    t, _ = pair
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in t.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob-{f.name}"))
    with CheckpointReader(snap) as r:
        assert "model.embed_tokens.weight" in r


def test_a_tensor_in_two_shards_is_an_error_naming_both(pair):
    _, d = pair
    state = load_file(d / "model.safetensors")
    names = sorted(state)
    a, b = {k: state[k] for k in names[:5]}, {k: state[k] for k in names[5:]}
    b[names[0]] = state[names[0]].clone()           # also stored in the second shard
    (d / "model.safetensors").unlink()
    save_file(a, d / "model-00001-of-00002.safetensors")
    save_file(b, d / "model-00002-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in names[5:]}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    code, _, err = run_cli("check", "--target", str(d.parent / "t"), "--drafter", str(d))
    assert code == 1 and "model-00002-of-00002.safetensors" in err and "also in model-00001-of-00002.safetensors" in err
    assert names[0] in err


# ------------------------------------------------------------------------------------- 6. NaN / Inf
def _poison(folder: Path, name: str, index: int, value: float) -> None:
    state = load_file(folder / "model.safetensors")
    state[name].view(-1)[index] = value
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_nonfinite_weights_reported_by_check_refused_by_generate_and_build(pair, tmp_path):
    t, d = pair
    _poison(d, "fc.weight", 77, float("nan"))
    _poison(t, "model.norm.weight", 3, float("inf"))
    code, out, _ = run_cli("check", "--target", str(t), "--drafter", str(d), "--json")
    rep = json.loads(out)
    assert code == 1 and len(rep["nonfinite"]) == 2
    assert "tensor 'model.norm.weight' contains Inf (first at flat index 3)" in rep["nonfinite"][0]
    assert "tensor 'fc.weight' contains NaN (first at flat index 77)" in rep["nonfinite"][1]
    assert run_cli("check", "--target", str(t), "--drafter", str(d), "--no-scan")[0] == 0
    code, _, err = gen(t, d)
    assert code == 1 and one_error(err).startswith(rep["nonfinite"][0]) and "--allow-nonfinite" in err
    assert gen(t, d, "--allow-nonfinite")[0] == 0
    argv = ["build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--quant", "none",
            "--drafter-quant", "none"]
    code, _, err = run_cli(*argv, "--out", str(tmp_path / "b"))
    assert code == 1 and "contains Inf" in one_error(err) and "--allow-nonfinite" in err
    code, _, err = run_cli(*argv, "--out", str(tmp_path / "b"), "--allow-nonfinite")
    assert code == 0, err


def test_the_scan_streams_in_bounded_slices_and_reports_the_global_index(tmp_path):
    w = torch.zeros(3000, 1000)
    w.view(-1)[2_345_678] = float("-inf")
    save_file({"w": w, "ids": torch.arange(10)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        sizes = [(i, s.numel() * s.element_size()) for i, s in r.iter_slices("w", max_bytes=1 << 20)]
        assert max(n for _, n in sizes) <= 1 << 20 and sum(n for _, n in sizes) == w.numel() * 4
        assert [i for i, _ in sizes] == list(range(0, w.numel(), (1 << 20) // 4))
        import dflash_trt.io.checkpoint as ck

        assert ck._SCAN_SLICE <= 16 << 20
        assert nonfinite_tensors(r) == [f"{tmp_path / 'model.safetensors'}: tensor 'w' contains Inf "
                                        "(first at flat index 2345678)"]


@pytest.mark.parametrize("cmd", ["quantize", "convert", "build", "export-onnx", "bench"])
def test_every_reader_of_a_config_applies_checks_rules_first(pair, tmp_path, cmd):
    t, d = pair
    edit_config(t, _set("num_attention_heads", "abc"))
    argv = {"quantize": ["quantize", "--model", str(t), "--format", "fp8", "--out", str(tmp_path / "o")],
            "convert": ["convert", "--model", str(t), "--out", str(tmp_path / "o")],
            "build": ["build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--out", str(tmp_path / "o")],
            "export-onnx": ["export-onnx", "--target", str(t), "--drafter", str(d), "--out", str(tmp_path / "o.onnx")],
            "bench": ["bench", "--target", str(t), "--drafter", str(d), "--limit", "1"]}[cmd]
    before = paths_under(tmp_path)
    code, _, err = run_cli(*argv)
    assert code == 1 and one_error(err) == f"{t / 'config.json'}: num_attention_heads = 'abc': must be an integer"
    assert paths_under(tmp_path) == before


def test_stale_feature_cache_temps_are_removed(tmp_path, capsys):
    from dflash_trt.train.features import _remove_stale_temps as _remove_stale_feature_temps

    dead, live = tmp_path / f".k1.{2**22 + 12345}.tmp", tmp_path / f".k2.{os.getpid()}.tmp"
    for f in (dead, live):
        f.write_bytes(b"partial")
        os.utime(f, (0, 0))
    _remove_stale_feature_temps(tmp_path)
    assert not dead.exists() and live.exists() and "left behind by an interrupted run" in capsys.readouterr().err
