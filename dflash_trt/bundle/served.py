"""The pair a bundle serves: the folders its engines load (manifest.json `target.bundle_path`,
`drafter.bundle_path`), which `generate`, `bench` and `check --bundle` run on the CPU runtime, so
tau, speed-up and losslessness are measured on the quantized weights the engines load."""
from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import MANIFEST_NAME, Manifest


def served_pair(bundle: str | Path) -> tuple[Path, Path]:
    """(target folder, drafter folder) of a bundle, each checked to hold a checkpoint."""
    bundle = Path(bundle)
    m = Manifest.read(bundle)
    folders = []
    for what, rel in (("target", m.target.bundle_path), ("drafter", m.drafter.bundle_path)):
        if not rel:
            raise DFlashError(f"{bundle / MANIFEST_NAME}: {what}.bundle_path is not set: the bundle holds no {what} "
                              f"checkpoint to run")
        folder = bundle / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise DFlashError(f"{bundle / MANIFEST_NAME}: {what}.bundle_path {rel!r} leaves the bundle")
        if not any(folder.glob("*.safetensors")):
            raise DFlashError(f"{folder}: the bundle holds no {what} weights (a --configs-only bundle? rebuild it "
                              f"with `dflash-trt build --out {bundle}` once the weights are downloaded)")
        folders.append(folder)
    return folders[0], folders[1]


def pair_folders(bundle, target: str | None, drafter: str | None) -> tuple[str | None, str | None]:
    """A command's --bundle DIR or --target / --drafter (not both): the folders or names to resolve."""
    if bundle is None:
        return target, drafter
    if target is not None or drafter is not None:
        raise DFlashError("--bundle runs the bundle's own target and drafter; drop --target / --drafter")
    return tuple(map(str, served_pair(bundle)))
