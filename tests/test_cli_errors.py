"""Bad input gives one clear line naming the field or file, and a non-zero exit."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli


def edit_config(folder, fn):
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def gen_args(t, d):
    return ["generate", "--target", str(t), "--drafter", str(d), "-p", "hi", "--max-new-tokens", "4"]


def test_good_pair_checks_ok_and_generates(pair):
    t, d = pair
    code, out, _ = run_cli("check", "--target", str(t), "--drafter", str(d), "--json")
    rep = json.loads(out)
    assert code == 0 and rep["ok"] and rep["problems"] == [] and rep["block_size"] == 8
    code, out, _ = run_cli(*gen_args(t, d), "--json")
    res = json.loads(out)
    assert code == 0 and len(res["token_ids"]) == 4 and set(res) >= {
        "text", "token_ids", "tau", "blocks", "accepted_per_block", "seconds", "tokens_per_s"}


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.pop("hidden_size"), "missing field(s) hidden_size"),
    (lambda c: c.update(hidden_size=32), "hidden_size: drafter 32 != target 64"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), "target_layer_ids [9] out of range"),
    (lambda c: c["dflash_config"].update(mask_token_id=100000), "mask_token_id = 100000 outside the target vocabulary"),
    (lambda c: c.update(block_size=1), "block_size = 1"),
])
def test_check_names_the_bad_field(pair, edit, needle):
    t, d = pair
    edit_config(d, edit)
    code, out, err = run_cli("check", "--target", str(t), "--drafter", str(d))
    assert code == 1 and needle in err


def test_generate_refuses_missing_config_field(pair):
    t, d = pair
    edit_config(d, lambda c: c.pop("vocab_size"))
    code, _, err = run_cli(*gen_args(t, d))
    assert code == 1 and err.startswith("error: ") and "vocab_size" in err and len(err.strip().splitlines()) == 1


def test_truncated_safetensors(pair):
    t, d = pair
    f = t / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, _, err = run_cli(*gen_args(t, d))
    assert code == 1 and "model.safetensors" in err and len(err.strip().splitlines()) == 1


def test_pickle_checkpoint_refused_unless_opted_in(pair):
    t, d = pair
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    code, _, err = run_cli(*gen_args(t, d))
    assert code == 1 and "pytorch_model.bin" in err and "pickle" in err
    code, out, _ = run_cli(*gen_args(t, d), "--allow-pickle", "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 4
