"""The target's answers from vLLM (train/vllm_answers.py in the vLLM environment) against
transformers' generate, the oracle: greedy float32 answers to the same prompt ids are the same
tokens (measured: 32 of 32 identical, 64 new tokens, embedded SmolLM2-135M).

Runs where a vLLM environment exists ($DFLASH_TRT_VLLM_ENV, or .venv/vllm); else the vLLM case
skips, naming what is missing. vLLM never enters this environment: the script runs in its own."""
from __future__ import annotations

import json

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.stacks.vllm.env import vllm_env_ready
from dflash_trt.train.data import generate_responses
from dflash_trt.train.prompts import build_prompts


def test_asking_for_vllm_without_its_environment_is_one_clear_error(tmp_path, monkeypatch):
    from dflash_trt.models.tiny import make_tiny

    make_tiny("llama", tmp_path / "t")
    monkeypatch.setenv("DFLASH_TRT_VLLM_ENV", str(tmp_path / "no-such-env"))
    assert not vllm_env_ready()
    with pytest.raises(DFlashError, match="no vLLM environment .*DFLASH_TRT_VLLM_ENV"):
        generate_responses(tmp_path / "t", ["hi"], tmp_path / "a.jsonl", max_new_tokens=4, progress=False,
                           engine="vllm")
    assert not (tmp_path / "a.jsonl").exists()


@pytest.mark.skipif(not vllm_env_ready(), reason="no vLLM environment ($DFLASH_TRT_VLLM_ENV or .venv/vllm)")
def test_vllm_answers_equal_transformers_greedy_answers(tmp_path):
    from dflash_trt.presets.embedded import ensure_embedded_target

    target = ensure_embedded_target()
    prompts = [r["prompt"] for r in build_prompts("train", seed=7)][:4]
    rows = {}
    for engine in ("vllm", "hf"):
        out = tmp_path / f"{engine}.jsonl"
        generate_responses(target, prompts, out, max_new_tokens=24, batch_size=4, progress=False, threads=1,
                           dtype="float32", engine=engine)
        rows[engine] = {r["prompt"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows["vllm"]) == set(prompts)
    for p in prompts:
        assert rows["vllm"][p]["prompt_ids"] == rows["hf"][p]["prompt_ids"]
        assert rows["vllm"][p]["output_ids"] == rows["hf"][p]["output_ids"], p
