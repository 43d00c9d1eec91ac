"""Where dflash-trt keeps things: its cache folder and the package's own data files."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def dflash_home() -> Path:
    """Our cache folder: $DFLASH_TRT_HOME, default ~/.cache/dflash-trt."""
    return Path(os.environ.get("DFLASH_TRT_HOME") or Path.home() / ".cache" / "dflash-trt")


def package_path(*parts: str) -> Path:
    """A file or folder shipped inside the package (works for an installed wheel and a checkout)."""
    return Path(str(resources.files("dflash_trt").joinpath(*parts)))
