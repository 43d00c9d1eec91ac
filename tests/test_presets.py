"""Every preset: its pinned fields well-formed, its target config the bytes SOURCES.md records, its
drafter's figures consistent with its target and with the drafter's published checkpoint size, and
a plan on dgx-b300 that fits (the planner read through the presets the CLI uses)."""
from __future__ import annotations

import hashlib
import json
import re
from importlib import resources

import pytest

from dflash_trt.models.config import decoder_config
from dflash_trt.plan import cost, planner
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
    assert round(cost.weight_bytes(shape, "none") / 2**30, 2) == PUBLISHED_DRAFTER_GIB[name]


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


# Sizes the model publishers state (model cards: "1T total / 32B activated", GLM-5 "744B / 40B
# active", MiniMax-M2.5 "230B / 10B", Gemma 4 "25.2B / 3.8B active" and 30.7B, Qwen3.5 397B-A17B):
# the planner's counts from config.json alone, within 5% (vision towers and MTP heads not counted).
PUBLISHED_PARAMS_B = {
    "kimi-k2.5": (1000, 32), "glm-5.1": (744, 40), "minimax-m2.5": (230, 10), "minimax-m2.7": (230, 10),
    "gemma-4-26b-a4b": (25.2, 3.8), "gemma-4-31b": (30.7, 30.7), "qwen3.5-397b-a17b": (397, 17),
}


@pytest.mark.parametrize("name", PUBLISHED_PARAMS_B)
def test_family_targets_have_the_published_parameter_counts(name):
    shape = planner.target_shape(PRESETS[name].config(), name)
    total, active = PUBLISHED_PARAMS_B[name]
    assert abs(shape.total_params / (total * 1e9) - 1) < 0.05
    assert abs(shape.active_params / (active * 1e9) - 1) < 0.05


def test_gemma_4_kv_bytes_per_token_by_hand():
    """Gemma 4 31B: 50 sliding layers of 16 KV heads x 256 and 10 full-attention layers of 4 x 512
    (global_head_dim, num_global_key_value_heads), K and V, FP8: 1 byte each."""
    cfg = decoder_config(PRESETS["gemma-4-31b"].config())
    types = cfg["layer_types"]
    assert types.count("sliding_attention") == 50 and types.count("full_attention") == 10
    shape = planner.target_shape(PRESETS["gemma-4-31b"].config(), "gemma-4-31b")
    assert cost.kv_bytes_per_token(shape, "fp8") == 50 * 2 * 16 * 256 + 10 * 2 * 4 * 512
    # TP 8: ceil(16 / 8) = 2 and ceil(4 / 8) = 1 heads per GPU
    assert cost.kv_bytes_per_token(shape, "fp8", tp=8) == 50 * 2 * 2 * 256 + 10 * 2 * 1 * 512


# ----------------------------------------------------------------------- the embedded drafter's measured acceptance
def test_embedded_acceptance_is_measured_on_the_shipped_prompts_and_plan_speed_uses_it(tmp_path):
    """The smollm2-135m preset's acceptance is the file `dflash-trt bench` wrote beside the drafter's model card:
    measured on the shipped held-out prompts (their sha256), at the drafter's block. `plan --speed` without --tau
    takes tau and the per-position acceptance from it (names it as the source), and its schedule is what the
    histogram gives, computed here by hand (not the geometric shape through a tau)."""
    p = PRESETS["smollm2-135m"]
    assets = resources.files("dflash_trt")
    stored = json.loads(assets.joinpath(p.acceptance_file).read_text())
    prompts = assets.joinpath("data", "heldout_prompts.jsonl").read_bytes()
    assert stored["prompts"]["sha256"] == hashlib.sha256(prompts).hexdigest()
    drafter = json.loads(assets.joinpath("assets", "smollm2-135m-dflash", "config.json").read_text())
    B = stored["block_size"]
    assert B == drafter["block_size"] and "dflash-trt bench" in stored["command"]
    hist = {int(k): v for k, v in stored["acceptance_histogram"].items()}
    blocks = sum(hist.values())
    survival = [sum(v for n, v in hist.items() if n > k) / blocks for k in range(1, B)]
    assert survival == pytest.approx(stored["acceptance_per_position"], abs=1e-6)
    code, out, err = run_cli("plan", "--target", "smollm2-135m", "--hardware", "dgx-b300", "--speed", "--json")
    assert code == 0, err
    speed = json.loads(out)["speed"]
    assert p.acceptance_file in speed["tau_source"] and p.acceptance_file in speed["acceptance_source"]
    assert speed["tau"] == pytest.approx(1 + sum(survival)) == pytest.approx(stored["tau"], abs=0.01)
    sched = speed["layouts"][0]["draft_schedule"]
    lengths = [1 + sum(survival[:k]) for k in range(B)]
    assert sched["acceptance_lengths"] == pytest.approx(lengths[:sched["max_k"] + 1])
    # the schedule is what `build --draft-schedule FILE.json` reads
    f = tmp_path / "plan.json"
    f.write_text(out)
    from dflash_trt.plan.schedule_cost import schedule_file
    assert schedule_file(str(f), B, 1, 1).ranges == [tuple(r) for r in sched["ranges"]]
