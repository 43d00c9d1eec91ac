"""Ahead-of-time build of the KV-injection plugin kernel for the user's GPU (docs/kernels.md).

`build_plugin("blackwell" | "hopper", out_dir)` compiles kernels/kv_inject_triton.py with Triton
for every SM of the architecture (blackwell: sm_100, sm_103; hopper: sm_90) and every shipped
variant (head_dim 64/128 x bf16 or FP8 cache), on a CPU-only machine, into

    out_dir/kv_inject_hd{64,128}_bf16_{bf16,fp8e4m3}.sm_{NN}.{cubin,ptx}
    out_dir/plugin.json   kernel names, launch grid formula, num_warps, shared memory, block
                          sizes, dtypes, argument order, source hashes

TensorRT's AOT plugin (kernels/kv_inject_trt.py) hands the PTX of the current GPU's entry to the
engine builder; the cubins serve runtimes that load kernels directly (cuModuleLoadData).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_sms
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.manifest import sha256_file
from dflash_trt.kernels import kv_inject_trt

MANIFEST_FORMAT = "dflash-trt-plugin/1"
# (head_dim, activation/weight dtype, cache dtype); FP8 caches are written as e4m3fn bit patterns.
VARIANTS = [(hd, "bf16", cache) for hd in (64, 128) for cache in ("bf16", "fp8e4m3")]
CONSTEXPRS = ("HEAD_DIM", "BLOCK_T", "BLOCK_K", "FP8")
_CACHE_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "fp8e4m3": "*u8"}


def kernel_signature(arg_names, act: str, cache: str) -> dict:
    """Triton signature (arg name -> type) of one variant, in the kernel's argument order."""
    types = {
        "ctx_ptr": f"*{act}", "w_ptr": f"*{act}", "b_ptr": f"*{act}", "knorm_ptr": f"*{act}",
        "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "slot_ptr": "*i32", "scal_ptr": "*fp32",
        "k_in_ptr": _CACHE_PTR[cache], "v_in_ptr": _CACHE_PTR[cache],
        "k_out_ptr": _CACHE_PTR[cache], "v_out_ptr": _CACHE_PTR[cache],
    }
    return {n: types.get(n, "constexpr" if n in CONSTEXPRS else "i32") for n in arg_names}


def build_plugin(arch: str, out_dir: str | Path, progress: bool = False) -> dict:
    """Compile the kernel for `arch` into out_dir (replaced atomically); returns the manifest."""
    sms_of = arch_sms()
    if arch not in sms_of:
        raise DFlashError(f"--arch {arch!r}: expected one of {', '.join(sms_of)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise DFlashError("TRITON_INTERPRET is set: unset it to compile the plugin ahead of time")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_trt.kernels import kv_inject_triton  # imports triton (the `plugin` extra)

    tmod = kv_inject_trt
    fn = kv_inject_triton.kv_inject_kernel
    kernels = []
    jobs = [(sm, v) for sm in sms_of[arch] for v in VARIANTS]
    with atomic_output_dir(out_dir) as tmp:
        for sm, (hd, act, cache) in tqdm(jobs, desc=f"plugin {arch}", disable=not progress, unit="kernel"):
            cfg = tmod.kernel_config(hd)
            constexprs = {"HEAD_DIM": hd, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_K": cfg["BLOCK_K"],
                          "FP8": cache == "fp8e4m3"}
            sig = kernel_signature(fn.arg_names, act, cache)
            k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", sm, 32),
                               options={"num_warps": cfg["num_warps"]})
            stem = f"kv_inject_hd{hd}_{act}_{cache}.sm_{sm}"
            (tmp / f"{stem}.cubin").write_bytes(k.asm["cubin"])
            (tmp / f"{stem}.ptx").write_text(k.asm["ptx"])
            md = k.metadata
            kernels.append({
                "name": md.name, "sm": sm, "target": f"sm_{sm}a", "head_dim": hd, "act_dtype": act,
                "cache_dtype": cache, "constexprs": constexprs, "num_warps": md.num_warps,
                "num_stages": md.num_stages, "block": [md.num_warps * 32, 1, 1], "shared_mem": md.shared,
                "global_scratch_size": getattr(md, "global_scratch_size", 0),
                "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
                "signature": {n: t for n, t in sig.items() if t != "constexpr"},
                "cubin": f"{stem}.cubin", "ptx": f"{stem}.ptx",
                "cubin_sha256": sha256_file(tmp / f"{stem}.cubin"), "ptx_sha256": sha256_file(tmp / f"{stem}.ptx"),
            })
        manifest = {
            "format": MANIFEST_FORMAT, "plugin_id": tmod.PLUGIN_ID, "arch": arch, "sms": list(sms_of[arch]),
            "kernel": tmod.KERNEL_NAME, "triton_version": triton.__version__,
            "grid": {"formula": list(tmod.GRID_FORMULA), "BLOCK_T": "constexprs.BLOCK_T"},
            "arg_order": [n for n in fn.arg_names if n not in CONSTEXPRS],
            # Triton >= 3.3 appends two pointer parameters to every kernel; pass null pointers when
            # the entry's scratch sizes are 0.
            "hidden_trailing_args": ["global_scratch", "profile_scratch"],
            "inputs": list(tmod.INPUT_NAMES), "outputs": list(tmod.OUTPUT_NAMES),
            "scalar_args": list(tmod.SCALAR_NAMES),
            "source": {"kernel": {"file": "dflash_trt/kernels/kv_inject_triton.py",
                                  "sha256": sha256_file(Path(kv_inject_triton.__file__))},
                       "plugin": {"file": "dflash_trt/kernels/kv_inject_trt.py",
                                  "sha256": sha256_file(Path(kv_inject_trt.__file__))}},
            "kernels": kernels,
        }
        (tmp / "plugin.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
