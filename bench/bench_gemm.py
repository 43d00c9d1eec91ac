"""Decode-size GEMMs on this CPU: the measurement behind kernels/gemm.py's choice.

For the linear layers of the embedded target (SmolLM2-135M: q/o 576x576, k/v 192x576, gate/up
1536x576, down 576x1536, lm_head 49152x576) at M = 1..17 rows, median microseconds of:
  mkl      F.linear in float32 (MKL sgemm)
  onednn   float32 with the weight prepacked for oneDNN (torch.ops.mkldnn._reorder_linear_weight)
  dflash   csrc/gemm.c with its packed weight
  bf16     the runtime's bfloat16 linear (oneDNN, one row run as two; native only on AVX512-BF16 / AMX)
and, per backend, whether row i of an M-row product equals the one-row product bitwise (batch
invariance: what keeps greedy DFlash token-identical to greedy AR). Weights cycle through a set
larger than the L3 cache, as in a real forward pass, so M=1 is bound by memory as it is in decode.

    python bench/bench_gemm.py [--threads 1] [--reps 15] > gemm.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch
import torch.nn.functional as F

from dflash_trt.hardware import cpu
from dflash_trt.kernels import gemm
from dflash_trt.models.layers import linear

SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "gate_proj": (1536, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 9, 16, 17)
CACHE_BYTES = 96 << 20   # more than any L3 we run on: each call reads its weight from DRAM


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def _backends(lib):
    def mkl(x, ws):
        return [F.linear(x, w) for w in ws]

    def dflash(x, ws):
        return [gemm.matmul(lib, x, gemm.packed(w)) for w in ws]

    out = {"mkl": (torch.float32, mkl, lambda w: w), "dflash": (torch.float32, dflash, lambda w: w)}
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        def onednn(x, pws):
            return [torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "") for pw in pws]
        out["onednn"] = (torch.float32, onednn, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 16))
    def runtime_bf16(x, ws):   # what the runtime runs in bf16: oneDNN, one row as two (models/layers.py)
        return [linear(x, w) for w in ws]

    out["bf16"] = (torch.bfloat16, runtime_bf16, lambda w: w)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = gemm.library()
    if lib is None:
        print("csrc/gemm.c did not build: no C compiler?", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    report = {"cpu": cpu(), "threads": a.threads, "gemm_path": gemm.path(), "torch": torch.__version__,
              "isa": torch.backends.cpu.get_cpu_capability(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        copies = max(1, CACHE_BYTES // (n * k * 4))
        base = [torch.randn(n, k, generator=g) for _ in range(copies)]
        rows = {}
        for backend, (dtype, fn, prep) in _backends(lib).items():
            ws = [prep(w.to(dtype)) for w in base]
            x_all = torch.randn(max(ROWS), k, generator=g).to(dtype)
            one = [fn(x_all[i:i + 1], ws[:1])[0][0] for i in range(max(ROWS))]
            for m in ROWS:
                x = x_all[:m]
                fn(x, ws)   # warm-up (and dflash's packing)
                us = _median_us(functools.partial(fn, x, ws), a.reps) / len(ws)
                block = fn(x, ws[:1])[0]
                invariant = all(torch.equal(block[i], one[i]) for i in range(m))
                rows.setdefault(str(m), {})[backend] = {"us": round(us, 1), "batch_invariant": invariant}
        report["shapes"][name] = {"n": n, "k": k, "rows": rows}
        print(f"{name} {n}x{k}: " + "  ".join(
            f"M={m} " + "/".join(f"{b} {v['us']:.0f}" for b, v in r.items()) for m, r in rows.items()),
            file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
