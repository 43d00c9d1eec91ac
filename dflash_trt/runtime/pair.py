"""The Python API the CLI wraps: load a pair, generate text."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import CheckpointReader, nonfinite_tensors
from dflash_trt.io.jsonio import read_json
from dflash_trt.kernels import attention, gemm
from dflash_trt.models.check import require_pair, require_target
from dflash_trt.models.config import MAX_BLOCK, MAX_CONTEXT, decoder_config
from dflash_trt.models.draft_vocab import read_draft_vocab
from dflash_trt.models.drafter import load_drafter
from dflash_trt.models.target import load_target, stop_token_ids
from dflash_trt.models.weights import holds_quantized_weights, quantized_weights
from dflash_trt.runtime import decode
from dflash_trt.runtime.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def native_bf16() -> bool:
    """The CPU computes bfloat16 natively (AVX512-BF16 / AMX)."""
    # Not oneDNN's "bf16 supported", which is also true where it emulates bf16 on plain AVX-512:
    # emulated bf16 GEMMs are slower than float32 and not batch-invariant (measured on a
    # Skylake-SP VM: verify passes differ from AR steps, and DFlash's tokens from AR's).
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def auto_dtype() -> torch.dtype:
    """float32 where the C decode kernels build (invariant by construction, and faster than oneDNN's bf16 even on
    an AMX host: docs/decode-loop.md); else bfloat16 where the CPU computes it natively, else float32."""
    if gemm.library() is not None and attention.library() is not None:
        return torch.float32
    return torch.bfloat16 if native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, quantized: bool = False) -> torch.dtype:
    """`quantized`: the target stores quantized weights (a bundle's target/). auto then runs float32, the
    dtype that holds the values the engines' GEMMs multiply by exactly (an FP8 weight times its fp32
    scale, an NVFP4 block's E2M1 x E4M3 x fp32 global scale); bfloat16 would round them once more."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if quantized else auto_dtype()
    if dtype not in DTYPES:
        raise DFlashError(f"--dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _transposed_linear_weights(model: torch.nn.Module) -> None:
    """float32 on CPU: each Linear's weight held as its transpose (the parameter a strided [out, in] view), so
    F.linear is MKL's NN GEMM: 1.5-5.6x faster for ~9-row verify passes than NT on a row-major weight (576x576:
    446 -> 80 us, 2 threads). (bfloat16 keeps the layout whose invariance tests/test_runtime_lossless.py pins.)"""
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
    max_len: int = 4096         # the drafter's RoPE table length (positions it can draft at)


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _refuse_nonfinite(folder: Path, allow_pickle: bool) -> None:
    """check's streaming NaN / Inf scan, with its message (one pass over the stored weights)."""
    with CheckpointReader(folder, allow_pickle=allow_pickle) as r:
        bad = nonfinite_tensors(r, limit=1)
    if bad:
        raise DFlashError(f"{bad[0]}; pass --allow-nonfinite to load it anyway")


def _weights_fit(folders: list[Path], dt: torch.dtype, allow_pickle: bool) -> None:
    """The weights, held in `dt`, must fit this machine's memory (a bound stated before allocating)."""
    total = 0
    for f in folders:
        with CheckpointReader(f, allow_pickle=allow_pickle) as r:
            quantized = quantized_weights(r)   # held decoded: an NVFP4 byte is two weights
            total += sum(math.prod(quantized[k].decoded_shape(r.meta(k)[1]) if k in quantized else r.meta(k)[1])
                         for k in r.keys()) * dt.itemsize
    mem = physical_memory()
    if mem and total > mem:
        raise DFlashError(f"{', '.join(map(str, folders))}: the weights need {total / 2**30:.1f} GiB in {dt} but this "
                          f"machine has {mem / 2**30:.1f} GiB of memory")


def target_context(cfg: dict) -> int:
    """The positions the target takes: max_position_embeddings (a wrapper's in text_config), else MAX_CONTEXT."""
    return decoder_config(cfg).get("max_position_embeddings") or MAX_CONTEXT


def load_pair(target_dir, drafter_dir=None, dtype: str | torch.dtype = "auto", max_len: int = 4096,
              allow_pickle: bool = False, allow_nonfinite: bool = False, draft_vocab: bool = True) -> Pair:
    """Validate (check's rules: configs, the pair, tensor headers; NaN / Inf weights unless
    allow_nonfinite), then load. Nothing is allocated for a pair that check refuses. draft_vocab=False
    ignores a drafter's draft_vocab.json (drafts from the full vocabulary)."""
    from transformers import AutoTokenizer

    target_dir = Path(target_dir)
    if not 1 <= max_len <= MAX_CONTEXT:
        raise DFlashError(f"max_len {max_len}: must be between 1 and {MAX_CONTEXT}")
    if drafter_dir is not None:
        require_pair(target_dir, drafter_dir, allow_pickle=allow_pickle)
    else:
        require_target(target_dir, allow_pickle=allow_pickle)
    # no position past the target's context is ever used (check_request): RoPE tables no longer than it
    max_len = min(max_len, target_context(read_json(target_dir / "config.json")))
    folders = [target_dir] + ([Path(drafter_dir)] if drafter_dir is not None else [])
    dt = resolve_dtype(dtype, quantized=holds_quantized_weights(target_dir, allow_pickle))
    _weights_fit(folders, dt, allow_pickle)
    if not allow_nonfinite:
        for f in folders:
            _refuse_nonfinite(f, allow_pickle)
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
                Path(drafter_dir) if drafter_dir is not None else None, max_len)


def context_limit(pair: Pair, dflash: bool = True) -> tuple[int, str]:
    """(positions a request may use, what sets that number): the target's context, or the runtime's max_len."""
    ctx = target_context(pair.target.cfg)
    if dflash and pair.max_len < ctx:
        return pair.max_len, f"the runtime's max_len of {pair.max_len} positions"
    return ctx, f"the target's context of {ctx} tokens (max_position_embeddings)"


def check_request(pair: Pair, n_prompt: int, max_new_tokens: int, block_size: int | None, mode: str = "dflash") -> int:
    """Bound a request before anything is allocated for it: the prompt and max_new_tokens against
    the target's context (max_position_embeddings) and the drafter's RoPE table, the block size
    against MAX_BLOCK, the KV caches against this machine's memory. Returns the block size."""
    dflash = mode == "dflash" and pair.drafter is not None
    B = block_size or (pair.drafter.config.block_size if dflash else 1)
    if mode == "dflash" and (dflash or block_size is not None) and not 2 <= B <= MAX_BLOCK:
        raise DFlashError(f"--block-size {B}: must be between 2 and {MAX_BLOCK}")
    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    limit, why = context_limit(pair, dflash)
    slack = B + 1 if dflash else 1      # positions drafted / verified past the last new token
    room = limit - n_prompt - slack
    if room < 1:
        raise DFlashError(f"the prompt has {n_prompt} tokens, more than {why} allows (at most {limit - slack - 1})")
    if max_new_tokens > room:
        raise DFlashError(f"--max-new-tokens {max_new_tokens}: the prompt's {n_prompt} tokens plus this exceed {why}; "
                          f"at most {room} for this prompt")
    n = n_prompt + max_new_tokens + slack
    per_pos = pair.target.cache_bytes_per_position()
    if dflash:
        c = pair.drafter.config
        per_pos += 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * pair.drafter.fc.weight.element_size()
    mem = physical_memory()
    if mem and n * per_pos > mem:
        raise DFlashError(f"--max-new-tokens {max_new_tokens}: the KV caches for {n} positions need "
                          f"{n * per_pos / 2**30:.1f} GiB, more than this machine's {mem / 2**30:.1f} GiB")
    return B


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
    ids = encode_prompt(pair.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise DFlashError("the prompt is empty")
    V = pair.target.vocab_size
    if not all(isinstance(i, int) and 0 <= i < V for i in ids):
        raise DFlashError(f"prompt token ids must be integers in 0..{V - 1} (the target vocabulary)")
    check_request(pair, len(ids), max_new_tokens, block_size, mode)
    res = decode.generate(pair.target, pair.drafter if mode == "dflash" else None, ids,
                          max_new_tokens=max_new_tokens, seed=seed, block_size=block_size, mode=mode,
                          sampling=SamplingParams(temperature, top_k, top_p),
                          stop_ids=pair.stop_ids, fused_inject=fused_inject)
    res.text = pair.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    return res
