"""Triton Python-backend model serving the dflash-trt reference runtime (lossless DFlash, CPU).

Written into a bundle by `dflash-trt build`. It needs the `dflash-trt` package in the Python
environment of Triton's Python backend (`pip install dflash-trt`). Settings come from
1/model.yaml: `target` and `drafter` (absolute, or relative to the bundle root, which is two
folders above this model's folder), `dtype`, `max_new_tokens`, `chat`.

Request tensors (same names as TensorRT-LLM's llmapi model): text_input, streaming,
sampling_param_{temperature,top_k,top_p,max_tokens,seed}, plus block_size and raw_prompt.
Response tensors: text_output, finish_reason, acceptance_rate, total_accepted_draft_tokens,
total_draft_tokens, tau. The model is decoupled: each request gets its responses through its
response sender, the last one flagged final.
"""
import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    arr = tensor.as_numpy()
    if arr.size != 1:
        raise pb_utils.TritonModelException(f"input {name}: expected one value, got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value


def _prompt(request):
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        raise pb_utils.TritonModelException("input text_input is missing")
    arr = tensor.as_numpy().reshape(-1)
    if arr.size != 1:
        raise pb_utils.TritonModelException(f"input text_input: one prompt per request, got {arr.size}")
    value = arr[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def stats_from_result(result, block_size):
    """TensorRT-LLM's speculative-decoding counters for one generation: every verify pass
    offered block_size - 1 drafted tokens; accepted_per_block counts the bonus token too."""
    blocks = len(result.accepted_per_block)
    drafted = blocks * (block_size - 1)
    accepted = sum(max(0, a - 1) for a in result.accepted_per_block)
    return accepted, drafted, (accepted / drafted if drafted else 0.0)


class TritonPythonModel:
    def initialize(self, args):
        from dflash_trt.runtime.pair import load_pair  # the reference runtime; imported here, not at module load

        model_dir = Path(args["model_repository"])
        version_dir = model_dir / str(args.get("model_version") or "1")
        with open(version_dir / "model.yaml") as f:
            self.settings = yaml.safe_load(f) or {}
        self.model_config = json.loads(args["model_config"])
        bundle_root = Path(os.environ.get("DFLASH_BUNDLE_ROOT") or model_dir.parent.parent)

        def where(p):
            p = Path(str(p))
            return p if p.is_absolute() else (bundle_root / p).resolve()

        self.target_dir = where(self.settings["target"])
        self.drafter_dir = where(self.settings["drafter"])
        self.pair = load_pair(self.target_dir, self.drafter_dir, self.settings.get("dtype", "float32"))
        self.block_size = int(self.settings["block_size"])
        self.logger = pb_utils.Logger
        self.logger.log_info(f"[dflash_reference] target {self.target_dir}, drafter {self.drafter_dir}, "
                             f"block size {self.block_size}")

    def _run(self, request):
        from dflash_trt.runtime.pair import generate

        prompt = _prompt(request)
        max_tokens = _scalar(request, "sampling_param_max_tokens", self.settings.get("max_new_tokens", 128))
        block_size = int(_scalar(request, "block_size", self.block_size))
        raw = bool(_scalar(request, "raw_prompt", not self.settings.get("chat", True)))
        result = generate(
            self.pair, prompt,
            max_new_tokens=int(max_tokens),
            temperature=float(_scalar(request, "sampling_param_temperature", 0.0)),
            top_k=int(_scalar(request, "sampling_param_top_k", 0)),
            top_p=float(_scalar(request, "sampling_param_top_p", 1.0)),
            seed=int(_scalar(request, "sampling_param_seed", 0)),
            block_size=block_size, mode="dflash", chat=not raw,
        )
        accepted, drafted, rate = stats_from_result(result, block_size)
        finish = "length" if len(result.token_ids) >= int(max_tokens) else "stop"
        tensors = [
            pb_utils.Tensor("text_output", np.array([result.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([finish.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("acceptance_rate", np.array([rate], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([accepted], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([drafted], dtype=np.int32)),
            pb_utils.Tensor("tau", np.array([result.tau or 0.0], dtype=np.float32)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        # Decoupled: answer through each request's sender. The reference runtime produces the
        # whole generation in one call, so a streaming request gets it as one final response.
        for request in requests:
            sender = request.get_response_sender()
            try:
                response = self._run(request)
            except Exception as e:  # report to the client, keep serving
                response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.pair = None
