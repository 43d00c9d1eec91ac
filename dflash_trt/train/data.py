"""Training data of a DFlash drafter: the target's own answers, and its features over them.

    prompts ──target generates──▶ responses (JSONL) ──target forward──▶ cached features (bf16)

The answers are the target's greedy ones, so the labels are exactly the tokens the target emits
at decode time. The target is frozen, so its hidden states at the chosen layers are computed
once and cached on disk (one file per sequence); a training step then only runs the drafter
and the (frozen) lm_head.

Teacher-forced labels (`--labels teacher-forced`) come from the same pass: with every position's
logits kept, the target's top-k next tokens and their log-probabilities at each position of ANY
text (train/corpus.py) are labels, at the cost of one forward per sequence instead of one per
generated token.

    any text ──target forward (all logits)──▶ features + top-k next tokens per position
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import PROCESS_START, alive, io_failure
from dflash_trt.io.jsonio import read_jsonl
from dflash_trt.models.config import MAX_VOCAB
from dflash_trt.models.target import load_target
from dflash_trt.runtime.pair import encode_prompt, resolve_dtype
from dflash_trt.train.prompts import read_prompts

MAX_SEQUENCE = 1 << 16  # tokens per training sequence (prompt + response)


def generate_responses(target_dir: str | Path, prompts: list[str], out_path: str | Path, *,
                       max_new_tokens: int = 192, batch_size: int = 16, progress: bool = True,
                       threads: int | None = None, dtype: str = "auto") -> Path:
    """Answer each prompt with the target (greedy, chat template) and append rows
    `{"prompt", "prompt_ids", "output_ids"}` to out_path. Resumable: prompts already in the file
    are skipped. Uses transformers' batched generate (left padding): this is data, not the product.
    dtype "auto" is the runtime's default (bfloat16 where the CPU has native bf16): the answers
    are then the ones the deployed target gives, and batched bf16 generate ran 2x faster than
    float32 here (0.98 vs 0.50 prompts/s per core at batch 48)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    out_path = Path(out_path)
    done = {r["prompt"] for r in read_jsonl(out_path) if isinstance(r, dict) and isinstance(r.get("prompt"), str)} \
        if out_path.exists() else set()
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    if not todo:
        return out_path
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=resolve_dtype(dtype)).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    encoded = sorted(((p, encode_prompt(tok, p)) for p in todo), key=lambda x: len(x[1]))  # less padding
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    random.Random(0).shuffle(batches)  # a mix of lengths early, so the progress rate is honest
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="generating responses", unit="prompt", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with open(out_path, "a") as f, torch.no_grad():
        for batch in batches:
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            gen = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            for (prompt, ids), row in zip(batch, gen[:, width:].tolist()):
                row = _strip_after_eos(row, eos)
                f.write(json.dumps({"prompt": prompt, "prompt_ids": ids, "output_ids": row}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return out_path


def _strip_after_eos(row: list[int], eos) -> list[int]:
    stops = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(row):
        if t in stops:
            return row[: i + 1]  # keep the end token: drafting it is part of decoding
    return row


@dataclass
class Sequences:
    """Token sequences (prompt + target response) with the target's features, packed flat."""
    tokens: torch.Tensor       # [N_tok] int64
    offsets: torch.Tensor      # [n_seq + 1] int64: sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens: torch.Tensor  # [n_seq] int64
    features: torch.Tensor | None = None  # [N_tok, n_feat * H] bfloat16
    # teacher-forced labels: the target's top-k tokens after each position (row t predicts token
    # t+1; column 0 is its greedy choice) and their log-probabilities
    top_ids: torch.Tensor | None = None   # [N_tok, K] int32
    top_logp: torch.Tensor | None = None  # [N_tok, K] float16

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def load_sequences(path: str | Path, tokenizer=None) -> tuple[Sequences, list[str]]:
    """A data JSONL: rows with `prompt_ids` + `output_ids` (as generate_responses writes), or with
    text `prompt` + `response` (tokenized with the chat template; needs the tokenizer)."""
    rows = read_jsonl(path)
    toks, plens, prompts = [], [], []
    vocab = len(tokenizer) if tokenizer is not None else MAX_VOCAB
    for i, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise DFlashError(f"{path}: row {i} is a JSON {type(r).__name__}, expected an object")
        if "prompt_ids" in r and "output_ids" in r:
            p, o = _token_ids(path, i, r, "prompt_ids", vocab), _token_ids(path, i, r, "output_ids", vocab)
        elif "prompt" in r and "response" in r:
            if tokenizer is None:
                raise DFlashError(f"{path}: text rows need the target's tokenizer")
            if not (isinstance(r["prompt"], str) and isinstance(r["response"], str)):
                raise DFlashError(f"{path}: row {i}: prompt and response must be strings")
            p = encode_prompt(tokenizer, r["prompt"])
            o = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
        else:
            raise DFlashError(f"{path}: row {i} has neither prompt_ids/output_ids nor prompt/response")
        if len(p) + len(o) > MAX_SEQUENCE:
            raise DFlashError(f"{path}: row {i} has {len(p) + len(o)} tokens; a training sequence may have at most "
                              f"{MAX_SEQUENCE}")
        if len(o) < 2:
            continue  # nothing to draft
        toks.append(torch.tensor(p + o, dtype=torch.long))
        plens.append(len(p))
        prompts.append(r.get("prompt", ""))
    if not toks:
        raise DFlashError(f"{path}: no usable sequences (each needs at least 2 response tokens)")
    lens = torch.tensor([len(t) for t in toks])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return Sequences(torch.cat(toks), offsets, torch.tensor(plens)), prompts


def _token_ids(path, i: int, row: dict, key: str, vocab: int) -> list[int]:
    ids = row[key]
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                          for t in ids)):
        raise DFlashError(f"{path}: row {i}: {key} must be a list of token ids in 0..{vocab - 1}")
    return ids


def target_features(target_dir: str | Path, data: Sequences, layer_ids: list[int], cache_dir: Path,
                    progress: bool = True, dtype: torch.dtype = torch.float32, topk: int = 0) -> torch.Tensor:
    """Features [N_tok, n*H] (bf16) of the captured target layers over every sequence, computed
    with our target runtime in `dtype` (the same code that captures them at decode time). With
    topk > 0 the same pass also labels every position with the target's top-k next tokens
    (data.top_ids / data.top_logp). Cached per sequence (keyed by its tokens, the layers, the dtype,
    k and the target's config), so data that grows, as a resumed generation does, only costs the
    new sequences."""
    cfg_text = (Path(target_dir) / "config.json").read_text()
    salt = hashlib.sha256(json.dumps([layer_ids, cfg_text, str(dtype)] + ([topk] if topk else [])).encode()
                          ).hexdigest()[:12]
    folder = cache_dir / f"layers-{salt}"
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_feature_temps(folder)
    keys = [hashlib.sha256(data.tokens[data.seq(i)].numpy().tobytes()).hexdigest()[:24] for i in range(len(data))]
    todo = [i for i, k in enumerate(keys) if not (folder / f"{k}.safetensors").is_file()]
    if todo:
        target = load_target(target_dir, dtype=dtype)
        target.setup_cache(max(data.seq(i).stop - data.seq(i).start for i in todo) + 1)
        bar = tqdm(total=sum(data.seq(i).stop - data.seq(i).start for i in todo), unit="tok", unit_scale=True,
                   desc="target labels" if topk else "target features", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        for i in todo:
            bar.update(data.seq(i).stop - data.seq(i).start)
            if (folder / f"{keys[i]}.safetensors").is_file():
                continue   # another process sharing the cache computed it meanwhile
            logits, feats = target(data.tokens[data.seq(i)], 0, capture=layer_ids, all_logits=bool(topk))
            tensors = {"features": feats.to(torch.bfloat16).contiguous()}
            if topk:
                logp, ids = torch.log_softmax(logits.float(), -1).topk(topk, -1)
                tensors.update(top_ids=ids.to(torch.int32).contiguous(), top_logp=logp.to(torch.float16).contiguous())
            _write_cache(folder, keys[i], tensors)
        bar.close()
    # filled in place, not concatenated: a corpus's features are gigabytes, a copy would double them
    n_tok, out = int(data.offsets[-1]), {}
    for i, k in enumerate(keys):
        for name, t in load_file(str(folder / f"{k}.safetensors")).items():
            if name not in out:
                out[name] = torch.empty((n_tok,) + tuple(t.shape[1:]), dtype=t.dtype)
            out[name][data.seq(i)] = t
    if topk:
        data.top_ids, data.top_logp = out["top_ids"], out["top_logp"]
    return out["features"]


def _write_cache(folder: Path, key: str, tensors: dict) -> None:
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / f"{key}.safetensors")
    except Exception as e:  # OSError, or safetensors' own error type for a failed write
        tmp.unlink(missing_ok=True)
        why = io_failure(e) or (e.strerror if isinstance(e, OSError) else None)
        if why is None:
            raise
        raise DFlashError(f"{folder}: cannot write the feature cache ({why})") from None


def _remove_stale_feature_temps(folder: Path) -> None:
    """`.<key>.<pid>.tmp` files of feature writers that were killed (their process is gone and
    started before this one), with a line saying so."""
    for f in folder.glob(".*.tmp"):
        pid = f.name.rsplit(".", 2)[-2]
        try:
            stale = pid.isdigit() and not alive(int(pid)) and f.stat().st_mtime < PROCESS_START
            if stale:
                f.unlink()
                print(f"dflash-trt: removed {f}, left behind by an interrupted run (pid {pid})", file=sys.stderr)
        except OSError:
            continue


def _is_prompt_only(path: Path) -> bool:
    rows = read_jsonl(path)
    return bool(rows) and all(isinstance(r, dict) and "prompt" in r and "output_ids" not in r and "response" not in r
                              for r in rows)


def prepare_data(target_dir: Path, path: Path, out_path: Path, max_new_tokens: int, progress: bool,
                 dtype: torch.dtype = torch.float32) -> Path:
    """A prompt-only JSONL is answered by the target first (resumable, into out_path)."""
    if _is_prompt_only(path):
        return generate_responses(target_dir, read_prompts(path), out_path, max_new_tokens=max_new_tokens,
                                  progress=progress, dtype=dtype)
    return path

