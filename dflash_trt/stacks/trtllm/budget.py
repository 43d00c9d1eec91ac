"""TensorRT-LLM's DFlash draft-context buffer, per rank, and the budget it must fit in.

DFlashWorker keeps the drafter's cross-attention context of every request in fixed CUDA buffers
allocated once (NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/dflash.py @ 2fc4bbbc414379ff,
`_lazy_init_ctx_buffers`):

    ctx_buf      [max_batch, max_ctx, proj_dim]  in the drafter's fc dtype (bf16: 2 bytes)
    ctx_pos_buf  [max_batch, max_ctx]            int64
    ctx_len, batch_to_slot [max_batch]           int64

proj_dim is fc.weight.shape[0], the drafter's hidden size: the fc is a plain nn.Linear, not split
over tensor parallel ranks, so every rank holds the whole buffer for the batch it schedules
(max_batch_size; with attention DP each rank schedules its own max_batch_size). PR #19466
("DFlash buffer sizing/position fixes", open when read) sizes max_ctx as min(max_seq_len,
max_position_embeddings) and checks the buffer when the config is validated: over budget raises
for the VANILLA and FA4 drafter attention backends and warns for TRTLLM. Issue #16005 reports
the buffer at ~80 GB per rank for batch 64 x 131k context.

The budget, as PR #19466's review describes its config-time estimate: on-disk weight bytes as
the resident weights, a fixed 4 GiB overhead, and a 0.70 safety factor; the KV cache takes
free_gpu_memory_fraction of the rest, so the buffer has what is left:

    budget = 0.70 x (1 - free_gpu_memory_fraction) x (GPU memory - weights per rank - 4 GiB)

The formula is our reading of an unmerged PR (its review excerpts; the full diff was not in the
stored sources): a model of the check, not the check itself.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
OVERHEAD_BYTES = 4 * GIB        # PR #19466: fixed 4 GiB overhead
SAFETY_FACTOR = 0.70            # PR #19466: _DFLASH_BUDGET_SAFETY_FACTOR
POSITION_BYTES = 8              # ctx_pos_buf is int64


@dataclass(frozen=True)
class DraftContextBudget:
    max_batch: int              # requests one rank schedules
    max_ctx: int                # min(max_seq_len, drafter max_position_embeddings)
    proj_dim: int               # drafter hidden size
    buffer_bytes: int           # per rank
    budget_bytes: int           # per rank
    gpu_memory_bytes: int
    weights_bytes_per_rank: int
    free_gpu_memory_fraction: float

    @property
    def fits(self) -> bool:
        return self.buffer_bytes <= self.budget_bytes

    @property
    def largest_batch(self) -> int:
        """The largest max_batch_size whose buffer fits the budget at this max_ctx."""
        return self.budget_bytes // self.per_request_bytes if self.per_request_bytes else 0

    @property
    def per_request_bytes(self) -> int:
        return self.max_ctx * (self.proj_dim * 2 + POSITION_BYTES) + 2 * POSITION_BYTES

    def describe(self) -> str:
        def g(b: int) -> str:
            return f"{b / GIB:.1f} GiB"
        return (f"DFlash draft-context buffer {g(self.buffer_bytes)} per rank (max_batch_size {self.max_batch} x "
                f"{self.max_ctx} tokens x {self.proj_dim} bf16 + positions) vs budget {g(self.budget_bytes)} "
                f"(0.70 x (1 - free_gpu_memory_fraction {self.free_gpu_memory_fraction:g}) x ({g(self.gpu_memory_bytes)} "
                f"- weights {g(self.weights_bytes_per_rank)} - 4 GiB))")


def draft_context_budget(*, max_batch: int, max_seq_len: int, drafter_cfg: dict, gpu_memory_bytes: int,
                         weights_bytes_per_rank: int, free_gpu_memory_fraction: float) -> DraftContextBudget:
    proj_dim = int(drafter_cfg["hidden_size"])
    max_pos = drafter_cfg.get("max_position_embeddings")
    max_ctx = min(max_seq_len, int(max_pos)) if max_pos else max_seq_len
    per_request = max_ctx * (proj_dim * 2 + POSITION_BYTES) + 2 * POSITION_BYTES
    free = max(0, gpu_memory_bytes - weights_bytes_per_rank - OVERHEAD_BYTES)
    budget = int(SAFETY_FACTOR * (1 - free_gpu_memory_fraction) * free)
    return DraftContextBudget(max_batch=max_batch, max_ctx=max_ctx, proj_dim=proj_dim,
                              buffer_bytes=max_batch * per_request, budget_bytes=budget,
                              gpu_memory_bytes=gpu_memory_bytes, weights_bytes_per_rank=weights_bytes_per_rank,
                              free_gpu_memory_fraction=free_gpu_memory_fraction)
