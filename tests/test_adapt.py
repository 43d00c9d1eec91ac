"""`dflash-trt adapt`: the traffic reader (train/traffic.py) against the tokenizer's own rendering, bad rows,
and the gate on a tiny bundle with real training (adapt.py)."""
from __future__ import annotations

import gzip
import json

import pytest
from helpers import run_cli
from transformers import AutoTokenizer

from dflash_trt.errors import DFlashError
from dflash_trt.train.traffic import read_traffic

SECRET = "SECRET-PROMPT-TEXT-42"   # in every bad row: no line may show it without --verbose
CHAT = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Write a Python function that adds two numbers."}],
        "response": "ignored"}


def _jsonl(path, rows) -> None:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


@pytest.fixture(scope="module")
def tiny_bundle(tiny_pairs, tmp_path_factory):
    t, d = tiny_pairs["llama"]
    out = tmp_path_factory.mktemp("adapt") / "bundle"
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--gpu", "none",
                           "--quant", "none", "--out", str(out))
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def tok(tiny_pairs):
    return AutoTokenizer.from_pretrained(str(tiny_pairs["llama"][0]))


def _code_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        text = f"Write a Python function number {i} that returns the square of {i} plus {i * 7}."
        rows.append({"prompt": text} if i % 2 else {"messages": [{"role": "user", "content": text}]})
    return rows


def test_mixed_rows_gzip_folder_order_dedupe_and_a_stable_split(tmp_path, tok):
    folder = tmp_path / "logs"
    folder.mkdir()
    rows = _code_rows(40)
    _jsonl(folder / "b.jsonl.gz", rows[20:] + [CHAT])
    _jsonl(folder / "a.jsonl", rows[:20] + [CHAT, rows[3]])   # two repeats
    (folder / "notes.txt").write_text("not traffic")
    t = read_traffic([folder], tok, max_prompt_tokens=1000, held_out_fraction=0.3)
    assert [f["path"] for f in t.files] == [str(folder / "a.jsonl"), str(folder / "b.jsonl.gz")]
    assert [f["rows"] for f in t.files] == [22, 21] and t.rows == 43
    assert t.duplicates == 2 and len(t.train) + len(t.held_out) == 41 and not t.skipped
    got = {tuple(r.ids) for r in t.train + t.held_out}
    chat_ids = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    assert tuple(chat_ids) in got                                   # the target's own template
    assert tuple(tok(rows[1]["prompt"])["input_ids"]) in got       # a completion: the text as is
    assert {r.kind for r in t.train + t.held_out} == {"chat", "completion"}
    assert 0 < len(t.held_out) < len(t.train)
    assert not {r.key for r in t.train} & {r.key for r in t.held_out}
    # stable: another run, the files given in the other order, splits every prompt the same way
    again = read_traffic([folder / "b.jsonl.gz", folder / "a.jsonl"], tok, max_prompt_tokens=1000,
                         held_out_fraction=0.3)
    assert {r.key for r in again.held_out} == {r.key for r in t.held_out}
    # a larger held-out fraction only moves prompts from train to held out
    wider = read_traffic([folder], tok, max_prompt_tokens=1000, held_out_fraction=0.6)
    assert {r.key for r in t.held_out} < {r.key for r in wider.held_out}


BAD_ROWS = [   # (row, the reason's category, words of its line)
    ("{" + SECRET, "not JSON", "not JSON"),
    (b"\xff\xfe" + SECRET.encode(), "wrong encoding", "not UTF-8"),
    ({"model": "m", "input": SECRET}, "no prompt", "neither messages"),
    ({"messages": [{"role": "wizard", "content": SECRET}]}, "unknown role", "'wizard' is not one of"),
    ({"prompt": "   "}, "empty prompt", "prompt is empty"),
    ({"messages": [{"role": "user", "content": ""}]}, "empty prompt", "every message is empty"),
    ({"prompt": (SECRET + " ") * 400}, "over context", "prompt tokens, more than"),
]


def test_each_bad_row_is_one_line_naming_file_and_line(tmp_path, tok):
    path = tmp_path / "t.jsonl"
    good = _code_rows(30)
    raw = b"".join((r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()) + b"\n"
                   for r, _, _ in BAD_ROWS)
    path.write_bytes(raw + "".join(json.dumps(r) + "\n" for r in good).encode())
    lines = []
    t = read_traffic([path], tok, max_prompt_tokens=500, held_out_fraction=0.3, log=lines.append)
    assert [b.kind for b in t.skipped] == [k for _, k, _ in BAD_ROWS]
    for i, ((_, _, words), line) in enumerate(zip(BAD_ROWS, lines), 1):
        assert line.startswith(f"{path}:{i}: ") and words in line and "\n" not in line
        assert SECRET not in line
    assert len(t.train) + len(t.held_out) == 30
    verbose = []
    read_traffic([path], tok, max_prompt_tokens=500, held_out_fraction=0.3, verbose=True, log=verbose.append)
    assert SECRET in verbose[0]
    with pytest.raises(DFlashError, match="more than --max-bad-rows 6"):
        read_traffic([path], tok, max_prompt_tokens=500, held_out_fraction=0.3, max_bad_rows=6)


@pytest.mark.parametrize("rows, words", [
    (["not json", {"prompt": ""}], "no usable prompt left"),
    ([{"prompt": "one prompt only"}], "part empty at --held-out"),
])
def test_cli_refuses_unusable_traffic_and_writes_nothing(tiny_bundle, tmp_path, rows, words):
    path = tmp_path / "t.jsonl"
    _jsonl(path, rows)
    out = tmp_path / "new"
    code, stdout, err = run_cli("adapt", "--bundle", str(tiny_bundle), "--traffic", str(path), "--out", str(out))
    assert code == 1 and words in err and err.count("error:") == 1
    assert not out.exists() and not (tmp_path / "new.run").exists() and stdout == ""


def test_cli_max_bad_rows(tiny_bundle, tmp_path):
    path = tmp_path / "t.jsonl"
    _jsonl(path, ["oops"] + _code_rows(20))
    code, _, err = run_cli("adapt", "--bundle", str(tiny_bundle), "--traffic", str(path), "--out",
                           str(tmp_path / "new"), "--max-bad-rows", "0")
    assert code == 1 and f"{path}:1: not JSON" in err and "more than --max-bad-rows 0" in err
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.run").exists()


def test_gate_refuses_an_untrained_drafter_with_figures_and_writes_nothing(tiny_bundle, tmp_path):
    path = tmp_path / "t.jsonl"
    _jsonl(path, _code_rows(24))
    out = tmp_path / "new"
    code, stdout, err = run_cli("adapt", "--bundle", str(tiny_bundle), "--traffic", str(path), "--out", str(out),
                                "--steps", "0", "--max-new-tokens", "16", "--answer-engine", "hf", "--json")
    assert code == 1 and "gate refused, nothing written" in err
    r = json.loads(stdout)
    g = r["gate"]
    assert r["passed"] is False and r["revision"] is None and not out.exists()
    assert g["after"]["tau"] < g["before"]["tau"] * (1 + g["min_gain"])
    for side in ("before", "after"):
        f = g[side]
        assert f["lossless"] is True and f["prompts"] == r["traffic"]["held_out"] > 0
        assert len(f["acceptance"]) == 7 and f["acceptance"] == sorted(f["acceptance"], reverse=True)
        assert f["tau"] == pytest.approx(1 + sum(f["acceptance"]), rel=1e-9)   # tau = 1 + sum of survival
    assert json.loads((tmp_path / "new.run" / "gate.json").read_text())["passed"] is False
    # the same command again continues the run: nothing answered, trained or decoded twice
    code, again, err = run_cli("adapt", "--bundle", str(tiny_bundle), "--traffic", str(path), "--out", str(out),
                               "--steps", "0", "--max-new-tokens", "16", "--answer-engine", "hf", "--json",
                               "--min-gain", "5")
    again = json.loads(again)
    assert code == 1 and "gate: the figures of" in err and "resuming" in err and not out.exists()
    assert (again["gate"]["before"], again["gate"]["after"], again["gate"]["min_gain"]) == \
        (g["before"], g["after"], 5.0)


def test_help_teaches():
    code, out, _ = run_cli("adapt", "--help")
    assert code == 0 and "Examples:" in out and "--min-gain" in out and "torchrun" in out
    from dflash_trt.adapt import AdaptSettings   # the CLI's own copies of the measured defaults (no torch for --help)

    for default in (f"default: {AdaptSettings.steps};", f"default: {AdaptSettings.lr}",
                    f"default: {AdaptSettings.min_gain}"):
        assert default in " ".join(out.split()), default


def test_deploy_train_adapt_renders_a_job_running_adapt(tmp_path):
    """The Job's command line parses as `dflash-trt adapt` (click's own parser is the oracle)."""
    import shlex

    import click
    import yaml

    from dflash_trt.commands.adapt import adapt_cmd

    code, _, err = run_cli("deploy-train", "--out", str(tmp_path / "d"), "--nodes", "1", "--gpus-per-node", "8",
                           "--adapt-bundle", "/data/b", "--traffic", "/data/logs", "--run-dir", "/data/adapt-run",
                           "--train-arg=--steps", "--train-arg=600")
    assert code == 0, err
    job = yaml.safe_load((tmp_path / "d" / "manifests" / "job.yaml").read_text())
    line = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    argv = shlex.split(line.split("-m dflash_trt.cli ", 1)[1])
    assert argv[0] == "adapt" and line.startswith("exec torchrun")
    opts, rest, _ = adapt_cmd.make_parser(click.Context(adapt_cmd)).parse_args(argv[1:])
    assert not rest and (opts["bundle_dir"], opts["traffic"], opts["out"], opts["run_dir"], opts["steps"]) == \
        ("/data/b", ["/data/logs"], "/data/b-adapted", "/data/adapt-run", "600")
    code, _, err = run_cli("deploy-train", "--out", str(tmp_path / "e"), "--adapt-bundle", "/elsewhere/b")
    assert code == 1 and "adapt.bundle" in err and "outside storage.mountPath" in err


def test_a_passing_run_writes_a_revision_verify_accepts(tiny_bundle, tmp_path):
    """Real fine-tuning (300 steps) on the tiny pair: the gate passes, the revision carries the new drafter with
    the parent's shape, its adaptation record, and `verify` and `bench --bundle` (lossless) take it."""
    import hashlib

    from dflash_trt.io.manifest import Manifest

    path = tmp_path / "t.jsonl"
    _jsonl(path, _code_rows(40))
    out = tmp_path / "new"
    code, stdout, err = run_cli("adapt", "--bundle", str(tiny_bundle), "--traffic", str(path), "--out", str(out),
                                "--steps", "300", "--lr", "3e-3", "--max-new-tokens", "24", "--answer-engine", "hf",
                                "--held-out", "0.3", "--min-gain", "0.01", "--json")
    r = json.loads(stdout)
    assert code == 0, err + json.dumps(r["gate"])[:2000]
    g = r["gate"]
    assert r["passed"] and r["revision"] == str(out)
    assert g["after"]["tau"] >= g["before"]["tau"] * 1.01 and g["after"]["lossless"]
    assert run_cli("verify", "--bundle", str(out))[0] == 0
    m = Manifest.read(out)
    rev = m.revision
    assert rev.kind == "adapt" and rev.parent.path == str(tiny_bundle.resolve())
    assert rev.parent.manifest_sha256 == hashlib.sha256((tiny_bundle / "manifest.json").read_bytes()).hexdigest()
    assert "drafter/model.safetensors" in rev.changed and "target/model.safetensors" not in rev.changed
    a = rev.adapt
    assert a.traffic == [{"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows": 40}]
    assert a.rows["train"] + a.rows["held_out"] == 40 and a.rows["skipped"] == 0
    assert a.training["step"] == 300 and a.gate["after"] == g["after"] and a.gate["before"] == g["before"]
    old, new = (json.loads((b / "drafter" / "config.json").read_text()) for b in (tiny_bundle, out))
    for k in ("num_hidden_layers", "block_size", "intermediate_size", "dflash_config", "hidden_size"):
        assert old[k] == new[k], k
    assert (out / "drafter" / "model.safetensors").read_bytes() == \
        (tmp_path / "new.run" / "train" / "drafter" / "model.safetensors").read_bytes()
    prompts = tmp_path / "p.jsonl"
    _jsonl(prompts, [r for r in _code_rows(6) if "prompt" in r])
    code, bench, err = run_cli("bench", "--bundle", str(out), "--prompts", str(prompts),
                               "--max-new-tokens", "16", "--json")
    assert code == 0 and json.loads(bench)["lossless"] is True, err


def test_a_gpu_bundles_schedule_is_replanned_from_the_measured_acceptance(tiny_pairs, tmp_path):
    """A bundle with a GPU node: the revision's schedule comes from the gate's acceptance and the bundle's own cost
    model on the layout its plan.json records (the CPU bundles above keep their parent's, none)."""
    from dflash_trt.adapt import replanned_schedule
    from dflash_trt.io.manifest import Manifest

    t, d = tiny_pairs["llama"]
    b = tmp_path / "gpu"
    code, _, err = run_cli("build", "--target", str(t), "--drafter", str(d), "--arch", "hopper", "--gpu", "h200",
                           "--quant", "none", "--out", str(b))
    assert code == 0, err
    m = Manifest.read(b)
    high = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3][: m.drafter.block_size - 1]
    low = [0.05] + [0.0] * (len(high) - 1)
    sched_high = replanned_schedule(b, m, b / "drafter", high)
    sched_low = replanned_schedule(b, m, b / "drafter", low)
    assert sched_high.max_k == len(high) and sched_high.ranges[0][0] == 1
    assert sched_high.ranges[0][2] > sched_low.ranges[0][2]    # more accepted: more drafted at concurrency 1


def test_the_gates_shared_ar_pass_gives_each_drafter_its_own_figures(tiny_pairs):
    """run_bench's `also` (the gate: old and new drafter against one AR run per prompt) reports each drafter as
    a run of its own would: the same drafter under two names gives its own run's tau, acceptance and identity."""
    from dflash_trt.bench.runtime import run_bench
    from dflash_trt.runtime.pair import load_pair

    t, d = tiny_pairs["llama"]
    pair = load_pair(t, d, "float32")
    prompts = [[5, 9, 14, 3], [7, 7, 21, 30, 2, 11]]
    alone = run_bench(pair, prompts, max_new_tokens=24, progress=False)
    shared = run_bench(pair, prompts, max_new_tokens=24, progress=False, also={"twin": pair.drafter})
    for r in (shared, shared["also"]["twin"]):
        for k in ("tau", "acceptance_histogram", "blocks", "lossless", "match_rate", "n_prompts"):
            assert r[k] == alone[k], k
    assert shared["wall_seconds"]["ar"] == shared["also"]["twin"]["wall_seconds"]["ar"]   # one AR run, shared
    assert "also" not in alone
