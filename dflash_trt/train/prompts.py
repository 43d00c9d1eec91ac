"""Prompts for training and evaluating drafters, built only from material that ships with Python.

Each public function of a standard-library module with a signature and a docstring becomes a
"write this function" request (plus some "explain" requests and general instructions drawn from
module docstrings). The held-out split uses DIFFERENT modules than the training split, so τ
measured on it is not inflated by memorised answers. No public benchmark problem is used.

Prompt files are JSONL with one `{"prompt": "..."}` object per line (extra keys are kept).
"""
from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_jsonl

# Pure-Python, side-effect-free modules (importing them prints, opens or starts nothing).
TRAIN_MODULES = (
    "abc", "argparse", "ast", "base64", "binascii", "codecs", "collections", "collections.abc",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "dis", "email.utils", "email.header", "enum", "filecmp", "fileinput", "functools",
    "getopt", "gettext", "glob", "gzip", "hashlib", "hmac", "http.cookies", "imaplib", "importlib",
    "importlib.util", "inspect", "io", "itertools", "json", "keyword", "linecache", "locale",
    "logging", "lzma", "mimetypes", "operator", "optparse", "os", "os.path", "pathlib", "pickle",
    "pkgutil", "platform", "plistlib", "posixpath", "pprint", "queue", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "selectors", "shutil", "smtplib", "socket", "socketserver",
    "sqlite3", "string", "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "threading",
    "time", "timeit", "tokenize", "traceback", "types", "typing", "unittest", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib", "math", "cmath",
    "array", "codeop", "cmd", "pydoc", "trace", "tracemalloc", "wsgiref.util", "zipimport",
)
# Held out: no function, docstring or module text of these is ever in the training prompts.
HELDOUT_MODULES = (
    "textwrap", "statistics", "fractions", "bisect", "heapq", "colorsys", "calendar", "ipaddress",
    "difflib", "shlex", "html", "urllib.parse", "fnmatch", "graphlib", "numbers", "stat",
)

_CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}`. {doc}",
    "Implement `def {name}{sig}:` in Python. Docstring: {doc}",
    "Write a Python function called {name} with the signature `{name}{sig}`. It should do this: {doc}",
    "Here is a description of a function: {doc}\nWrite it in Python as `{name}{sig}`, with a short docstring.",
)
_EXPLAIN_TEMPLATES = (
    "Explain what `{qual}` does in Python and show a short example of calling it.",
    "In two or three sentences, what is `{qual}{sig}` for? Its documentation says: {doc}",
)
_GENERAL_TEMPLATES = (
    "What is the Python module `{mod}` used for? Give one short example.",
    "Summarize this in one sentence: {doc}",
    "Rewrite the following text in simple words for a beginner: {doc}",
    "List three common uses of the Python `{mod}` module.",
)


@dataclass(frozen=True)
class FunctionDoc:
    module: str
    name: str
    signature: str
    doc: str       # first paragraph of the docstring, whitespace collapsed


def _first_paragraph(doc: str | None, max_chars: int = 320) -> str | None:
    if not doc:
        return None
    para = re.split(r"\n\s*\n", doc.strip())[0]
    para = " ".join(para.split())
    if len(para) < 25 or ">>>" in para:
        return None
    if len(para) > max_chars:  # cut at a sentence end when there is one
        cut = para[:max_chars]
        para = cut[: cut.rfind(". ") + 1] if ". " in cut else cut.rsplit(" ", 1)[0] + " ..."
    return para


def _import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except ImportError:  # a module this Python lacks (e.g. built without sqlite3): skip it
            return None


def module_functions(module_name: str) -> list[FunctionDoc]:
    """Public functions (and public methods of public classes) defined in the module, with a
    signature that inspect can read and a docstring worth turning into a request."""
    mod = _import(module_name)
    if mod is None:
        return []
    out: list[FunctionDoc] = []
    public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for name in sorted(set(public)):
        obj = getattr(mod, name, None)
        candidates = []
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            candidates.append((name, obj))
        elif inspect.isclass(obj) and getattr(obj, "__module__", "") == mod.__name__:
            for meth_name, meth in sorted(vars(obj).items()):
                if not meth_name.startswith("_") and inspect.isfunction(meth):
                    candidates.append((meth_name, meth))
        for fname, fn in candidates:
            doc = _first_paragraph(inspect.getdoc(fn))
            if doc is None:
                continue
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if len(sig) > 120:
                continue
            sig = re.sub(r"^\((self|cls)(, )?", "(", sig)  # a method's request reads as a plain function
            out.append(FunctionDoc(module_name, fname, sig, doc))
    return out


def _requests_for_module(module_name: str, rng: random.Random) -> list[dict]:
    rows = []
    for f in module_functions(module_name):
        qual = f"{f.module}.{f.name}"
        if rng.random() < 0.75:
            text = rng.choice(_CODE_TEMPLATES).format(name=f.name, sig=f.signature, doc=f.doc)
            kind = "code"
        else:
            text = rng.choice(_EXPLAIN_TEMPLATES).format(qual=qual, sig=f.signature, doc=f.doc)
            kind = "explain"
        rows.append({"prompt": text, "source": qual, "kind": kind})
    mod = _import(module_name)
    mod_doc = _first_paragraph(getattr(mod, "__doc__", None)) if mod is not None else None
    for tmpl in _GENERAL_TEMPLATES:
        if "{doc}" in tmpl and mod_doc is None:
            continue
        rows.append({"prompt": tmpl.format(mod=module_name, doc=mod_doc), "source": module_name, "kind": "general"})
    return rows


def build_prompts(split: str, limit: int | None = None, seed: int = 0) -> list[dict]:
    """Prompt rows for `split` ("train" or "heldout"), deduplicated and shuffled deterministically."""
    modules = {"train": TRAIN_MODULES, "heldout": HELDOUT_MODULES}.get(split)
    if modules is None:
        raise DFlashError(f"unknown prompt split {split!r}; use 'train' or 'heldout'")
    rng = random.Random(f"{split}-{seed}")
    rows, seen = [], set()
    for m in modules:
        for row in _requests_for_module(m, rng):
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
    rng.shuffle(rows)
    return rows[:limit] if limit else rows


def read_prompts(path: str | Path) -> list[str]:
    """The `prompt` of each line of a JSONL prompt file."""
    return [row["prompt"] for row in read_jsonl(path, require="prompt")]
