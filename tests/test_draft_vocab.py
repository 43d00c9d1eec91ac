"""Draft vocabularies (models/draft_vocab.py): the file format is checked, drafting from a subset
stays lossless against AR, and the subset's logits are exactly the full lm_head's at those tokens."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.models.draft_vocab import FILE, read_draft_vocab, write_draft_vocab
from dflash_trt.runtime.decode import draft_logits, generate
from dflash_trt.runtime.pair import load_pair

from helpers import run_cli


@pytest.fixture
def pair_dirs(tiny_pairs, tmp_path):
    tdir, ddir = tiny_pairs["llama"]
    own = tmp_path / "drafter"
    shutil.copytree(ddir, own)   # the session's tiny drafter stays without a vocabulary
    return tdir, own


def _vocab_size(tdir) -> int:
    return json.loads((tdir / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("body,needle", [
    ({"format": "other", "version": 1}, "not a dflash-trt draft vocabulary"),
    ({"vocab_size": 7}, "does not match the target's"),
    ({"token_ids": [3, 2]}, "sorted, unique"),
    ({"token_ids": [1, 1]}, "sorted, unique"),
    ({"token_ids": [-1, 2]}, "sorted, unique"),
    ({"token_ids": "1,2"}, "non-empty list of integers"),
    ({"token_ids": [1, 2.0]}, "non-empty list of integers"),
    ({"token_ids": [True]}, "non-empty list of integers"),
])
def test_bad_files_are_refused_with_the_file_named(tmp_path, body, needle):
    good = {"format": "dflash-trt-draft-vocab", "version": 1, "vocab_size": 100, "token_ids": [0, 5, 99]}
    (tmp_path / FILE).write_text(json.dumps({**good, **body}))
    with pytest.raises(DFlashError, match=needle) as e:
        read_draft_vocab(tmp_path, 100)
    assert str(tmp_path / FILE) in str(e.value)
    (tmp_path / FILE).write_text(json.dumps({**good, "token_ids": [0, 100]}))
    with pytest.raises(DFlashError, match=r"in \[0, 100\)"):
        read_draft_vocab(tmp_path, 100)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_subset_logits_equal_the_full_lm_head_there(pair_dirs, dtype):
    tdir, ddir = pair_dirs
    V = _vocab_size(tdir)
    write_draft_vocab(ddir, list(range(0, V, 3)), V, "test")
    pair = load_pair(tdir, ddir, dtype)
    ids = pair.drafter.draft_vocab
    assert ids is not None and ids.tolist() == list(range(0, V, 3))
    h = torch.randn(7, pair.target.hidden_size).to(pair.target.dtype)
    with torch.no_grad():   # as decoding runs it: with autograd on, the full lm_head takes MKL's path
        # (its weight requires grad) and the draft rows ours, which agree bitwise only for some h
        sub, full = draft_logits(pair.target, pair.drafter, h), pair.target.logits(h)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(sub[:, outside]).all()
    # each logit is its own reduction over the hidden size: the same bits in a sub-GEMM
    assert torch.equal(sub[:, ids], full[:, ids])


def test_drafting_from_a_subset_is_lossless(pair_dirs):
    tdir, ddir = pair_dirs
    V = _vocab_size(tdir)
    write_draft_vocab(ddir, list(range(V // 2)), V, "test")
    pair = load_pair(tdir, ddir, "float32")
    assert pair.drafter.draft_vocab is not None
    assert load_pair(tdir, ddir, "float32", draft_vocab=False).drafter.draft_vocab is None
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        prompt = torch.randint(4, V, (12,), generator=g).tolist()
        ar = generate(pair.target, None, prompt, max_new_tokens=24, mode="ar", stop_ids=pair.stop_ids)
        for B in (2, 8):
            df = generate(pair.target, pair.drafter, prompt, max_new_tokens=24, block_size=B, stop_ids=pair.stop_ids)
            assert df.token_ids == ar.token_ids


def test_cli_writes_a_vocabulary_that_bench_uses(pair_dirs, tmp_path):
    tdir, ddir = pair_dirs
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(3)))
    code, out, err = run_cli("draft-vocab", "--target", str(tdir), "--drafter", str(ddir), "--corpus", str(corpus),
                             "--dtype", "float32", "--json")
    assert code == 0, err
    summary = json.loads(out)
    ids = read_draft_vocab(ddir, _vocab_size(tdir))
    assert summary["tokens"] == len(ids) < _vocab_size(tdir) and summary["positions"] > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    for flag, size in (((), len(ids)), (("--full-draft-vocab",), _vocab_size(tdir))):
        code, out, err = run_cli("bench", "--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts),
                                 "--max-new-tokens", "8", "--json", *flag)
        assert code == 0, err
        report = json.loads(out)
        assert report["draft_vocab_size"] == size and report["lossless"] is True
        assert {"verify_over_ar", "draft_over_ar", "gemm_path", "cpu"} <= set(report)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "no text field"}) + "\n")
    code, _, err = run_cli("draft-vocab", "--target", str(tdir), "--drafter", str(ddir), "--corpus", str(bad))
    assert code == 1 and err.strip().splitlines()[-1].startswith("error:") and "text" in err


def test_check_refuses_a_bad_vocabulary_as_generate_does(pair_dirs):
    tdir, ddir = pair_dirs
    (ddir / FILE).write_text(json.dumps({"format": "dflash-trt-draft-vocab", "version": 1, "vocab_size": 3,
                                         "token_ids": [0]}))
    code, out, err = run_cli("check", "--target", str(tdir), "--drafter", str(ddir))
    assert code == 1 and "does not match the target's" in out + err
    code, _, err = run_cli("generate", "--target", str(tdir), "--drafter", str(ddir), "-p", "hi", "--max-new-tokens", "4")
    assert code == 1 and "does not match the target's" in err.strip().splitlines()[-1]
