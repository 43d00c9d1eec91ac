"""What the pipeline asks of a model family (one config.json `model_type`), as one row of data.

The planner, the checkpoint shapes, the quantizer and build look a row up (models/families.family) and
never compare a model_type with a name (tests/test_name_branches.py). The defaults are a plain
Llama-style decoder's answers; docs/families.md lists who reads each field.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    # ---- config.json -> checkpoint tensor shapes (models/shapes.py)
    # (head_dim, num_key_value_heads) of one layer, given the config's: Gemma 4's full-attention layers differ
    layer_attention_dims: Callable[[dict, int, int | None, int | None], tuple[int | None, int | None]] = \
        lambda c, layer, hd, nkv: (hd, nkv)
    # one layer's MLP width, given the config's: Gemma 4's KV-sharing layers are double-wide
    layer_intermediate_size: Callable[[dict, int, int], int] = lambda c, layer, inter: inter
    q_proj_with_gate: bool = False        # q_proj also emits the attention-output gate (2 x heads x head_dim)
    qk_norm_over_all_heads: bool = False  # q_norm / k_norm span all heads' features, not one head's
    # a MoE checkpoint's own tensors per layer {name under the layer: shape} (gpt-oss: MXFP4 blocks, biases, sinks)
    expert_tensor_shapes: Callable[..., dict[str, tuple[int, ...]]] = lambda *, H, nh, E, inter: {}
    # ---- weight formats (quant/quantize.py, bundle/build.py, plan/planner.resolve_quant)
    # its experts ship as MXFP4 (gpt-oss): kept as they are, only attention is quantized, TensorRT-LLM serves
    # the MXFP4 experts only (no FP8 / NVFP4 re-quantization)
    mxfp4_experts: bool = False
    architectures: tuple[str, ...] = ()   # config.json `architectures` that name it where model_type is missing
    # modules ModelOpt leaves unquantized but does not list in exclude_modules (fnmatch patterns)
    unlisted_excluded: tuple[str, ...] = ()
    # ---- the planner's parameter groups (plan/planner.target_shape)
    # counted from config.json by hand; False: from transformers' model of the config on the meta device
    # (plan/family_shapes.py)
    hand_sized: bool = False
    experts: bool = False                 # a MoE: num_local_experts / num_experts experts per MoE layer
    expert_width_key: str = "intermediate_size"   # config.json key of an expert's (or the MLP's) width
    sparse_moe_layers: bool = False       # decoder_sparse_step / mlp_only_layers pick the MoE layers (Qwen3-MoE)
    qk_norm: bool = False                 # per-head q / k RMSNorm weights
    attention_sinks: bool = False         # one learned sink logit per head
    expert_biases: bool = False           # router bias and gate_up / down biases per expert
    # ---- make-tiny (models/tiny.py): its transformers config class ("config") and what the tiny target sets
    # beyond the shared small sizes; None: make-tiny makes none of this family
    tiny: dict | None = field(default=None, hash=False, compare=False)


PLAIN = Family()   # a model_type no row names
