"""The bundle onto the cluster, and back (docs/rollout.md): every bundle version in its own folder of
the claim, `bundles/<bundle>-<digest>` (the pods' bundle.pvc.subPath), so an upgrade is a new folder plus
`helm upgrade` and `helm rollback` mounts the previous one. The folder is filled by `dflash-trt push`
(copied, re-hashed, renamed into place) or by the chart's loader Job (`deploy --loader-image`).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from dflash_trt.deploy.values import require_intact
from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir, refuse_inside
from dflash_trt.io.clone import clone_tree
from dflash_trt.io.manifest import MANIFEST_NAME, Manifest
from dflash_trt.io.manifest import verify as verify_bundle

BUNDLES_DIR = "bundles"
DIGEST_CHARS = 12


def manifest_sha256(bundle: str | Path) -> str:
    return hashlib.sha256((Path(bundle) / MANIFEST_NAME).read_bytes()).hexdigest()


def version_sub_path(bundle: str | Path) -> str:
    """The bundle's folder on the claim: bundles/<folder name>-<manifest digest>."""
    bundle = Path(bundle).resolve()
    return f"{BUNDLES_DIR}/{bundle.name}-{manifest_sha256(bundle)[:DIGEST_CHARS]}"


def sha256sums(bundle: str | Path) -> str:
    """`sha256sum -c` lines of every artifact (manifest.json is checked on its own, copied last)."""
    return "".join(f"{a.sha256}  {a.path}\n" for a in Manifest.read(bundle).artifacts)


def delivery_values(values: dict, bundle: str | Path, *, sub_path: str | None = None,
                    loader_image: dict | None = None) -> dict:
    """Chart values for where the pods find this bundle version: bundle.pvc.subPath (default:
    version_sub_path; "" = the claim's root, no versioning) and, with `loader_image` (the chart's
    image block of an image holding the bundle), the loader Job that copies it there."""
    sub = version_sub_path(bundle) if sub_path is None else sub_path.strip("/")
    if ".." in Path(sub).parts:
        raise DFlashError(f"--sub-path {sub_path}: leaves the claim")
    values["bundle"].setdefault("pvc", {})["subPath"] = sub
    if loader_image is not None:
        if not sub:
            raise DFlashError("--loader-image copies the bundle under its version folder: drop --sub-path ''")
        if loader_image.get("digest"):
            raise DFlashError("--loader-image: give REPOSITORY:TAG (the chart's loader takes a tag)")
        values["bundle"]["loader"] = {
            "enabled": True, "image": {"repository": loader_image["repository"], "tag": loader_image["tag"]},
            "sha256sums": sha256sums(bundle), "manifestSha256": manifest_sha256(bundle)}
    return values


def push(bundle: str | Path, claim_root: str | Path, sub_path: str | None = None) -> tuple[Path, bool]:
    """Copy a verified bundle to <claim_root>/<sub_path> (default version_sub_path): (folder, copied);
    copied False when that folder already holds this very bundle. The copy is re-hashed against the
    manifest before it is renamed into place: nothing half-copied is ever under the version's name."""
    bundle, root = Path(bundle), Path(claim_root)
    require_intact(bundle)
    if not root.is_dir():
        raise DFlashError(f"--to {root}: no such folder (the claim, mounted here)")
    dest = root / (version_sub_path(bundle) if sub_path is None else sub_path.strip("/"))
    refuse_inside(dest, "--to", ("--bundle", bundle))
    if (dest / MANIFEST_NAME).is_file() and manifest_sha256(dest) == manifest_sha256(bundle) \
            and not verify_bundle(dest):
        return dest, False
    with atomic_output_dir(dest) as tmp:
        clone_tree(bundle, tmp)
        if problems := verify_bundle(tmp):
            raise DFlashError(f"{dest}: the copy does not match the manifest: {problems[0]}; nothing was published")
    return dest, True
