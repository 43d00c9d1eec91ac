"""The Python API the CLI wraps: load a pair, generate text."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.models.draft_vocab import read_draft_vocab
from dflash_trt.models.drafter import load_drafter
from dflash_trt.models.target import load_target, stop_token_ids
from dflash_trt.runtime import decode
from dflash_trt.runtime.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX: ~2x faster decode than
    float32, and greedy DFlash stays bitwise lossless: see target.Attention), else float32."""
    # Not oneDNN's "bf16 supported", which is also true where it emulates bf16 on plain AVX-512:
    # emulated bf16 GEMMs are slower than float32 and not batch-invariant (measured on a
    # Skylake-SP VM: verify passes differ from AR steps, and DFlash's tokens from AR's).
    try:
        native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else torch.float32


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()
    if dtype not in DTYPES:
        raise DFlashError(f"--dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _transposed_linear_weights(model: torch.nn.Module) -> None:
    """float32 on CPU: keep each Linear's weight in memory as its transpose (the parameter stays
    [out, in], a strided view), so that F.linear's x @ W.T is MKL's NN GEMM. For the verify pass's
    ~9 rows that is 1.5-5.6x faster than the NT GEMM on a row-major weight (SmolLM2's 576x576:
    446 -> 80 us, 2 threads), and one-row steps are as fast or faster. (bfloat16 keeps the
    layout whose batch invariance tests/test_runtime_lossless.py pins.)"""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32:
            m.weight.data = m.weight.data.t().contiguous().t()


@dataclass
class Pair:
    target: "object"
    drafter: "object | None"
    tokenizer: "object"
    stop_ids: list[int]
    target_dir: Path
    drafter_dir: Path | None


def load_pair(target_dir, drafter_dir=None, dtype: str | torch.dtype = "auto", max_len: int = 4096,
              allow_pickle: bool = False, draft_vocab: bool = True) -> Pair:
    """The target, its drafter (optional) and tokenizer, ready to decode. draft_vocab=False ignores a
    drafter's draft_vocab.json (drafts from the full vocabulary)."""
    from transformers import AutoTokenizer


    dt = resolve_dtype(dtype)
    target_dir = Path(target_dir)
    target = load_target(target_dir, dt, max_len=max_len, allow_pickle=allow_pickle)
    drafter = load_drafter(drafter_dir, dt, max_len=max_len, allow_pickle=allow_pickle) if drafter_dir is not None else None
    if drafter is not None and draft_vocab:
        drafter.draft_vocab = read_draft_vocab(drafter_dir, target.vocab_size)
    if dt == torch.float32:
        for model in (target, drafter):
            if model is not None:
                _transposed_linear_weights(model)
    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except Exception as e:  # transformers raises many types here; one line is what the user needs
        raise DFlashError(f"{target_dir}: cannot load the tokenizer ({type(e).__name__}: {str(e).splitlines()[0]})")
    return Pair(target, drafter, tok, stop_token_ids(target_dir), target_dir,
                Path(drafter_dir) if drafter_dir is not None else None)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Render with the chat template when the tokenizer has one (and chat=True)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def generate(pair: Pair, prompt: str | list[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, block_size: int | None = None,
             mode: str = "dflash", chat: bool = True, fused_inject: bool = True):
    """Generate from text (or token ids). Returns a decode.GenerationResult with `.text` set."""
    if block_size is not None and block_size < 2 and mode == "dflash":
        raise DFlashError(f"--block-size {block_size}: must be at least 2")
    ids = encode_prompt(pair.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise DFlashError("the prompt is empty")
    res = decode.generate(pair.target, pair.drafter if mode == "dflash" else None, ids,
                          max_new_tokens=max_new_tokens, seed=seed, block_size=block_size, mode=mode,
                          sampling=SamplingParams(temperature, top_k, top_p),
                          stop_ids=pair.stop_ids, fused_inject=fused_inject)
    res.text = pair.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    return res
