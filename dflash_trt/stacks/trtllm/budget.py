"""TensorRT-LLM's DFlash draft-context buffer, per rank, and the budget it must fit in (docs/deploy.md).

DFlashWorker keeps the drafter's context of every request in CUDA buffers allocated once
(NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/dflash.py @ 2fc4bbbc414379ff, `_lazy_init_ctx_buffers`):
ctx_buf [max_batch, max_ctx, proj_dim] in the fc's dtype (bf16), ctx_pos_buf [max_batch, max_ctx] int64, and
ctx_len, batch_to_slot [max_batch] int64. proj_dim is the drafter's hidden size; the fc is not split over
tensor-parallel ranks, so every rank holds the whole buffer for the batch it schedules (issue #16005: ~80 GB
per rank for batch 64 x 131k context). PR #19466 (open when read) sizes max_ctx as min(max_seq_len,
max_position_embeddings) and checks the buffer at config time against
    budget = 0.70 x (1 - free_gpu_memory_fraction) x (GPU memory - weights per rank - 4 GiB)
(over it, the VANILLA and FA4 drafter backends raise, TRTLLM warns): our reading of the PR's review, a
model of the check, not the check itself.
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
