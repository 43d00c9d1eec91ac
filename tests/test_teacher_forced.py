"""Teacher-forced labels, distillation, draft-vocabulary training and the stdlib corpus (issue 19).

Oracles: plain autoregressive decoding (the teacher-forced top-1 along a greedy answer IS the
answer), a loop that walks the greedy path slot by slot (the label cut rule), torch's own
kl_div (the distillation term), and the held-out modules' real source (the corpus leaves it out).
"""
from __future__ import annotations

import inspect
import json
import random

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.io.jsonio import read_json
from dflash_trt.train.data import Sequences, load_sequences
from dflash_trt.train.features import label_sequences
from dflash_trt.train.initial import TrainConfig
from dflash_trt.train.objective import FrozenTarget, make_batch, sample_picks
from dflash_trt.train.prompts import HELDOUT_MODULES, build_prompts

from helpers import block_loss, run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target and text rows it never generated (prompt + response)."""
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("tf")
    make_tiny("llama", root / "target")
    rng = random.Random(0)
    words = "def return self if else for in range len list dict value key name path data text".split()
    with open(root / "text.jsonl", "w") as f:
        for r in build_prompts("train", limit=10):
            body = " ".join(rng.choice(words) for _ in range(rng.randrange(20, 40)))
            f.write(json.dumps({"prompt": r["prompt"], "response": body}) + "\n")
    return root


def _tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny / "target"))


def test_teacher_forced_top1_along_a_greedy_answer_is_the_answer(tiny):
    """Labels from one forward pass equal what plain autoregressive decoding emits (float64)."""
    from dflash_trt.models.target import load_target
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import encode_prompt

    tok = _tokenizer(tiny)
    target = load_target(tiny / "target", dtype=torch.float64)
    rows = []
    for r in build_prompts("train", limit=3):
        ids = encode_prompt(tok, r["prompt"])
        target.setup_cache(len(ids) + 40)
        out = generate(target, None, ids, max_new_tokens=24, mode="ar").token_ids
        rows.append({"prompt_ids": ids, "output_ids": out})
    path = tiny / "greedy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, _ = load_sequences(path)
    label_sequences(tiny / "target", data, [0, 2], tiny / "cache64", progress=False, dtype=torch.float64, topk=3)
    assert data.top_ids.shape == (int(data.offsets[-1]), 3) and data.top_logp.dtype == torch.float16
    for i, r in enumerate(rows):
        sl, P = data.seq(i), len(r["prompt_ids"])
        top1 = data.top_ids[sl][:, 0].tolist()
        assert top1[P - 1:P - 1 + len(r["output_ids"])] == r["output_ids"]
        assert (data.top_logp[sl][:, :-1] >= data.top_logp[sl][:, 1:]).all()   # sorted, most likely first


def _path_oracle(toks, top1, a, B):
    """Slot k's label by walking the greedy path: defined while the text's tokens a+1..a+k-1 are the
    target's own predictions; the label is the target's prediction after a+k-1."""
    labels = [-100] * B
    for k in range(1, B):
        if a + k >= len(toks):
            break
        if any(toks[a + j] != top1[a + j - 1] for j in range(1, k)):
            break
        labels[k] = top1[a + k - 1]
    return labels


def test_teacher_forced_slots_stop_where_the_text_leaves_the_greedy_path():
    rng = random.Random(1)
    T, B, V = 40, 8, 6
    toks = torch.tensor([rng.randrange(V) for _ in range(T)])
    # the target agrees with the text ~60% of the time, so paths of every length occur
    top1 = torch.tensor([int(toks[t + 1]) if t + 1 < T and rng.random() < 0.6 else rng.randrange(V)
                         for t in range(T)])
    top = torch.stack([top1, (top1 + 1) % V], 1).to(torch.int32)
    data = Sequences(toks, torch.tensor([0, T]), torch.tensor([2]), torch.zeros(T, 4),
                     top, torch.tensor([[-0.1, -2.5]] * T, dtype=torch.float16))
    picks = [(0, list(range(2, T - 1)))]
    b = make_batch(data, picks, B, mask_id=V, labels_from="teacher-forced", distill_k=2)
    lengths = set()
    for j, a in enumerate(picks[0][1]):
        want = _path_oracle(toks.tolist(), top1.tolist(), a, B)
        assert b.labels[j * B:(j + 1) * B].tolist() == want, a
        lengths.add(sum(x >= 0 for x in want))
        for k in range(1, B):   # the soft targets are the target's top-2 after a+k-1
            if want[k] >= 0:
                assert b.soft_ids[j * B + k].tolist() == top[a + k - 1].tolist()
    assert {1, 2, 3} <= lengths   # the cut happens at different slots
    # data labels are the text's own next tokens, whatever the target predicts
    d = make_batch(data, picks, B, mask_id=V)
    a = picks[0][1][0]
    assert d.labels[1:B].tolist() == toks[a + 1:a + B].tolist()


def _frozen_and_batch(tiny, distill_k=0, vocab=None):
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.train.initial import drafter_config_for

    cfg = read_json(tiny / "target" / "config.json")
    data, _ = load_sequences(tiny / "text.jsonl", _tokenizer(tiny))
    dcfg = drafter_config_for(cfg, TrainConfig(layers=1, block_size=8), mask_token_id=3)
    label_sequences(tiny / "target", data, dcfg.target_layer_ids, tiny / "cache", progress=False, topk=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    batch = make_batch(data, sample_picks(data, random.Random(5), 16, 4), 8, 3, "teacher-forced", distill_k)
    return drafter, FrozenTarget(tiny / "target", cfg, vocab), batch


def test_distillation_adds_the_kl_to_the_renormalised_top_k(tiny):
    drafter, frozen, batch = _frozen_and_batch(tiny, distill_k=4)
    with torch.no_grad():
        total = block_loss(drafter, frozen, batch, 4.0)
        hard = block_loss(drafter, frozen, _without_soft(batch), 4.0)
        # the oracle: torch's kl_div on the same drafter logits
        sel = batch.labels >= 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ctx = drafter.project_context(batch.features.float())
            h = drafter(frozen.embed[batch.block_tokens], batch.q_pos, ctx, batch.ctx_pos, batch.mask)
            logits = F.linear(h[sel], frozen.lm_head)
        logq = torch.log_softmax(logits.float(), -1)
        p = torch.softmax(batch.soft_logp[sel], -1)
        dense = torch.zeros_like(logq).scatter_(1, batch.soft_ids[sel], p)
        kl = F.kl_div(logq, dense, reduction="none").sum(-1)
        w = torch.exp(-(batch.slot[sel].float() - 1) / 4.0)
    assert total.item() == pytest.approx(hard.item() + float((kl * w).sum() / w.sum()), rel=1e-4)
    assert total > hard


def _without_soft(batch):
    import dataclasses

    return dataclasses.replace(batch, soft_ids=None, soft_logp=None)


def test_draft_vocab_restricts_the_logits_and_drops_labels_outside(tiny):
    V = read_json(tiny / "target" / "config.json")["vocab_size"]
    drafter, full, batch = _frozen_and_batch(tiny, distill_k=4)
    _, everything, _ = _frozen_and_batch(tiny, distill_k=4, vocab=torch.arange(V))
    with torch.no_grad():
        assert block_loss(drafter, everything, batch, 4.0).item() == pytest.approx(
            block_loss(drafter, full, batch, 4.0).item(), rel=1e-5)
    # a vocabulary of the labelled tokens but one: that label's slots leave the loss
    labelled = batch.labels[batch.labels >= 0]
    gone = int(labelled.mode().values)
    vocab = torch.tensor(sorted(set(labelled.tolist()) - {gone}))
    _, sub, _ = _frozen_and_batch(tiny, distill_k=0, vocab=vocab)
    assert sub.lm_head.shape[0] == len(vocab) and torch.equal(sub.token(torch.arange(len(vocab))), vocab)
    hard = _without_soft(batch)
    kept = hard.labels.clone()
    kept[kept == gone] = -100
    import dataclasses

    with torch.no_grad():
        assert block_loss(drafter, sub, hard, 4.0).item() == pytest.approx(
            block_loss(drafter, sub, dataclasses.replace(hard, labels=kept), 4.0).item(), rel=1e-6)


def test_cli_teacher_forced_distill_trains_on_text_and_ships_the_vocab(tiny):
    """Rows the target never generated, labelled by it; the drafter lowers its loss, carries the
    draft vocabulary it was trained on, and decodes losslessly."""
    from dflash_trt.models.draft_vocab import read_draft_vocab, write_draft_vocab
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import load_pair

    V = read_json(tiny / "target" / "config.json")["vocab_size"]
    vdir = tiny / "vocab"
    vdir.mkdir()
    write_draft_vocab(vdir, list(range(0, V, 2)) + [1], V, "test")
    out = tiny / "cli-tf"
    code, stdout, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"),
                                "--labels", "teacher-forced", "--distill", "topk:4", "--draft-vocab", str(vdir),
                                "--out", str(out), "--steps", "30", "--lr", "3e-3", "--block-size", "8",
                                "--blocks-per-step", "16", "--layers", "1", "--threads", "1", "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["last_loss"] < s["first_loss"] - 0.2, s
    assert torch.equal(read_draft_vocab(out / "drafter", V), read_draft_vocab(vdir, V))
    state = read_json(out / "state" / "state.json")["train_config"]
    assert state["labels"] == "teacher-forced" and state["distill_k"] == 4
    pair = load_pair(tiny / "target", out / "drafter")
    assert pair.drafter.draft_vocab is not None
    data, _ = load_sequences(tiny / "text.jsonl", _tokenizer(tiny))
    ids = data.tokens[data.seq(0)][: int(data.prompt_lens[0])].tolist()
    d = generate(pair.target, pair.drafter, ids, max_new_tokens=24, mode="dflash")
    a = generate(pair.target, None, ids, max_new_tokens=24, mode="ar")
    assert d.token_ids == a.token_ids


@pytest.mark.parametrize("value", ["top:4", "topk:0", "topk:x", "topk:65"])
def test_cli_refuses_a_bad_distill_spec(tiny, value):
    code, _, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"),
                           "--distill", value, "--out", str(tiny / "never"))
    assert code == 2 and "topk:K" in err.strip().splitlines()[-1]
    assert not (tiny / "never").exists()


def test_cli_refuses_a_folder_without_a_draft_vocab(tiny):
    empty = tiny / "no-vocab"
    empty.mkdir(exist_ok=True)
    other = empty / "vocab.json"   # a file, but not a draft_vocab.json
    other.write_text("{}")
    for given in (empty, other):
        code, _, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"),
                               "--labels", "teacher-forced", "--draft-vocab", str(given), "--out", str(tiny / "nv"),
                               "--steps", "1", "--threads", "1")
        assert code == 1 and "draft_vocab.json" in err.strip().splitlines()[-1], given


# ------------------------------------------------------------------------------------ corpus
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    code, stdout, err = run_cli("corpus", "--out", str(out), "--json")
    assert code == 0, err
    return out, json.loads(stdout)


def test_corpus_is_chat_rows_of_stdlib_code(corpus):
    out, about = corpus
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == about["rows"] > 5000 and about["files"] > 300
    assert all(set(r) == {"prompt", "response", "source", "kind"} for r in rows)
    code = [r for r in rows if r["kind"] == "code"]
    assert len(code) > len(rows) // 2
    assert all(r["response"].startswith("```python\n") and r["response"].endswith("\n```") for r in code)
    compile(code[0]["response"][len("```python\n"):-4], "<corpus>", "exec")   # real, dedented source


def test_corpus_leaves_out_the_held_out_modules(corpus):
    """No row comes from a held-out module, and no held-out function's source is in any response."""
    from dflash_trt.train.prompts import _import

    out, _ = corpus
    text = out.read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    held = tuple(HELDOUT_MODULES)
    assert not [r["source"] for r in rows if r["source"].rsplit(".", 1)[0] in held]
    checked = 0
    for name in held:
        mod = _import(name)
        for fn in vars(mod).values():
            if inspect.isfunction(fn) and getattr(fn, "__module__", "") == mod.__name__:
                src = inspect.getsource(fn)
                if src.count("\n") >= 4:
                    body = json.dumps("\n".join(src.splitlines()[1:4]))[1:-1]   # 3 lines after the def
                    assert body not in text, f"{name}.{fn.__name__}"
                    checked += 1
    assert checked > 50


def test_corpus_is_deterministic_and_honours_max_rows(tmp_path):
    from dflash_trt.train.corpus import build_corpus

    a, _ = build_corpus(max_rows=50, seed=3)
    b, _ = build_corpus(max_rows=50, seed=3)
    c, _ = build_corpus(max_rows=50, seed=4)
    assert a == b and len(a) == 50 and a != c


def test_init_from_a_shallower_drafter_grows_it_without_changing_what_it_computes(tiny):
    """--layers 3 --init-from a 1-layer drafter: the new layers start as identities, so the grown
    drafter's outputs equal the trained one's (then training improves it)."""
    from dflash_trt.models.drafter import DFlashDrafter, load_drafter
    from dflash_trt.train.initial import drafter_config_for, init_from_drafter

    code, _, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"),
                           "--labels", "teacher-forced", "--out", str(tiny / "one"), "--steps", "3", "--layers", "1",
                           "--block-size", "8", "--threads", "1")
    assert code == 0, err
    src = load_drafter(tiny / "one" / "drafter", torch.float32)
    cfg = read_json(tiny / "target" / "config.json")
    grown = DFlashDrafter(drafter_config_for(cfg, TrainConfig(layers=3, block_size=8,
                                                              target_layer_ids=src.config.target_layer_ids),
                                             src.config.mask_token_id))
    notes = init_from_drafter(grown, tiny / "one" / "drafter", tiny / "target", cfg)
    assert any("grown from 1 to 3" in n for n in notes)
    assert torch.equal(grown.layers[2].self_attn.q_proj.weight, src.layers[0].self_attn.q_proj.weight)
    assert grown.layers[0].self_attn.q_proj.weight.abs().sum() > 0   # the target's layer, not zeros
    torch.manual_seed(1)
    H, nf = src.config.hidden_size, src.config.n_features
    feats, h = torch.randn(12, nf * H), torch.randn(8, H)
    mask = torch.ones(8, 20, dtype=torch.bool)
    with torch.no_grad():
        a = src(h, torch.arange(12, 20), src.project_context(feats), torch.arange(12), mask)
        b = grown(h, torch.arange(12, 20), grown.project_context(feats), torch.arange(12), mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    shallower = DFlashDrafter(drafter_config_for(cfg, TrainConfig(layers=1, block_size=8,
                                                                  target_layer_ids=src.config.target_layer_ids), 3))
    init_from_drafter(shallower, tiny / "one" / "drafter")   # same depth: a plain copy
    assert torch.equal(shallower.layers[0].mlp.down_proj.weight, src.layers[0].mlp.down_proj.weight)
    code, _, err = run_cli("train-drafter", "--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"),
                           "--labels", "teacher-forced", "--out", str(tiny / "fewer"), "--steps", "1", "--layers", "1",
                           "--init-from", str(grown_dir(tiny, grown)), "--block-size", "8", "--threads", "1")
    assert code == 1 and "more than --layers 1" in err.strip().splitlines()[-1]


def grown_dir(tiny, model):
    from dflash_trt.models.drafter import save_drafter

    return save_drafter(model, tiny / "grown3")


def test_init_from_takes_the_drafters_own_config_unless_a_flag_gives_it(tiny):
    """--init-from D: the run's layers, intermediate size, target layer ids, mask token and draft vocabulary
    are D's where no flag gives them (D's differ from every default here), a flag wins (--block-size), and the
    command says which came from where."""
    from dflash_trt.models.draft_vocab import read_draft_vocab, write_draft_vocab

    V = read_json(tiny / "target" / "config.json")["vocab_size"]
    vdir = tiny / "init-vocab"
    vdir.mkdir()
    write_draft_vocab(vdir, list(range(0, V, 3)) + [1], V, "test")
    common = ("--target", str(tiny / "target"), "--data", str(tiny / "text.jsonl"), "--steps", "1", "--threads", "1")
    code, _, err = run_cli("train-drafter", *common, "--out", str(tiny / "d"), "--layers", "2", "--block-size", "8",
                           "--intermediate-size", "96", "--target-layers", "1,2", "--mask-token-id", "5",
                           "--draft-vocab", str(vdir))
    assert code == 0, err
    D = tiny / "d" / "drafter"
    code, _, err = run_cli("train-drafter", *common, "--out", str(tiny / "tuned"), "--init-from", str(D),
                           "--block-size", "4")
    assert code == 0, err
    said = next(line for line in err.splitlines() if line.startswith("--init-from"))
    assert said == (f"--init-from {D}: layers 2, intermediate size 96, target layers 1,2, mask token id 5, draft "
                    f"vocab {(D / 'draft_vocab.json').resolve()} (from its config); --block-size 4 (flag)")
    written = read_json(tiny / "tuned" / "drafter" / "config.json")
    assert (written["num_hidden_layers"], written["intermediate_size"], written["block_size"]) == (2, 96, 4)
    assert written["dflash_config"]["target_layer_ids"] == [1, 2]
    assert written["dflash_config"]["mask_token_id"] == 5
    assert torch.equal(read_draft_vocab(tiny / "tuned" / "drafter", V), read_draft_vocab(vdir, V))
