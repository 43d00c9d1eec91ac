"""`bench`: DFlash against plain autoregressive decoding on the same prompts, in one process.

Runs are interleaved (AR, DFlash, DFlash, AR, ...) so that a slow or noisy moment of the machine
hits both modes alike. Reports tau, wall-clock speed-up, throughput, losslessness (greedy:
token-identical to AR), the acceptance histogram and the per-block cost split of the runtime.
"""
from __future__ import annotations

import collections
import sys

from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import cpu
from dflash_trt.kernels import gemm
from dflash_trt.runtime.decode import generate
from dflash_trt.runtime.pair import check_request, encode_prompt
from dflash_trt.runtime.sampling import SamplingParams


def cost_ratios(ar_step_seconds: float, ar_steps: int, dflash_timings: dict, blocks: int) -> dict:
    """What one DFlash block costs in AR steps, measured in the same run: verify_over_ar (a B-token
    verify pass over one AR step), draft_over_ar, inject_over_ar, and their sum block_over_ar;
    speed-up ~= tau / block_over_ar in decode. Inputs: the AR loop's target-pass seconds and steps,
    the DFlash loop's per-part seconds (GenerationResult.timings) and blocks."""
    if ar_steps < 1 or blocks < 1:
        return {}
    step = ar_step_seconds / ar_steps
    out = {"ar_ms_per_step": 1000 * step}
    for part in ("verify", "draft", "inject"):
        out[f"{part}_over_ar"] = dflash_timings[part] / blocks / step
    out["block_over_ar"] = sum(out[f"{p}_over_ar"] for p in ("verify", "draft", "inject"))
    return out


def explain(tau: float, ratios: dict) -> str:
    """One line for a newcomer: where the speed-up comes from."""
    return (f"each DFlash block gives {tau:.2f} tokens (tau) and costs {ratios['block_over_ar']:.2f} plain "
            f"decoding steps (verify {ratios['verify_over_ar']:.2f} + draft {ratios['draft_over_ar']:.2f} + "
            f"inject {ratios['inject_over_ar']:.2f}), so decoding runs {tau:.2f} / "
            f"{ratios['block_over_ar']:.2f} = {tau / ratios['block_over_ar']:.2f}x faster")


def run_bench(pair, prompts: list[str | list[int]], *, max_new_tokens: int = 128, block_size: int | None = None,
              temperature: float = 0.0, seed: int = 0, fused_inject: bool = True, progress: bool = True) -> dict:
    sp = SamplingParams(temperature)
    B = block_size or pair.drafter.config.block_size
    encoded = [encode_prompt(pair.tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]  # or token ids
    for i, ids in enumerate(encoded, 1):   # every prompt bounded before the first is decoded
        try:
            check_request(pair, len(ids), max(max_new_tokens, 8), B)
        except DFlashError as e:
            raise DFlashError(f"prompt {i}: {e}") from None
    # Warm-up: first calls pay allocator and kernel-selection costs that are not the method's.
    for mode in ("ar", "dflash"):
        generate(pair.target, pair.drafter if mode == "dflash" else None, encoded[0], max_new_tokens=8,
                 mode=mode, block_size=B, sampling=sp, stop_ids=pair.stop_ids, fused_inject=fused_inject)
    walls = {"ar": 0.0, "dflash": 0.0}
    ar_steps, ar_verify = 0, 0.0
    tokens = {"ar": 0, "dflash": 0}
    hist: collections.Counter = collections.Counter()
    split = collections.Counter()
    per_prompt = []
    bar = tqdm(total=len(encoded), desc="bench", unit="prompt", disable=not progress, file=sys.stderr)
    for i, ids in enumerate(encoded):
        results = {}
        for mode in (("ar", "dflash") if i % 2 == 0 else ("dflash", "ar")):
            r = generate(pair.target, pair.drafter if mode == "dflash" else None, ids, max_new_tokens=max_new_tokens,
                         mode=mode, block_size=B, sampling=sp, seed=seed + i, stop_ids=pair.stop_ids,
                         fused_inject=fused_inject)
            results[mode] = r
            walls[mode] += r.seconds
            tokens[mode] += len(r.token_ids)
        d, a = results["dflash"], results["ar"]
        ar_steps, ar_verify = ar_steps + len(a.token_ids) - 1, ar_verify + a.timings["verify"]
        hist.update(d.accepted_per_block)
        split.update(d.timings)
        per_prompt.append({"prompt_tokens": len(ids), "new_tokens": len(d.token_ids), "tau": d.tau,
                           "match": d.token_ids == results["ar"].token_ids,
                           "ar_seconds": results["ar"].seconds, "dflash_seconds": d.seconds})
        bar.update(1)
        n_blocks = sum(hist.values())
        bar.set_postfix(tau=f"{sum(k * v for k, v in hist.items()) / max(n_blocks, 1):.2f}",
                        speedup=f"{walls['ar'] / max(walls['dflash'], 1e-9):.2f}x")
    bar.close()
    n_blocks = sum(hist.values())
    matches = sum(p["match"] for p in per_prompt)
    decode = sum(split[k] for k in ("draft", "verify", "inject", "bookkeeping"))
    tau = sum(k * v for k, v in hist.items()) / n_blocks if n_blocks else None
    ratios = cost_ratios(ar_verify, ar_steps, split, n_blocks)
    return {
        "tau": tau,
        "speedup": walls["ar"] / walls["dflash"] if walls["dflash"] else None,
        "tokens_per_s_dflash": tokens["dflash"] / walls["dflash"] if walls["dflash"] else None,
        "tokens_per_s_ar": tokens["ar"] / walls["ar"] if walls["ar"] else None,
        "lossless": (matches == len(per_prompt)) if sp.greedy else None,
        "match_rate": matches / len(per_prompt),
        "n_prompts": len(per_prompt),
        "block_size": B,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
        "blocks": n_blocks,
        "wall_seconds": {"ar": walls["ar"], "dflash": walls["dflash"]},
        # Per-block cost split of the decode loop (prefill excluded), as fractions of decode time.
        "block_cost_split": {k: split[k] / decode for k in ("draft", "verify", "inject", "bookkeeping")} if decode else {},
        "ms_per_block": {k: 1000 * split[k] / n_blocks for k in ("draft", "verify", "inject", "bookkeeping")}
        if n_blocks else {},
        # What a block costs in AR steps (same run): speed-up ~= tau / block_over_ar.
        **ratios,
        "cpu": cpu(),
        "gemm_path": gemm.path(pair.target.dtype),
        "per_prompt": per_prompt,
    }


def format_table(r: dict) -> str:
    rows = [
        ("prompts", f"{r['n_prompts']}"), ("block size", f"{r['block_size']}"),
        ("dtype, threads", f"{r.get('dtype', '-')}, {r.get('threads', '-')}"),
        ("tau (tokens / target pass)", f"{r['tau']:.2f}" if r["tau"] else "-"),
        ("speed-up (AR wall / DFlash wall)", f"{r['speedup']:.2f}x" if r["speedup"] else "-"),
        ("tokens/s DFlash", f"{r['tokens_per_s_dflash']:.1f}"), ("tokens/s AR", f"{r['tokens_per_s_ar']:.1f}"),
        ("lossless (greedy, all prompts)", str(r["lossless"])), ("match rate", f"{r['match_rate']:.3f}"),
        ("acceptance histogram", " ".join(f"{k}:{v}" for k, v in r["acceptance_histogram"].items())),
        ("block cost split", " ".join(f"{k} {100 * v:.1f}%" for k, v in r["block_cost_split"].items())),
        ("cost in AR steps", f"verify {r['verify_over_ar']:.2f}, draft {r['draft_over_ar']:.2f}, "
                             f"inject {r['inject_over_ar']:.2f}" if "verify_over_ar" in r else "-"),
        ("CPU, GEMM path", f"{r['cpu']['model']} ({' '.join(r['cpu']['features']) or 'no AVX2'}), {r['gemm_path']}"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
