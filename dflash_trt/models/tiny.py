"""`make-tiny`: a tiny random target of a real family (each family whose row has a `tiny` recipe: Llama,
Qwen3, gpt-oss) with a working tokenizer, and a matching random DFlash drafter. For smoke tests of
deployments, tests and benchmarks: real config fields and tensor names, a few layers, seconds to build."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.formats import mxfp4_encode
from dflash_trt.io.jsonio import read_json
from dflash_trt.models.config import DrafterConfig, default_target_layer_ids, drafter_identity
from dflash_trt.models.drafter import DFlashDrafter, save_drafter
from dflash_trt.models.families import TRAITS, Family

# make-tiny's --arch (the model_type, dashed) -> model_type: the families whose row has a `tiny` recipe
ARCHS = {mt.replace("_", "-"): mt for mt, f in TRAITS.items() if f.tiny}
MASK_TOKEN = "<|mask|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    # Text that ships with Python itself (module docstrings), so the tokenizer is reproducible offline.
    docs = [m.__doc__ or "" for m in (json, os, shutil, tempfile, textwrap)]
    return [*docs, "def add(a, b):\n    return a + b\n", "Hello, world! 0123456789"]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on a fixed corpus: every string round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token=MASK_TOKEN, chat_template=CHAT_TEMPLATE)


def tiny_target_config(arch: str, vocab_size: int, eos_id: int, bos_id: int):
    """The family's transformers config at the shared small sizes, with what its row's `tiny` sets."""
    import transformers

    fields = dict(_family(arch).tiny)
    return getattr(transformers, fields.pop("config"))(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "eos_token_id": eos_id, "bos_token_id": bos_id, "pad_token_id": bos_id,
        "initializer_range": 0.1, "tie_word_embeddings": False, **fields})


def _family(arch: str) -> Family:
    if arch not in ARCHS:
        raise DFlashError(f"--arch {arch!r}: expected one of {', '.join(ARCHS)}")
    return TRAITS[ARCHS[arch]]


DRAFTER_KINDS = ("dflash", "dflash2", "dflash-swa")


def tiny_drafter_config(target_cfg: dict, mask_token_id: int, block_size: int = 8, layers: int = 2,
                        kind: str = "dflash") -> DrafterConfig:
    """kind: "dflash" (non-causal, full attention), "dflash2" (the z-lab DFlash2 fixture's layout,
    z-lab/dflash tests/fixtures/dflash2-config.json @0a7587c0: every layer sliding-window,
    is_causal false, conv taps 2, candidate selector; scaled down, window 8 so short prompts
    cross it), "dflash-swa" (a DFlash drafter with mixed layers as the Qwen3.6 / gemma-4
    drafters: sliding layers causal and windowed, full layers non-causal)."""
    if kind not in DRAFTER_KINDS:
        raise DFlashError(f"--drafter-kind {kind!r}: expected one of {', '.join(DRAFTER_KINDS)}")
    L = target_cfg["num_hidden_layers"]
    ids = default_target_layer_ids(L, layers) if L > 4 else list(range(min(layers, L)))
    d = {
        **drafter_identity("dflash2" if kind == "dflash2" else "dflash"), "attention_bias": False,
        "hidden_size": target_cfg["hidden_size"], "intermediate_size": 2 * target_cfg["hidden_size"],
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": target_cfg["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 2048, "hidden_act": "silu",
        "block_size": block_size, "num_target_layers": L,
        "layer_types": ["full_attention"] * layers, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
    }
    if kind == "dflash2":
        d.update(is_causal=False, use_sliding_window=True, sliding_window=8,
                 layer_types=["sliding_attention"] * layers)
        d["dflash_config"].update(block_size=block_size, conv_group_size=16, conv_kernel_size=2,
                                  final_logit_softcapping=20.0, output_multiplier=0.5, selector_rank=16,
                                  selector_top_k=8)
    elif kind == "dflash-swa":
        d.update(use_sliding_window=True, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                 + ["sliding_attention"] * (layers % 2))
    return DrafterConfig.from_dict(d)


def init_drafter_weights(drafter: DFlashDrafter, std: float = 0.1) -> None:
    """Random weights that make every part count: matrices N(0, std); DFlash2's conv base kernels
    1 on the current-token tap plus noise (zero would silence the layer)."""
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std)
            elif n.endswith("base_kernel"):
                p.normal_(0, 0.3)
                p[:, 0] += 1.0


def make_tiny(arch: str, target_out: str | Path, drafter_out: str | Path | None = None, seed: int = 0,
              mxfp4: bool = True, block_size: int = 8, drafter_layers: int = 2, drafter_kind: str = "dflash") -> dict:
    """Write a tiny target (and drafter). gpt-oss experts are stored MXFP4 like the real model
    unless mxfp4=False. Returns a summary dict."""
    from transformers import AutoModelForCausalLM

    fam = _family(arch)
    tok = build_tokenizer()
    cfg = tiny_target_config(arch, len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.bos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if fam.attention_sinks or fam.expert_biases:
        with torch.no_grad():  # HF leaves sinks / expert biases at zero; give them values so tests see them
            for n, p in model.named_parameters():
                if n.endswith(("sinks", "_bias", "router.bias")):
                    p.normal_(0, 0.5)

    target_out = Path(target_out)
    with atomic_output_dir(target_out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if fam.mxfp4_experts and mxfp4:
            _store_experts_mxfp4(tmp)
    summary = {"arch": arch, "target": str(target_out), "vocab_size": len(tok),
               "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size}
    if drafter_out is not None:
        dcfg = tiny_drafter_config(read_json(target_out / "config.json"),
                                   tok.convert_tokens_to_ids(MASK_TOKEN), block_size, drafter_layers, drafter_kind)
        torch.manual_seed(seed + 1)
        drafter = DFlashDrafter(dcfg)
        init_drafter_weights(drafter)
        save_drafter(drafter, drafter_out)
        summary.update(drafter=str(drafter_out), drafter_kind=drafter_kind, block_size=block_size,
                       target_layer_ids=dcfg.target_layer_ids, mask_token_id=dcfg.mask_token_id)
    return summary


def _store_experts_mxfp4(folder: Path) -> None:
    """Re-store gpt-oss expert weights as MXFP4 blocks/scales, as openai/gpt-oss-* ship them."""
    path = folder / "model.safetensors"
    state = load_file(path)
    out = {}
    for k, v in state.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_encode(v.transpose(1, 2).float().contiguous())  # [E, out, in]
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales
        else:
            out[k] = v
    save_file(out, path, metadata={"format": "pt"})
    cfg = read_json(folder / "config.json")
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
