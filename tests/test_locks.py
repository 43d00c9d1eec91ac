"""Every env `make` builds is its lock (locks/<env>.txt, Makefile): `pip freeze` of it equals the lock,
package for package, so a fresh machine runs the suite on the versions it last passed with. The
lock format (locks/refresh.py) is checked too: exact `==` pins only, nothing unpinned, no
editable or URL requirement. `make test-latest` builds unlocked envs on purpose and sets
DFLASH_TRT_UNLOCKED, which skips the equality checks there."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from dflash_trt.paths import dynamo_env_dir, vllm_env_dir

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("locks_refresh", REPO / "locks" / "refresh.py")
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)

ENVS = {"venv": Path(sys.prefix), "triton-stub": Path(sys.prefix) / "triton-stub",
        "vllm": vllm_env_dir(), "dynamo": dynamo_env_dir()}
READY = {"vllm": ".dflash-trt-vllm-ready", "dynamo": ".dflash-trt-dynamo-ready"}
unlocked = pytest.mark.skipif(bool(os.environ.get("DFLASH_TRT_UNLOCKED")),
                              reason="make test-latest: the envs are unlocked on purpose")


@pytest.mark.parametrize("name", list(ENVS))
def test_lock_pins_every_package_exactly(name):
    text = (REPO / "locks" / f"{name}.txt").read_text()
    kept, removed = refresh.parse_lock(text)
    assert kept, f"locks/{name}.txt pins nothing"
    for line in (*kept.values(), *removed.values()):
        pkg, sep, version = line.partition("==")
        assert sep and pkg and version and not any(c in version for c in "<>=*; @"), \
            f"locks/{name}.txt: {line!r} is not an exact pin"
    assert not (kept.keys() & refresh.OURS), f"locks/{name}.txt pins a dist-info our own code writes"


@unlocked
@pytest.mark.parametrize("name", list(ENVS))
def test_env_equals_its_lock(name):
    env = ENVS[name]
    if name in READY and not (env / READY[name]).is_file():
        pytest.skip(f"no {name} env at {env} (make {name})")
    if not (env / "bin" / "python3").exists():
        pytest.skip(f"no {name} env at {env}")
    kept, _ = refresh.parse_lock((REPO / "locks" / f"{name}.txt").read_text())
    moved = refresh.moves(kept, refresh.freeze(env, name))
    assert not moved, f"{env} differs from locks/{name}.txt: {'; '.join(moved)} (make setup/{name} installs the lock)"


def test_moves_names_package_and_versions():
    old, _ = refresh.parse_lock("# header\ntransformers==5.24.0\nkernels==0.19.1\n")
    new = {"transformers": "transformers==5.25.0", "tqdm": "tqdm==4.70.1"}
    assert refresh.moves(old, new) == ["kernels 0.19.1 -> (absent)", "tqdm (absent) -> 4.70.1",
                                       "transformers 5.24.0 -> 5.25.0"]
