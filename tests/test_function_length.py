"""Functions stay readable (issue 40): none in the package over 100 lines, none in the command line
(commands/) over 60 (a command parses, calls the library and reports; the work lives in the library).
Read with `ast`; a function's lines run from its `def` to its last line, docstring included."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_trt"
LIMIT, COMMAND_LIMIT = 100, 60


def long_functions(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_100_lines():
    assert not long_functions(PACKAGE, LIMIT)


def test_no_command_function_over_60_lines():
    assert not long_functions(PACKAGE / "commands", COMMAND_LIMIT)


def test_the_check_counts_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 61)
    assert long_functions(tmp_path, COMMAND_LIMIT) == [f"{tmp_path.name}/m.py:1 f (62 lines)"]
