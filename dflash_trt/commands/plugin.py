"""plugin build, export-onnx: the drafter KV-injection plugin for TensorRT."""
from __future__ import annotations

import json

import click

from dflash_trt.hardware import arch_sms

MAX_PAGE_SIZE = 4096  # tokens per KV page (TensorRT-LLM uses 32-128)

# "blackwell (sm_100 + sm_103) or hopper (sm_90)"
ARCHS_HELP = " or ".join(f"{arch} ({' + '.join(f'sm_{sm}' for sm in sms)})" for arch, sms in arch_sms().items())


@click.group("plugin")
def plugin_group():
    """The drafter KV-injection plugin (dflash::KVInject): one fused Triton kernel that turns
    accepted tokens' target features into every drafter layer's K/V in a paged cache.

    \b
    Example:
      dflash-trt plugin build --arch blackwell --out engines/plugin
    """


@plugin_group.command("build")
@click.option("--arch", type=str, required=True, help=f"GPU architecture: {ARCHS_HELP}.")
@click.option("--out", "out", type=click.Path(file_okay=False), default="engines/plugin", show_default=True,
              help="Output folder (replaced atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print the plugin.json manifest on stdout.")
def build_cmd(arch, out, as_json):
    """Compile the KV-injection kernel ahead of time (no GPU needed) into cubin + PTX per SM,
    with a plugin.json manifest: kernel names, launch grid formula, num_warps, shared memory,
    block sizes, dtypes, source hashes.

    \b
    Examples:
      dflash-trt plugin build --arch blackwell --out engines/plugin
      dflash-trt plugin build --arch hopper --json | jq '.kernels[].shared_mem'
    """
    from dflash_trt.stacks.trtllm.plugin import build_plugin

    m = build_plugin(arch.lower(), out, progress=not as_json)
    if as_json:
        click.echo(json.dumps(m, indent=2))
    else:
        sms = ", ".join(f"sm_{s}" for s in m["sms"])
        click.echo(f"wrote {len(m['kernels'])} kernels for {arch} ({sms}) and plugin.json to {out}")


@click.command("export-onnx")
@click.option("--drafter", "drafter_dir", type=click.Path(file_okay=False), required=True, help="DFlash drafter folder.")
@click.option("--target", "target_dir", type=click.Path(file_okay=False), required=True,
              help="Target folder (only its embed_tokens and lm_head are read).")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="ONNX file to write.")
@click.option("--page-size", type=click.IntRange(1, MAX_PAGE_SIZE), default=16, show_default=True,
              help="Paged KV cache page size (power of two).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def export_onnx_cmd(drafter_dir, target_dir, out, page_size, as_json):
    """Export the drafter to ONNX: KV injection as one custom node dflash::KVInject (mapped by
    TensorRT's ONNX parser to the plugin), the draft pass in standard ONNX ops, logits through
    the target's lm_head.

    \b
    Example:
      dflash-trt export-onnx --drafter drafters/qwen3-8b-dflash --target models/Qwen3-8B --out drafter.onnx
    """
    from dflash_trt.bundle.onnx_export import export_onnx
    from dflash_trt.models.check import require_pair

    require_pair(target_dir, drafter_dir)   # check's rules first, with its messages
    path = export_onnx(drafter_dir, target_dir, out, page_size=page_size)
    if as_json:
        click.echo(json.dumps({"onnx": str(path), "page_size": page_size, "custom_op": "dflash::KVInject"}, indent=2))
    else:
        click.echo(f"wrote {path}")
