"""Triton Python-backend model serving the dflash-trt reference runtime (lossless DFlash, CPU).

Written into a bundle by `dflash-trt build`; `dflash-trt serve --bundle DIR` runs it in a real Triton server on
any machine. It needs the `dflash-trt` package in the Python environment of Triton's Python backend. Settings:
1/model.yaml (`target` and `drafter` are absolute, or relative to the bundle root, two folders above this
model's folder); tensors and settings: docs/pipeline.md, "Triton model repository". The model is decoupled:
execute() validates each request and queues it; `decode_slots` worker threads, each with its own pair and KV
cache, decode and answer with one final response (the reference runtime produces a generation in one call, so
a streaming request gets its full text at once). dflash_kv_cache_utilization here is the KV positions reserved
by the active requests (prompt + max_tokens + one block) over the slots' capacity.
"""
import math
import os
import queue
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml
from dflash_metrics import Metrics  # 1/dflash_metrics.py, shared with the tensorrt_llm model


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    arr = tensor.as_numpy()
    if arr.size != 1:
        raise BadRequest(f"input {name}: expected one value, got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value


def _prompt(request, max_bytes):
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        raise BadRequest("input text_input is missing")
    arr = tensor.as_numpy().reshape(-1)
    if arr.size != 1:
        raise BadRequest(f"input text_input: one prompt per request, got {arr.size}")
    value = arr[0]
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    if len(raw) > max_bytes:
        raise BadRequest(f"input text_input: {len(raw)} bytes, more than this model's max_prompt_bytes = {max_bytes}")
    return raw.decode("utf-8", errors="replace")


class BadRequest(Exception):
    """A request the model refuses: answered with Triton's INVALID_ARG (HTTP 400), not INTERNAL (500)."""


def _failure(e):
    """The error response to an exception or a message."""
    if isinstance(e, BadRequest):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            str(e), pb_utils.TritonError.INVALID_ARG))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))


def _tensor(name, value, dtype=np.object_):
    return pb_utils.Tensor(name, np.array([value], dtype=dtype))


# (input, generate() argument, type, default, check, what it must be): the sampling parameters
# the runtime takes (dflash_trt/runtime/sampling.py), checked before a request is queued
SAMPLING = (
    ("sampling_param_temperature", "temperature", float, 0.0, lambda v: math.isfinite(v) and v >= 0,
     "a finite number >= 0 (0 = greedy)"),
    ("sampling_param_top_p", "top_p", float, 1.0, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    ("sampling_param_top_k", "top_k", int, 0, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    ("sampling_param_seed", "seed", int, 0, lambda v: 0 <= v < 1 << 64, "an integer in [0, 2**64)"),
)
HEALTH_INPUT = "health_check"   # a request with it true is answered at once from execute(): the stub lives


class TritonPythonModel:
    def initialize(self, args):
        from dflash_trt.runtime.pair import load_pair  # the reference runtime; imported here, not at module load

        model_dir = Path(args["model_repository"])
        version = str(args.get("model_version") or "1")
        with open(model_dir / version / "model.yaml") as f:
            self.settings = s = yaml.safe_load(f) or {}
        bundle_root = Path(os.environ.get("DFLASH_BUNDLE_ROOT") or model_dir.parent.parent)

        def where(p):
            p = Path(str(p))
            return p if p.is_absolute() else (bundle_root / p).resolve()

        self.target_dir, self.drafter_dir = where(s["target"]), where(s["drafter"])
        self.block_size = int(s["block_size"])
        self.max_len = int(s.get("max_len", 4096))
        self.max_prompt_bytes = int(s.get("max_prompt_bytes", 1 << 20))
        slots = max(1, int(s.get("decode_slots", 1)))
        # one pair per slot: a pair owns its KV caches, so two requests never share one
        self.pairs = [load_pair(self.target_dir, self.drafter_dir, s.get("dtype", "float32"), max_len=self.max_len)
                      for _ in range(slots)]
        self.metrics = Metrics(args.get("model_name", "dflash_reference"), version)
        self.queue = queue.Queue(maxsize=max(1, int(s.get("max_queue", 64))))
        self.reserved = [0] * slots  # KV positions reserved by each slot's active request
        self.workers = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(slots)]
        for w in self.workers:
            w.start()
        pb_utils.Logger.log_info(f"[dflash_reference] target {self.target_dir}, drafter {self.drafter_dir}, "
                                 f"block size {self.block_size}, {slots} decode slot(s)")

    def _parse(self, request):
        """The generate() arguments of a request; a bad request raises before it is queued."""
        prompt = _prompt(request, self.max_prompt_bytes)
        max_tokens = int(_scalar(request, "sampling_param_max_tokens", self.settings.get("max_new_tokens", 128)))
        if max_tokens < 1:
            raise BadRequest(f"input sampling_param_max_tokens: {max_tokens}, must be at least 1")
        block_size = int(_scalar(request, "block_size", self.block_size))
        if not 2 <= block_size <= self.block_size:
            raise BadRequest(f"input block_size: {block_size}, must be 2..{self.block_size}")
        kw = {"prompt": prompt, "max_new_tokens": max_tokens, "block_size": block_size,
              "chat": not bool(_scalar(request, "raw_prompt", not self.settings.get("chat", True)))}
        for name, arg, cast, default, ok, must in SAMPLING:
            value = _scalar(request, name)
            if value is not None and not ok(value):
                raise BadRequest(f"input {name}: {value}, must be {must}")
            kw[arg] = cast(default if value is None else value)
        return kw

    def _generate(self, slot, kw):
        from dflash_trt.runtime.pair import encode_prompt, generate

        pair = self.pairs[slot]
        ids = encode_prompt(pair.tokenizer, kw.pop("prompt"), kw.pop("chat"))
        need = len(ids) + kw["max_new_tokens"] + kw["block_size"] + 1
        if need > self.max_len:
            raise BadRequest(f"prompt of {len(ids)} tokens + {kw['max_new_tokens']} new tokens "
                             f"exceeds this model's max_len = {self.max_len}")
        self.reserved[slot] = need
        self._gauges()
        result = generate(pair, ids, mode="dflash", **kw)
        self.metrics.blocks_done(list(result.accepted_per_block))
        # TensorRT-LLM's speculative-decoding counters: every verify pass offered block_size - 1 drafted
        # tokens; accepted_per_block counts the bonus token too
        drafted = len(result.accepted_per_block) * (kw["block_size"] - 1)
        accepted = sum(max(0, a - 1) for a in result.accepted_per_block)
        rate = accepted / drafted if drafted else 0.0
        finish = "length" if len(result.token_ids) >= kw["max_new_tokens"] else "stop"
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor("text_output", result.text.encode("utf-8")), _tensor("finish_reason", finish.encode("utf-8")),
            _tensor("acceptance_rate", rate, np.float32), _tensor("total_accepted_draft_tokens", accepted, np.int32),
            _tensor("total_draft_tokens", drafted, np.int32), _tensor("tau", result.tau or 0.0, np.float32)])

    def _gauges(self):
        active = sum(1 for r in self.reserved if r)
        self.metrics.set("dflash_requests_active", active)
        self.metrics.set("dflash_requests_waiting", self.queue.qsize())
        self.metrics.set("dflash_kv_cache_utilization", sum(self.reserved) / (self.max_len * len(self.reserved)))

    def _worker(self, slot):
        while True:
            item = self.queue.get()
            if item is None:
                return
            sender, kw = item
            try:
                response = self._generate(slot, kw)
            except Exception as e:  # report to the client, keep serving
                response = _failure(e)
            finally:
                self.reserved[slot] = 0
                self._gauges()
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _health(self):
        """The answer to a health request: every decode worker is alive (the stub is, as it answers)."""
        dead = [i for i, w in enumerate(self.workers) if not w.is_alive()]
        if dead:
            return _failure(f"dflash_reference: decode worker(s) {dead} died")
        return pb_utils.InferenceResponse(output_tensors=[_tensor("text_output", b""),
                                                          _tensor("finish_reason", b"health")])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                if _scalar(request, HEALTH_INPUT, False):
                    response = self._health()
                else:
                    self.queue.put_nowait((sender, self._parse(request)))
                    continue
            except queue.Full:
                response = _failure(f"dflash_reference: {self.queue.maxsize} requests already waiting (max_queue); "
                                    "retry later")
            except Exception as e:
                response = _failure(e)
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._gauges()

    def finalize(self):
        for _ in self.workers:
            self.queue.put(None)
        for w in self.workers:
            w.join(timeout=60)
        self.pairs = []
