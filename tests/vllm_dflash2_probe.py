"""Run inside the vLLM env (python of $DFLASH_TRT_VLLM_ENV), never in ours: vLLM's own code on our files.

    python vllm_dflash2_probe.py units OUT.json            vLLM's DFlash2 pieces on fixed inputs
    python vllm_dflash2_probe.py decode TARGET DRAFTER B PROMPTS.json OUT.json

`units`: vllm/model_executor/models/qwen3_dflash.py `_resolve_layer_attention` on config variants,
qwen3_dflash2.py `_grouped_conv` (its CPU path) and `_score_edges` on seeded float64 tensors.
`decode`: vLLM's offline LLM, greedy, token ids in, with speculative_config method "dflash" on the
DFlash2 drafter (vLLM picks DFlash2Speculator from its architecture), and without speculation.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def units(out):
    from types import SimpleNamespace

    import torch
    from transformers import Qwen3Config
    from vllm.model_executor.models import qwen3_dflash, qwen3_dflash2

    # mixed sliding/full drafters ask the current vLLM config whether the V2 model runner is on (which
    # needs Triton: not on CPU); answer yes so that the resolution itself is what gets compared
    qwen3_dflash.get_current_vllm_config = lambda: SimpleNamespace(use_v2_model_runner=True)

    variants = json.loads(sys.stdin.read())
    res = {"attention": {}}
    for name, cfg in variants.items():
        c = Qwen3Config(**{k: v for k, v in cfg.items() if k != "dflash_config"})
        c.dflash_config = cfg.get("dflash_config", {})
        if "is_causal" in cfg:
            c.is_causal = cfg["is_causal"]
        try:
            res["attention"][name] = [list(qwen3_dflash._resolve_layer_attention(c, i))
                                      for i in range(cfg["num_hidden_layers"])]
        except Exception as e:  # noqa: BLE001  (reported, compared by the test)
            res["attention"][name] = f"{type(e).__name__}: {e}"
    g = torch.Generator().manual_seed(0)
    T, H, G, taps, B = 8, 32, 4, 2, 4   # two blocks of 4 rows
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    delta = torch.randn(T, taps, H // G, generator=g, dtype=torch.float64)
    base = torch.randn(taps, H, generator=g, dtype=torch.float64)
    res["conv"] = qwen3_dflash2._grouped_conv(x, delta, base, B, H // G, G, taps).tolist()
    V, R, K, S = 16, 4, 3, 3
    pred, succ = (torch.randn(V, R, generator=g, dtype=torch.float64) for _ in range(2))
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(S)])[None]
    unary = torch.randn(1, S, K, generator=g, dtype=torch.float64)
    hid = torch.randn(1, S, R, generator=g, dtype=torch.float64)
    anchor = torch.tensor([5])
    res["edges"] = qwen3_dflash2._score_edges(pred, succ, cand, unary, hid, anchor, K).tolist()
    res["edge_inputs"] = {"pred": pred.tolist(), "succ": succ.tolist(), "cand": cand.tolist(), "unary": unary.tolist(),
                          "hid": hid.tolist(), "x": x.tolist(), "delta": delta.tolist(), "base": base.tolist()}
    Path(out).write_text(json.dumps(res))


def decode(target, drafter, B, prompts_file, out):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(prompts_file).read_text())
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    res = {}
    for mode in ("dflash", "ar"):
        kw = {"model": target, "dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0}
        if mode == "dflash":
            kw["speculative_config"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": int(B) - 1}
        try:
            llm = LLM(**kw)
        except Exception as e:  # noqa: BLE001  the engine's refusal, reported as it says it
            res[mode] = {"refused": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
            break   # nothing to compare AR with
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
        res[mode] = [list(o.outputs[0].token_ids) for o in outs]
        if mode == "dflash":
            try:
                m = llm.get_metrics()
                res["metrics"] = {x.name: getattr(x, "value", None) or getattr(x, "values", None) for x in m
                                  if "spec_decode" in x.name}
            except Exception as e:  # noqa: BLE001
                res["metrics"] = f"{type(e).__name__}: {e}"
        del llm
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    if sys.argv[1] == "units":
        units(sys.argv[2])
    else:
        decode(*sys.argv[2:7])
