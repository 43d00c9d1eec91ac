"""The numbering of the target layers whose hidden states feed the drafter, in every stack's
convention (docs/layer-ids.md). A wrong id does not fail: it only drops acceptance. So every
convention is one function below, each pinned to the code that defines it:

- z-lab / TensorRT-LLM: `dflash_config.target_layer_ids`, 0-based decoder-layer OUTPUTS
  (feature i = HF `hidden_states[i + 1]`). TensorRT-LLM's `DFlashDecodingConfig.target_layer_ids`
  takes the same numbers (docs/layer-ids.md).
- vllm-project/speculators: `aux_hidden_state_layer_ids` count hidden-state indices, 0 = the
  embeddings, so they are z-lab + 1 (speculators `convert/dflash` converter and its test
  `tests/unit/convert/test_dflash_converter.py`: [1,9,17,25,33] -> [2,10,18,26,34]).
- vLLM: reads the drafter's config.json. `get_eagle3_aux_layers_from_config`
  (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) takes `eagle_aux_hidden_state_layer_ids`
  as they are, else `[i + 1 for i in dflash_config.target_layer_ids]` ("Add 1 to convert DFlash's
  aux layer id semantics"); its target models collect the aux state at the ENTRY of layer idx.
  So the ids vLLM runs with are z-lab + 1.
- SGLang: `parse_dflash_draft_config` (python/sglang/srt/speculative/dflash_utils.py) reads the
  0-based `dflash_config.target_layer_ids` and checks 0 <= id < num_target_layers; the target's
  `set_dflash_layers_to_capture` then captures "before layer id + 1". So SGLang expects the
  z-lab numbers in the config (a speculators-format id maps to it with -1); the capture points
  it derives are listed separately as `capture_before_layer`.

One module for all of them, not one per stack: the conventions are defined against each other
(the manifest records the ids in every one, and the tests pin them side by side).
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
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise DFlashError(f"drafter target_layer_ids {ids}: {bad} outside the target's {num_target_layers} layers")
    return {"zlab": ids, "trtllm": list(ids), "speculators": zlab_to_speculators(ids),
            "vllm": zlab_to_vllm(ids), "sglang": zlab_to_sglang(ids)}
