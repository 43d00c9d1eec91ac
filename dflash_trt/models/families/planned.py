"""Decoders the planner sizes from config.json by hand (plan/planner.target_shape) that the CPU
reference runtime does not run: Qwen2, Mistral (dense, Llama's layout), Qwen3-MoE and Mixtral.
Rows only, no `build`: models/families.FAMILIES does not list them.
"""
from __future__ import annotations

from dflash_trt.models.families.family import Family

TRAITS = {
    "qwen2": Family(hand_sized=True),
    "mistral": Family(hand_sized=True),
    # transformers 5.24 Qwen3MoeSparseMoeBlock: experts of moe_intermediate_size; decoder_sparse_step and
    # mlp_only_layers leave some layers a dense MLP of intermediate_size
    "qwen3_moe": Family(hand_sized=True, experts=True, qk_norm=True, expert_width_key="moe_intermediate_size",
                        sparse_moe_layers=True),
    "mixtral": Family(hand_sized=True, experts=True),
}
