"""TensorRT plugin `dflash::KVInject` for the drafter KV-injection kernel (kv_inject_triton.py).

Registered through `tensorrt.plugin` (register / aot_impl); TensorRT is imported only inside
`register_plugin()`, so the kernel configuration, grid and argument order are plain Python, tested
without TensorRT and applied to its symbolic shapes inside aot_impl (only +, * and //).

Plugin I/O (one TensorRT node; the ONNX node `KVInject` with plugin_namespace "dflash"):
  inputs   ctx_raw [T, H] (fc output), w_kv [L*2*nkv*hd, H], b_kv [L*2*nkv*hd], k_norm_w [L, hd],
           cos [P, hd] fp32, sin [P, hd] fp32, positions [T] i32, slots [T] i32,
           scalars [3] fp32 = (rms_norm_eps, k_scale, v_scale),
           k_cache, v_cache [num_pages, L, nkv, page_size, hd]
  outputs  k_cache_out, v_cache_out: aliased to k_cache, v_cache (updated in place)
  attrs    num_layers, num_kv_heads, head_dim, page_size
"""
from __future__ import annotations

import json
from pathlib import Path

PLUGIN_NAMESPACE = "dflash"
PLUGIN_NAME = "KVInject"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
KERNEL_NAME = "kv_inject_kernel"

INPUT_NAMES = ("ctx_raw", "w_kv", "b_kv", "k_norm_w", "cos", "sin", "positions", "slots", "scalars",
               "k_cache", "v_cache")
OUTPUT_NAMES = ("k_cache_out", "v_cache_out")
SCALAR_NAMES = ("T", "H", "n_kv", "page_shift", "stride_ctx", "stride_page", "stride_layer", "stride_head",
                "stride_tok")

# Kernel tiles per head_dim: BLOCK_T tokens x one head (two halves of hd/2 for rotate-half RoPE);
# tl.dot needs every tile side >= 16, hence BLOCK_T = 16 even for T = 1.
_CONFIGS = {
    64: {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4},
    128: {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4},
}
SUPPORTED_HEAD_DIMS = tuple(_CONFIGS)

# Grid as text, for the manifest (read by people and by other runtimes): x over token tiles,
# y over (layer, K|V, kv head).
GRID_FORMULA = ("(T + BLOCK_T - 1) // BLOCK_T", "num_layers * 2 * num_kv_heads", "1")


def kernel_config(head_dim: int) -> dict:
    if head_dim not in _CONFIGS:
        raise ValueError(f"head_dim {head_dim} has no kernel configuration (supported: {SUPPORTED_HEAD_DIMS})")
    return dict(_CONFIGS[head_dim])


def grid(T, num_layers, num_kv_heads, block_t):
    """Launch grid; works on ints and on TensorRT shape expressions alike."""
    return ((T + block_t - 1) // block_t, num_layers * 2 * num_kv_heads, 1)


def scalar_args(*, T, H, n_kv, page_shift, stride_ctx, stride_page, stride_layer, stride_head, stride_tok):
    """The int32 kernel arguments between the input and the output pointers, in kernel order."""
    vals = dict(T=T, H=H, n_kv=n_kv, page_shift=page_shift, stride_ctx=stride_ctx, stride_page=stride_page,
                stride_layer=stride_layer, stride_head=stride_head, stride_tok=stride_tok)
    return [vals[n] for n in SCALAR_NAMES]


def paged_cache_scalars(T, H, num_layers, num_kv_heads, head_dim, page_size):
    """scalar_args for a contiguous ctx_raw [T, H] and a contiguous paged cache
    [num_pages, L, nkv, page_size, hd] (strides in elements)."""
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} is not a power of two")
    stride_tok = head_dim
    stride_head = page_size * stride_tok
    stride_layer = num_kv_heads * stride_head
    stride_page = num_layers * stride_layer
    return scalar_args(T=T, H=H, n_kv=num_kv_heads, page_shift=page_size.bit_length() - 1, stride_ctx=H,
                       stride_page=stride_page, stride_layer=stride_layer, stride_head=stride_head,
                       stride_tok=stride_tok)


def select_kernel(manifest: dict, sm: int, head_dim: int, act_dtype: str, cache_dtype: str) -> dict:
    """The manifest entry compiled for this GPU (sm = 10*major + minor) and these dtypes."""
    for k in manifest["kernels"]:
        if k["sm"] == sm and k["head_dim"] == head_dim and k["act_dtype"] == act_dtype and k["cache_dtype"] == cache_dtype:
            return k
    raise ValueError(f"no kernel for sm_{sm}, head_dim {head_dim}, {act_dtype} activations, {cache_dtype} cache "
                     f"in the plugin manifest (built for {manifest.get('arch')})")


def register_plugin(manifest_path):
    """Register dflash::KVInject with TensorRT (needs the `tensorrt` package and a GPU machine).
    The AOT implementation hands TensorRT the PTX from the plugin manifest for the current GPU."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    manifest_path = Path(manifest_path)
    manifest = json.loads(manifest_path.read_text())
    trt_dtype_names = {trt.bfloat16: "bf16", trt.float16: "fp16", trt.float32: "fp32", trt.fp8: "fp8e4nv"}

    @trtp.register(PLUGIN_ID)
    def _desc(ctx_raw: trtp.TensorDesc, w_kv: trtp.TensorDesc, b_kv: trtp.TensorDesc, k_norm_w: trtp.TensorDesc,
              cos: trtp.TensorDesc, sin: trtp.TensorDesc, positions: trtp.TensorDesc, slots: trtp.TensorDesc,
              scalars: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
              num_layers: int, num_kv_heads: int, head_dim: int, page_size: int
              ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return k_cache.aliased(), v_cache.aliased()

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(ctx_raw, w_kv, b_kv, k_norm_w, cos, sin, positions, slots, scalars, k_cache, v_cache,
             num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, outputs, tactic):
        import torch

        major, minor = torch.cuda.get_device_capability()
        entry = select_kernel(manifest, 10 * major + minor, head_dim, trt_dtype_names[ctx_raw.dtype],
                              trt_dtype_names[k_cache.dtype])
        T, H = ctx_raw.shape_expr[0], ctx_raw.shape_expr[1]
        cfg = kernel_config(head_dim)
        gx, gy, gz = grid(T, num_layers, num_kv_heads, cfg["BLOCK_T"])
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = gx, gy, gz
        params.block_x = cfg["num_warps"] * 32
        params.shared_mem = entry["shared_mem"]
        scal = paged_cache_scalars(0, 0, num_layers, num_kv_heads, head_dim, page_size)
        scal[0], scal[1], scal[4] = T, H, H  # symbolic T and H
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in scal])
        ptx = (manifest_path.parent / entry["ptx"]).read_bytes()
        return entry["name"].encode(), ptx, params, extra

    return PLUGIN_ID
