"""The one reader of JSON and JSON Lines files: every problem is one DFlashError naming the file
(and the line, for JSONL), never a traceback."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

from dflash_trt.errors import DFlashError


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn the ways reading a text file fails into one line naming it."""
    try:
        yield
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
        with _reading(path):
            obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(obj, dict):
        raise DFlashError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, value) for each non-blank line of a JSON Lines file, read as it goes (a
    caller that stops early reads no further; lines end at \n only, as JSON Lines says)."""
    path = Path(path)
    with _reading(path), open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{i}: invalid JSON ({e.msg})") from None
            yield i, value


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
