"""The map is true: every file, folder and module that README.md and docs/*.md cite exists, and README's
layout lists every package folder of dflash_trt/ (and nothing else). The oracle is the checkout itself: a
citation is a path (`dflash_trt/...`, or a source file path such as `stacks/trtllm/convert.py` that must be the
tail of some file in the repository), a module (`python -m dflash_trt.x`, `dflash_trt.x.y`) whose file exists,
or a module attribute (`dflash_trt.x.NAME`) defined at the top level of that file (read with ast, nothing
imported)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PACKAGE_PATH = re.compile(r"(?<![\w./-])dflash_trt/[\w./<>*-]*")
DOTTED = re.compile(r"(?<![\w./-])dflash_trt(?:\.\w+)+")
# a source file cited by a path of at least one folder (stacks/trtllm/convert.py, models/target.py)
SOURCE_PATH = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)+[\w-]+\.(?:py|json|yaml|c|h|md|jsonl|Dockerfile))(?![\w/])")
# what is not a file of this repository: URLs, upstream sources, run-time outputs
FOREIGN = re.compile(r"https?://|z-lab/|tensorrt_llm/|vllm/|sglang/|transformers/|triton_backend/|examples/|"
                     r"site-packages/")


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).exists()]


def citations(kind: re.Pattern) -> list[tuple[str, int, str]]:
    """(doc, line, cited text) of every match of `kind` in the docs."""
    found = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in kind.finditer(line):
                text = m.group(1) if kind.groups else m.group(0)
                if not FOREIGN.search(line[max(0, m.start() - 60):m.start()] + text):
                    found.append((doc.name, n, text.rstrip(".,;:)")))
    return found


def wheel_only(path: str) -> bool:
    """dflash_trt/_deploy exists in a built wheel only: setup.py copies the top-level deploy/ there."""
    return path.rstrip("/") == "dflash_trt/_deploy" and '"_deploy"' in (ROOT / "setup.py").read_text()


def module_file(dotted: str) -> Path | None:
    rel = Path(*dotted.split("."))
    for p in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def test_every_cited_package_path_exists():
    missing = []
    for doc, n, text in citations(PACKAGE_PATH):
        path = text.split("<")[0].split("*")[0]     # dflash_trt/kernels/<name>.c: its folder
        if not (ROOT / path).exists() and not wheel_only(path):
            missing.append(f"{doc}:{n}: {text}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_every_cited_module_exists():
    missing = []
    for doc, n, text in citations(DOTTED):
        if module_file(text):
            continue
        parent, _, name = text.rpartition(".")
        f = module_file(parent)
        if not (f and defines(f, name)):
            missing.append(f"{doc}:{n}: {text}")
    assert not missing, "cited modules (python -m, dotted names) that do not exist:\n" + "\n".join(missing)


def test_every_cited_source_file_exists():
    """A path that starts in one of this repository's folders (tests/, bench/, deploy/, stacks/, families/, ...)
    is a file of ours: some file of the checkout ends with it."""
    files = repo_files()
    ours = package_folders() - BUNDLE_FOLDERS | {"tests", "bench", "deploy"}
    missing = []
    for doc, n, text in citations(SOURCE_PATH):
        if text.startswith("dflash_trt/") or text.split("/")[0] not in ours:
            continue                                 # the package paths' own test; a bundle's or upstream's file
        if not any(f == text or f.endswith("/" + text) for f in files):
            missing.append(f"{doc}:{n}: {text}")
    assert not missing, "cited files found nowhere in the repository:\n" + "\n".join(missing)


BUNDLE_FOLDERS = {"configs", "triton"}   # folders of a built bundle, named like package folders


def chart_value(dotted: str) -> bool:
    """Whether `dotted` is a key path of the serving chart's values.yaml (bundle.pvc.existingClaim)."""
    node = yaml.safe_load((ROOT / "deploy/helm/dflash-trt/values.yaml").read_text())
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def package_folders() -> set[str]:
    """Names of the package's folders at any depth (stacks, trtllm, families, ...)."""
    return {p.parent.name for p in (ROOT / "dflash_trt").rglob("__init__.py")} - {"dflash_trt"}


SHORT_DOTTED = re.compile(r"`((\w+)(?:\.\w+)+)`")
NOT_MODULE = {"json", "py", "yaml", "md", "png", "jsonl", "txt", "pbtxt", "safetensors", "onnx", "plan", "c", "h"}


def test_every_short_module_name_exists():
    """`bundle.onnx_export`, `plan.speed`: a dotted name starting with a top-level package of dflash_trt is a
    module of ours (or a name defined in one)."""
    top = {p.name for p in (ROOT / "dflash_trt").iterdir() if (p / "__init__.py").is_file()}
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in SHORT_DOTTED.finditer(line):
                text, first = m.group(1), m.group(2)
                if first not in top or text.rsplit(".", 1)[1] in NOT_MODULE or chart_value(text):
                    continue
                dotted = "dflash_trt." + text
                parent, _, name = dotted.rpartition(".")
                if not (module_file(dotted) or (module_file(parent) and defines(module_file(parent), name))):
                    missing.append(f"{doc.name}:{n}: {text}")
    assert not missing, "cited modules of dflash_trt that do not exist:\n" + "\n".join(missing)


BARE_SOURCE = re.compile(r"`([\w-]+\.py)`")
UPSTREAM = re.compile(r"vLLM|vllm|TensorRT-LLM|tensorrt_llm|SGLang|sglang|transformers|z-lab|Triton's|upstream")


def test_every_bare_source_name_exists():
    """`manifest.py`, `serving_configs.py`: a bare file name cited in a line that names no upstream project is
    the name of one of our files."""
    names = {Path(f).name for f in repo_files()}
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in BARE_SOURCE.finditer(line):
                if m.group(1) not in names and not UPSTREAM.search(line[:m.start()]):
                    missing.append(f"{doc.name}:{n}: {m.group(1)}")
    assert not missing, "cited file names found nowhere in the repository:\n" + "\n".join(missing)


def readme_layout() -> list[str]:
    """The folders README's layout lists under dflash_trt/ (its indented block)."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("\n    dflash_trt/\n"):]
    block = block[:block.index("\n    deploy/")]
    return re.findall(r"^ {6}(\w+)/", block, flags=re.M)


def test_readme_layout_lists_every_package_folder():
    listed = set(readme_layout())
    folders = {p.name for p in (ROOT / "dflash_trt").iterdir() if (p / "__init__.py").is_file()}
    assert listed == folders, (f"README layout: missing {sorted(folders - listed)}, "
                               f"not a package {sorted(listed - folders)}")


@pytest.mark.parametrize("doc", [d.name for d in DOCS])
def test_relative_doc_links_resolve(doc):
    path = next(d for d in DOCS if d.name == doc)
    bad = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
           if not t.startswith(("http://", "https://", "mailto:")) and not (path.parent / t).exists()]
    assert not bad, f"{doc}: links to missing files {bad}"


def stacks_doc_members() -> set[str]:
    """The members docs/stacks.md says a stack answers: the names before the colon of each bullet of its
    "What a stack answers" list (parenthesised asides left out)."""
    text = (ROOT / "docs/stacks.md").read_text()
    block = text[text.index("What a stack answers"):]
    block = block[:block.index("\n\n", block.index("\n- "))]
    names = set()
    for bullet in re.split(r"\n- ", block)[1:]:
        head = re.sub(r"\([^)]*\)", "", " ".join(bullet.split())).split(":")[0]
        names |= set(re.findall(r"`(\w+)`", head))
    return names


def test_stacks_doc_matches_the_stack_interface():
    """docs/stacks.md names every method of stacks/base.py's Stack, and nothing Stack does not define."""
    from dflash_trt.stacks.base import Stack

    doc = stacks_doc_members()
    methods = {n for n, v in vars(Stack).items() if callable(v) and not n.startswith("_")}
    assert doc <= set(dir(Stack)), f"docs/stacks.md names {sorted(doc - set(dir(Stack)))}"
    assert methods <= doc, f"docs/stacks.md does not name {sorted(methods - doc)}"
