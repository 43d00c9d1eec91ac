"""The package's layers: a folder is a layer, and a layer imports only the layers below it.

    base (errors, paths, hardware, engines) < kernels < io < presets, models < runtime, quant < stacks
    < train, plan < bundle (build writes the plan it built from) < deploy < bench < the command line
    (cli, commands/, main_job)

No module imports one of ours through importlib (a registry is a dict of imported modules), but
for the command line's lazy commands and the corpus of standard-library texts (train/).

Read with `ast` from the source (no import needed); every import of our own modules counts, at
module top or inside a function. Imports sit at module top, except lazy imports of heavy optional
dependencies (torch stays out of `dflash-trt --help`; triton, onnx, modelopt, helm stay optional)
and, in the command line layer, of the library itself (so `--help` stays light).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_trt"

BASE = {"base"}
# layer -> the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    "base": BASE,
    "kernels": BASE | {"kernels"},
    "io": BASE | {"kernels", "io"},
    "presets": BASE | {"io", "presets"},
    "models": BASE | {"kernels", "io", "models"},
    "runtime": BASE | {"kernels", "io", "models", "runtime"},
    "quant": BASE | {"kernels", "io", "models", "quant"},
    "stacks": BASE | {"kernels", "io", "presets", "models", "runtime", "quant", "stacks"},
    "train": BASE | {"kernels", "io", "presets", "models", "runtime", "stacks", "train"},
    "bundle": BASE | {"kernels", "io", "presets", "models", "runtime", "quant", "stacks", "plan", "bundle"},
    "plan": BASE | {"io", "presets", "models", "stacks", "plan"},
    "deploy": BASE | {"io", "presets", "models", "stacks", "bundle", "plan", "deploy"},
    # bench/runtime.py measures our runtime, bench/endpoint.py a served bundle against its plan
    "bench": BASE | {"kernels", "io", "presets", "models", "runtime", "stacks", "plan", "deploy", "bench"},
    "cli": set(),  # the top: may import anything
}
# `import dflash_trt` stays light, and `dflash_trt.load_pair` / `.generate` resolve lazily to the runtime
FACADE = {"dflash_trt": {"runtime"}}
FOLDER_LAYERS = {"kernels", "io", "presets", "models", "runtime", "quant", "stacks", "train", "bundle", "plan",
                 "deploy", "bench"}
TOP_MODULES = {"cli", "main_job", "adapt"}   # adapt: the pipeline of train, bench and bundle
BASE_MODULES = {"__init__", "errors", "paths", "hardware", "engines"}
# importlib.import_module, by module: the lazy commands of the CLI (`--help` stays light) and the
# standard-library modules whose source is a training corpus (train/prompts.py, train/draft_vocab.py)
IMPORTLIB_OK = {"dflash_trt.cli", "dflash_trt.train.prompts", "dflash_trt.train.draft_vocab"}

# Third-party packages that may be imported inside a function: heavy (torch and what pulls it in)
# or optional extras. Anything else is imported at module top.
LAZY_OK = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "triton", "onnx", "onnxruntime",
           "onnxruntime_extensions", "tensorrt", "tensorrt_llm", "modelopt", "tritonclient", "helm_python",
           "jsonschema", "google", "kubernetes_validate", "gguf", "huggingface_hub", "accelerate",
           "httpx", "httpx2",  # huggingface_hub's HTTP client (presets/hub.py catches its transport errors)
           "matplotlib",  # plan --plot (the [plot] extra)
           "grafana_foundation_sdk",  # deploy --monitoring's dashboard (the [deploy] extra)
           "vllm"}  # train/vllm_answers.py runs in the vLLM environment, never imported by the package
# Our own modules that import an optional dependency at their top: imported lazily themselves.
OPTIONAL_OWN = {"dflash_trt.kernels.kv_inject_triton"}


def layer_of(module: str) -> str:
    """dflash_trt.models.target -> models; dflash_trt.errors -> base; dflash_trt.cli -> cli."""
    parts = module.split(".")[1:]
    if not parts or (len(parts) == 1 and parts[0] in BASE_MODULES):
        return "base"
    if parts[0] in FOLDER_LAYERS:
        return parts[0]
    if parts[0] == "commands" or parts[0] in TOP_MODULES:
        return "cli"
    raise AssertionError(f"{module}: not in any layer; add its folder to tests/test_layers.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def package_modules() -> list[tuple[str, Path]]:
    # assets/ holds files copied into bundles (Triton's model.py), not package modules
    return sorted((module_name(p), p) for p in PACKAGE.rglob("*.py") if "assets" not in p.relative_to(PACKAGE).parts)


def violations(module: str, source: str) -> list[str]:
    """Every layering or lazy-import rule that `source` (the text of `module`) breaks."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    layer = layer_of(module)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and module not in IMPORTLIB_OK:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append(f"{module}:{node.lineno}: imports through importlib ({name})")
        if isinstance(node, ast.ImportFrom):
            if node.level:
                out.append(f"{module}:{node.lineno}: relative import")
                continue
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        # `from dflash_trt.io import formats` imports dflash_trt.io.formats: the longest module that exists
        own = [t for t in targets if t == "dflash_trt" or t.startswith("dflash_trt.")]
        own = [t for t in own if (PACKAGE.parent / t.replace(".", "/")).with_suffix(".py").is_file()
               or (PACKAGE.parent / t.replace(".", "/") / "__init__.py").is_file()]
        own = [t for t in own if not any(o != t and o.startswith(t + ".") for o in own)]
        for t in own:
            to = layer_of(t)
            if layer != "cli" and to not in ALLOWED[layer] | FACADE.get(module, set()) and to != "cli":
                out.append(f"{module}:{node.lineno}: layer {layer} imports {t} (layer {to})")
            if to == "cli" and layer != "cli":
                out.append(f"{module}:{node.lineno}: layer {layer} imports the command line ({t})")
        if id(node) in top:
            optional = [t for t in own if t in OPTIONAL_OWN]
            if optional and module not in OPTIONAL_OWN:
                out.append(f"{module}:{node.lineno}: imports {optional[0]} (needs an optional dependency) at top")
            continue
        roots = {t.split(".")[0] for t in targets}
        if own:
            lazy_ok = layer == "cli" or module == "dflash_trt" or all(t in OPTIONAL_OWN for t in own)
        else:
            lazy_ok = roots <= LAZY_OK
        if not lazy_ok:
            out.append(f"{module}:{node.lineno}: import of {targets[0]} inside a function (import it at module top)")
    return out


def test_every_module_is_in_a_layer_and_respects_it():
    problems = []
    for module, path in package_modules():
        problems += violations(module, path.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source, expected", [
    ("dflash_trt.models.target", "from dflash_trt.bundle.build import Builder\n", "layer models imports"),
    ("dflash_trt.io.checkpoint", "import dflash_trt.quant.quantize\n", "layer io imports"),
    ("dflash_trt.io.checkpoint", "from dflash_trt.models import target\n", "layer io imports"),
    ("dflash_trt.runtime.decode", "def f():\n    from dflash_trt.models.target import TargetModel\n",
     "inside a function"),
    ("dflash_trt.runtime.decode", "def f():\n    import json\n", "inside a function"),
    ("dflash_trt.runtime.kv_inject", "from dflash_trt.kernels.kv_inject_triton import kv_inject_kernel\n",
     "optional dependency"),
    ("dflash_trt.bundle.build", "from dflash_trt.commands.core import check_cmd\n", "the command line"),
    ("dflash_trt.models.target", "import importlib\nf = importlib.import_module('dflash_trt.models.families.mla')\n",
     "through importlib"),
    ("dflash_trt.stacks.trtllm", "from dflash_trt.bundle.build import Builder\n", "layer stacks imports"),
    ("dflash_trt.quant.quantize", "from dflash_trt.stacks import trtllm\n", "layer quant imports"),
])
def test_the_checker_catches_a_planted_violation(module, source, expected):
    assert any(expected in v for v in violations(module, source)), violations(module, source)


def test_the_checker_accepts_what_the_rules_allow():
    assert violations("dflash_trt.bundle.build", "from dflash_trt.quant.quantize import quantize_checkpoint\n"
                      "def f():\n    import torch\n    from dflash_trt.kernels import kv_inject_triton\n") == []
    assert violations("dflash_trt.commands.core", "def f():\n    from dflash_trt.models.tiny import make_tiny\n") == []


# Each module imported first, in a clean state, so an import cycle shows whatever the entry point.
_IMPORT_EACH = r"""
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "dflash_trt" or m.startswith("dflash_trt.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_without_a_cycle():
    names = [m for m, _ in package_modules()]
    for order in (names, names[::-1]):
        r = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *order], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_help_does_not_import_torch():
    code = ("import sys; from dflash_trt.cli import cli, COMMANDS; import importlib\n"
            "[importlib.import_module(t.split(':')[0]) for t in COMMANDS.values()]\n"
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'onnx', 'modelopt') if m in sys.modules]\n"
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
