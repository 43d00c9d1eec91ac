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
              temperature: float = 0.0, seed: int = 0, fused_inject: bool = True, progress: bool = True,
              also: dict | None = None) -> dict:
    """The report of the pair's drafter against AR. `also` (name -> drafter model): more drafters decoded on
    the same prompts against the same AR runs (adapt's gate: old and new drafter, one AR pass for both, which
    is a third of its time saved); each one's report under r["also"][name], with the same keys."""
    sp = SamplingParams(temperature)
    B = block_size or pair.drafter.config.block_size
    encoded = [encode_prompt(pair.tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]  # or token ids
    for i, ids in enumerate(encoded, 1):   # every prompt bounded before the first is decoded
        try:
            check_request(pair, len(ids), max(max_new_tokens, 8), B)
        except DFlashError as e:
            raise DFlashError(f"prompt {i}: {e}") from None
    drafters = {"dflash": pair.drafter, **(also or {})}

    def run(arm: str, ids: list[int], n: int, i: int = 0):
        return generate(pair.target, drafters.get(arm), ids, max_new_tokens=n, mode="ar" if arm == "ar" else "dflash",
                        block_size=B, sampling=sp, seed=seed + i, stop_ids=pair.stop_ids, fused_inject=fused_inject)

    arms = ("ar", *drafters)
    # Warm-up: first calls pay allocator and kernel-selection costs that are not the method's.
    for arm in arms:
        run(arm, encoded[0], 8)
    walls, tokens = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0)
    ar_steps, ar_verify = 0, 0.0
    hist = {d: collections.Counter() for d in drafters}
    split = {d: collections.Counter() for d in drafters}
    per_prompt: dict[str, list] = {d: [] for d in drafters}
    bar = tqdm(total=len(encoded), desc="bench", unit="prompt", disable=not progress, file=sys.stderr)
    for i, ids in enumerate(encoded):
        results = {}
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:   # interleaved: each arm runs first in turn
            results[arm] = r = run(arm, ids, max_new_tokens, i)
            walls[arm] += r.seconds
            tokens[arm] += len(r.token_ids)
        a = results["ar"]
        ar_steps, ar_verify = ar_steps + len(a.token_ids) - 1, ar_verify + a.timings["verify"]
        for d in drafters:
            r = results[d]
            hist[d].update(r.accepted_per_block)
            split[d].update(r.timings)
            per_prompt[d].append({"prompt_tokens": len(ids), "new_tokens": len(r.token_ids), "tau": r.tau,
                                  "match": r.token_ids == a.token_ids, "ar_seconds": a.seconds,
                                  "dflash_seconds": r.seconds})
        bar.update(1)
        n_blocks = sum(hist["dflash"].values())
        bar.set_postfix(tau=f"{sum(k * v for k, v in hist['dflash'].items()) / max(n_blocks, 1):.2f}",
                        speedup=f"{walls['ar'] / max(walls['dflash'], 1e-9):.2f}x")
    bar.close()

    def report(d: str) -> dict:
        h, sp_d, pp, wall = hist[d], split[d], per_prompt[d], walls[d]
        n_blocks = sum(h.values())
        matches = sum(p["match"] for p in pp)
        decode = sum(sp_d[k] for k in ("draft", "verify", "inject", "bookkeeping"))
        return {
            "tau": sum(k * v for k, v in h.items()) / n_blocks if n_blocks else None,
            "speedup": walls["ar"] / wall if wall else None,
            "tokens_per_s_dflash": tokens[d] / wall if wall else None,
            "tokens_per_s_ar": tokens["ar"] / walls["ar"] if walls["ar"] else None,
            "lossless": (matches == len(pp)) if sp.greedy else None,
            "match_rate": matches / len(pp),
            "n_prompts": len(pp),
            "block_size": B,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "acceptance_histogram": {str(k): h[k] for k in sorted(h)},
            "blocks": n_blocks,
            "wall_seconds": {"ar": walls["ar"], "dflash": wall},
            # Per-block cost split of the decode loop (prefill excluded), as fractions of decode time.
            "block_cost_split": {k: sp_d[k] / decode for k in ("draft", "verify", "inject", "bookkeeping")}
            if decode else {},
            "ms_per_block": {k: 1000 * sp_d[k] / n_blocks for k in ("draft", "verify", "inject", "bookkeeping")}
            if n_blocks else {},
            # What a block costs in AR steps (same run): speed-up ~= tau / block_over_ar.
            **cost_ratios(ar_verify, ar_steps, sp_d, n_blocks),
            "cpu": cpu(),
            "gemm_path": gemm.path(pair.target.dtype),
            "per_prompt": pp,
        }

    return report("dflash") | ({"also": {d: report(d) for d in also}} if also else {})


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


def format_buckets(reports: list[dict]) -> str:
    """`bench --context-buckets` on our runtime: a row per context length."""
    lines = [f"{'context':>8} {'tau':>5} {'speed-up':>8} {'AR tok/s':>9} {'DFlash tok/s':>12}  lossless"]
    for r in reports:
        lines.append(f"{r['context_tokens']:>8.0f} {r['tau']:>5.2f} {r['speedup']:>7.2f}x {r['tokens_per_s_ar']:>9.1f} "
                     f"{r['tokens_per_s_dflash']:>12.1f}  {r['lossless']}")
    return "\n".join(lines)
