"""Fuzz test of the CLI (issue 16): seeded random truncations and byte flips of safetensors headers
and JSON configs, hostile values in config fields, and CLI integers at the edges of their ranges.

Every case asserts: no traceback; where the input is invalid, exit != 0 with a last stderr line
starting with `error:`; no new paths. Invalidity is decided by an independent oracle where one
exists: the safetensors library's own reader for checkpoint files, json.loads for configs; a
mutation those accept may run (exit 0) but must still fail cleanly if it fails. Configs that
`check` refuses must be refused by `generate` with check's first message.

Runs in `make test` (about a minute on 2 cores); `-m "not fuzz"` leaves it out. DFLASH_FUZZ_SEED
and DFLASH_FUZZ_SCALE (a multiplier of the case counts) replay or widen a run.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli

pytestmark = pytest.mark.fuzz

SEED = int(os.environ.get("DFLASH_FUZZ_SEED", "16"))
SCALE = float(os.environ.get("DFLASH_FUZZ_SCALE", "1"))
HOSTILE = [None, "", "12", "x" * 300, -1, 0, 1, 3, 2**31, 2**63, 10**18, -(2**63), 1.5, -0.0, float("nan"),
           float("inf"), True, False, [], [1, "a"], [0, 0], [3, 1], {}, {"a": 1}, "\u0000", "\udcff"[:0] + "é"]


def n(k: int) -> int:
    return max(1, int(k * SCALE))


@pytest.fixture(scope="module")
def world(tiny_pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    t, d = tiny_pairs["llama"]
    shutil.copytree(t, root / "t")
    shutil.copytree(d, root / "d")
    (root / "data.jsonl").write_text('{"prompt_ids": [1, 2], "output_ids": [3, 4, 5]}\n')
    return root


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


class Case:
    """One fuzz case: mutate a file, run commands, restore the file, compare the tree."""

    def __init__(self, root: Path, path: Path, data: bytes, what: str):
        self.root, self.path, self.what = root, path, what
        self.original = path.read_bytes()
        self.before = tree(root)
        path.write_bytes(data)

    def run(self, *argv: str, must_fail: bool) -> tuple[int, str]:
        code, _, err = run_cli(*argv)
        where = f"{self.what}: dflash-trt {' '.join(argv)}\n{err[-2000:]}"
        assert "Traceback" not in err, where
        if must_fail:
            assert code != 0, where
        if code != 0:
            lines = err.strip().splitlines()
            assert lines and lines[-1].startswith("error: "), where
        return code, err

    def done(self) -> None:
        self.path.write_bytes(self.original)
        assert tree(self.root) == self.before, f"{self.what}: new paths {tree(self.root) - self.before}"


def st_valid(path: Path, original: dict) -> bool:
    """The safetensors library's verdict (the oracle): readable, and the same tensors as before?"""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            got = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
            for k in got:
                f.get_tensor(k)
    except Exception:  # noqa: BLE001  (the oracle's reasons do not matter, only its verdict)
        return False
    return got == original


def st_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118


def check_argv(root):
    return ("check", "--target", str(root / "t"), "--drafter", str(root / "d"), "--no-scan")


def gen_argv(root):
    return ("generate", "--target", str(root / "t"), "--drafter", str(root / "d"), "-p", "hi", "--max-new-tokens", "2")


def mutate_safetensors(rng: random.Random, blob: bytes) -> tuple[bytes, str]:
    (hlen,) = struct.unpack("<Q", blob[:8])
    kind = rng.choice(["truncate", "truncate-header", "flip", "flip", "length"])
    if kind == "truncate":
        cut = rng.randrange(len(blob))
        return blob[:cut], f"truncated to {cut} bytes"
    if kind == "truncate-header":
        cut = rng.randrange(8 + hlen)
        return blob[:cut], f"truncated to {cut} bytes (inside the header)"
    if kind == "flip":
        out = bytearray(blob)
        spots = [rng.randrange(8, 8 + hlen) for _ in range(rng.choice([1, 1, 2, 4]))]
        for i in spots:
            out[i] = rng.randrange(256)
        return bytes(out), f"header bytes {spots} replaced"
    v = rng.choice([0, 1, 2, hlen - 1, hlen + 1, len(blob), len(blob) - 7, 2**63, 2**64 - 1, rng.randrange(2**64)])
    return struct.pack("<Q", v) + blob[8:], f"header length set to {v}"


def test_fuzz_safetensors_headers(world):
    rng = random.Random(SEED)
    for i in range(n(1200)):
        which = rng.choice(["t", "d"])
        path = world / which / "model.safetensors"
        original = st_meta(path)
        data, what = mutate_safetensors(rng, path.read_bytes())
        case = Case(world, path, data, f"case {i} ({which}): {what}")
        try:
            valid = st_valid(path, original)
            code, _ = case.run(*check_argv(world), must_fail=not valid)
            if rng.random() < 0.25 or (valid and code == 0):
                case.run(*gen_argv(world), must_fail=not valid)
        finally:
            case.done()


def mutate_json(rng: random.Random, text: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["truncate", "flip", "flip", "value", "value", "value"])
    if kind == "truncate":
        cut = rng.randrange(len(text.rstrip()))
        return text[:cut], f"truncated to {cut} bytes"
    if kind == "flip":
        out = bytearray(text)
        spots = [rng.randrange(len(text)) for _ in range(rng.choice([1, 2, 3]))]
        for i in spots:
            out[i] = rng.randrange(256)
        return bytes(out), f"bytes {spots} replaced"
    cfg = json.loads(text)
    keys = [(k,) for k in cfg] + [("dflash_config", k) for k in (cfg.get("dflash_config") or {})]
    key = rng.choice(keys)
    value = rng.choice(HOSTILE)
    node = cfg
    for k in key[:-1]:
        node = node[k]
    if rng.random() < 0.15:
        del node[key[-1]]
        what = f"{'.'.join(key)} removed"
    else:
        node[key[-1]] = value
        what = f"{'.'.join(key)} = {value!r}"
    return json.dumps(cfg).encode(), what


def json_valid(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
        return False


def test_fuzz_json_configs(world):
    rng = random.Random(SEED + 1)
    for i in range(n(1000)):
        which = rng.choice(["t/config.json", "d/config.json", "t/config.json", "d/config.json",
                            "t/generation_config.json"])
        path = world / which
        data, what = mutate_json(rng, path.read_bytes())
        case = Case(world, path, data, f"case {i} ({which}): {what}")
        try:
            valid = json_valid(data)
            code, err = case.run(*check_argv(world), must_fail=not valid)
            if code != 0 or rng.random() < 0.3:
                gcode, gerr = case.run(*gen_argv(world), must_fail=code != 0)
                if code != 0:   # generate refuses what check refuses, with check's first message
                    first = err.strip().splitlines()[0].removeprefix("problem: ").removeprefix("error: ")
                    got = gerr.strip().splitlines()[-1].removeprefix("error: ").split(" (and ")[0]
                    assert got == first, (what, first, got)
            if which.endswith("/config.json") and rng.random() < 0.1:   # the other readers of a config
                folder = str(path.parent)
                case.run("quantize", "--model", folder, "--format", "fp8", "--out", str(world / "q"),
                         must_fail=not valid)
                shutil.rmtree(world / "q", ignore_errors=True)   # (a success writes it)
        finally:
            case.done()


def edge_ints(rng: random.Random, lo: int | None, hi: int | None) -> str:
    """A value outside [lo, hi] (None: unbounded on that side), or not an integer at all."""
    picks = []
    if lo is not None:
        picks += [lo - 1, lo - 1 - rng.randrange(10**6), -(2**63) - 1, -(2**31)]
    if hi is not None:
        picks += [hi + 1, hi + 1 + rng.randrange(10**6), 2**63, 2**64, 10**30]
    picks = [p for p in picks if (lo is None or p < lo) or (hi is None or p > hi)]
    return str(rng.choice(picks)) if rng.random() < 0.85 else rng.choice(["1e3", "0x10", "", " ", "nan", "1.5", "--"])


def cli_options(root: Path) -> list[tuple[list[str], str, int | None, int | None]]:
    """(argv, option, lo, hi): values outside [lo, hi] must be refused."""
    t, d, out = str(root / "t"), str(root / "d"), str(root / "out")
    gen = ["generate", "--target", t, "--drafter", d, "-p", "hi", "--max-new-tokens", "2"]
    bench = ["bench", "--target", t, "--drafter", d, "--limit", "1", "--max-new-tokens", "2"]
    train = ["train-drafter", "--target", t, "--data", str(root / "data.jsonl"), "--out", out, "--steps", "1"]
    build = ["build", "--target", t, "--drafter", d, "--arch", "hopper", "--out", out]
    return [
        (gen, "--max-new-tokens", 1, 2048), (gen, "--block-size", 2, 64), (gen, "--top-k", 0, None),
        (gen, "--seed", 0, 2**63 - 1),
        (bench, "--max-new-tokens", 1, 2048), (bench, "--block-size", 2, 64), (bench, "--limit", 1, None),
        (bench, "--threads", 1, 1024),
        (["quantize", "--model", d, "--format", "fp8", "--out", out], "--calib-samples", 1, None),
        (["convert", "--model", t, "--out", out], "--tp", 1, 4), (["convert", "--model", t, "--out", out], "--pp", 1, 1),
        (["convert", "--model", t, "--out", out], "--ep", 1, 1),
        (train, "--layers", 1, 16), (train, "--block-size", 2, 64), (train, "--blocks-per-step", 1, 4096),
        (train, "--mask-token-id", 0, 511), (train, "--threads", 1, 1024), (train, "--intermediate-size", 16, 1 << 20),
        (train, "--save-every", 1, None), (train, "--max-new-tokens", 2, 2047), (train, "--seed", 0, 2**63 - 1),
        (build, "--tp", 1, 4), (build, "--ep", 1, 1), (build, "--pp", 1, 4), (build, "--block-size", 2, 8),
        (["export-onnx", "--drafter", d, "--target", t, "--out", out + ".onnx"], "--page-size", 1, 4096),
        (["make-tiny", "--arch", "llama", "--out", out], "--block-size", 2, 64),
        (["make-tiny", "--arch", "llama", "--out", out], "--seed", 0, 2**63 - 1),
    ]


def test_fuzz_cli_integers_at_the_edges(world):
    rng = random.Random(SEED + 2)
    options = cli_options(world)
    before = tree(world)
    for i in range(n(2000)):
        argv, opt, lo, hi = options[i % len(options)] if i < len(options) else rng.choice(options)
        value = edge_ints(rng, lo, hi)
        code, _, err = run_cli(*argv, f"{opt}={value}")
        where = f"case {i}: {' '.join(argv)} {opt}={value!r}\n{err[-2000:]}"
        assert "Traceback" not in err and code != 0, where
        assert err.strip().splitlines()[-1].startswith("error: "), where
        assert tree(world) == before, f"{where}\nnew paths {tree(world) - before}"


def test_real_exit_codes_in_subprocesses(world):
    """A few of the same cases through the installed entry point: the process's own exit status."""
    before = tree(world)
    bad_cfg = world / "d" / "config.json"
    original = bad_cfg.read_bytes()
    try:
        bad_cfg.write_bytes(original[: len(original) // 2])
        for argv, want in ((check_argv(world), 1), (gen_argv(world), 1),
                           (("generate", "--target", str(world / "t"), "-p", "x", "--mode", "ar", "--seed", "-1"), 2),
                           (("quantize", "--model", str(world / "t"), "--format", "fp8", "--max-shard-size", "0",
                             "--out", str(world / "q")), 1)):
            r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], capture_output=True, text=True,
                               check=False)
            assert r.returncode == want and "Traceback" not in r.stderr, (argv, r.stderr)
            assert r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr
    finally:
        bad_cfg.write_bytes(original)
    assert tree(world) == before
