"""The numbering of the target layers whose hidden states feed the drafter, in every stack's
convention (docs/layer-ids.md: what an id means, the table, a worked example). A wrong id does not
fail, it only drops acceptance, so every convention is one function below, pinned to the code that
defines it:

- z-lab / TensorRT-LLM `target_layer_ids`: 0-based decoder-layer OUTPUTS (HF `hidden_states[i + 1]`);
- vllm-project/speculators `aux_hidden_state_layer_ids`: z-lab + 1 (its `convert/dflash` converter and
  `tests/unit/convert/test_dflash_converter.py`: [1,9,17,25,33] -> [2,10,18,26,34]);
- vLLM: z-lab + 1 (`get_eagle3_aux_layers_from_config`, vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py);
- SGLang: the z-lab numbers (`parse_dflash_draft_config`, python/sglang/srt/speculative/dflash_utils.py),
  captured before layer id + 1 (`set_dflash_layers_to_capture`, listed as `capture_before_layer`).
"""
from __future__ import annotations

from dflash_trt.errors import DFlashError


def zlab_to_speculators(ids: list[int]) -> list[int]:
    return [int(i) + 1 for i in ids]


def speculators_to_zlab(ids: list[int]) -> list[int]:
    out = [int(i) - 1 for i in ids]
    if any(i < 0 for i in out):
        raise DFlashError(f"speculators aux_hidden_state_layer_ids {ids}: 0 is the embedding output, not a decoder layer")
    return out


def zlab_to_vllm(ids: list[int]) -> list[int]:
    """vLLM's aux hidden-state layer ids (what `eagle_aux_hidden_state_layer_ids` must hold)."""
    return [int(i) + 1 for i in ids]


def zlab_to_sglang(ids: list[int]) -> list[int]:
    """SGLang's `dflash_config.target_layer_ids`: the z-lab numbers unchanged."""
    return [int(i) for i in ids]


def sglang_capture_points(ids: list[int]) -> list[int]:
    """The layer indices SGLang's target captures before (`set_dflash_layers_to_capture`)."""
    return [int(i) + 1 for i in ids]


def layer_ids_by_stack(zlab_ids: list[int], num_target_layers: int) -> dict[str, list[int]]:
    ids = [int(i) for i in zlab_ids]
    if bad := [i for i in ids if not 0 <= i < num_target_layers]:
        raise DFlashError(f"drafter target_layer_ids {ids}: {bad} outside the target's {num_target_layers} layers")
    return {"zlab": ids, "trtllm": list(ids), "speculators": zlab_to_speculators(ids),
            "vllm": zlab_to_vllm(ids), "sglang": zlab_to_sglang(ids)}
