"""The bundle carries its plan (plan.json, plan/record.py): build writes it and the manifest hashes it; deploy,
`plan --bundle` and Dynamo rendering read it and run no layout search (counted by cProfile over a real run);
a missing or too old record, or a case it does not hold, is one line naming `plan --bundle --refresh`, which
re-plans into a revision that verifies."""
from __future__ import annotations

import cProfile
import json
import pstats
import shutil
from pathlib import Path

import pytest

from dflash_trt.io.manifest import Manifest, verify
from dflash_trt.models.config import load_drafter_config
from dflash_trt.plan import planner
from dflash_trt.plan.record import BUILD_NODE_COUNTS, PLAN_FILE, PLAN_RECORD_VERSION, plan_bundle, read_plan

from helpers import run_cli

SEARCH = ("plan", "_evaluate", "_candidate_layouts")   # the planner's layout search


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """gpt-oss-120b for a DGX B300, built from its config.json alone (build --configs-only)."""
    out = tmp_path_factory.mktemp("rec") / "gptoss"
    code, _, err = run_cli("build", "--target", "gpt-oss-120b", "--gpu", "b300", "--configs-only", "--out", str(out))
    assert code == 0, err
    return out


def search_calls(*argv: str) -> tuple[int, dict[str, int]]:
    """(exit code, calls of each planner layout-search function) of `dflash-trt ARGV` run in-process."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        code = run_cli(*argv)[0]
    finally:
        prof.disable()
    counts = dict.fromkeys(SEARCH, 0)
    for (path, _, name), (_, calls, *_) in pstats.Stats(prof).stats.items():
        if name in counts and "dflash_trt/plan/" in path:
            counts[name] += calls
    return code, counts


def test_build_writes_the_plan_and_the_manifest_hashes_it(bundle, tmp_path):
    m = json.loads((bundle / "manifest.json").read_text())
    assert PLAN_FILE in {a["path"] for a in m["artifacts"]} and verify(bundle) == []
    rec = read_plan(bundle)
    assert rec.version == PLAN_RECORD_VERSION and rec.quant == {"target": "mxfp4", "kv_cache": "fp8", "drafter": "none"}
    assert [c.nodes for c in rec.cases] == [1, 2, 4, 8] and {c.hardware for c in rec.cases} == {"dgx-b300"}
    # the schedule's figures: break-even = the DFlash step over the AR step of its K (monitoring's figure)
    row = rec.schedule["by_concurrency"][0]
    assert row["dflash_step_s"] == pytest.approx(row["break_even_acceptance_length"] * row["ar_step_s"])
    code, out, _ = run_cli("plan", "--bundle", str(bundle), "--json")
    assert code == 0 and json.loads(out)["chosen"] == rec.cases[0].plan["chosen"]
    tampered = tmp_path / "t"
    shutil.copytree(bundle, tampered)
    d = json.loads((tampered / PLAN_FILE).read_text())
    d["cases"][0]["plan"]["layouts"][0]["replicas"] = 7
    (tampered / PLAN_FILE).write_text(json.dumps(d))
    assert any(p.startswith(f"{PLAN_FILE}: ") for p in verify(tampered))
    code, _, err = run_cli("deploy", "--bundle", str(tampered), "--out", str(tmp_path / "dep"))
    assert code == 1 and f"{PLAN_FILE}: " in err and "does not match its manifest.json" in err


def test_build_plans_once_and_records_what_its_written_configs_imply(tmp_path):
    """build searches once per recorded case (the draft schedule is priced on the one-node case, no search of its
    own), before its stacks write their configs; the record equals the bundle planned again from those files."""
    out = tmp_path / "b"
    code, counts = search_calls("build", "--target", "gpt-oss-120b", "--gpu", "b300", "--configs-only",
                                "--out", str(out))
    assert code == 0 and counts == dict.fromkeys(SEARCH, len(BUILD_NODE_COUNTS)), counts
    rec = json.loads((out / PLAN_FILE).read_text())
    from_files = plan_bundle(out, Manifest.read(out))     # served_settings read from configs/ and the Triton repo
    assert from_files.serving["max_attention_window"] and from_files.serving["kv_fraction"]
    assert json.loads(json.dumps(from_files.to_dict())) == rec
    assert json.loads((out / "manifest.json").read_text())["draft_schedule"]["schedule"]["levels"]


@pytest.mark.parametrize("argv", [("deploy", "--out", "{tmp}/d", "--json"), ("plan", "--json"),
                                  ("deploy", "--nodes", "2", "--out", "{tmp}/d2", "--json"),
                                  ("deploy", "--server", "dynamo", "--out", "{tmp}/g", "--json")])
def test_readers_run_no_layout_search(bundle, tmp_path, argv):
    args = [a.format(tmp=tmp_path) for a in argv]
    code, counts = search_calls(args[0], "--bundle", str(bundle), *args[1:])
    assert code == 0 and counts == dict.fromkeys(SEARCH, 0), counts


def test_a_case_the_record_lacks_is_one_line_and_refresh_plans_it(bundle, tmp_path):
    code, out, err = run_cli("deploy", "--bundle", str(bundle), "--nodes", "3", "--out", str(tmp_path / "d"))
    assert code == 1 and out == "" and err.count("\n") == 1 and not (tmp_path / "d").exists()
    assert f"plan --bundle {bundle} --refresh --hardware dgx-b300 --nodes 3" in err
    new = tmp_path / "r2"
    code, counts = search_calls("plan", "--bundle", str(bundle), "--refresh", "--nodes", "3", "--out", str(new))
    assert code == 0 and counts["_evaluate"] >= 5      # the refresh is the search: the build's 4 cases and this one
    assert verify(new) == []
    rev = json.loads((new / "manifest.json").read_text())["revision"]
    assert rev["kind"] == "plan" and rev["changed"] == [PLAN_FILE] and rev["parent"]["path"] == str(bundle.resolve())
    code, counts = search_calls("deploy", "--bundle", str(new), "--nodes", "3", "--out", str(tmp_path / "d3"))
    assert code == 0 and counts == dict.fromkeys(SEARCH, 0)
    direct = planner.plan(*_configs(bundle), "dgx-b300", target_name="gpt-oss-120b", quant="mxfp4", nodes=3, tp=1,
                          ep=1, max_seq_len=32768, max_batch_size=64, batch_pinned=True,
                          **_kv(new)).chosen
    v = json.loads(run_cli("deploy", "--bundle", str(new), "--nodes", "3", "--json",
                           "--out", str(tmp_path / "d4"))[1])["values_content"]
    assert (v["parallel"]["tp"], v["replicas"]) == (direct.tp, direct.replicas) == (1, 24)


def _configs(bundle: Path) -> tuple[dict, dict]:
    m = json.loads((bundle / "manifest.json").read_text())
    return m["target"]["config"], m["drafter"]["config"]


def _kv(bundle: Path) -> dict:
    s = read_plan(bundle).serving
    return {k: s[k] for k in ("kv_fraction", "max_num_tokens", "max_attention_window") if k in s}


@pytest.mark.parametrize("version", [None, PLAN_RECORD_VERSION - 1])
def test_a_missing_or_old_record_is_one_line(bundle, tmp_path, version):
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    if version is None:
        (b / PLAN_FILE).unlink()
        m["artifacts"] = [a for a in m["artifacts"] if a["path"] != PLAN_FILE]
        state = "missing"
    else:
        (b / PLAN_FILE).write_text(json.dumps({**json.loads((b / PLAN_FILE).read_text()), "version": version}))
        from dflash_trt.io.manifest import sha256_file
        for a in m["artifacts"]:
            if a["path"] == PLAN_FILE:
                a.update(bytes=(b / PLAN_FILE).stat().st_size, sha256=sha256_file(b / PLAN_FILE))
        state = f"version {version}, this dflash-trt reads {PLAN_RECORD_VERSION}"
    (b / "manifest.json").write_text(json.dumps(m))
    for argv in (("deploy", "--bundle", str(b), "--out", str(tmp_path / "d")), ("plan", "--bundle", str(b))):
        code, out, err = run_cli(*argv)
        assert (code, out, err.count("\n")) == (1, "", 1), err
        assert (f"{b}/{PLAN_FILE}: {state}: rebuild the bundle, or `dflash-trt plan --bundle {b} --refresh --out NEW`"
                in err)
    assert not (tmp_path / "d").exists()


def test_tunes_cost_model_reads_the_record_and_matches_a_fresh_search(bundle):
    """`tune` prices a step with the layout plan.json records; the same figures as the layout search build ran."""
    from dflash_trt.deploy.values import plan_for_bundle
    from dflash_trt.plan import tune

    m = Manifest.read(bundle)
    prof = cProfile.Profile()
    prof.enable()
    recorded = tune.bundle_step_cost(m, load_drafter_config(bundle / "drafter").raw, plan_for_bundle(bundle))
    prof.disable()
    assert not [k for k in pstats.Stats(prof).stats if k[2] in SEARCH and "dflash_trt/plan/" in k[0]]
    searched = tune.bundle_step_cost(m, load_drafter_config(bundle / "drafter").raw, None)
    assert recorded.concurrencies == searched.concurrencies and recorded.source == searched.source
    for c in (1, 8, 64):
        for k in (0, 3, 9):
            assert recorded.step_seconds(c, k) == pytest.approx(searched.step_seconds(c, k), rel=1e-12)
