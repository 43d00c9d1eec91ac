"""Triton Python-backend model: TensorRT-LLM's LLM API (PyTorch backend) with DFlash.

Written into a bundle by `dflash-trt build`; runs in NVIDIA's `tritonserver:<yy.mm>-trtllm-python-py3` image.
Its interface is that of TensorRT-LLM's own llmapi model (NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/
tensorrt_llm, config.pbtxt @ 0a71057313ec, 1/model.py and 1/helpers.py @ 044a90d209e3): the same tensors and
SamplingParams defaults, `stop` cancels a request id's generations, streamed responses carry the whole text so
far; so clients written for upstream's model work unchanged. Added here: bundle-relative paths (`model`,
`speculative_config.speculative_model`: relative to the bundle root, two folders above this model's folder, or
$DFLASH_BUNDLE_ROOT) and the dflash_* metrics (1/dflash_metrics.py). Tensor parallelism inside a node is the LLM
API's; across nodes, start `trtllm-llmapi-launch tritonserver --model-repository ...` under MPI.
"""
import asyncio
import json
import os
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml
from dflash_metrics import Metrics  # 1/dflash_metrics.py, shared with the dflash_reference model

# request tensor -> tensorrt_llm.SamplingParams argument, and upstream's defaults
SAMPLING_INPUTS = {f"sampling_param_{a}": a for a in (
    "best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens", "seed",
    "exclude_input_from_output", "return_perf_metrics")}
SAMPLING_DEFAULTS = {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}
OUTPUT_FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
STATS_PERIOD_S = 1.0


def _value(x):
    if isinstance(x, (bytes, np.bytes_)):
        return x.decode("utf-8")
    return x.item() if hasattr(x, "item") else x


def _scalar(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy()
    if arr.size != 1:
        raise pb_utils.TritonModelException(f"Expected a scalar tensor for tensor {name}")
    return _value(arr.reshape(-1)[0])


def read_request(request):
    """(prompt, SamplingParams kwargs, streaming, output flags) of one Triton request."""
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        raise pb_utils.TritonModelException("text_input is missing from the request")
    prompts = tensor.as_numpy()
    if prompts.ndim > 1 or prompts.size != 1:
        raise pb_utils.TritonModelException("The current implementation only supports text_input being a 1D tensor "
                                            "of one prompt.")
    given = {arg: _scalar(request, name) for name, arg in SAMPLING_INPUTS.items()}
    params = SAMPLING_DEFAULTS | {arg: v for arg, v in given.items() if v is not None}
    stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
    if stop is not None:
        params["stop"] = [_value(s) for s in stop.as_numpy().reshape(-1)]
    flags = {f: bool(_scalar(request, f) or False) for f in OUTPUT_FLAGS}
    return _value(prompts.reshape(-1)[0]), params, bool(_scalar(request, "streaming") or False), flags


def lora_request(request):
    """upstream helpers.get_lora_request_from_request: all of lora_id, lora_name, lora_path or none."""
    lid, name, path = (_scalar(request, n) for n in ("lora_id", "lora_name", "lora_path"))
    if lid is None and name is None and path is None:
        return None
    if lid is None or name is None or path is None:
        raise pb_utils.TritonModelException("lora_id, lora_name, and lora_path must all be provided together")
    source = _scalar(request, "lora_ckpt_source") or "hf"
    if source not in ("hf", "nemo"):
        raise pb_utils.TritonModelException(f"lora_ckpt_source must be one of ('hf', 'nemo'), got {source!r}")
    if not os.path.exists(path):
        raise pb_utils.TritonModelException(f"lora_path does not exist on the Triton server's filesystem: {path}")
    from tensorrt_llm.executor.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int(lid), lora_path=path, lora_ckpt_source=source)


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


def _tensor(name, values, dtype):
    return pb_utils.Tensor(name, np.asarray(values, dtype=dtype))


def response_tensors(output, flags, perf: bool):
    """upstream `_create_response`: text_output = output.text (cumulative), the requested
    reason / logprob outputs, and the perf-metric outputs when the request asked for them."""
    outs = output.outputs
    tensors = [_tensor("text_output", [o.text.encode("utf-8") for o in outs], np.object_)]
    for reason in ("finish_reason", "stop_reason"):
        if flags[f"return_{reason}"]:
            tensors.append(_tensor(reason, [str(getattr(o, reason)).encode() for o in outs], np.object_))
    if flags["return_cumulative_logprob"]:
        tensors.append(_tensor("cumulative_logprob", [o.cumulative_logprob or 0.0 for o in outs], np.float32))
    metrics = getattr(outs[0], "request_perf_metrics", None)
    if perf and metrics is not None:
        kv, timing, spec = metrics.kv_cache_metrics, metrics.timing_metrics, metrics.speculative_decoding

        def ns(t):  # datetime.timedelta since the epoch, as upstream converts it
            return int(t.total_seconds() * 1e9) if hasattr(t, "total_seconds") else int(t)

        tensors += [
            _tensor("kv_cache_reused_block", [kv.num_reused_blocks], np.int32),
            _tensor("kv_cache_hit_rate", [kv.kv_cache_hit_rate], np.float32),
            _tensor("kv_cache_alloc_new_blocks", [kv.num_new_allocated_blocks], np.int32),
            _tensor("kv_cache_alloc_total_blocks", [kv.num_total_allocated_blocks], np.int32),
            _tensor("kv_cache_missed_block", [kv.num_missed_blocks], np.int32),
            *(_tensor(f"{t}_ns", [ns(getattr(timing, t))], np.int64)
              for t in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time")),
            _tensor("acceptance_rate", [spec.acceptance_rate], np.float32),
            _tensor("total_accepted_draft_tokens", [spec.total_accepted_draft_tokens], np.int32),
            _tensor("total_draft_tokens", [spec.total_draft_tokens], np.int32),
        ]
    return tensors


def _answer(sender, response):
    """Send the final response, or return it where there is no sender (not decoupled: execute() returns it)."""
    if sender is None:
        return response
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return None


def _failure(e):
    # upstream: a text_output "N/A" with the error
    return pb_utils.InferenceResponse(output_tensors=[_tensor("text_output", [b"N/A"], np.object_)],
                                      error=pb_utils.TritonError(f"Error generating request: {e}"))


def verify_blocks(output, max_draft_len):
    """Tokens per verify block of a finished request, from its speculative counters: every
    block drafted max_draft_len tokens and produced accepted + 1 (the bonus)."""
    metrics = getattr(output.outputs[0], "request_perf_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None)
    if spec is None or not max_draft_len or not spec.total_draft_tokens:
        return []
    blocks = max(1, round(spec.total_draft_tokens / max_draft_len))
    accepted = spec.total_accepted_draft_tokens
    return [1 + accepted // blocks + (1 if i < accepted % blocks else 0) for i in range(blocks)]


class TritonPythonModel:
    def initialize(self, args):
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        self.SamplingParams = SamplingParams
        model_dir = Path(args["model_repository"])
        version = str(args.get("model_version") or "1")
        bundle_root = Path(os.environ.get("DFLASH_BUNDLE_ROOT") or model_dir.parent.parent)
        llm_args, triton_config = load_llm_args(model_dir / version, bundle_root)
        self.decoupled = bool(triton_config.get("decoupled", True))
        self.max_draft_len = int((llm_args.get("speculative_config") or {}).get("max_draft_len") or 0)
        # dict sections (speculative_config, kv_cache_config, ...) become TensorRT-LLM config objects
        llm_args = update_llm_args_with_extra_dict({}, llm_args)
        pb_utils.Logger.log_info(f"[dflash] starting the LLM API with {llm_args}")
        self.llm = LLM(**llm_args)
        self.metrics = Metrics(args.get("model_name", "tensorrt_llm"), version)
        self.active, self.by_request_id, self.lock = 0, {}, threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stats_task = asyncio.run_coroutine_threadsafe(self._stats_loop(), self.loop)

    async def _stats_loop(self):
        """Waiting requests and KV-cache use from the LLM's iteration stats
        (get_stats_async; numQueuedRequests, kvCacheStats used / max blocks)."""
        while True:
            try:
                async for stat in self.llm.get_stats_async(timeout=2):
                    if isinstance(stat, str):
                        stat = json.loads(stat)
                    self.metrics.set("dflash_requests_waiting", stat.get("numQueuedRequests", 0))
                    kv = stat.get("kvCacheStats") or {}
                    if kv.get("maxNumBlocks"):
                        used = kv.get("usedNumBlocks", kv["maxNumBlocks"] - kv.get("freeNumBlocks", kv["maxNumBlocks"]))
                        self.metrics.set("dflash_kv_cache_utilization", used / kv["maxNumBlocks"])
            except Exception as e:  # stats are best effort; serving goes on
                pb_utils.Logger.log_warn(f"[dflash] iteration stats unavailable: {e}")
            await asyncio.sleep(STATS_PERIOD_S)

    def _cancel(self, request_id, sender):
        """upstream handle_stop_request: `stop` aborts the generations of a request id."""
        if not request_id:
            _answer(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "A request id must be provided for request cancellation")))
            return
        with self.lock:
            for generation in self.by_request_id.pop(request_id, []):
                generation.abort()
        _answer(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "Request cancelled by client", pb_utils.TritonError.CANCELLED)))

    async def _serve(self, request, sender):
        request_id = request.request_id()
        try:
            prompt, params, streaming, flags = read_request(request)
            if streaming and not self.decoupled:
                raise pb_utils.TritonModelException("Streaming is only supported in decoupled mode.")
            perf = bool(params.pop("return_perf_metrics"))
            # always measured, for the dflash_* metrics; returned to the client only if it asked
            sampling = self.SamplingParams(return_perf_metrics=True, **params)
            generation = self.llm.generate_async(prompt, sampling, streaming=streaming,
                                                 lora_request=lora_request(request))
        except Exception as e:
            return _answer(sender, _failure(e))
        with self.lock:
            self.active += 1
            self.by_request_id.setdefault(request_id, []).append(generation)
            self.metrics.set("dflash_requests_active", self.active)
        last = None
        try:
            async for out in generation:
                last = out
                if request.is_cancelled():
                    generation.abort()
                    break
                if streaming:
                    sender.send(pb_utils.InferenceResponse(output_tensors=response_tensors(out, flags, perf)),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0)
            if last is not None:
                self.metrics.blocks_done(verify_blocks(last, self.max_draft_len))
            if not streaming or last is None or not last.finished:
                return _answer(sender, pb_utils.InferenceResponse(output_tensors=response_tensors(last, flags, perf))
                               if last is not None else None)
        except Exception as e:
            return _answer(sender, _failure(e))
        finally:
            with self.lock:
                self.active -= 1
                self.metrics.set("dflash_requests_active", self.active)
                gens = self.by_request_id.get(request_id, [])
                if generation in gens:
                    gens.remove(generation)
                if not gens:
                    self.by_request_id.pop(request_id, None)
        return None

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                sender = request.get_response_sender()
                if _scalar(request, "stop"):
                    self._cancel(request.request_id(), sender)
                    continue
                asyncio.run_coroutine_threadsafe(self._serve(request, sender), self.loop)
            return None
        futures = [asyncio.run_coroutine_threadsafe(self._serve(r, None), self.loop) for r in requests]
        return [f.result() for f in futures]

    def finalize(self):
        self.stats_task.cancel()
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
