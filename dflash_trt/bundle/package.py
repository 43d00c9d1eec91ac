"""The one packager: the only code that lays out a bundle folder, copies weights into it, hashes its files
and writes its manifest.json, inside a temporary folder renamed into place at the end (io/atomic.py), for
a build (serving_files, write_manifest) and for a revision (write_revision: `tune`, `adapt`).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt import __version__, stacks
from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir, refuse_inside
from dflash_trt.io.clone import clone_tree
from dflash_trt.io.draft_schedule import DraftSchedule
from dflash_trt.io.manifest import (
    MANIFEST_NAME,
    REVISION_KINDS,
    ArtifactRecord,
    HashCache,
    Manifest,
    RevisionParent,
    RevisionRecord,
    list_artifacts,
    sha256_file,
)
from dflash_trt.models.config import load_drafter_config
from dflash_trt.plan.record import PLAN_FILE, PlanRecord, write_plan
from dflash_trt.stacks.base import draft_schedule_record

ENGINES_README = (
    "TensorRT engines of this bundle, written by `dflash-trt compile --bundle <bundle>` on the GPU\n"
    "node into engines/<gpu>-trt<version>/ (see manifest.json, stages.compile), only for bundles built\n"
    "with --trt-drafter-engine or --backend engine. The serving configs load no engine: every stack\n"
    "runs the Hugging Face checkpoints in target/ and drafter/ as they are.\n")
# what serving_files() writes (the reference/ copy of the pair besides, for a "copy" layout)
SERVING_FILES = ("configs", stacks.TRITON.repository, "engines/README.txt")


def reference_pair(work: Path, layout: str, tdir: Path, ddir: Path, on_file=None, copy: bool = True) -> dict:
    """Where the dflash_reference model finds its unquantized pair (manifest reference_runtime.layout):
    the bundle's own target/ and drafter/, a copy under reference/ (copied here unless `copy` is False: a
    revision has the parent's), or the source folders."""
    if layout == "bundle":
        return {"target": "target", "drafter": "drafter"}
    if layout == "copy":
        if copy:
            clone_tree(tdir, work / "reference" / "target", on_file)
            clone_tree(ddir, work / "reference" / "drafter", on_file)
        return {"target": "reference/target", "drafter": "reference/drafter"}
    return {"target": str(tdir), "drafter": str(ddir)}


def configs_index(m: Manifest) -> dict:
    """manifest serving_configs: key -> bundle path of each served stack's config files."""
    return {k: v for st in stacks.served(m.served_stacks) for k, v in st.config_files.items()}


def serving_files(ctx: stacks.BundleContext) -> Manifest:
    """configs/ (each served stack's own writer), the Triton repository and engines/README.txt, from the
    manifest ctx carries (ctx.reference set); returns it with its serving_configs index. Paths are
    bundle-relative: the commands run from the bundle root."""
    served = stacks.served(ctx.manifest.served_stacks)
    (ctx.work / "configs").mkdir(exist_ok=True)
    for st in served:
        st.write_configs(ctx)
    ctx.manifest = replace(ctx.manifest, serving_configs=configs_index(ctx.manifest))
    stacks.TRITON.write_repository(ctx, served)
    (ctx.work / "engines").mkdir(exist_ok=True)
    (ctx.work / "engines" / "README.txt").write_text(ENGINES_README)
    return ctx.manifest


def write_manifest(work: Path, m: Manifest, arts: list[ArtifactRecord]) -> Manifest:
    """The manifest with its artifacts and their stats (the next build's reuse check: a rename keeps
    mtimes), validated and written atomically."""
    m = replace(m, artifacts=arts, artifact_stats={a.path: [(work / a.path).stat().st_size,
                                                           (work / a.path).stat().st_mtime_ns] for a in arts})
    m.write(work)
    return m


# ------------------------------------------------------------------------------------------ revisions
@dataclass
class RevisionChange:
    kind: str                         # a REVISION_KINDS key: "tune" | "adapt"
    summary: str                      # one line: what changed and why
    record: object                    # the kind's typed record (REVISION_KINDS[kind].record)
    drafter: Path | None = None       # a new drafter folder (adapt); None: the parent's, copied
    draft_schedule: DraftSchedule | None = None   # a new schedule: configs/ and the Triton repo rewritten
    schedule_source: str | None = None
    plan: PlanRecord | None = None    # a new plan.json (plan --refresh); None: the parent's, copied


def write_revision(parent: Path, out: Path, change: RevisionChange) -> Manifest:
    """`out`: the bundle `parent` with `change`: the parent's files (their recorded sha256 kept), a new drafter
    if the change has one, and the serving files written anew from the revised manifest (RevisionRecord)."""
    parent, out = Path(parent).resolve(), Path(out)
    kind = REVISION_KINDS.get(change.kind)
    if kind is None or not isinstance(change.record, kind.record):
        raise DFlashError(f"revision kind {change.kind!r} with a {type(change.record).__name__}: expected one of "
                          + ", ".join(f"{k} with a {v.record.__name__}" for k, v in REVISION_KINDS.items()))
    m = Manifest.read(parent)
    refuse_inside(out, "--out", ("--bundle", parent))
    if out.exists() and any(out.iterdir()):
        raise DFlashError(f"--out {out}: exists and is not empty; write the revision to a new folder")
    recorded = {a.path: a for a in m.artifacts}
    cache = HashCache()

    def copied(src: Path, dst: Path) -> None:   # a parent's file copied unchanged: its recorded sha256
        a = recorded.get(src.relative_to(parent).as_posix())
        if a is not None and a.bytes == dst.stat().st_size:
            cache.remember(dst, a.sha256)

    skip = {*SERVING_FILES, MANIFEST_NAME, *(["drafter"] if change.drafter else []), *([PLAN_FILE] if change.plan else [])}
    with atomic_output_dir(out) as work:
        for entry in sorted(parent.iterdir()):
            if entry.name not in skip and not entry.name.startswith("."):
                clone_tree(entry, work / entry.name, copied)
        new = replace(m, tool_version=__version__, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      drafter=_drafter(m, change, work, cache))
        if change.draft_schedule is not None:
            new = replace(new, draft_schedule=draft_schedule_record(change.draft_schedule, change.schedule_source,
                                                                    stacks.served(m.served_stacks)))
        new = serving_files(_context(work, new, m))
        if change.plan is not None:
            write_plan(work, new, change.plan)
        arts = list_artifacts(work, lambda rel, st: cache.linked(work / rel))
        before = {a.path: a.sha256 for a in m.artifacts}
        after = {a.path: a.sha256 for a in arts}
        rev = RevisionRecord(kind=change.kind, summary=change.summary,
                             parent=RevisionParent(path=str(parent),
                                                   manifest_sha256=sha256_file(parent / MANIFEST_NAME)),
                             changed=sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p)),
                             **{change.kind: change.record})
        return write_manifest(work, replace(new, revision=rev), arts)


def _drafter(m: Manifest, change: RevisionChange, work: Path, cache: HashCache):
    """The revision's drafter record: the parent's, or the new drafter folder's (copied into drafter/; the
    served block size and layer ids stay the parent's: a revision does not change the drafter's shape)."""
    if change.drafter is None:
        return m.drafter
    src = Path(change.drafter).resolve()
    for dst in (work / "drafter", *([work / "reference" / "drafter"] if (work / "reference").is_dir() else [])):
        shutil.rmtree(dst, ignore_errors=True)
        clone_tree(src, dst, lambda s, d: cache.remember(d, cache.sha256(s)))
    cfg = load_drafter_config(work / "drafter")
    return replace(m.drafter, path=str(src), sha256=cache.tree(src), revision=None, config=cfg.raw)


def _context(work: Path, new: Manifest, parent: Manifest) -> stacks.BundleContext:
    """What the stacks' writers read for a revision: the unquantized target they take the vLLM drafter's
    vocabulary rows from (the bundle's own when it is not quantized, else the source the manifest names)."""
    target = Path(parent.target.path)
    if parent.quant.target == "none":
        target = work / "target"
    elif not (target / "config.json").is_file():
        raise DFlashError(f"revision: the unquantized target {target} (manifest target.path) is not there; the "
                          "serving configs are written from it")
    ctx = stacks.BundleContext(work=work, manifest=new, target_config=parent.target.config,
                               block_size=parent.drafter.block_size, target_dir=target, drafter_dir=work / "drafter",
                               drafter=load_drafter_config(work / "drafter"))
    layout = parent.reference_runtime.layout if parent.reference_runtime else "source"
    ctx.reference = reference_pair(work, layout, Path(new.target.path),
                                   Path(new.drafter.path), copy=False)
    return ctx
