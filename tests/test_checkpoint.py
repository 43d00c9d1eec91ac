"""Streaming checkpoint I/O: agreement with the safetensors library both ways, and every bad
input of issue 4 ending in a one-line error that names the file or tensor, exit status 1 and
nothing written (the previous output intact)."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from safetensors import safe_open

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.checkpoint import CheckpointReader, check_finite, load_config
from dflash_trt.io.shards import ShardedWriter, TensorSpec

from helpers import run_cli

CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
       "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "tie_word_embeddings": False}


def tiny_state(cfg=CFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    def r(*s):
        return (torch.randn(*s, generator=g) * 0.05).bfloat16()
    sd = {"model.embed_tokens.weight": r(V, H), "lm_head.weight": r(V, H), "model.norm.weight": torch.ones(H).bfloat16()}
    p = "model.layers.0."
    sd.update({p + "input_layernorm.weight": torch.ones(H).bfloat16(), p + "post_attention_layernorm.weight": torch.ones(H).bfloat16(),
               p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(kv, H),
               p + "self_attn.v_proj.weight": r(kv, H), p + "self_attn.o_proj.weight": r(H, H),
               p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H), p + "mlp.down_proj.weight": r(H, I)})
    return sd


def write_model(folder: Path, sd=None, cfg=CFG, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = tiny_state(cfg) if sd is None else sd
    if shards == 1:
        st.save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        names = sorted(sd)
        wm = {}
        for i in range(shards):
            fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: sd[n] for n in names[i::shards]}
            st.save_file(part, folder / fn, metadata={"format": "pt"})
            wm.update({n: fn for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return folder


def raw_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw(path: Path, header: dict, body: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------------------ reading

def test_reader_matches_safetensors_library_all_dtypes(tmp_path):
    sd = {"bf16": torch.randn(3, 5).bfloat16(), "f16": torch.randn(7).half(), "f32": torch.randn(2, 2, 2),
          "f64": torch.randn(3).double(), "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
          "e5m2": torch.randn(5).to(torch.float8_e5m2), "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
          "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32), "b": torch.tensor([True, False, True]),
          "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    st.save_file(sd, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        assert sorted(r.keys()) == sorted(sd)
        for k, v in sd.items():
            assert r.meta(k) == (v.dtype, tuple(v.shape))
            assert bytes_equal(r.get(k), v), k
            assert r.file_of(k) == tmp_path / "model.safetensors"


def test_reader_sharded_index_and_rows(tmp_path):
    sd = tiny_state()
    write_model(tmp_path / "m", sd, shards=3)
    with CheckpointReader(tmp_path / "m") as r:
        assert sorted(r.keys()) == sorted(sd)
        assert len({r.file_of(k).name for k in r.keys()}) == 3
        for k in sd:
            assert bytes_equal(r.get(k), sd[k])
        ids = torch.tensor([3, 0, 63, 3])
        assert bytes_equal(r.get_rows("model.embed_tokens.weight", ids), sd["model.embed_tokens.weight"][ids])


def test_writer_output_read_by_safetensors_library(tmp_path):
    sd = {f"t{i}": torch.randn(100 + i, 8).bfloat16() for i in range(6)}
    sd["s"] = torch.tensor(1.5)
    sd["q"] = torch.randn(16, 8).to(torch.float8_e4m3fn)
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in sd.items()]
    with atomic_output_dir(tmp_path / "out") as tmp:
        w = ShardedWriter(tmp, specs, max_shard_bytes=4000)
        for k in reversed(list(sd)):  # any order: tensors go to planned offsets
            w.write(k, sd[k])
        files = w.close()
    out = tmp_path / "out"
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    for f in shards:
        assert f.stat().st_size <= 4000 + 1024  # cap on data, plus a small header
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in shards:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                got[k] = h.get_tensor(k)
                assert index["weight_map"][k] == f.name
    assert sorted(got) == sorted(sd)
    for k in sd:
        assert bytes_equal(got[k], sd[k])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_writer_refuses_unplanned_and_missing(tmp_path):
    w = ShardedWriter(tmp_path, [TensorSpec("a", torch.float32, (2,))])
    with pytest.raises(DFlashError, match="'b' was not planned"):
        w.write("b", torch.zeros(2))
    with pytest.raises(DFlashError, match="planned but never written"):
        w.close()


def test_atomic_dir_keeps_previous_output_on_failure(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("previous")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(dest) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 10)
            raise RuntimeError("interrupted")
    assert (dest / "old.txt").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_output_dir(dest) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_load_config_errors(tmp_path):
    with pytest.raises(DFlashError, match="config.json: missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="config.json: invalid JSON"):
        load_config(tmp_path)


def test_check_finite_names_tensor():
    t = torch.ones(4, 4)
    t[2, 1] = float("nan")
    with pytest.raises(DFlashError, match=r"f.safetensors: tensor 'w' contains NaN \(first at flat index 9\)"):
        check_finite("w", t, "f.safetensors")
    check_finite("ok", torch.ones(3).bfloat16())


def test_pickle_refused_unless_allowed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    torch.save(tiny_state(), tmp_path / "pytorch_model.bin")
    with pytest.raises(DFlashError, match="pytorch_model.bin: pickle checkpoint refused"):
        CheckpointReader(tmp_path)
    with CheckpointReader(tmp_path, allow_pickle=True) as r:
        assert bytes_equal(r.get("lm_head.weight"), tiny_state()["lm_head.weight"])


# ------------------------------------------------------------------ bad input through the CLI

def error_lines(err: str) -> list[str]:
    """The lines of stderr text that are not progress-bar output; there must be no traceback."""
    assert "Traceback" not in err
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]


def corrupt(kind: str, m: Path) -> str:
    """Damage the checkpoint at m; returns a regex the error line must match."""
    f = m / "model.safetensors"
    header, body = raw_header(f)
    q = "model.layers.0.self_attn.q_proj.weight"
    if kind == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
        return r"model.safetensors: tensor '.*' ends at data byte \d+ but the file holds only"
    if kind == "header_too_long":
        data = f.read_bytes()
        f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
        return r"model.safetensors: header of \d+ bytes needs a file of at least \d+ bytes"
    if kind == "overlap":
        k = "model.layers.0.self_attn.k_proj.weight"
        b, e = header[q]["data_offsets"]
        header[k]["data_offsets"] = [b + 2, b + 2 + header[k]["data_offsets"][1] - header[k]["data_offsets"][0]]
        write_raw(f, header, body)
        return r"model.safetensors: tensors '.*' and '.*' have overlapping data_offsets"
    if kind == "out_of_range":
        b, e = header[q]["data_offsets"]
        header[q]["data_offsets"] = [len(body) + 8, len(body) + 8 + (e - b)]
        write_raw(f, header, body)
        return rf"model.safetensors: tensor '{q}' ends at data byte \d+ but the file holds only"
    if kind == "bad_span":
        b, e = header[q]["data_offsets"]
        header[q]["data_offsets"] = [b, e - 2]
        write_raw(f, header, body)
        return rf"model.safetensors: tensor '{q}' data_offsets .* needs"
    if kind == "unknown_dtype":
        header[q]["dtype"] = "F7"
        write_raw(f, header, body)
        return rf"model.safetensors: tensor '{q}' has unknown dtype 'F7'"
    if kind == "nan":
        sd = st.load_file(f)
        sd[q][1, 2] = float("nan")
        st.save_file(sd, f)
        return rf"model.safetensors: tensor '{q}' contains NaN"
    if kind == "inf":
        sd = st.load_file(f)
        sd["model.norm.weight"][0] = float("inf")
        st.save_file(sd, f)
        return r"model.safetensors: tensor 'model.norm.weight' contains Inf"
    if kind == "shape":
        sd = st.load_file(f)
        sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:48].clone()
        st.save_file(sd, f)
        return r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has shape \[48, 32\] but .*config.json implies \[64, 32\]"
    raise AssertionError(kind)


BAD = ["truncated", "header_too_long", "overlap", "out_of_range", "bad_span", "unknown_dtype", "nan", "inf", "shape"]


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_bad_checkpoint_one_line_error_nothing_written(tmp_path, kind, command):
    m = write_model(tmp_path / "m")
    pattern = corrupt(kind, m)
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("keep me")
    args = ["quantize", "--model", str(m), "--format", "fp8", "--out", str(out)] if command == "quantize" else \
        ["convert", "--model", str(m), "--tp", "1", "--out", str(out)]
    code, _, stderr = run_cli(*args)
    assert code == 1
    err = error_lines(stderr)
    assert len(err) == 1 and err[0].startswith("error: "), err
    import re
    assert re.search(pattern, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]   # no temp folder left
    assert sorted(p.name for p in out.iterdir()) == ["previous.txt"]    # previous output intact


@pytest.mark.parametrize("kind", ["missing", "absolute", "dotdot", "not_in_shard"])
def test_bad_index_json(tmp_path, kind):
    m = write_model(tmp_path / "m", shards=2)
    idx = json.loads((m / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    idx["weight_map"][name] = {"missing": "model-00009-of-00009.safetensors", "absolute": "/etc/passwd",
                               "dotdot": "../m/model-00001-of-00002.safetensors",
                               "not_in_shard": "model-00001-of-00002.safetensors"
                               if idx["weight_map"][name].startswith("model-00002") else "model-00002-of-00002.safetensors"}[kind]
    (m / "model.safetensors.index.json").write_text(json.dumps(idx))
    code, _, stderr = run_cli("quantize", "--model", str(m), "--format", "nvfp4", "--out", str(tmp_path / "out"))
    assert code == 1
    err = error_lines(stderr)
    assert len(err) == 1 and "model.safetensors.index.json" in err[0], err
    assert {"missing": "does not exist", "absolute": "absolute path", "dotdot": "path with '..'",
            "not_in_shard": "which does not contain it"}[kind] in err[0]
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_pickle_checkpoint_refused_by_cli(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(CFG))
    torch.save(tiny_state(), m / "pytorch_model.bin")
    code, _, err = run_cli("quantize", "--model", str(m), "--format", "fp8", "--out", str(tmp_path / "out"))
    assert code == 1
    assert "pickle checkpoint refused" in err
    assert not (tmp_path / "out").exists()
    code, _, _ = run_cli("quantize", "--model", str(m), "--format", "fp8", "--allow-pickle", "--out", str(tmp_path / "out"))
    assert code == 0
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs: a real filesystem that runs out of space (needs root / CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({r.stderr.strip() or 'mount failed'}); "
                    "disk-full handling is then untested")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_disk_full_during_write(tmp_path, small_fs, command):
    cfg = dict(CFG, hidden_size=128, intermediate_size=512, vocab_size=256)
    m = write_model(tmp_path / "m", cfg=cfg)   # ~0.6 MB of bf16: does not fit in 256 KiB
    out = small_fs / "out"
    args = ["quantize", "--model", str(m), "--format", "fp8", "--out", str(out)] if command == "quantize" else \
        ["convert", "--model", str(m), "--tp", "2", "--out", str(out)]
    code, _, stderr = run_cli(*args)
    assert code == 1
    err = error_lines(stderr)
    assert len(err) == 1 and "disk full while writing" in err[0] and ".safetensors" in err[0], err
    assert list(small_fs.iterdir()) == []   # the temp folder was removed: nothing half-written
    assert shutil.disk_usage(small_fs).used < 64 * 1024


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantize_groups_spanning_shards(tmp_path, fmt):
    """Fused groups (q/k/v, gate/up) whose members sit in different shards: the streaming
    quantizer holds zero-copy views of several shards at once. Same bytes as from one shard."""
    from safetensors.torch import load_file

    from dflash_trt.quant.quantize import quantize_checkpoint

    sd = tiny_state(CFG)
    one = write_model(tmp_path / "one", sd=sd)
    three = write_model(tmp_path / "three", sd=sd, shards=3)   # round-robin: q, k, v split
    wm = json.loads((three / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({wm[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"}) > 1
    quantize_checkpoint(one, tmp_path / "q1", fmt, progress=False)
    quantize_checkpoint(three, tmp_path / "q3", fmt, progress=False)
    a, b = load_file(tmp_path / "q1" / "model.safetensors"), load_file(tmp_path / "q3" / "model.safetensors")
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)), n
