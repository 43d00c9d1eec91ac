"""Where a decode step of the embedded pair goes on this CPU: op-level profile of plain AR decoding and
of DFlash (draft + verify + inject), as JSON (docs/decode-loop.md, "Where a decode step goes").

Per mode, from torch.profiler (self CPU time of every aten op, so shares survive a loaded machine
better than wall-clock does) and cProfile (Python function calls):
  buckets          share of the decode loop's profiled time: gemm (linear / mm / addmm / the lm_head, and
                   the float32 C GEMM: gemm.matmul), attention (CachedAttention's and the drafter's
                   attention: bmm, softmax, masks, GQA expansion, the float32 C attention), kv_write
                   (slice assignments into the caches: aten::copy_ called straight from Python), sampler
                   (argmax / softmax / multinomial / topk in the sampler and the acceptance rule),
                   other_ops (norms, RoPE, SiLU, cat, embedding, views), python (time inside the loop's
                   phases that no aten op accounts for: interpreter, dispatch into torch, the profiler's
                   own cost)
  phases           the same time split by decode-loop stage (prefill excluded): draft, verify,
                   accept (verify bookkeeping), inject, ar_step, sample
  top_ops          the aten ops with the largest self CPU share, with calls per generated token; the
                   C kernels (ctypes calls: no aten op accounts for them) as region:gemm / c_attention / norm
  per_token        aten ops and Python function calls per generated token
and the host: CPU model, flags, threads, torch version, dtype, GEMM path, 1-minute load average.

    PYTHONPATH=. python bench/bench_profile.py [--tokens 64] [--prompts 2] [--threads 2] > profile.json

--ab N instead times one attention layer (100 N alternations), then plain and DFlash decoding, with
the runtime's attention against the previous one
(a repeat_interleave copy of K/V per layer, the mask padded and inverted per layer), alternating
the two N times in this one process so that the load of a shared machine falls on both alike:
the median of the per-pair time ratios (previous / now) and their spread.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_trt.hardware import cpu
from dflash_trt.kernels import attention as kernel_attention
from dflash_trt.kernels import gemm
from dflash_trt.models import layers
from dflash_trt.models import attention as target_attention
from dflash_trt.models import drafter as drafter_module
from dflash_trt.presets.embedded import embedded_drafter_path, ensure_embedded_target
from dflash_trt.runtime import decode
from dflash_trt.runtime.pair import encode_prompt, load_pair

PHASES = {"prefill": (decode, "prefill"), "draft": (decode, "draft"), "verify": (decode, "verify"),
          "accept": (decode, "accept"), "ar_step": (decode, "ar_step"), "sample": (decode, "sample_token"),
          "inject": (decode.DrafterCache, "inject")}
REGIONS = {"attention": [(target_attention.CachedAttention, "attend_cached"),
                         (target_attention.CachedAttention, "store_and_attend")]
           + [(cls, "forward") for cls in vars(drafter_module).values()
              if isinstance(cls, type) and cls.__name__.endswith("Attention")],
           # the C kernels (ctypes calls: no aten op accounts for their time, so they are labelled themselves)
           "gemm": [(gemm, "matmul")], "norm": [(layers.RMSNorm, "forward")],
           "c_attention": [(kernel_attention, "attend"), (kernel_attention, "rope_attend")]}
GEMM_OPS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::_mkldnn_linear"}
SAMPLER_OPS = {"aten::argmax", "aten::softmax", "aten::_softmax", "aten::multinomial", "aten::topk", "aten::sort",
               "aten::cumsum", "aten::cumprod", "aten::eq", "aten::sum", "aten::item", "aten::_local_scalar_dense"}


def _labelled(label: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return run


def instrument() -> None:
    """Wrap the loop's stages and the attention regions in record_function labels (this process only)."""
    for label, (owner, name) in PHASES.items():
        setattr(owner, name, _labelled(f"phase:{label}", getattr(owner, name)))
    for label, sites in REGIONS.items():
        for owner, name in sites:
            if name in vars(owner):
                setattr(owner, name, _labelled(f"region:{label}", vars(owner)[name]))


def _ancestors(ev):
    p = ev.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def bucket_of(ev, chain) -> str:
    names = [ev.name] + [a.name for a in chain]
    if "region:attention" in names or "region:c_attention" in names:
        return "attention"
    if "region:norm" in names:
        return "other_ops"
    if "region:gemm" in names:
        return "gemm"
    if ev.name in GEMM_OPS or any(n in GEMM_OPS for n in names):
        return "gemm"
    if ev.name == "aten::copy_" and (ev.cpu_parent is None or ev.cpu_parent.name.startswith(("phase:", "region:"))):
        return "kv_write"
    phase = next((n for n in names if n.startswith("phase:")), "")
    if phase in ("phase:sample", "phase:accept") or ev.name in SAMPLER_OPS:
        return "sampler"
    return "other_ops"


def summarize(prof, n_tokens: int) -> dict:
    buckets, phases, op_self, op_calls = Counter(), Counter(), Counter(), Counter()
    phase_wall, phase_ops = Counter(), Counter()
    n_ops = 0
    for ev in prof.events():
        if ev.name.startswith("phase:") and not any(a.name.startswith("phase:") for a in _ancestors(ev)):
            phase_wall[ev.name[6:]] += ev.cpu_time_total
            continue
        if not ev.name.startswith(("aten::", "region:")):
            continue
        chain = list(_ancestors(ev))
        phase = next((a.name[6:] for a in reversed(chain) if a.name.startswith("phase:")), None)
        if phase is None or phase == "prefill":
            continue
        n_ops += ev.name.startswith("aten::")
        op_self[ev.name] += ev.self_cpu_time_total
        op_calls[ev.name] += 1
        buckets[bucket_of(ev, chain)] += ev.self_cpu_time_total
        phase_ops[phase] += ev.self_cpu_time_total
    phase_wall.pop("prefill", None)
    for ph, wall in phase_wall.items():
        phases[ph] = wall
        buckets["python"] += max(0.0, wall - phase_ops[ph])
    total = sum(buckets.values())
    share = lambda c: {k: round(v / total, 4) for k, v in sorted(c.items(), key=lambda kv: -kv[1])}  # noqa: E731
    top = sorted(op_self.items(), key=lambda kv: -kv[1])[:15]
    return {"profiled_ms_per_token": round(total / 1e3 / n_tokens, 3), "buckets": share(buckets),
            "phases": share(phases),
            "top_ops": [{"op": k, "share": round(v / total, 4), "calls_per_token": round(op_calls[k] / n_tokens, 1)}
                        for k, v in top],
            "aten_ops_per_token": round(n_ops / n_tokens, 1)}


def python_calls(run, n_tokens: int) -> dict:
    """cProfile over the same decode: Python function calls per generated token, and the most called."""
    pr = cProfile.Profile()
    pr.runcall(run)
    st = pstats.Stats(pr)
    calls = sorted(((v[1], f"{os.path.basename(k[0])}:{k[2]}") for k, v in st.stats.items()), reverse=True)[:10]
    return {"python_calls_per_token": round(st.total_calls / n_tokens, 1),
            "most_called": [{"function": f, "calls_per_token": round(c / n_tokens, 1)} for c, f in calls]}


def _previous_attend_rows(self, q, k, v, blocked):
    """The attention before bench_profile.py's first profile: every query head's K/V copied out."""
    k, v = k.repeat_interleave(self.nh // self.nkv, 0), v.repeat_interleave(self.nh // self.nkv, 0)
    s = (q @ k.transpose(1, 2)) * self.hd ** -0.5
    return torch.softmax(s.float().masked_fill(blocked, float("-inf")), dim=-1).to(v.dtype) @ v


def _previous_padded_masks(mask, extra):
    padded = torch.nn.functional.pad(mask, (0, extra), value=False) if extra else mask
    return padded, ~padded


def ab(run, repeats: int) -> dict:
    """Interleaved A/B: the previous attention (A) against the runtime's (B), per mode."""
    cls, mod = target_attention.CachedAttention, target_attention
    now = (cls._attend_rows, mod.padded_masks)
    variants = {"previous": (_previous_attend_rows, _previous_padded_masks), "now": now}
    out = {}
    for mode in ("ar", "dflash"):
        secs = {name: [] for name in variants}
        for i in range(repeats + 1):
            for name, (rows, masks) in variants.items():
                cls._attend_rows, mod.padded_masks = rows, masks
                t0 = time.perf_counter()
                n = run(mode)
                if i:   # the first round warms both up
                    secs[name].append((time.perf_counter() - t0) / n)
        cls._attend_rows, mod.padded_masks = now
        ratios = sorted(a / b for a, b in zip(secs["previous"], secs["now"]))
        out[mode] = {"ms_per_token": {k: round(1e3 * statistics.median(v), 2) for k, v in secs.items()},
                     "previous_over_now_median": round(statistics.median(ratios), 3),
                     "previous_over_now_min_max": [round(ratios[0], 3), round(ratios[-1], 3)]}
    return out


def ab_layer(repeats: int, kv_len: int = 512, start: int = 300) -> dict:
    """The same A/B on one attention layer alone (9 heads over 3 KV heads of 64, SmolLM2's; bf16), 30 calls
    sharing one mask as the layers of a pass do: far less noise than whole decodes on a loaded host."""
    cls, mod = target_attention.CachedAttention, target_attention
    now = (cls._attend_rows, mod.padded_masks)
    variants = {"previous": (_previous_attend_rows, _previous_padded_masks), "now": now}
    a = cls(9, 3, 64)
    a.k_cache, a.v_cache = torch.randn(2, 3, kv_len, 64, dtype=torch.bfloat16)
    out = {}
    for T in (1, 8):
        q, pos = torch.randn(9, T, 64, dtype=torch.bfloat16), torch.arange(start, start + T)
        secs, outs = {name: [] for name in variants}, {}
        for i in range(repeats + 1):
            for name, (rows, masks) in variants.items():
                cls._attend_rows, mod.padded_masks = rows, masks
                mask = torch.arange(start + T)[None, :] <= pos[:, None]   # fresh per pass, as the shell makes it
                t0 = time.perf_counter()
                for _ in range(30):
                    outs[name] = a.attend_cached(q, start, mask)
                if i:
                    secs[name].append((time.perf_counter() - t0) / 30)
        cls._attend_rows, mod.padded_masks = now
        r = sorted(p / n for p, n in zip(secs["previous"], secs["now"]))
        out[f"rows_{T}"] = {"us_per_layer": {k: round(1e6 * statistics.median(v), 1) for k, v in secs.items()},
                            "previous_over_now_median": round(statistics.median(r), 3),
                            "previous_over_now_p10_p90": [round(r[len(r) // 10], 3), round(r[9 * len(r) // 10], 3)],
                            "bitwise_equal": bool(torch.equal(outs["previous"], outs["now"]))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts profiled")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ab", type=int, default=0, metavar="N", help="interleaved A/B repeats instead of the profile")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    pair = load_pair(ensure_embedded_target(), embedded_drafter_path(), a.dtype)
    from dflash_trt.bench.endpoint import read_prompts
    prompts = [encode_prompt(pair.tokenizer, r["prompt"]) for r in read_prompts(None)[:a.prompts]]

    def run(mode):
        return sum(len(decode.generate(pair.target, pair.drafter if mode == "dflash" else None, p,
                                       max_new_tokens=a.tokens, mode=mode, stop_ids=()).token_ids) for p in prompts)

    report = {"host": {"cpu": cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "load_average_1min": os.getloadavg()[0]},
              "dtype": str(pair.target.dtype).removeprefix("torch."), "gemm_path": gemm.path(pair.target.dtype),
              "tokens_per_prompt": a.tokens, "prompts": len(prompts), "modes": {}}
    if a.ab:
        report["ab_attention_layer"] = ab_layer(100 * a.ab)
        report["ab_attention"] = ab(run, a.ab)
        report["host"]["load_average_1min_end"] = os.getloadavg()[0]
        print(json.dumps(report, indent=2))
        return 0
    instrument()
    for mode in ("ar", "dflash"):
        run(mode)   # warm-up: packed weights, caches, oneDNN primitives
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            n = run(mode)
        report["modes"][mode] = {**summarize(prof, n), **python_calls(lambda: run(mode), n)}
    report["host"]["load_average_1min_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
