"""train-drafter on a tiny Llama target: the recipe lowers the loss, writes a z-lab checkpoint
that our loader and runtime accept, and --resume continues exactly where the run stopped."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from dflash_trt.train.data import generate_responses, load_sequences
from dflash_trt.train.features import label_sequences
from dflash_trt.train.initial import TrainConfig, init_from_target, read_target_tensors
from dflash_trt.train.objective import FrozenTarget, make_batch, sample_picks
from dflash_trt.train.trainer import train_drafter

from helpers import block_loss, run_cli, tiny_target_with_answers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target and a small data set of its own greedy answers."""
    return tiny_target_with_answers(tmp_path_factory.mktemp("train"))


def _run(tiny, out, **kw):
    tc = TrainConfig(layers=1, block_size=8, steps=kw.pop("steps", 8), lr=3e-3, warmup=2, blocks_per_step=12,
                     save_every=kw.pop("save_every", 4), eval_every=100)
    return train_drafter(tiny / "target", tiny / "data.jsonl", out, tc, progress=False, threads=1, **kw)


def test_generate_responses_resumes(tiny):
    rows = [json.loads(line) for line in (tiny / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["output_ids"] and r["prompt_ids"] for r in rows)
    # a second call finds every prompt done and appends nothing
    generate_responses(tiny / "target", [r["prompt"] for r in rows], tiny / "data.jsonl", max_new_tokens=40,
                       progress=False)
    assert len((tiny / "data.jsonl").read_text().splitlines()) == 12


def test_block_mask_is_per_anchor(tiny):
    data, _ = load_sequences(tiny / "data.jsonl")
    data.features = torch.zeros(int(data.offsets[-1]), 4)
    picks = sample_picks(data, random.Random(0), 6, 3)
    b = make_batch(data, picks, 4, mask_id=3)
    Tc = len(b.ctx_pos)
    blocks = [(s, a) for s, anchors in picks for a in anchors]
    for j, (s, a) in enumerate(blocks):
        row = b.mask[j * 4]
        # context: exactly its own sequence's positions < anchor
        own = torch.zeros(Tc, dtype=torch.bool)
        start = sum(max(an) for s2, an in picks[: [p[0] for p in picks].index(s)])
        own[start:start + a] = True
        assert torch.equal(row[:Tc], own)
        # blocks: only its own 4 slots, all of them (bidirectional)
        expect = torch.zeros(len(blocks) * 4, dtype=torch.bool)
        expect[j * 4:(j + 1) * 4] = True
        assert torch.equal(row[Tc:], expect)
        assert b.block_tokens[j * 4] == data.tokens[data.seq(s)][a] and (b.block_tokens[j * 4 + 1:j * 4 + 4] == 3).all()
        assert torch.equal(b.q_pos[j * 4:(j + 1) * 4], torch.arange(a, a + 4))


def test_training_lowers_loss_and_writes_zlab_checkpoint(tiny):
    from dflash_trt.io.jsonio import read_json
    from dflash_trt.models.drafter import DFlashDrafter, load_drafter
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import load_pair

    out = tiny / "run"
    s = _run(tiny, out, steps=30, save_every=30)
    data, _ = load_sequences(tiny / "data.jsonl")
    label_sequences(tiny / "target", data, s["target_layer_ids"], out / "features", progress=False)
    frozen = FrozenTarget(tiny / "target", read_json(tiny / "target" / "config.json"))
    batch = make_batch(data, sample_picks(data, random.Random(123), 24, 4), 8, s["mask_token_id"])
    trained = load_drafter(out / "drafter", torch.float32)
    # the same config with the run's starting weights (seed 0 init from the target's last layer)
    torch.manual_seed(0)
    start = DFlashDrafter(trained.config)
    init_from_target(start, read_target_tensors(tiny / "target", lambda k: k.startswith("model.")),
                     read_json(tiny / "target" / "config.json"))
    with torch.no_grad():
        before, after = block_loss(start, frozen, batch, 4.0), block_loss(trained, frozen, batch, 4.0)
    assert after < before - 0.2, (before, after)

    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["mask_token_id"] == s["mask_token_id"]
    assert cfg["num_target_layers"] == 4 and cfg["hidden_size"] == 64
    with safe_open(str(out / "drafter" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in names)
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.0.self_attn.k_norm.weight" in names
    assert not any("embed" in k or "lm_head" in k for k in names)  # the target's, not the drafter's

    # and the runtime decodes with it, losslessly
    pair = load_pair(tiny / "target", out / "drafter")
    ids = data.tokens[data.seq(0)][: int(data.prompt_lens[0])].tolist()
    d = generate(pair.target, pair.drafter, ids, max_new_tokens=24, mode="dflash")
    a = generate(pair.target, None, ids, max_new_tokens=24, mode="ar")
    assert d.token_ids == a.token_ids


def test_resume_continues_from_saved_step(tiny):
    straight = _run(tiny, tiny / "straight", steps=8, save_every=4)
    first = _run(tiny, tiny / "split", steps=8, save_every=4, stop_after=4)
    assert first["step"] == 4 and first["stopped_early"]
    state = json.loads((tiny / "split" / "state" / "state.json").read_text())
    assert state["step"] == 4
    second = _run(tiny, tiny / "split", steps=8, save_every=4, resume=True)
    assert second["step"] == 8
    steps_logged = [json.loads(x)["step"] for x in (tiny / "split" / "log.jsonl").read_text().splitlines()]
    assert steps_logged == [8]  # logged every 10 steps and at the end: one line, from the resumed session
    from safetensors.torch import load_file
    a = load_file(str(tiny / "straight" / "state" / "model.safetensors"))
    b = load_file(str(tiny / "split" / "state" / "model.safetensors"))
    # weights, Adam moments and the anchor RNG were restored: the split run equals the straight one
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert straight["last_loss"] == pytest.approx(second["last_loss"], rel=1e-4)


def test_refuses_to_overwrite_a_run_without_resume(tiny):
    from dflash_trt.errors import DFlashError

    with pytest.raises(DFlashError, match="--resume"):
        _run(tiny, tiny / "straight", steps=2)


def test_cli_trains_and_reports_json(tiny):
    out = tiny / "cli-run"
    code, stdout, _ = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "data.jsonl"),
                              "--out", str(out), "--steps", "3", "--block-size", "8", "--blocks-per-step", "8",
                              "--threads", "1", "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["step"] == 3 and (out / "drafter" / "config.json").is_file()
    # nothing to resume in a fresh folder: one-line error, exit 1
    code, _, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "data.jsonl"),
                           "--out", str(tiny / "fresh"), "--resume")
    assert code == 1
    assert "nothing to resume" in err
