"""A stack, a server and a model family are each one module (or one table row) the pipeline looks up,
never a name it branches on (docs/stacks.md, docs/families.md).

Read with `ast` from the package the interpreter imports (like tests/test_layers.py; run with
PYTHONPATH=<another checkout> to read that one):

- no comparison with a stack or server name literal (==, !=, in / not in a literal container,
  match / case) outside dflash_trt/stacks/; the names are the registry's and engines.json's;
- no literal list of them there either (a tuple / list / set of two or more, or a dict keyed by two
  or more: a copy of the registry's names, or a second factory keyed by stack name);
- no comparison of a `model_type` (cfg["model_type"], cfg.get("model_type"), x.model_type, a
  variable named model_type or assigned from one) with a string literal outside
  dflash_trt/models/families/ and dflash_trt/presets/.
"""
from __future__ import annotations

import ast
from pathlib import Path

import dflash_trt
from dflash_trt import engines
from dflash_trt.stacks import REGISTRY

PACKAGE = Path(dflash_trt.__file__).resolve().parent


def _sources(*allowed: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(allowed):
            yield rel, ast.parse(path.read_text(), filename=str(path))


def _strings(node) -> set[str]:
    """The string literals of a constant or of a literal tuple / list / set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _strings(e)}
    return set()


def _case_strings(pattern) -> set[str]:
    if isinstance(pattern, ast.MatchValue):
        return _strings(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return {s for p in pattern.patterns for s in _case_strings(p)}
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _case_strings(pattern.pattern)
    return set()


# The same word naming another thing: (file, name) -> what it names there
OTHER_MEANING = {
    ("runtime/kv_inject.py", "triton"): "the Triton compiler, a kernel backend (torch | triton), not Triton "
                                        "Inference Server",
    ("train/data.py", "vllm"): "vLLM as the offline engine writing training answers (--engine auto|vllm|transformers), "
                               "not a serving stack of a bundle",
}


def stack_and_server_names() -> set[str]:
    f = engines.facts()
    return set(REGISTRY) | set(f["stacks"]) | set(f["servers"])


def name_comparisons(tree: ast.AST, names: set[str]) -> list[tuple[int, set[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            hit = {s for operand in (node.left, *node.comparators) for s in _strings(operand)} & names
            if hit:
                out.append((node.lineno, hit))
        elif isinstance(node, ast.Match):
            hit = {s for case in node.cases for s in _case_strings(case.pattern)} & names
            if hit:
                out.append((node.lineno, {f"match/case {h}" for h in hit}))
    return out


def test_no_stack_or_server_name_comparison_outside_stacks():
    names = stack_and_server_names()
    found = [f"dflash_trt/{rel}:{line}: compares with {', '.join(sorted(hit))}"
             for rel, tree in _sources("stacks/")
             for line, hit in name_comparisons(tree, {n for n in names if (rel, n) not in OTHER_MEANING})]
    assert not found, "a stack or server name branched on outside dflash_trt/stacks/ (ask the Stack):\n" + \
        "\n".join(found)


# Literal lists of names that are a format's own keys, not a copy of the registry: (file, names) -> why
FORMAT_KEYS = {
    ("io/manifest.py", frozenset({"vllm", "sglang", "trtllm"})):
        "manifest.json drafter.target_layer_ids' keys: the layer-id conventions (docs/layer-ids.md), a field list "
        "of the format (io is below stacks/ and cannot ask the registry)",
}


def name_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, frozenset[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hit = frozenset({s for e in node.elts for s in _strings(e)} & names)
        elif isinstance(node, ast.Dict):
            hit = frozenset({s for k in node.keys if k is not None for s in _strings(k)} & names)
        else:
            continue
        if len(hit) >= 2:
            out.append((node.lineno, hit))
    return out


def test_no_literal_list_of_stack_or_server_names_outside_stacks():
    names = stack_and_server_names()
    found = [f"dflash_trt/{rel}:{line}: lists {', '.join(sorted(hit))}"
             for rel, tree in _sources("stacks/") for line, hit in name_lists(tree, names)
             if not any(rel == f and hit <= allowed for f, allowed in FORMAT_KEYS)]
    assert not found, ("a literal list of stack or server names outside dflash_trt/stacks/ (derive it from "
                       "stacks.REGISTRY or engines.json):\n" + "\n".join(found))


# ------------------------------------------------------------------------------- model families
def _mentions_model_type(node, names: set[str]) -> bool:
    """cfg["model_type"], cfg.get("model_type"), x.model_type, or a name bound to one of them."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr == "model_type":
            return True
        if isinstance(n, ast.Name) and n.id in names:
            return True
        if isinstance(n, ast.Subscript) and _strings(n.slice) == {"model_type"}:
            return True
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                and _strings(n.args[0]) == {"model_type"}):
            return True
    return False


def _model_type_names(scope: ast.AST) -> set[str]:
    """model_type, and each variable of the scope assigned from a model_type (mt = cfg.get("model_type"))."""
    names = {"model_type"}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _mentions_model_type(node.value, names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def model_type_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    out = set()
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        names = _model_type_names(scope)
        for node in ast.walk(scope):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                literals = {s for o in operands for s in _strings(o)}
                if literals and any(not _strings(o) and _mentions_model_type(o, names) for o in operands):
                    out.add((node.lineno, ", ".join(sorted(literals))))
            elif isinstance(node, ast.Match) and _mentions_model_type(node.subject, names):
                out.add((node.lineno, "match/case"))
    return sorted(out)


def test_no_model_type_literal_comparison_outside_families():
    found = [f"dflash_trt/{rel}:{line}: model_type compared with {what}"
             for rel, tree in _sources("models/families/", "presets/") for line, what in model_type_comparisons(tree)]
    assert not found, ("a model family branched on by name outside dflash_trt/models/families/ (ask the family's "
                       "module, docs/families.md):\n" + "\n".join(found))


# ------------------------------------------------------------------------------- the detectors themselves
def test_detectors_see_each_form():
    """Each form the rules name is caught, and look-ups that are not branches are not (the oracle: these
    snippets, written by hand)."""
    names = {"vllm", "trtllm-serve"}
    caught = ['if s == "vllm": pass', 'x = s != "trtllm-serve"', 'if s in ("vllm", "x"): pass',
              'match s:\n    case "vllm": pass']
    for src in caught:
        assert name_comparisons(ast.parse(src), names), src
    for src in ['REGISTRY["vllm"]', 'd = {"vllm": 1}', 'if s == "other": pass']:
        assert not name_comparisons(ast.parse(src), names), src
    for src in ['X = ("vllm", "trtllm-serve")', 'F = {"vllm": f, "trtllm-serve": g}',
                'click.Choice(["vllm", "trtllm-serve"])']:
        assert name_lists(ast.parse(src), names), src
    for src in ['X = ("vllm", "hf")', 'F = {"vllm": f}']:
        assert not name_lists(ast.parse(src), names), src
    caught = ['if cfg.get("model_type") == "gpt_oss": pass', 'if cfg["model_type"] in ("a", "b"): pass',
              'if c.model_type != "qwen3": pass', 'def f(cfg):\n    mt = cfg.get("model_type")\n    return mt == "x"',
              'def f(model_type):\n    return model_type in ["a"]', 'match cfg.get("model_type"):\n    case "a": pass']
    for src in caught:
        assert model_type_comparisons(ast.parse(src)), src
    for src in ['if "model_type" not in cfg: pass', 'x = {k: v for k, v in c.items() if k not in ("model_type",)}',
                'if cfg.get("model_type") in SUPPORTED: pass',
                'if cfg.get("speculators_model_type") == "dflash": pass']:
        assert not model_type_comparisons(ast.parse(src)), src
