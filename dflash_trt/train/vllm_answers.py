"""The target's greedy answers from vLLM's offline batched generation (`LLM.generate`).

Run by train/data.py with the Python of a separate vLLM environment ($DFLASH_TRT_VLLM_ENV): vLLM
pins its own torch and transformers, so it never enters dflash-trt's environment, and this file
imports nothing of dflash-trt (only the standard library and vLLM). It talks JSON lines over files:

    python vllm_answers.py --model DIR --requests IN.jsonl --answers OUT.jsonl --summary S.json \\
        --max-new-tokens N [--dtype float32] [--max-model-len L]
    IN:  {"i": 0, "prompt_ids": [...]}            (token ids: the chat template is applied by the caller)
    OUT: {"i": 0, "output_ids": [...], "finish_reason": "stop" | "length"}
    S:   {"answers": n, "generate_seconds": s, "load_seconds": s, "vllm": "<version>"}
(vLLM logs to stdout and stderr, so the results go to files.)

Greedy (temperature 0), no stop strings: generation ends at the model's end tokens (vLLM takes
them from the tokenizer and generation_config.json, as transformers' generate does) or after N
tokens. vLLM's LLM/SamplingParams/TokensPrompt API: vllm-project/vllm vllm/entrypoints/llm.py,
vllm/sampling_params.py, vllm/inputs/data.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--answers", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(a.requests) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(r["prompt_ids"]) for r in reqs) + a.max_new_tokens
    llm = LLM(model=a.model, dtype=a.dtype, seed=a.seed, max_model_len=a.max_model_len or longest,
              enforce_eager=True)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=a.max_new_tokens, skip_special_tokens=False)
    t1 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs], params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    with open(a.answers, "w") as f:
        for r, o in zip(reqs, outs):
            c = o.outputs[0]
            f.write(json.dumps({"i": r["i"], "output_ids": list(c.token_ids), "finish_reason": c.finish_reason}) + "\n")
    with open(a.summary, "w") as f:
        json.dump({"answers": len(outs), "generate_seconds": gen_s, "load_seconds": load_s,
                   "vllm": vllm.__version__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
