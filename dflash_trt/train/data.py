"""Training data of a DFlash drafter: the target's own answers, as token sequences.

    prompts ──target generates──▶ responses (JSONL) ──▶ Sequences ──train/features.py──▶ features on disk

The answers are the target's greedy ones, so the labels are exactly the tokens the target emits
at decode time. They come from vLLM's batched generation where a vLLM environment is installed
(train/vllm_answers.py, run in that environment's own Python), else from transformers' generate.
Teacher-forced labels (`--labels teacher-forced`) need no answers: the labelling pass of
train/features.py keeps the target's top-k next tokens at every position of ANY text
(train/corpus.py).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_jsonl
from dflash_trt.models.config import MAX_VOCAB
from dflash_trt.models.target import stop_token_ids
from dflash_trt.runtime.pair import encode_prompt, resolve_dtype
from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, vllm_env_ready, vllm_python
from dflash_trt.train.prompts import read_prompts

MAX_SEQUENCE = 1 << 16  # tokens per training sequence (prompt + response)


VLLM_ENV = "DFLASH_TRT_VLLM_ENV"   # a virtual environment with vLLM installed (default: .venv/vllm)


def generate_responses(target_dir: str | Path, prompts: list[str], out_path: str | Path, *,
                       max_new_tokens: int = 192, batch_size: int = 16, progress: bool = True,
                       threads: int | None = None, dtype: str = "auto", engine: str = "auto",
                       prompt_ids: dict[str, list[int]] | None = None) -> Path:
    """Answer each prompt with the target (greedy, chat template) and append rows
    `{"prompt", "prompt_ids", "output_ids"}` to out_path. Resumable: prompts already in the file
    are skipped. Uses transformers' batched generate (left padding): this is data, not the product.
    dtype "auto" is the runtime's default (bfloat16 where the CPU has native bf16): the answers
    are then the ones the deployed target gives, and batched bf16 generate ran 2x faster than
    float32 here (0.98 vs 0.50 prompts/s per core at batch 48).
    engine: "vllm" (vLLM's batched generation in its own environment, vllm_env.vllm_python()), "hf"
    (transformers), "auto" (vLLM where its environment exists).
    prompt_ids: prompts already rendered as token ids (a logged chat, train/traffic.py), by prompt; the
    rest are encoded with the chat template."""
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
    # the vLLM env's Python (paths.vllm_env_dir: $DFLASH_TRT_VLLM_ENV, else <this env>/vllm, which
    # `make vllm` builds); none where it is missing or half-made (then transformers answers)
    py = vllm_python() if engine in ("auto", "vllm") and vllm_env_ready() else None
    if engine == "vllm" and py is None:
        raise DFlashError(f"answers from vLLM: no vLLM environment (set ${VLLM_ENV} to a venv with vllm installed, "
                          f"or create {Path(sys.prefix) / 'vllm'})")
    encoded = [(p, (prompt_ids or {}).get(p) or encode_prompt(tok, p)) for p in todo]
    if py is not None:
        return _vllm_responses(py, target_dir, encoded, out_path, max_new_tokens, dtype, threads)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=resolve_dtype(dtype)).eval()
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    encoded.sort(key=lambda x: len(x[1]))  # less padding
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


def _vllm_responses(py: Path, target_dir, encoded: list[tuple[str, list[int]]], out_path: Path, max_new_tokens: int,
                    dtype: str, threads: int | None) -> Path:
    """The answers of vllm_answers.py run by the vLLM environment's Python, appended like generate's.
    The prompt ids are ours (encode_prompt), so both engines answer the very same tokens."""
    eos = stop_token_ids(target_dir)
    vdtype = str(resolve_dtype(dtype)).removeprefix("torch.")   # the dtype our runtime would answer in
    with tempfile.TemporaryDirectory(prefix="dflash-trt-vllm-") as tmp:
        req, ans, summary = Path(tmp) / "requests.jsonl", Path(tmp) / "answers.jsonl", Path(tmp) / "summary.json"
        req.write_text("".join(json.dumps({"i": i, "prompt_ids": ids}) + "\n" for i, (_, ids) in enumerate(encoded)))
        env = {**CPU_ENV, **clean_env()}   # the host's own settings win over the CPU defaults
        if threads:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        cmd = [str(py), str(Path(__file__).with_name("vllm_answers.py")), "--model", str(target_dir),
               "--requests", str(req), "--answers", str(ans), "--summary", str(summary),
               "--max-new-tokens", str(max_new_tokens),
               "--dtype", vdtype]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if r.returncode:
            tail = [x for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()][-1:] or ["no output"]
            raise DFlashError(f"answers from vLLM ({py}): exit {r.returncode}: {tail[0][:300]}")
        done = json.loads(summary.read_text())
        print(f"dflash-trt: vLLM {done['vllm']} answered {done['answers']} prompts in {done['generate_seconds']:.1f} s "
              f"({done['answers'] / done['generate_seconds']:.2f} answers/s; engine start {done['load_seconds']:.0f} s)",
              file=sys.stderr)
        rows = {o["i"]: o["output_ids"] for o in map(json.loads, ans.read_text().splitlines())}
        if len(rows) != len(encoded):
            raise DFlashError(f"answers from vLLM ({py}): {len(rows)} answers for {len(encoded)} prompts")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as f:
        f.writelines(json.dumps({"prompt": prompt, "prompt_ids": ids, "output_ids": _strip_after_eos(rows[i], eos)})
                     + "\n" for i, (prompt, ids) in enumerate(encoded))
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
    # [N_tok, n_feat * H] bfloat16: a tensor, or train/features.SequenceRows over the shards on
    # disk (indexed the same way, by a slice inside one sequence)
    features: object | None = None
    # teacher-forced labels: the target's top-k tokens after each position (row t predicts token
    # t+1; column 0 is its greedy choice) and their log-probabilities
    top_ids: object | None = None   # [N_tok, K] int32
    top_logp: object | None = None  # [N_tok, K] float16

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


def is_prompt_only(path: Path) -> bool:
    rows = read_jsonl(path)
    return bool(rows) and all(isinstance(r, dict) and "prompt" in r and "output_ids" not in r and "response" not in r
                              for r in rows)


def prepare_data(target_dir: Path, path: Path, out_path: Path, max_new_tokens: int, progress: bool,
                 dtype: torch.dtype = torch.float32, engine: str = "auto") -> Path:
    """A prompt-only JSONL is answered by the target first (resumable, into out_path)."""
    if is_prompt_only(path):
        return generate_responses(target_dir, read_prompts(path), out_path, max_new_tokens=max_new_tokens,
                                  progress=progress, dtype=dtype, engine=engine)
    return path

