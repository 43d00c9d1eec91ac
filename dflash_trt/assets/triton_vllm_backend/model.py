"""A Triton Python-based backend named `vllm` with the interface of Triton's vLLM backend
(triton-inference-server/vllm_backend src/model.py: model.json = engine arguments; inputs text_input, stream,
sampling_parameters (JSON of vllm.SamplingParams), exclude_input_in_output; output text_output; decoupled),
written for dflash-trt (none of that code): the bundle's triton/vllm model runs with it wherever NGC's backend
is absent, e.g. with vLLM's CPU build. Triton loads it as backends/vllm/model.py with the Python backend's
stub, whose env must import vllm with numpy<2 (stacks/vllm/server.py, make_vllm_stub_env). The engine is vllm's
LLMEngine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the stub is not a Python executable a spawned
engine-core process could start from), stepped by one thread; execute() only queues requests (decoupled).
"""
import json
import locale
import os
import queue
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class _Request:
    def __init__(self, sender, prompt, stream, exclude_input):
        self.sender, self.prompt, self.stream, self.exclude_input = sender, prompt, stream, exclude_input
        self.sent = 0  # characters of the cumulative text already streamed


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def _resolve(path, root: Path):
    """A relative path in model.json is relative to the bundle root (triton/<model>/../..)."""
    return path if not isinstance(path, str) or os.path.isabs(path) or not (root / path).exists() else str(root / path)


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("the vllm model must be decoupled (config.pbtxt)")
        model_dir = Path(args["model_repository"])
        engine_args = json.loads((model_dir / args["model_version"] / "model.json").read_text())
        root = model_dir.parent.parent
        for key in ("model", "tokenizer"):
            if key in engine_args:
                engine_args[key] = _resolve(engine_args[key], root)
        spec = engine_args.get("speculative_config")
        if isinstance(spec, dict) and "model" in spec:
            engine_args["speculative_config"] = {**spec, "model": _resolve(spec["model"], root)}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The stub's embedded Python keeps the C locale (PYTHONUTF8 is not read there, measured), and
        # importing vLLM 0.32 reads UTF-8 templates with open()'s locale encoding (torch/_inductor/
        # utils.py load_template): "UnicodeDecodeError: 'ascii' codec".
        if locale.getpreferredencoding(False).lower() in ("ascii", "ansi_x3.4-1968"):
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.SamplingParams = SamplingParams
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
        self.pending = queue.Queue()
        self.active = {}
        self.next_id = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        pb_utils.Logger.log_info(f"vllm: engine ready ({engine_args.get('model')}, speculative "
                                 f"{(spec or {}).get('method', 'none')})")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt = _scalar(request, "text_input", "")
                params = json.loads(_scalar(request, "sampling_parameters", "{}") or "{}")
                sampling = self.SamplingParams(**params)
                state = _Request(sender, prompt, bool(_scalar(request, "stream", False)),
                                 bool(_scalar(request, "exclude_input_in_output", False)))
            except Exception as e:  # noqa: BLE001 (any bad input is this request's error)
                self._fail(sender, f"bad request: {e}")
                continue
            self.next_id += 1
            self.pending.put((str(self.next_id), prompt, sampling, state))

    def _fail(self, sender, message):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send(self, state, text, final):
        out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
        state.sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                          flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def _loop(self):
        while not self.stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            try:
                while True:
                    rid, prompt, sampling, state = self.pending.get_nowait() if busy else self.pending.get(timeout=0.1)
                    try:
                        self.engine.add_request(rid, prompt, sampling)
                        self.active[rid] = state
                    except Exception as e:  # noqa: BLE001 (vLLM refuses the request: its message)
                        self._fail(state.sender, str(e))
                    busy = True
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                continue
            for out in self.engine.step():
                state = self.active.get(out.request_id)
                if state is None:
                    continue
                text = out.outputs[0].text if out.outputs else ""
                if state.stream:
                    if len(text) > state.sent or out.finished:
                        self._send(state, text[state.sent:], out.finished)
                        state.sent = len(text)
                elif out.finished:
                    self._send(state, text if state.exclude_input else state.prompt + text, True)
                if out.finished:
                    del self.active[out.request_id]

    def finalize(self):
        self.stopping.set()
        self.thread.join(timeout=60)
