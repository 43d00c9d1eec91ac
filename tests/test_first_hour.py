"""The smaller points of issue 41's first hour: --json errors, the presets listing, help text line
breaks, the build summary, a rebuild for another GPU, the safetensors header-length message."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import click
import pytest

from dflash_trt.cli import COMMANDS, cli
from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import read_safetensors_header
from dflash_trt.presets.catalog import PRESETS

from helpers import run_cli


def test_json_errors_are_json_on_stdout_and_one_line_on_stderr(tmp_path):
    for argv, code in ((["deploy", "--bundle", str(tmp_path / "none"), "--json"], 2),        # click's own check
                       (["plan", "--target", "no-such-model", "--hardware", "dgx-b300", "--json"], 1),  # ours
                       (["verify", "--bundle", str(tmp_path), "--json"], 1)):                # not a bundle
        r = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *argv], capture_output=True, text=True,
                           timeout=300, check=False)
        assert r.returncode == code, r.stderr
        doc = json.loads(r.stdout)
        assert doc["exit_code"] == code and doc["error"]
        assert r.stderr.strip().splitlines()[-1] == f"error: {doc['error']}"
    # without --json: nothing on stdout
    code, out, err = run_cli("plan", "--target", "no-such-model", "--hardware", "dgx-b300")
    assert code == 1 and out == "" and err.startswith("error: ")


def test_presets_lists_every_preset_with_its_pinned_revisions():
    code, out, _ = run_cli("presets", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == list(PRESETS)
    g = next(r for r in rows if r["name"] == "gpt-oss-120b")
    assert g["drafter"] == "z-lab/gpt-oss-120b-DFlash"
    assert g["drafter_revision"] == PRESETS["gpt-oss-120b"].drafter_revision
    code, out, _ = run_cli("presets")
    assert code == 0 and all(name in out for name in PRESETS)
    code, out, _ = run_cli("build", "--help")
    assert "dflash-trt presets" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_examples_keep_their_line_breaks(name):
    """A docstring line ending in a single backslash joins the next line (Python's line continuation
    inside a string): the example then prints as one line with a run of spaces."""
    cmd = cli.get_command(click.Context(cli), name)
    cmds = list(cmd.commands.values()) if isinstance(cmd, click.Group) else [cmd]
    for c in cmds:
        for line in (c.help or "").splitlines():
            # a joined example: an option after a run of spaces ("... Qwen3-8B           --calib ...")
            assert not re.search(r"\S {3,}-", line), (name, line)


def test_summary_says_the_schedules_source_once_and_lists_every_triton_model(tmp_path):
    """The embedded drafter's measured acceptance (its preset's acceptance.json) plans the schedule: said once."""
    code, out, err = run_cli("build", "--arch", "blackwell", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert "  draft schedule: 1-" in out and out.count("smollm2-135m-dflash/acceptance.json") == 1, out
    line = next(x for x in out.splitlines() if x.strip().startswith("configs/"))
    models = sorted(p.name for p in (tmp_path / "b" / "triton").iterdir() if p.is_dir())
    assert "vllm" in models and line.endswith("triton/ " + ", ".join(models))
    # the same --out rebuilt for another architecture: refused, not silently Hopper FP8
    code, _, err = run_cli("build", "--arch", "hopper", "--out", str(tmp_path / "b"))
    assert code == 1 and "holds a bundle for blackwell (b300, nvfp4), this build is for hopper (h200, fp8)" in err
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["arch"] == "blackwell"
    code, _, err = run_cli("build", "--arch", "hopper", "--out", str(tmp_path / "b"), "--force")
    assert code == 0, err
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["quant"]["target"] == "fp8"


def test_header_length_message_counts_the_length_field(tmp_path):
    """The bug: "header length 16 is larger than the file (23 bytes)", though 16 < 23: the file must
    hold 8 bytes of length plus the 16-byte header, 24 bytes."""
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 16) + b"{}" + b" " * 13)   # 23 bytes
    with pytest.raises(DFlashError) as e:
        read_safetensors_header(f)
    assert str(e.value).endswith("header of 16 bytes needs a file of at least 24 bytes (8-byte length + header), "
                                 "but the file has 23")
