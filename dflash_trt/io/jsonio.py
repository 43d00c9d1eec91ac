"""The one reader of JSON and JSON Lines files: every problem is one DFlashError naming the file
(and the line, for JSONL), never a traceback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from dflash_trt.errors import DFlashError


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DFlashError(f"{path}: not found") from None
    except IsADirectoryError:
        raise DFlashError(f"{path}: is a folder, expected a file") from None
    except UnicodeDecodeError as e:
        raise DFlashError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DFlashError(f"{path}: cannot read ({e.strerror})") from None


def read_json(path: str | Path) -> dict:
    """A file holding one JSON object."""
    path = Path(path)
    try:
        obj = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(obj, dict):
        raise DFlashError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, value) for each non-blank line of a JSON Lines file, read as it goes."""
    path = Path(path)
    for i, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{i}: invalid JSON ({e.msg})") from None


def read_jsonl(path: str | Path, require: str | None = None) -> list[dict]:
    """A JSON Lines file (blank lines skipped). With `require`, every row must be an object with
    that string field, and the file must have at least one row."""
    rows = []
    for i, row in iter_jsonl(path):
        if require and not (isinstance(row, dict) and isinstance(row.get(require), str)):
            raise DFlashError(f"{path}:{i}: expected an object with a string field {require!r}")
        rows.append(row)
    if require and not rows:
        raise DFlashError(f"{path}: no prompts in the file")
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Rows as JSON Lines, replacing `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)
    return path
