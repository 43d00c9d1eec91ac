"""Activation and KV-cache calibration, one decoder layer at a time.

The amaxes ModelOpt's max calibration records (every quantized Linear's largest |input|, every
attention's largest |K| and |V| after RoPE) with only one decoder layer's weights in memory: the
calibration prompts' hidden states are carried from layer to layer. The layers are the reference
runtime's, so calibration and the runtime share one implementation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader, check_finite
from dflash_trt.io.jsonio import iter_jsonl
from dflash_trt.models.families import RUNTIME_FAMILIES
from dflash_trt.models.families.dense import DecoderLayer
from dflash_trt.models.layers import RopeTable
from dflash_trt.models.shell import hf_config
from dflash_trt.models.weights import dequantize_mxfp4


@dataclass
class CalibrationResult:
    input_amax: dict[str, float] = field(default_factory=dict)   # Linear module name -> max |input|
    k_amax: dict[str, float] = field(default_factory=dict)       # "...self_attn" -> max |K| (post-RoPE)
    v_amax: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0


def load_calib_samples(path: str | Path, model_dir: str | Path, n: int, max_tokens: int = 512) -> list[torch.Tensor]:
    """Token-id tensors from a JSONL file: one object per line with "input_ids" (list of ints),
    "text", or "messages" (chat; formatted with the model's chat template)."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path}: calibration file not found")
    tok = None
    out = []
    for lineno, rec in iter_jsonl(path):
        if len(out) >= n:
            break
        if not isinstance(rec, dict):
            raise DFlashError(f"{path}:{lineno}: expected a JSON object")
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
                raise DFlashError(f"{path}:{lineno}: input_ids must be a non-empty list of token ids")
        elif "text" in rec or "messages" in rec:
            if tok is None:
                tok = _tokenizer(model_dir)
            if "messages" in rec:
                ids = tok.apply_chat_template(rec["messages"], tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids   # transformers 5: a BatchEncoding
            else:
                ids = tok(rec["text"])["input_ids"]
        else:
            raise DFlashError(f"{path}:{lineno}: needs one of input_ids, text or messages")
        out.append(torch.tensor(list(ids)[:max_tokens], dtype=torch.long))
    if not out:
        raise DFlashError(f"{path}: no calibration samples")
    return out


def _tokenizer(model_dir):
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise DFlashError(f"{model_dir}: cannot load the tokenizer for text calibration samples "
                          f"({str(e).splitlines()[0]}); give input_ids in the JSONL instead") from None


def layer_tensors(reader: CheckpointReader, i: int) -> dict[str, torch.Tensor]:
    """Decoder layer i's tensors (full names), each checked for NaN / Inf."""
    prefix = f"model.layers.{i}."
    out = {}
    for name in reader.keys():
        if name.startswith(prefix):
            t = reader.get(name)
            check_finite(name, t, reader.file_of(name))
            out[name] = t
    return out


class LayerCalibrator:
    """Carries the calibration prompts' hidden states through the decoder one layer at a time:
    `step(i, tensors)` runs layer i (built from its tensors, nothing else in memory) over every
    prompt and records the amaxes. Used on its own by `calibrate`, and by `quantize` to
    calibrate and quantize each layer from a single read of its weights."""

    def __init__(self, reader: CheckpointReader, cfg: dict, samples: list[torch.Tensor],
                 dtype: torch.dtype | None = None):
        mt = cfg.get("model_type")
        if RUNTIME_FAMILIES.get(mt) != DecoderLayer.__module__:
            raise DFlashError(f"--calib: calibration runs the runtime's Llama / Qwen3 / gpt-oss decoder layers, not "
                              f"{mt!r} ones; quantize it without --calib (weights only, as ModelOpt's export "
                              "without input_scale)")
        self.c = hf_config(cfg)
        self.num_layers = self.c.num_hidden_layers
        self.result = CalibrationResult(samples=len(samples), tokens=sum(len(s) for s in samples))
        embed = "model.embed_tokens.weight"
        if embed not in reader:
            raise DFlashError(f"{reader.folder}: no {embed}; calibration needs the target's embeddings")
        vocab = reader.meta(embed)[1][0]
        self.dtype = dtype or reader.meta(embed)[0]
        for s in samples:
            if int(s.max()) >= vocab:
                raise DFlashError(f"calibration sample has token id {int(s.max())} >= vocab size {vocab}")
        self.hidden = [reader.get_rows(embed, s).to(self.dtype) for s in samples]
        self.rope = RopeTable(self.c, max(len(s) for s in samples), self.dtype)

    @torch.no_grad()
    def step(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        prefix, dtype = f"model.layers.{i}.", self.dtype
        # gpt-oss experts: MXFP4 -> dense [E, in, out], the runtime's layout
        state = dequantize_mxfp4({k[len(prefix):]: v for k, v in tensors.items()})
        with torch.device("meta"):
            layer = DecoderLayer(self.c, i)
        layer.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                              strict=True, assign=True)
        amax: dict[str, float] = {}

        def hook(name):
            def fn(mod, args):
                amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().amax()))
            return fn

        handles = [m.register_forward_pre_hook(hook(prefix + n)) for n, m in layer.named_modules()
                   if isinstance(m, nn.Linear)]
        attn = layer.self_attn
        kmax = vmax = 0.0
        for j, x in enumerate(self.hidden):
            T = x.shape[0]
            attn.k_cache = torch.zeros(attn.nkv, T, attn.hd, dtype=dtype)
            attn.v_cache = torch.zeros(attn.nkv, T, attn.hd, dtype=dtype)
            pos = torch.arange(T)
            cos, sin = self.rope(pos)
            self.hidden[j] = layer(x, cos, sin, 0, pos[None, :] <= pos[:, None])
            kmax = max(kmax, float(attn.k_cache.abs().amax()))   # K after RoPE, V: what the cache holds
            vmax = max(vmax, float(attn.v_cache.abs().amax()))
        for h in handles:
            h.remove()
        self.result.input_amax.update(amax)
        self.result.k_amax[prefix + "self_attn"] = kmax
        self.result.v_amax[prefix + "self_attn"] = vmax


def calibrate(reader: CheckpointReader, cfg: dict, samples: list[torch.Tensor],
              dtype: torch.dtype | None = None, progress: bool = True) -> CalibrationResult:
    """Max-calibrate a Llama / Qwen3 / gpt-oss checkpoint layer by layer (see module doc).

    Runs in the checkpoint's own dtype by default (as ModelOpt's calibration forward does), so
    the layer in memory is the size it has on disk."""
    cal = LayerCalibrator(reader, cfg, samples, dtype)
    for i in tqdm(range(cal.num_layers), desc="calibrate (layers)", disable=not progress, unit="layer"):
        cal.step(i, layer_tensors(reader, i))
    return cal.result
