"""Triton Python-backend model: TensorRT-LLM's LLM API (PyTorch backend) with DFlash.

Written into a bundle by `dflash-trt build`; runs in NVIDIA's
`nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3` image (it imports `tensorrt_llm`).
The request / response tensors and the model.yaml layout are those of TensorRT-LLM's own
`triton_backend/all_models/llmapi` model, so clients and tooling written for it work here; this
file is a smaller implementation of the same contract that also resolves the bundle's relative
paths (`model`, `speculative_config.speculative_model`: relative to the bundle root, two folders
above this model's folder, or $DFLASH_BUNDLE_ROOT).

Multi-GPU tensor parallelism inside one node is handled by the LLM API itself; across nodes,
start the server with `trtllm-llmapi-launch tritonserver --model-repository ...` under MPI.
"""
import asyncio
import json
import os
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

# request tensor -> tensorrt_llm.SamplingParams argument
SAMPLING_INPUTS = {
    "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k",
    "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_max_tokens": "max_tokens",
    "sampling_param_seed": "seed",
    "sampling_param_exclude_input_from_output": "exclude_input_from_output",
}


def _value(x):
    if isinstance(x, bytes):
        return x.decode("utf-8")
    return x.item() if hasattr(x, "item") else x


def read_request(request):
    """(prompt, sampling kwargs, streaming, return_finish_reason) of one Triton request."""
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        raise pb_utils.TritonModelException("input text_input is missing")
    prompts = tensor.as_numpy().reshape(-1)
    if prompts.size != 1:
        raise pb_utils.TritonModelException(f"input text_input: one prompt per request, got {prompts.size}")
    params = {}
    for name, arg in SAMPLING_INPUTS.items():
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is not None:
            params[arg] = _value(t.as_numpy().reshape(-1)[0])
    stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
    if stop is not None:
        params["stop"] = [_value(s) for s in stop.as_numpy().reshape(-1)]

    def flag(name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return bool(t.as_numpy().reshape(-1)[0]) if t is not None else False

    return _value(prompts[0]), params, flag("streaming"), flag("return_finish_reason")


def load_llm_args(version_dir: Path, bundle_root: Path) -> tuple[dict, dict]:
    """(LLM keyword arguments, triton_config) from model.yaml, bundle-relative paths resolved."""
    with open(version_dir / "model.yaml") as f:
        cfg = yaml.safe_load(f) or {}
    triton_config = cfg.pop("triton_config", {}) or {}

    def where(p):
        p = Path(str(p))
        return str(p if p.is_absolute() else (bundle_root / p).resolve())

    cfg["model"] = where(cfg["model"])
    spec = cfg.get("speculative_config")
    if isinstance(spec, dict) and spec.get("speculative_model"):
        spec["speculative_model"] = where(spec["speculative_model"])
    return cfg, triton_config


class TritonPythonModel:
    def initialize(self, args):
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        self.SamplingParams = SamplingParams
        model_dir = Path(args["model_repository"])
        version_dir = model_dir / str(args.get("model_version") or "1")
        bundle_root = Path(os.environ.get("DFLASH_BUNDLE_ROOT") or model_dir.parent.parent)
        llm_args, triton_config = load_llm_args(version_dir, bundle_root)
        self.decoupled = bool(triton_config.get("decoupled", True))
        self.model_config = json.loads(args["model_config"])
        # dict sections (speculative_config, kv_cache_config, ...) become TensorRT-LLM config objects
        llm_args = update_llm_args_with_extra_dict({}, llm_args)
        pb_utils.Logger.log_info(f"[dflash] starting the LLM API with {llm_args}")
        self.llm = LLM(**llm_args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _response(self, output, delta, return_finish_reason):
        completion = output.outputs[0]
        text = getattr(completion, "text_diff", completion.text) if delta else completion.text
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if return_finish_reason:
            tensors.append(pb_utils.Tensor("finish_reason",
                                           np.array([str(completion.finish_reason).encode()], dtype=np.object_)))
        metrics = getattr(completion, "request_perf_metrics", None)
        spec = getattr(metrics, "speculative_decoding", None) if metrics is not None else None
        if spec is not None:
            tensors += [
                pb_utils.Tensor("acceptance_rate", np.array([spec.acceptance_rate], dtype=np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens",
                                np.array([spec.total_accepted_draft_tokens], dtype=np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.array([spec.total_draft_tokens], dtype=np.int32)),
            ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    async def _serve(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt, params, streaming, want_reason = read_request(request)
            if streaming and not self.decoupled:
                raise pb_utils.TritonModelException("streaming needs the decoupled transaction policy")
            params.setdefault("return_perf_metrics", True)  # acceptance statistics
            sampling = self.SamplingParams(**params)
            last = None
            async for out in self.llm.generate_async(prompt, sampling, streaming=streaming):
                last = out
                if streaming:
                    sender.send(self._response(out, True, want_reason), flags=final if out.finished else 0)
            if not streaming:
                response = self._response(last, False, want_reason)
                if sender is None:
                    return response
                sender.send(response, flags=final)
        except Exception as e:
            error = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
            if sender is None:
                return error
            sender.send(error, flags=final)
        return None

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                asyncio.run_coroutine_threadsafe(self._serve(request, request.get_response_sender()), self.loop)
            return None
        futures = [asyncio.run_coroutine_threadsafe(self._serve(r, None), self.loop) for r in requests]
        return [f.result() for f in futures]

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
