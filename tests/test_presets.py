"""Every preset: its pinned fields well-formed, its target config the bytes SOURCES.md records, its
drafter's figures consistent with its target and with the drafter's published checkpoint size, and
a plan on dgx-b300 that fits (the planner read through the presets the CLI uses)."""
from __future__ import annotations

import hashlib
import json
import re
from importlib import resources

import pytest

from dflash_trt.deploy import planner
from dflash_trt.models.config import decoder_config
from dflash_trt.presets.catalog import PRESETS

from helpers import run_cli

HEX40 = re.compile(r"[0-9a-f]{40}")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CONFIGS = resources.files("dflash_trt.presets.configs")

# BF16 checkpoint size of each z-lab drafter as the hub lists it (GiB; the spec table of
# search-index id 58668257119, presets/configs/SOURCES.md): an independent check of the figures.
PUBLISHED_DRAFTER_GIB = {
    "gpt-oss-120b": 1.46, "gpt-oss-20b": 1.46, "qwen3-8b": 1.95, "llama-3.1-8b": 1.95, "qwen3.5-27b": 3.96,
    "qwen3.5-35b-a3b": 0.72, "qwen3.5-122b-a10b": 1.44, "qwen3.6-27b": 3.22, "qwen3.6-35b-a3b": 0.72,
    "gemma-4-31b": 2.86, "gemma-4-26b-a4b": 0.80, "kimi-k2.5": 6.48,
}


def _block(d: dict) -> int:
    return d.get("block_size") or d["dflash_config"]["block_size"]


@pytest.mark.parametrize("name", PRESETS)
def test_pinned_fields_are_well_formed(name):
    p = PRESETS[name]
    assert HUB_ID.fullmatch(p.hf_id)
    assert p.drafter_hf_id is None or HUB_ID.fullmatch(p.drafter_hf_id)
    for rev in (p.revision, p.drafter_revision):
        assert rev is None or HEX40.fullmatch(rev), rev
    d = p.drafter_plan_config()
    if d is None:
        return
    assert p.block_size == _block(d)
    t = decoder_config(p.config())
    assert d["hidden_size"] == t["hidden_size"] and d["vocab_size"] == t["vocab_size"]
    ids = d["dflash_config"]["target_layer_ids"]
    assert d["num_target_layers"] == t["num_hidden_layers"]
    assert ids == sorted(set(ids)) and ids[-1] < t["num_hidden_layers"]
    assert len(d["layer_types"]) == d["num_hidden_layers"]


def _sources_rows() -> dict[str, tuple[int, str]]:
    rows = {}
    for line in CONFIGS.joinpath("SOURCES.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].endswith(".json") and re.fullmatch(r"[0-9a-f]{64}", cells[-1]):
            rows[cells[0]] = (int(cells[-2]), cells[-1])
    return rows


def test_config_files_are_the_bytes_sources_md_records():
    rows = _sources_rows()
    for p in PRESETS.values():
        for f in filter(None, (p.config_file, p.drafter_config_file)):
            if f == "smollm2-135m.json":      # written by us (SOURCES.md says so), not a copy
                continue
            data = CONFIGS.joinpath(f).read_bytes()
            assert rows[f] == (len(data), hashlib.sha256(data).hexdigest()), f
            assert json.loads(data)["model_type"]


@pytest.mark.parametrize("name", PUBLISHED_DRAFTER_GIB)
def test_drafter_figures_give_the_published_checkpoint_size(name):
    shape = planner.drafter_shape(PRESETS[name].drafter_plan_config(), name)
    assert round(planner.weight_bytes(shape, "none") / 2**30, 2) == PUBLISHED_DRAFTER_GIB[name]


def test_every_drafter_with_figures_has_a_published_size():
    assert {n for n, p in PRESETS.items() if p.drafter_plan_config()} == set(PUBLISHED_DRAFTER_GIB)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_plans_on_dgx_b300(name):
    tname, cfg, dcfg = planner.target_configs(name)
    p = planner.plan(cfg, dcfg, "dgx-b300", target_name=tname, drafter_name=f"{tname} drafter" if dcfg else None)
    assert p.chosen is not None and p.chosen.fits, [lay.reason for lay in p.layouts]
    assert (p.drafter is not None) == (dcfg is not None)
    if dcfg:
        assert p.block_size == PRESETS[name].block_size and p.drafter_params > 0
        assert p.chosen.drafter_bytes_per_gpu > 0


def test_plan_cli_llama_preset():
    """The preset whose drafter figures carry no mask token (it was a -1 placeholder the drafter
    validation refused): planned with its drafter."""
    code, out, err = run_cli("plan", "--target", "llama-3.1-8b", "--hardware", "dgx-b300", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["drafter"] and d["block_size"] == 10 and d["chosen"]["tp"] >= 1
