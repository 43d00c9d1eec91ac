"""Triton Inference Server: the bundle's model repository (repo.py, written for every bundle: always
dflash_reference, the CPU reference runtime, plus each served stack's own model, Stack.triton_inputs) and a
real tritonserver on any machine (server.py, `dflash-trt serve`). On a GPU, the chart's `triton` server runs
the TensorRT-LLM model (engines.json servers.triton). Not named `triton`: that folder on sys.path would
shadow the Triton compiler.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.stacks.base import BundleContext, Server, Stack
from dflash_trt.stacks.tritonserver.repo import write_triton_repo
from dflash_trt.stacks.tritonserver.server import TritonServer

REFERENCE_MODEL = "dflash_reference"     # CPU-capable Triton model of every bundle
REPOSITORY = "triton"                    # the model repository's folder in the bundle


def reference_settings(ref: dict, block_size: int) -> dict:
    """dflash_reference/1/model.yaml: where the pair is, and the runtime's serving limits."""
    return {"target": ref["target"], "drafter": ref["drafter"], "block_size": block_size, "dtype": "float32",
            "max_new_tokens": 128, "chat": True, "decode_slots": 1, "max_queue": 64, "max_prompt_bytes": 1 << 20}


class Triton(Stack):
    name = "triton"
    title = "Triton Inference Server"
    checked_against = "Triton Inference Server 2.51 (PyPI nvidia-pytriton 0.7.0), tritonclient's model_config.proto"
    repository = REPOSITORY
    writes_config = False     # the repository is written for every bundle, from the served stacks' inputs
    runs_here = True          # tritonserver from the PyPI wheel, any machine (server.py)
    servers = (Server("triton", mpi_launch=True, loads_triton_models=True, cpu_reference=True),)

    def model_list(self, served: list[Stack]) -> list[str]:
        """The manifest's triton_models: each served stack's GPU model, then dflash_reference."""
        return [m for st in served for m in st.triton_models] + [REFERENCE_MODEL]

    def write_repository(self, ctx: BundleContext, served: list[Stack]) -> None:
        inputs: dict = {"llm_yaml": None}
        for st in served:
            inputs |= st.triton_inputs(ctx)
        write_triton_repo(ctx.work / REPOSITORY, reference=reference_settings(ctx.reference, ctx.block_size), **inputs)

    def serve_commands(self, served):
        return {"triton_cpu": "dflash-trt serve --bundle .   # the dflash_reference model, any machine"}

    def local_server(self, bundle: Path, opts: dict):
        """(server, endpoints, announcement) of tritonserver on the bundle's repository."""
        if not bundle:
            raise DFlashError("serve: --bundle DIR is required (or --make-stub-env)")
        if opts.get("capture"):
            raise DFlashError("serve --capture: the capture middleware runs in vLLM's server (--engine vllm)")
        repo = Path(bundle) / REPOSITORY
        if not repo.is_dir():
            raise DFlashError(f"{bundle}: no {REPOSITORY}/ model repository (is it a dflash-trt bundle?)")
        models = list(opts.get("models") or [REFERENCE_MODEL])
        work = Path(tempfile.mkdtemp(prefix="dflash-trt-serve-"))
        server = TritonServer(repo, models, work=work, host=opts["host"], http_port=opts["http_port"],
                              grpc_port=opts["grpc_port"], metrics_port=opts["metrics_port"], stub_env=opts["stub_env"])
        info = {"http": server.http_url, "grpc": server.grpc_url, "metrics": server.metrics_url, "models": models,
                "log": str(server.log_path)}
        line = (f"serving {', '.join(models)} from {repo}: HTTP {info['http']}, gRPC {info['grpc']}, "
                f"metrics {info['metrics']} (log {info['log']}); Ctrl-C stops")
        return server, info, line


STACK = Triton()
