"""`make run`: the main job on the embedded pair (SmolLM2-135M-Instruct + our DFlash drafter).

1. set-up: fetch and convert the target once (cached under $DFLASH_TRT_HOME);
2. `dflash-trt build` of the embedded pair for Blackwell, deployed on its default node, DGX B300 (nothing to compile:
   the serving files load the checkpoints);
3. a short generation with DFlash and with plain AR: same text, tau, and the wall-clock speed-up.
"""
from __future__ import annotations

import sys

from dflash_trt.bench.runtime import cost_ratios, explain
from dflash_trt.cli import main as cli
from dflash_trt.kernels import gemm
from dflash_trt.presets.catalog import resolve_drafter, resolve_target
from dflash_trt.runtime.pair import generate, load_pair

PROMPT = "Write a Python function `is_palindrome(s)` that checks whether a string reads the same backwards."


def main() -> int:
    for argv in (["check", "--json"], ["build", "--arch", "blackwell"]):
        print(f"\n$ dflash-trt {' '.join(argv)}", flush=True)
        try:
            cli(argv)
        except SystemExit as e:
            if e.code:
                return int(e.code)

    pair = load_pair(resolve_target(None), resolve_drafter(None))
    print(f"\n$ dflash-trt generate -p {PROMPT!r}  (DFlash, then --mode ar)", flush=True)
    generate(pair, "hi", max_new_tokens=8)  # warm-up
    generate(pair, "hi", max_new_tokens=8, mode="ar")
    df = generate(pair, PROMPT, max_new_tokens=128)
    ar = generate(pair, PROMPT, max_new_tokens=128, mode="ar")
    print(df.text)
    print(f"\nDFlash: {len(df.token_ids)} tokens in {df.seconds:.2f} s ({df.tokens_per_s:.1f} tok/s), "
          f"tau {df.tau:.2f} over {df.blocks} blocks")
    print(f"AR:     {len(ar.token_ids)} tokens in {ar.seconds:.2f} s ({ar.tokens_per_s:.1f} tok/s)")
    print(f"same tokens as AR: {df.token_ids == ar.token_ids}; speed-up {ar.seconds / df.seconds:.2f}x")
    ratios = cost_ratios(ar.timings["verify"], len(ar.token_ids) - 1, df.timings, df.blocks)
    if ratios and df.tau:
        print(f"why: {explain(df.tau, ratios)} (AR step {ratios['ar_ms_per_step']:.1f} ms, "
              f"{str(pair.target.dtype).removeprefix('torch.')}, GEMM {gemm.path(pair.target.dtype)})")
    return 0 if df.token_ids == ar.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
