"""quantize, convert: checkpoints at scale (streaming, any machine, no GPU)."""
from __future__ import annotations

import json

import click

from dflash_trt.errors import DFlashError

MIN_SHARD_BYTES = 10**3     # smaller shards only multiply files (ShardedWriter caps their number)
MAX_SHARD_BYTES = 10**12


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        n = int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError, OverflowError):
        raise DFlashError(f"--max-shard-size {text!r}: expected a size such as 5GB or 500MiB") from None
    if not MIN_SHARD_BYTES <= n <= MAX_SHARD_BYTES:
        raise DFlashError(f"--max-shard-size {text!r}: must be between 1KB and 1TB")
    return n


@click.command("quantize")
@click.option("--model", required=True, type=click.Path(file_okay=False), help="Hugging Face checkpoint folder (target or DFlash drafter).")
@click.option("--format", "fmt", required=True, type=click.Choice(["fp8", "nvfp4"]), help="Weight format (nvfp4: Blackwell only).")
@click.option("--kv-cache", type=click.Choice(["fp8"]), help="Also write FP8 KV-cache scales (k_scale / v_scale).")
@click.option("--calib", type=click.Path(dir_okay=False), help="JSONL calibration prompts: {\"text\": ...}, {\"messages\": [...]} or {\"input_ids\": [...]} per line.")
@click.option("--calib-samples", type=click.IntRange(1), default=64, show_default=True, help="Prompts to use from --calib.")
@click.option("--exclude", multiple=True, metavar="PATTERN", help="Keep matching modules unquantized (glob on module names, e.g. '*layers.0.*'); repeatable.")
@click.option("--target", type=click.Path(file_okay=False), help="For a DFlash drafter with --calib: its target. The pair "
              "decodes the --calib prompts (greedy DFlash, CPU) and each drafter Linear gets input_scale from the "
              "largest |input| it read (a drafter's inputs come from its target, so it cannot calibrate alone).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
@click.option("--allow-pickle", is_flag=True, help="Accept a .bin/.pt checkpoint (loaded with torch.load(weights_only=True)).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder (replaced atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def quantize_cmd(model, fmt, kv_cache, calib, calib_samples, exclude, target, max_shard_size, allow_pickle, out,
                 as_json):
    """Quantize a checkpoint to FP8 or NVFP4, writing a ModelOpt-style unified Hugging Face
    checkpoint (hf_quant_config.json + quantization_config in config.json) that TensorRT-LLM's
    PyTorch backend, vLLM and SGLang load. Streams tensor by tensor: memory does not grow with
    the model, and no GPU is needed. lm_head, embeddings, routers and norms stay unquantized.

    Activation scales (input_scale) and KV-cache scales come from --calib prompts, run one
    decoder layer at a time; without --calib they are not written (KV scales default to 1.0)
    and the report says so.

    \b
    Examples:
      dflash-trt quantize --model Llama-3.1-8B --format fp8 --kv-cache fp8 \\
          --calib prompts.jsonl --out Llama-3.1-8B-FP8
      dflash-trt quantize --model Qwen3-8B --format nvfp4 --calib prompts.jsonl --out Qwen3-8B-NVFP4
      dflash-trt quantize --model Qwen3-8B-DFlash-b16 --format fp8 --out drafter-fp8   # drafter: weights only
      dflash-trt quantize --model Qwen3-8B-DFlash-b16 --format nvfp4 --exclude fc --target Qwen3-8B \\
          --calib prompts.jsonl --out drafter-nvfp4          # drafter with input scales (SGLang's layout)
    """
    from dflash_trt.quant.quantize import quantize_checkpoint

    amax = None
    if target is not None:
        if calib is None:
            raise DFlashError("--target: calibrates a drafter with its target on --calib prompts; pass --calib FILE")
        from dflash_trt.quant.calibrate import load_calib_samples
        from dflash_trt.runtime.drafter_calibration import drafter_input_amax
        samples = load_calib_samples(calib, target, calib_samples)
        amax = drafter_input_amax(target, model, [t.tolist() for t in samples], progress=not as_json)
        calib, calib_samples = None, len(samples)
    rep = quantize_checkpoint(model, out, fmt, kv_cache=kv_cache, calib=calib, calib_samples=calib_samples,
                              exclude=list(exclude), max_shard_bytes=_size(max_shard_size),
                              progress=not as_json, allow_pickle=allow_pickle, input_amax=amax).to_dict()
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    click.echo(f"wrote {fmt} checkpoint to {rep['out']}: {rep['quantized_modules']} Linear modules quantized, "
               f"{rep['bytes_in'] / 2**20:.1f} MiB -> {rep['bytes_out'] / 2**20:.1f} MiB in {rep['seconds']:.1f}s"
               + (f" ({rep['disk_wait_seconds']:.1f}s of it waiting for the disk)" if rep.get("disk_wait_seconds", 0) >= 0.1 else ""))
    click.echo(f"kept unquantized: {', '.join(rep['exclude_modules']) or 'none'}")
    if rep["calibrated"]:
        click.echo(f"calibrated on {rep['calibration_samples'] or calib_samples} prompts"
                   + (f" (DFlash decoding with {target})" if target else ""))
    for line in rep["not_calibrated"]:
        click.echo(f"NOT calibrated: {line}")


@click.command("convert")
@click.option("--model", required=True, type=click.Path(file_okay=False), help="Hugging Face Llama or Qwen3 checkpoint folder (unquantized).")
@click.option("--quant", type=click.Choice(["none", "fp8", "nvfp4"]), default="none", show_default=True, help="Weight format in the engine checkpoint.")
@click.option("--kv-cache", type=click.Choice(["fp8"]), help="FP8 KV cache (scales from --calib).")
@click.option("--calib", type=click.Path(dir_okay=False), help="JSONL calibration prompts (needed for fp8/nvfp4/--kv-cache).")
@click.option("--calib-samples", type=click.IntRange(1), default=64, show_default=True)
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True, help="Tensor-parallel ranks.")
@click.option("--pp", type=click.IntRange(1), default=1, show_default=True, help="Pipeline-parallel stages (1 only).")
@click.option("--ep", type=click.IntRange(1), default=1, show_default=True, help="Expert-parallel ranks (MoE only).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder (replaced atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
def convert_cmd(model, quant, kv_cache, calib, calib_samples, tp, pp, ep, out, as_json):
    """Write a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors) for the TensorRT
    engine path (TensorRT-LLM <= 1.2, `trtllm-build --checkpoint_dir OUT`): TensorRT-LLM tensor
    names, fused qkv per rank, TP splits, vocabulary padded to a multiple of tp, KV heads
    duplicated when there are fewer than tp. Llama and Qwen3 targets. gpt-oss, DeepSeek-V3 /
    Kimi K2.5 and GLM-5 have no engine layout: serve them with the PyTorch backend from their
    Hugging Face (or quantized) folder.

    \b
    Examples:
      dflash-trt convert --model Llama-3.1-8B --tp 2 --out trt-ckpt
      dflash-trt convert --model Qwen3-8B --quant fp8 --kv-cache fp8 --calib prompts.jsonl --tp 4 --out trt-fp8
    """
    from dflash_trt.stacks.trtllm.convert import convert_checkpoint

    rep = convert_checkpoint(model, out, tp=tp, pp=pp, ep=ep, quant=quant, kv_cache=kv_cache, calib=calib,
                             calib_samples=calib_samples, progress=not as_json).to_dict()
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    click.echo(f"wrote TensorRT-LLM checkpoint ({rep['architecture']}, tp={tp}, quant={quant}) to {rep['out']}: "
               f"{', '.join(rep['files'])}")
