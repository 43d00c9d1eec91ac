"""Served traffic as training prompts: OpenAI request bodies logged as JSON Lines.

    FILE.jsonl[.gz] | DIR ──rows──▶ prompts as the target's token ids ──dedupe──▶ train | held out

A row is the body of a `/v1/chat/completions` request (`messages`, rendered with the target's own
chat template, generation prompt added: the tokens the server prefilled) or of a `/v1/completions`
request (`prompt`: a string, a list of strings, or token ids). Whatever else a row holds (`response`,
`choices`, sampling settings) is ignored: the labels come from the target itself. A folder is read
file by file in sorted name order; `.gz` files are read through gzip.

A row that cannot be a prompt is skipped with one line naming FILE:LINE and why (never the prompt's
text unless `verbose`): not JSON, wrong encoding, no prompt, an unknown role, an empty prompt, or
longer than the target's context leaves room to answer. Identical prompts (the same token ids) count
once. The split is by a hash of the token ids, so it is stable across runs and files, and a prompt
is on one side only.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import sha256_file

ROLES = ("system", "developer", "user", "assistant", "tool")   # what OpenAI's chat API accepts


@dataclass(frozen=True)
class Request:
    """One distinct prompt, as the target's token ids."""
    key: str                 # sha256 of the token ids: the dedupe and split key
    ids: list[int]
    kind: str                # "chat" | "completion"
    where: str               # FILE:LINE of its first occurrence


@dataclass(frozen=True)
class BadRow:
    where: str               # FILE:LINE
    kind: str                # the reason's category (the summary counts them)
    reason: str              # one line, without the prompt's text unless verbose

    def line(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass
class Traffic:
    train: list[Request]
    held_out: list[Request]
    files: list[dict]                          # {path, sha256, rows} in reading order
    skipped: list[BadRow] = field(default_factory=list)
    duplicates: int = 0
    held_out_fraction: float = 0.0

    @property
    def rows(self) -> int:
        return sum(f["rows"] for f in self.files)

    def skipped_summary(self) -> str:
        counts = Counter(b.kind for b in self.skipped)
        return ", ".join(f"{n} {k}" for k, n in counts.most_common()) or "none"

    def fingerprint(self) -> str:
        """Which prompts and split these are: a run folder belongs to one fingerprint."""
        return hashlib.sha256(json.dumps([[r.key for r in self.train], [r.key for r in self.held_out]])
                              .encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"files": self.files, "rows": self.rows, "train": len(self.train), "held_out": len(self.held_out),
                "held_out_fraction": self.held_out_fraction, "duplicates": self.duplicates,
                "skipped": len(self.skipped), "skipped_by_reason": dict(Counter(b.kind for b in self.skipped))}


def traffic_files(paths: list[str | Path]) -> list[Path]:
    """The JSONL files to read: each FILE as given, each DIR's *.jsonl and *.jsonl.gz in sorted order."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(x for x in p.iterdir() if x.is_file() and x.name.endswith((".jsonl", ".jsonl.gz")))
            if not found:
                raise DFlashError(f"--traffic {p}: no *.jsonl or *.jsonl.gz files in the folder")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DFlashError(f"--traffic {p}: no such file or folder")
    return out


class _Skip(Exception):
    def __init__(self, kind: str, reason: str):
        self.kind, self.reason = kind, reason


def _text(content, where_in: str) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if kinds := {p.get("type") for p in content} - {"text"}:
            raise _Skip("no prompt", f"{where_in}: content part of type {sorted(map(str, kinds))[0]!r}; text only")
        return "".join(str(p.get("text", "")) for p in content)
    if content is None:
        return ""
    raise _Skip("no prompt", f"{where_in}: content is a JSON {type(content).__name__}, expected a string or parts")


def _chat_ids(tokenizer, messages) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise _Skip("no prompt", "messages is not a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _Skip("no prompt", f"messages[{i}] is not an object")
        if m.get("role") not in ROLES:
            raise _Skip("unknown role", f"messages[{i}].role {str(m.get('role'))[:20]!r} is not one of "
                        f"{', '.join(ROLES)}")
        clean.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")})
    if not any(m["content"].strip() for m in clean):
        raise _Skip("empty prompt", "every message is empty")
    if not getattr(tokenizer, "chat_template", None):
        raise _Skip("no prompt", "a chat row, but the target's tokenizer has no chat template to render it")
    try:
        ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    except Exception as e:   # jinja raises its own errors for what a template refuses (e.g. a role order)
        raise _Skip("no prompt", f"the target's chat template refuses these messages ({type(e).__name__})") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _completion_ids(tokenizer, prompt) -> list[list[int]]:
    """/v1/completions' prompt: a string, a list of strings (one prompt each), or token ids."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < len(tokenizer) for t in prompt):
            raise _Skip("no prompt", f"prompt token ids outside the target's vocabulary 0..{len(tokenizer) - 1}")
        return [list(prompt)]
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise _Skip("no prompt", f"prompt is a JSON {type(prompt).__name__}, expected a string, strings or token ids")
    if not texts or not any(t.strip() for t in texts):
        raise _Skip("empty prompt", "prompt is empty")
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts if t.strip()]


def _row_prompts(tokenizer, line: bytes) -> tuple[str, list[list[int]]]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Skip("wrong encoding", f"not UTF-8 (byte {e.start})") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Skip("not JSON", f"not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict):
        raise _Skip("not JSON", f"a JSON {type(row).__name__}, expected a request body object")
    if "messages" in row:
        return "chat", [_chat_ids(tokenizer, row["messages"])]
    if "prompt" in row:
        return "completion", _completion_ids(tokenizer, row["prompt"])
    raise _Skip("no prompt", "neither messages (/v1/chat/completions) nor prompt (/v1/completions)")


def _lines(path: Path):
    """(line number, raw bytes) of a JSONL file, gzip or plain."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    yield i, line
    except (OSError, EOFError) as e:   # a truncated or non-gzip .gz file
        raise DFlashError(f"{path}: cannot read ({e})") from None


def held_out(key: str, fraction: float) -> bool:
    """The split: the first 8 hex digits of the prompt's hash as a number in [0, 1)."""
    return int(key[:8], 16) / 16 ** 8 < fraction


def read_traffic(paths: list[str | Path], tokenizer, *, max_prompt_tokens: int, held_out_fraction: float,
                 max_bad_rows: int | None = None, verbose: bool = False, log=None) -> Traffic:
    """Every file's rows as distinct prompts, split train / held out. `log(line)` gets each skipped row's
    line as it is found. A prompt over max_prompt_tokens (the target's context less the answer's room) is
    skipped. Refused (DFlashError): no usable prompt, nothing on one side of the split, or more skipped rows
    than max_bad_rows."""
    seen: dict[str, Request] = {}
    files, skipped, dups = [], [], 0
    for path in traffic_files(paths):
        n = 0
        for i, line in _lines(path):
            n += 1
            where = f"{path}:{i}"
            try:
                kind, prompts = _row_prompts(tokenizer, line)
                for ids in prompts:
                    if len(ids) > max_prompt_tokens:
                        raise _Skip("over context", f"{len(ids)} prompt tokens, more than the {max_prompt_tokens} the "
                                    "target's context leaves beside the answer")
            except _Skip as s:
                reason = s.reason + (f" [row: {line.decode('utf-8', 'replace').strip()[:200]}]" if verbose else "")
                skipped.append(BadRow(where, s.kind, reason))
                if log:
                    log(skipped[-1].line())
                continue
            for ids in prompts:
                key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
                if key in seen:
                    dups += 1
                else:
                    seen[key] = Request(key, ids, kind, where)
        files.append({"path": str(path), "sha256": sha256_file(path), "rows": n})
    t = Traffic(train=[r for r in seen.values() if not held_out(r.key, held_out_fraction)],
                held_out=[r for r in seen.values() if held_out(r.key, held_out_fraction)], files=files,
                skipped=skipped, duplicates=dups, held_out_fraction=held_out_fraction)
    _refuse_unusable(t, max_bad_rows)
    return t


def _refuse_unusable(t: Traffic, max_bad_rows: int | None) -> None:
    what = f"--traffic: {t.rows} rows in {len(t.files)} files; skipped {len(t.skipped)} ({t.skipped_summary()})"
    if max_bad_rows is not None and len(t.skipped) > max_bad_rows:
        raise DFlashError(f"{what}: more than --max-bad-rows {max_bad_rows}")
    if not t.train and not t.held_out:
        raise DFlashError(f"{what}: no usable prompt left")
    if not t.train or not t.held_out:
        side = "train" if not t.train else "held-out"
        raise DFlashError(f"{what}: {len(t.train) + len(t.held_out)} distinct prompts leave the {side} part empty "
                          f"at --held-out {t.held_out_fraction:g}; give more traffic")
