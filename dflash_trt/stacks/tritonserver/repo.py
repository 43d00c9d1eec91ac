"""The bundle's Triton model repository, triton/ (docs/pipeline.md): tensorrt_llm (TensorRT-LLM's LLM
API with DFlash, GPU; when the trtllm stack is served), dflash_reference (our reference runtime, CPU) and
vllm (when the vllm stack is served). config.pbtxt files are rendered from dflash_trt/assets/triton_templates
(a folder NOT named `triton`: one on sys.path shadows the `triton` compiler modelopt imports) and parsed
back with Triton's own schema (tritonclient's model_config_pb2), so a typo fails the build, not the server.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from string import Template

import yaml

from dflash_trt.errors import DFlashError


def _template(*parts: str) -> str:
    """assets/triton_templates/<model>/<name>, or <name> alone: a file every model carries in its 1/ folder."""
    return resources.files("dflash_trt").joinpath("assets", "triton_templates", *parts).read_text()


def parse_model_config(text: str, source: str = "config.pbtxt"):
    """Parse protobuf text with Triton's ModelConfig schema; unknown fields are errors."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise DFlashError(f"{source}: cannot validate, tritonclient[grpc] is not installed ({e}); "
                          "pip install 'dflash-trt[serve]'") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise DFlashError(f"{source}: not a valid Triton ModelConfig: {e}") from None


def llmapi_model_yaml(serve_cfg: dict, target_path: str, *, decoupled: bool = True, max_batch_size: int = 0) -> dict:
    """1/model.yaml of the tensorrt_llm model: the trtllm-serve LLM arguments plus the target
    path and `triton_config` (TensorRT-LLM's llmapi model reads both)."""
    return {"model": target_path, **serve_cfg,
            "triton_config": {"max_batch_size": max_batch_size, "decoupled": decoupled}}


def _yaml(header: str, data: dict) -> str:
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def write_triton_repo(dest: str | Path, *, llm_yaml: dict | None, reference: dict, validate: bool = True,
                      vllm_engine_args: dict | None = None) -> list[Path]:
    """Write the repository under dest. `llm_yaml` from llmapi_model_yaml(), or None when the
    bundle serves no TensorRT-LLM (then only dflash_reference is written); `reference` = {target,
    drafter, block_size, dtype, max_new_tokens, chat, decode_slots, max_queue, max_prompt_bytes}.
    vllm_engine_args: the vllm model's 1/model.json (configs/vllm.json "engine_args"), or None. Returns the files."""
    dest = Path(dest)
    files = {}
    if llm_yaml is not None:
        tc = llm_yaml["triton_config"]
        files |= {
            "tensorrt_llm/config.pbtxt": Template(_template("tensorrt_llm", "config.pbtxt")).substitute(
                max_batch_size=int(tc["max_batch_size"]), decoupled="true" if tc["decoupled"] else "false"),
            "tensorrt_llm/1/model.py": _template("tensorrt_llm", "model.py"),
            "tensorrt_llm/1/dflash_metrics.py": _template("dflash_metrics.py"),
            "tensorrt_llm/1/model.yaml": _yaml(
                "# TensorRT-LLM LLM API arguments (tensorrt_llm.LLM), written by dflash-trt build.\n"
                "# Relative paths are relative to the bundle root. triton_config mirrors config.pbtxt.\n", llm_yaml),
        }
    files |= {
        "dflash_reference/config.pbtxt": Template(_template("dflash_reference", "config.pbtxt")).substitute(
            decoupled="true"),
        "dflash_reference/1/model.py": _template("dflash_reference", "model.py"),
        "dflash_reference/1/dflash_metrics.py": _template("dflash_metrics.py"),
        "dflash_reference/1/model.yaml": _yaml(
            "# dflash-trt reference runtime settings, written by dflash-trt build.\n"
            "# Relative paths are relative to the bundle root.\n", reference),
    }
    if vllm_engine_args is not None:
        files |= {"vllm/config.pbtxt": _template("vllm", "config.pbtxt"),
                  "vllm/1/model.json": json.dumps(vllm_engine_args, indent=2) + "\n"}
    written = []
    for rel, text in files.items():
        if validate and rel.endswith("config.pbtxt"):
            cfg = parse_model_config(text, rel)
            if cfg.name != rel.split("/")[0]:
                raise DFlashError(f"{rel}: model name {cfg.name!r} does not match its folder")
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        written.append(p)
    return written
