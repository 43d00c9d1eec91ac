"""The typed manifest both ways (io/manifest.py Manifest): what build writes reads back to the same JSON,
nothing else parses manifest.json, and each stack writes the draft schedule fields the manifest records
for it (a schedule recorded as skipped for a stack is written into none of its files)."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from dflash_trt.io.manifest import DraftScheduleRecord, Manifest
from dflash_trt.paths import package_path

from helpers import run_cli

# K 7 everywhere: nothing to write for any stack (the config's own behaviour); and one that adapts
FLAT = {"max_k": 7, "ranges": [[1, 64, 7]]}
ADAPTIVE = {"max_k": 7, "ranges": [[1, 8, 7], [9, 32, 3], [33, 64, 0]]}
# and K by context too: none past 4095 tokens of context (plan/draft_schedule.choose_by_context writes these)
BY_CONTEXT = {**ADAPTIVE, "by_context": [[1, 8, 0, 4095, 7], [9, 32, 0, 4095, 3], [33, 64, 0, 4095, 0],
                                         [1, 64, 4096, 2147483647, 0]]}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory, tiny_pairs):
    root = tmp_path_factory.mktemp("typed")
    t, d = tiny_pairs["llama"]
    out = {}
    for name, sched in (("flat", FLAT), ("adaptive", ADAPTIVE), ("by_context", BY_CONTEXT)):
        (root / f"{name}.json").write_text(json.dumps(sched))
        code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--quant", "none",
                               "--draft-schedule", str(root / f"{name}.json"), "--out", str(root / name))
        assert code == 0, err
        out[name] = root / name
    return out


def test_the_manifest_reads_back_to_the_json_written(scheduled):
    """Manifest.read(...).to_dict() is manifest.json as written: every key, in its order."""
    for bundle in scheduled.values():
        text = (bundle / "manifest.json").read_text()
        m = Manifest.read(bundle)
        assert json.dumps(m.to_dict(), indent=2) + "\n" == text
        assert isinstance(m.draft_schedule, DraftScheduleRecord) and m.serving_profile.profile == "latency"
        assert m.reference_runtime.layout == "bundle"


def test_a_flat_schedule_recorded_skipped_is_written_nowhere(scheduled):
    m = json.loads((scheduled["flat"] / "manifest.json").read_text())
    rec = m["draft_schedule"]["stacks"]
    assert rec["vllm"]["skipped"].startswith("nothing to write: the schedule drafts K = 7 at every concurrency")
    assert rec["trtllm"]["skipped"].startswith("nothing to write")
    spec = json.loads((scheduled["flat"] / "configs/vllm.json").read_text())["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" not in spec
    assert "num_speculative_tokens_per_batch_size" not in json.loads(
        (scheduled["flat"] / "configs/vllm-speculative-config.json").read_text())
    serve = yaml.safe_load((scheduled["flat"] / "configs/trtllm-serve.yaml").read_text())["speculative_config"]
    assert "draft_len_schedule" not in serve and "max_concurrency" not in serve


def test_each_stack_writes_the_fields_recorded_for_it(scheduled):
    """vllm.json and trtllm-serve.yaml carry exactly the recorded fields (JSON keys as JSON writes them)."""
    bundle = scheduled["adaptive"]
    rec = json.loads((bundle / "manifest.json").read_text())["draft_schedule"]["stacks"]
    spec = json.loads((bundle / "configs/vllm.json").read_text())["speculative_config"]
    assert set(rec["vllm"]) == {"fields"}
    assert {k: spec[k] for k in rec["vllm"]["fields"]} == rec["vllm"]["fields"]
    assert json.loads((bundle / "configs/vllm-speculative-config.json").read_text()) == spec
    serve = yaml.safe_load((bundle / "configs/trtllm-serve.yaml").read_text())["speculative_config"]
    assert json.loads(json.dumps({k: serve[k] for k in rec["trtllm"]["fields"]})) == rec["trtllm"]["fields"]


def test_the_context_axis_goes_to_vllms_plugin_and_the_others_say_why_not(scheduled):
    """vLLM: the entries in configs/vllm.json's env (and its command) under the variable the plugin reads, next to
    vLLM's own batch-size field; TensorRT-LLM: its batch-size fields, and the manifest says it has no context axis."""
    from dflash_trt.stacks.vllm.launch import VLLM_BY_CONTEXT_ENV

    bundle = scheduled["by_context"]
    rec = json.loads((bundle / "manifest.json").read_text())["draft_schedule"]["stacks"]
    v = json.loads((bundle / "configs/vllm.json").read_text())
    assert rec["vllm"]["fields"][VLLM_BY_CONTEXT_ENV] == BY_CONTEXT["by_context"] and "context" not in rec["vllm"]
    assert json.loads(v["env"][VLLM_BY_CONTEXT_ENV]) == BY_CONTEXT["by_context"]
    assert f"{VLLM_BY_CONTEXT_ENV}='[[1,8,0,4095,7]," in v["command"]
    assert v["speculative_config"]["num_speculative_tokens_per_batch_size"] == ADAPTIVE["ranges"]
    assert f'BY_CONTEXT = "{VLLM_BY_CONTEXT_ENV}"' in package_path("assets", "vllm_plugin",
                                                                   "dflash_trt_vllm_cpu_fix.py").read_text()
    assert rec["trtllm"]["context"].startswith("TensorRT-LLM's draft-length control is keyed by batch size only")
    assert "draft_len_schedule" in rec["trtllm"]["fields"]


def test_only_io_manifest_parses_manifest_json():
    """A module reading manifest.json goes through Manifest.read (io/manifest.py)."""
    reads = re.compile(r"json\.loads?\(|read_json\(|read_text\(|open\(")
    root = package_path()
    offenders = []
    for p in sorted(root.rglob("*.py")):
        if p == root / "io" / "manifest.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if ("manifest.json" in line or "MANIFEST_NAME" in line) and reads.search(line):
                offenders.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    assert offenders == []


EARLY = {"schema_version": 1, "tool_version": "0.1.0",
         "target": {"name": "t", "path": "/m/t", "config": {"model_type": "llama"}, "hf_id": None,
                    "revision": None, "bundle_path": "target", "sha256": "0" * 64},
         "drafter": {"path": "/m/d", "revision": None, "block_size": 8, "mask_token_id": 3,
                     "target_layer_ids": {"zlab": [1], "speculators": [1], "vllm": [1], "sglang": [1]}},
         "arch": "hopper", "gpu": "h200", "quant": {"target": "fp8", "kv_cache": "fp8"},
         "parallel": {"tp": 1, "ep": 1, "pp": 1}, "backend": "pytorch",
         "stages": {"compile": {"status": "deferred", "inputs_sha256": "x", "outputs": [], "reason": "no GPU"}},
         "triton_model_repository": "triton", "triton_models": ["tensorrt_llm"],
         "artifacts": [{"path": "a", "bytes": 1, "sha256": "1" * 64}]}


def test_a_manifest_of_an_early_bundle_writes_back_what_was_read():
    """Keys an early bundle lacks (created, node, serving_profile, draft_schedule, the drafter's config ...) are
    not added when its manifest is written back (`dflash-trt compile` updates one), and it stays valid; it is
    written back as the current schema version."""
    from dflash_trt.io.manifest import SCHEMA_VERSION, validate

    back = Manifest.from_dict(EARLY).to_dict()
    validate(back)
    # what a reader fills in for an early bundle: the stack of its Triton model, a bf16 drafter, no GPU source
    added = {k: back[k] for k in back.keys() - EARLY.keys()}
    assert added == {"node": None, "sm": [], "serving_stacks": {"served": ["trtllm"], "skipped": {}},
                     "trt_drafter_engine": False, "engines": {}}
    same = [k for k in EARLY if k not in ("quant", "schema_version")]
    assert {k: back[k] for k in same} == {k: EARLY[k] for k in same}
    assert back["quant"] == {**EARLY["quant"], "drafter": "none"} and back["schema_version"] == SCHEMA_VERSION == 2


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(colour="blue"), "field colour: unknown field"),
    (lambda m: m["drafter"].update(block_sise=8), "field drafter.block_sise: unknown field"),
    (lambda m: m["stages"]["compile"].update(extra=1), "field stages.compile.extra: unknown field"),
    (lambda m: m["parallel"].update(tp="1"), "field parallel.tp"),
    (lambda m: m["drafter"].update(block_size=8.0), "field drafter.block_size"),
    (lambda m: m["artifacts"][0].update(bytes="1"), "field artifacts.0.bytes"),
    (lambda m: m["triton_models"].append(3), "field triton_models.1"),
    (lambda m: m.update(schema_version=3), "manifest schema version 3; this dflash-trt"),
    (lambda m: m.pop("schema_version"), "manifest schema version None"),
])
def test_an_unknown_or_wrong_typed_field_is_refused_by_name(tmp_path, edit, words):
    """Read strictly, like pydantic's extra="forbid": the field named in one line; a later schema version by its
    number."""
    from dflash_trt.errors import DFlashError

    m = json.loads(json.dumps(EARLY))
    edit(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError) as e:
        Manifest.read(tmp_path)
    assert words in str(e.value) and str(tmp_path / "manifest.json") in str(e.value) and "\n" not in str(e.value)
