"""The bundle's Triton model repository.

- every config.pbtxt is parsed with Triton's own schema (tritonclient's model_config_pb2 +
  protobuf text_format), which rejects unknown fields;
- the reference-runtime model's 1/model.py is exercised IN-PROCESS. No Triton server runs here:
  `triton_python_backend_utils` (the module Triton's Python backend injects) is replaced by a
  small test double of Triton's API (tests/helpers.py: Tensor, InferenceRequest /
  InferenceResponse, response sender, TritonError). The model code and the runtime under it are the real ones, and its text
  is compared with what `dflash-trt generate` prints for the same request.
"""

import numpy as np
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from dflash_trt.errors import DFlashError
from dflash_trt.presets.catalog import get_preset
from dflash_trt.stacks.tritonserver.repo import llmapi_model_yaml, parse_model_config, write_triton_repo
from dflash_trt.stacks.trtllm.serve_config import trtllm_serve_config

from helpers import generate_json, load_model_module, make_pb_utils, triton_args


# ---------------------------------------------------------------------------- config.pbtxt
def _repo(tmp_path, reference=None):
    tcfg = get_preset("qwen3-8b").config()
    serve = trtllm_serve_config(target_cfg=tcfg, drafter_path="drafter", block_size=16, mask_token_id=151669,
                                zlab_ids=[1, 9, 17, 25, 33], tp=2, ep=1, pp=1, kv_cache="fp8", arch="blackwell")
    write_triton_repo(tmp_path / "triton", llm_yaml=llmapi_model_yaml(serve, "target"),
                      reference=reference or {"target": "target", "drafter": "drafter", "block_size": 16})
    return tmp_path / "triton"


def test_every_config_pbtxt_parses_with_tritons_schema(tmp_path):
    repo = _repo(tmp_path)
    configs = sorted(repo.glob("*/config.pbtxt"))
    assert [p.parent.name for p in configs] == ["dflash_reference", "tensorrt_llm"]
    for p in configs:
        cfg = text_format.Parse(p.read_text(), model_config_pb2.ModelConfig())
        assert cfg.name == p.parent.name and cfg.backend == "python"
        assert cfg.model_transaction_policy.decoupled  # streaming
        assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
        ins = {i.name: i for i in cfg.input}
        outs = {o.name: o for o in cfg.output}
        assert ins["text_input"].data_type == model_config_pb2.TYPE_STRING
        assert ins["streaming"].data_type == model_config_pb2.TYPE_BOOL and ins["streaming"].optional
        assert {"sampling_param_temperature", "sampling_param_top_k", "sampling_param_top_p",
                "sampling_param_max_tokens"} <= set(ins)
        assert {"text_output", "finish_reason", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens"} <= set(outs)
        assert outs["acceptance_rate"].data_type == model_config_pb2.TYPE_FP32
        assert outs["total_draft_tokens"].data_type == model_config_pb2.TYPE_INT32


def test_unknown_field_fails_to_parse(tmp_path):
    text = (_repo(tmp_path) / "tensorrt_llm" / "config.pbtxt").read_text()
    bad = text.replace('backend: "python"', 'backend: "python"\nspeculative_decoding: true')
    with pytest.raises(text_format.ParseError, match="speculative_decoding"):
        text_format.Parse(bad, model_config_pb2.ModelConfig())
    with pytest.raises(DFlashError, match="not a valid Triton ModelConfig"):
        parse_model_config(bad, "tensorrt_llm/config.pbtxt")


def test_llmapi_model_yaml_has_llm_args_and_triton_config(tmp_path):
    y = yaml.safe_load((_repo(tmp_path) / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert y["model"] == "target" and y["backend"] == "pytorch" and y["tensor_parallel_size"] == 2
    assert y["speculative_config"]["decoding_type"] == "DFlash"
    assert y["speculative_config"]["max_draft_len"] == 15
    assert y["triton_config"] == {"max_batch_size": 0, "decoupled": True}


def test_llmapi_model_reads_triton_requests_and_bundle_paths(tmp_path, pb_cleanup):
    """The tensorrt_llm model's request parsing and path resolution (tensorrt_llm itself is not
    installed here, so the LLM is not started)."""
    repo = _repo(tmp_path)
    pb = make_pb_utils(repo / "tensorrt_llm" / "1")
    mod = load_model_module(repo / "tensorrt_llm" / "1" / "model.py", pb)
    req = pb.InferenceRequest([
        pb.Tensor("text_input", np.array([b"hello"], dtype=np.object_)),
        pb.Tensor("streaming", np.array([True])),
        pb.Tensor("sampling_param_max_tokens", np.array([7], dtype=np.int32)),
        pb.Tensor("sampling_param_temperature", np.array([0.5], dtype=np.float32)),
        pb.Tensor("sampling_param_stop", np.array([b"\n\n", b"END"], dtype=np.object_)),
    ])
    prompt, params, streaming, flags = mod.read_request(req)
    assert prompt == "hello" and streaming is True
    assert flags == {"return_finish_reason": False, "return_stop_reason": False, "return_cumulative_logprob": False}
    assert params["max_tokens"] == 7 and params["temperature"] == pytest.approx(0.5) and params["stop"] == ["\n\n", "END"]
    # upstream helpers.get_sampling_params_from_request defaults
    assert (params["best_of"], params["exclude_input_from_output"], params["return_perf_metrics"]) == (1, False, False)
    llm_args, triton_config = mod.load_llm_args(repo / "tensorrt_llm" / "1", tmp_path)
    assert llm_args["model"] == str(tmp_path / "target")
    assert llm_args["speculative_config"]["speculative_model"] == str(tmp_path / "drafter")
    assert "triton_config" not in llm_args and triton_config["decoupled"] is True


def test_llmapi_model_has_upstreams_full_interface(tmp_path):
    """Every input and output of TensorRT-LLM's llmapi model (tests/upstream_trtllm.py, read from
    its config.pbtxt), with the same types, dims and optionality, and nothing else."""
    import upstream_trtllm as trt

    cfg = parse_model_config((_repo(tmp_path) / "tensorrt_llm" / "config.pbtxt").read_text())
    dt = model_config_pb2.DataType.Name
    assert [(i.name, dt(i.data_type), list(i.dims), i.optional) for i in cfg.input] == trt.LLMAPI_INPUTS
    assert [(o.name, dt(o.data_type), list(o.dims)) for o in cfg.output] == trt.LLMAPI_OUTPUTS


def test_llmapi_model_streams_cumulative_text(tmp_path, pb_cleanup):
    """upstream _create_response sends output.text, the whole text so far, in every streamed
    response. RequestOutput here is a plain record with the attributes that function reads."""
    import types

    import upstream_trtllm as trt

    assert trt.LLMAPI_STREAMS == "cumulative"
    repo = _repo(tmp_path)
    pb = make_pb_utils(repo / "tensorrt_llm" / "1")
    mod = load_model_module(repo / "tensorrt_llm" / "1" / "model.py", pb)
    flags = {"return_finish_reason": True, "return_stop_reason": False, "return_cumulative_logprob": False}
    texts = []
    for so_far in ("Hel", "Hello", "Hello world"):
        out = types.SimpleNamespace(outputs=[types.SimpleNamespace(text=so_far, finish_reason=None, stop_reason=None,
                                                                   cumulative_logprob=None)])
        tensors = {t.name(): t.as_numpy() for t in mod.response_tensors(out, flags, perf=False)}
        texts.append(tensors["text_output"][0].decode())
        assert set(tensors) == {"text_output", "finish_reason"}
    assert texts == ["Hel", "Hello", "Hello world"]


def test_llmapi_verify_blocks_add_up_to_the_request_counters(tmp_path, pb_cleanup):
    import types

    repo = _repo(tmp_path)
    mod = load_model_module(repo / "tensorrt_llm" / "1" / "model.py", make_pb_utils(repo / "tensorrt_llm" / "1"))
    spec = types.SimpleNamespace(total_draft_tokens=15 * 7, total_accepted_draft_tokens=23)
    out = types.SimpleNamespace(outputs=[types.SimpleNamespace(
        request_perf_metrics=types.SimpleNamespace(speculative_decoding=spec))])
    blocks = mod.verify_blocks(out, max_draft_len=15)
    assert len(blocks) == 7 and sum(blocks) == 23 + 7  # accepted drafts + one bonus token per block


# -------------------------------------------------------------- the reference model, in-process
def test_reference_model_returns_the_same_text_as_generate(tmp_path, pb_cleanup):
    """Triton is not running here: its Python-backend API is the test double above."""
    from dflash_trt.models.tiny import make_tiny

    make_tiny("llama", tmp_path / "t", tmp_path / "d", seed=3)
    repo = _repo(tmp_path / "bundle", reference={"target": str(tmp_path / "t"), "drafter": str(tmp_path / "d"),
                                                 "block_size": 8, "dtype": "float32", "max_new_tokens": 128,
                                                 "chat": True})
    pb = make_pb_utils(repo / "dflash_reference" / "1")
    mod = load_model_module(repo / "dflash_reference" / "1" / "model.py", pb)
    model = mod.TritonPythonModel()
    model.initialize(triton_args(repo, "dflash_reference"))

    prompt = "the quick brown fox"
    requests = [pb.InferenceRequest([pb.Tensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
                                     pb.Tensor("sampling_param_max_tokens", np.array([24], dtype=np.int32)),
                                     pb.Tensor("streaming", np.array([s]))]) for s in (False, True)]
    assert model.execute(requests) is None  # decoupled: answers go through the senders
    model.finalize()  # the decode slot drains the queue before it stops
    expected = generate_json(tmp_path / "t", tmp_path / "d", prompt, 24)
    for req in requests:
        [(resp, flags)] = req.get_response_sender().sent
        assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and not resp.has_error()
        out = {t.name(): t.as_numpy() for t in resp.output_tensors()}
        assert out["text_output"][0].decode() == expected["text"]
        drafted, accepted = int(out["total_draft_tokens"][0]), int(out["total_accepted_draft_tokens"][0])
        assert drafted == expected["blocks"] * 7
        assert accepted == sum(a - 1 for a in expected["accepted_per_block"])
        assert out["acceptance_rate"][0] == pytest.approx(accepted / drafted)
        assert out["tau"][0] == pytest.approx(expected["tau"])


def test_reference_model_reports_bad_requests_as_errors(tmp_path, pb_cleanup):
    from dflash_trt.models.tiny import make_tiny

    make_tiny("llama", tmp_path / "t", tmp_path / "d", seed=3)
    repo = _repo(tmp_path / "bundle", reference={"target": str(tmp_path / "t"), "drafter": str(tmp_path / "d"),
                                                 "block_size": 8})
    pb = make_pb_utils(repo / "dflash_reference" / "1")
    mod = load_model_module(repo / "dflash_reference" / "1" / "model.py", pb)
    model = mod.TritonPythonModel()
    model.initialize(triton_args(repo, "dflash_reference"))
    req = pb.InferenceRequest([pb.Tensor("sampling_param_max_tokens", np.array([4], dtype=np.int32))])
    model.execute([req])  # refused before it is queued
    [(resp, flags)] = req.get_response_sender().sent
    assert resp.has_error() and "text_input" in resp.error().message()
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
