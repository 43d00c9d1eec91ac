"""Benchmark: KV injection, fused PyTorch path (2) against the plain reference (1), on CPU.

Per accepted-token batch T = 1, 4, 16, the embedded drafter (dflash_trt/assets/smollm2-135m-dflash;
when it is not there, a random drafter of its shape: hidden 576, 9 heads / 3 kv heads, head_dim 64,
5 target features, 1 and 2 layers), in float32 and bfloat16 (the CPU runtime's two dtypes). Both
write into the runtime's contiguous cache [L, nkv, max_len, hd]; the fused path is what the runtime
runs (two GEMMs + the C epilogue, or the torch epilogue where no C compiler exists).
Goal: fused >= 1.5x faster at T = 16 (in every dtype measured).

Also the FLOP and byte counts of the fused op for a gpt-oss-120b-sized drafter (H 2880, 8 layers,
64 / 8 heads, head_dim 64, 5 features, bf16 weights), with the memory-bound time on each GPU of the
hardware catalog (dflash_trt/hardware.json), so the GPU roofline time can be read off.

    python bench/bench_kv_inject.py [--out FILE] [--iters N]      # prints JSON
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "dflash_trt" / "assets" / "smollm2-135m-dflash"


def drafters(dtype: torch.dtype):
    from dflash_trt.models.config import DrafterConfig
    from dflash_trt.models.drafter import DFlashDrafter, load_drafter

    if (EMBEDDED / "config.json").is_file():
        yield "embedded smollm2-135m-dflash", load_drafter(EMBEDDED, dtype, max_len=4096)
        return
    for layers in (1, 2):
        cfg = DrafterConfig.from_dict(dict(
            hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, block_size=16, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 8, 15, 22, 26])))
        torch.manual_seed(0)
        d = DFlashDrafter(cfg, max_len=4096).eval().to(dtype)
        yield f"random drafter of the embedded shape, {layers} layer(s)", d


def time_pair(fns: dict, iters: int) -> dict:
    """Median and min seconds per call, the candidates interleaved call by call so that load from
    other processes on a shared machine hits both alike."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    samples = {n: [] for n in fns}
    for _ in range(iters):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[n].append(time.perf_counter() - t0)
    return {n: (statistics.median(x), min(x)) for n, x in samples.items()}


def bench_cpu(iters: int, dtype: torch.dtype) -> list[dict]:
    from dflash_trt.runtime.kv_inject import fused_injector, reference_inject_contiguous

    rows = []
    for label, d in drafters(dtype):
        c = d.config
        inj = fused_injector(d)  # built once per drafter, as the runtime does
        k = torch.zeros(c.num_hidden_layers, c.num_key_value_heads, 4096, c.head_dim, dtype=dtype)
        v = torch.zeros_like(k)
        for T in (1, 4, 16):
            feats = torch.randn(T, c.n_features * c.hidden_size).to(dtype)
            pos = torch.arange(100, 100 + T)
            r = time_pair({"reference": lambda: reference_inject_contiguous(d, feats, pos, k, v, 100),
                           "fused": lambda: inj.inject_contiguous(feats, pos, k, v, 100)}, iters)
            rows.append({"drafter": label, "dtype": str(dtype).removeprefix("torch."), "layers": c.num_hidden_layers, "T": T,
                         "reference_us": round(r["reference"][0] * 1e6, 1), "fused_us": round(r["fused"][0] * 1e6, 1),
                         "speedup": round(r["reference"][0] / r["fused"][0], 3),
                         "reference_min_us": round(r["reference"][1] * 1e6, 1),
                         "fused_min_us": round(r["fused"][1] * 1e6, 1),
                         "speedup_min": round(r["reference"][1] / r["fused"][1], 3)})
    return rows


def fused_op_cost(T: int, H=2880, L=8, nkv=8, hd=64, n_feat=5, w_bytes=2, act_bytes=2, cache_bytes=2) -> dict:
    """FLOPs and DRAM bytes of one fused injection (fc GEMM + KV GEMM + epilogue), weights read once."""
    F, N = n_feat * H, L * 2 * nkv * hd
    flops = {"fc_gemm": 2 * T * F * H, "kv_gemm": 2 * T * H * N,
             # hidden_norm: square+sum per ctx element; k_norm: ~4/elem; RoPE: 3/elem; rstd scale: 1/elem
             "epilogue": T * (2 * H + N * 1 + (N // 2) * (4 + 3))}
    nbytes = {"fc_weight": F * H * w_bytes, "kv_weight": N * H * w_bytes, "features": T * F * act_bytes,
              "ctx_raw_write_read": 2 * T * H * act_bytes, "rope_tables": 2 * T * hd * 4,
              "k_norm_weight": L * hd * w_bytes, "cache_write": T * N * cache_bytes}
    total_f, total_b = sum(flops.values()), sum(nbytes.values())
    return {"T": T, "flops": flops, "bytes": nbytes, "total_flops": total_f, "total_bytes": total_b,
            "flop_per_byte": round(total_f / total_b, 2)}


def gpu_roofline(costs: list[dict]) -> dict:
    hw = json.loads((REPO / "dflash_trt" / "hardware.json").read_text())["hardware"]
    out = {}
    for name, h in hw.items():
        bw = h.get("hbm_bytes_per_s")
        if bw:
            out[name] = {"hbm_bytes_per_s": bw,
                         "memory_bound_us": {str(c["T"]): round(c["total_bytes"] / bw * 1e6, 2) for c in costs}}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated; the CPU runtime runs float32 or bfloat16 (make run / bench: bfloat16)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO))
    cpu = [row for name in a.dtypes.split(",") for row in bench_cpu(a.iters, getattr(torch, name.strip()))]
    costs = [fused_op_cost(T) for T in (1, 4, 16)]
    at16 = [r["speedup"] for r in cpu if r["T"] == 16]
    result = {
        "bench": "kv_inject", "machine": {"cpu": platform.processor() or platform.machine(),
                                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "cpu_fused_vs_reference": cpu,
        "goal": {"speedup_at_T16": 1.5, "met": bool(at16) and min(at16) >= 1.5},
        "gpt_oss_120b_drafter": {"shape": {"H": 2880, "layers": 8, "heads": 64, "kv_heads": 8, "head_dim": 64,
                                           "features": 5, "dtype": "bf16 weights/activations, bf16 cache"},
                                 "cost": costs, "roofline": gpu_roofline(costs)},
    }
    text = json.dumps(result, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
