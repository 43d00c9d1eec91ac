"""The one JSON / JSON Lines reader: one error line naming the file (and line) for every failure."""
from __future__ import annotations

import json

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import iter_jsonl, read_json, read_jsonl


def test_read_json_errors_name_the_file(tmp_path):
    with pytest.raises(DFlashError, match=r"missing\.json: not found"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"a": 1,,}')
    with pytest.raises(DFlashError, match=r"bad\.json: invalid JSON \(.* at line 1\)"):
        read_json(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(DFlashError, match=r"list\.json: expected a JSON object, found list"):
        read_json(tmp_path / "list.json")
    (tmp_path / "latin1.json").write_bytes(b'{"a": "\xe9"}')
    with pytest.raises(DFlashError, match=r"latin1\.json: not UTF-8 text"):
        read_json(tmp_path / "latin1.json")
    with pytest.raises(DFlashError, match="is a folder"):
        read_json(tmp_path)


def test_jsonl_line_numbers_blank_lines_and_unicode_separators(tmp_path):
    p = tmp_path / "p.jsonl"
    # U+2028 inside a string is valid JSON and must not split the line
    p.write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n\n" + '{"prompt": "c"}\n' + "{oops\n")
    rows = []
    with pytest.raises(DFlashError, match=r"p\.jsonl:4: invalid JSON"):
        for i, row in iter_jsonl(p):
            rows.append((i, row))
    assert rows == [(1, {"prompt": "a\u2028b"}), (3, {"prompt": "c"})]
    with pytest.raises(DFlashError, match=r"p\.jsonl:4: invalid JSON"):
        read_jsonl(p, require="prompt")


def test_jsonl_is_read_as_it_goes(tmp_path):
    """A caller that stops early (calibration takes the first n samples) never meets later lines."""
    p = tmp_path / "calib.jsonl"
    p.write_bytes(b'{"text": "one"}\n{"text": "two"}\n' + b'{"text": "filler"}\n' * 20_000 + b"\xff\xfe not utf-8\n")
    it = iter_jsonl(p)
    assert next(it) == (1, {"text": "one"}) and next(it) == (2, {"text": "two"})
    with pytest.raises(DFlashError, match="not UTF-8 text"):
        list(it)


def test_jsonl_require_field(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": 3}\n')
    with pytest.raises(DFlashError, match=r"p\.jsonl:1: expected an object with a string field 'prompt'"):
        read_jsonl(p, require="prompt")
    p.write_text("\n")
    with pytest.raises(DFlashError, match="no prompts in the file"):
        read_jsonl(p, require="prompt")
