"""An in-domain training corpus from what ships with Python: the standard library's own code.

Every function and method of the stdlib's source files becomes a chat row shaped like the
serving traffic of a code assistant: the request (`Write a Python function `name(sig)`. <doc>`,
the wording train/prompts.py uses) and, as the response, the function's real source in a code
block; documented ones also give an "explain" row whose response is the docstring. The target
never generated these responses: `train-drafter --labels teacher-forced` labels them with its own
predictions in one forward pass per row, which is what makes a large corpus affordable.

Held out, as in train/prompts.py: the files of HELDOUT_MODULES and their tests (no line of them
is in the corpus), and the whole test suite (`test/`, `tests/`, `idle_test/`). No public benchmark
problem is in the standard library.
"""
from __future__ import annotations

import ast
import hashlib
import os
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

from dflash_trt.train.prompts import _CODE_TEMPLATES, HELDOUT_MODULES

MAX_RESPONSE_CHARS = 1600   # ~450 tokens of code: teacher-forced rows stay <= 512 tokens, where a
# forward pass over the sequence costs least per token (0.58 s for 512 tokens vs 2.1 s for 1024, bf16)
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_files(root: Path) -> set[Path]:
    """The source files of the held-out modules (a package: all of its files)."""
    out = set()
    for name in HELDOUT_MODULES:
        rel = Path(*name.split("."))
        if (root / rel).is_dir():
            out |= set((root / rel).rglob("*.py"))
        out.add(root / rel.with_suffix(".py"))
    return out


def _held_out_name(path: Path) -> bool:
    """test_textwrap.py, _pydecimal-like twins: any file whose stem names a held-out module."""
    stems = {m.split(".")[-1] for m in HELDOUT_MODULES}
    stem = path.stem.lower().removeprefix("test_").removeprefix("_py").removeprefix("_")
    return stem in stems


def source_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    hold = held_out_files(root)
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
        for n in sorted(names):
            p = Path(d) / n
            if n.endswith(".py") and p not in hold and not _held_out_name(p):
                files.append(p)
    return files


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> str:
    args = node.args
    if method and args.posonlyargs:
        args = ast.arguments(**{**args.__dict__, "posonlyargs": args.posonlyargs[1:]})
    elif method and args.args:
        args = ast.arguments(**{**args.__dict__, "args": args.args[1:]})
    sig = f"({ast.unparse(args)})"
    if node.returns is not None:
        sig += f" -> {ast.unparse(node.returns)}"
    return sig


def _functions(tree: ast.Module):
    """(node, is_method) for module-level functions and the methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, False
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, True


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def rows_for_file(root: Path, path: Path, rng: random.Random) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []   # a file this Python cannot parse (there are a few templates): skip it
    parts = path.relative_to(root).with_suffix("").parts
    mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    lines = text.splitlines()
    rows = []
    for node, method in _functions(tree):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        src = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno]))  # (ast.get_source_segment
        # re-splits the whole file per call: minutes on the stdlib)
        if not src or len(src) > MAX_RESPONSE_CHARS or src.count("\n") < 2:
            continue
        doc = ast.get_docstring(node) or ""
        sig = _signature(node, method)
        if len(sig) > 160:
            continue
        brief = _first_paragraph(doc)[:320] if doc else f"It is part of the Python module `{mod}`."
        prompt = rng.choice(_CODE_TEMPLATES).format(name=node.name, sig=sig, doc=brief)
        rows.append({"prompt": prompt, "response": f"```python\n{src.rstrip()}\n```",
                     "source": f"{mod}.{node.name}", "kind": "code"})
        if len(doc) >= 80:
            rows.append({"prompt": f"Explain what `{mod}.{node.name}{sig}` does.", "response": doc.strip(),
                         "source": f"{mod}.{node.name}", "kind": "explain"})
    return rows


def build_corpus(max_rows: int | None = None, seed: int = 0, root: Path | None = None) -> tuple[list[dict], dict]:
    """Corpus rows (shuffled deterministically) and a description of where they came from."""
    root = root or stdlib_root()
    rng = random.Random(f"corpus-{seed}")
    files = source_files(root)
    rows, seen = [], set()
    for p in files:
        for r in rows_for_file(root, p, rng):
            key = hashlib.sha256((r["prompt"] + r["response"]).encode()).digest()
            if key not in seen:   # the stdlib has duplicate functions (e.g. pure-Python twins)
                seen.add(key)
                rows.append(r)
    rng.shuffle(rows)
    rows = rows[:max_rows] if max_rows else rows
    about = {"source": f"Python {sys.version.split()[0]} standard library at {root}", "files": len(files),
             "rows": len(rows), "held_out_modules": list(HELDOUT_MODULES),
             "skipped_dirs": sorted(_SKIP_DIRS)}
    return rows, about
