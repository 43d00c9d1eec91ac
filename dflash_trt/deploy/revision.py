"""A bundle revision: the same bundle with a re-planned draft schedule (`dflash-trt tune`), and the chart
values that differ for `helm upgrade`.

Model folders are copied as `build` copies them (bundle/build.py link_tree: a reflink, else a copy), configs/
and the Triton repository are written fresh by each served stack's own writer from the new draft_schedule
record (as `build` writes them), and manifest.json gets draft_schedule and `tune` (io/manifest.py TuneRecord:
the window, the drafts counted, the acceptance measured, the revision it came from). Built in a temporary
folder, renamed at the end.
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from dflash_trt import stacks
from dflash_trt.bundle.build import link_tree, reference_pair, write_configs
from dflash_trt.deploy.values import deploy_values
from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import atomic_output_dir
from dflash_trt.io.manifest import MANIFEST_NAME, ArtifactRecord, HashCache, Manifest, TuneRecord, sha256_file
from dflash_trt.models.config import load_drafter_config
from dflash_trt.stacks.base import draft_schedule_record

REWRITTEN = ("configs", stacks.TRITON.repository)   # written fresh by the stacks' writers; the rest is linked


def write_revision(bundle: Path, out: Path, r) -> dict:
    """`out`: `bundle` with the schedule of `r` (plan/tune.Retune); returns the new manifest (as JSON)."""
    bundle, out = Path(bundle).resolve(), Path(out)
    m = Manifest.read(bundle)
    if out.resolve() == bundle:
        raise DFlashError(f"--out {out}: is the bundle itself; write the revision to a new folder")
    if out.exists() and any(out.iterdir()):
        raise DFlashError(f"--out {out}: exists and is not empty")
    old_artifacts = {a.path: a for a in m.artifacts or []}
    with atomic_output_dir(out) as work:
        for entry in bundle.iterdir():
            if entry.name not in (*REWRITTEN, MANIFEST_NAME) and not entry.name.startswith("."):
                link_tree(entry, work / entry.name)
        src_target = Path(m.target.path)
        if m.quant.target == "none":
            src_target = work / "target"     # the bundle's own copy is the unquantized target
        elif not (src_target / "config.json").is_file():
            raise DFlashError(f"tune: the vLLM drafter's vocabulary rows come from the unquantized target, "
                              f"{src_target} (manifest target.path), which is not there")
        served = stacks.served(m.served_stacks)
        new_m = replace(m, draft_schedule=draft_schedule_record(r.after, f"tune: {_source_line(r)}", served),
                        tune=_tune_record(bundle, r))
        ctx = stacks.BundleContext(work=work, manifest=new_m, target_config=m.target.config,
                                   block_size=m.drafter.block_size, target_dir=src_target,
                                   drafter_dir=work / "drafter", drafter=load_drafter_config(work / "drafter"))
        new_m = replace(new_m, serving_configs=write_configs(ctx))
        ctx.manifest = new_m
        ctx.reference = reference_pair(work, m.reference_runtime.layout, Path(m.target.path), Path(m.drafter.path))
        stacks.TRITON.write_repository(ctx, served)
        cache = HashCache()
        arts = []
        for p in sorted(work.rglob("*")):
            rel = p.relative_to(work).as_posix()
            if not p.is_file() or rel == MANIFEST_NAME or "__pycache__" in p.parts or rel.startswith("."):
                continue
            old = old_artifacts.get(rel)
            if old and rel.split("/")[0] not in REWRITTEN and p.stat().st_size == old.bytes:
                arts.append(old)      # copied from the bundle: its recorded hash
            else:
                arts.append(ArtifactRecord(path=rel, bytes=p.stat().st_size, sha256=cache.sha256(p)))
        new_m = replace(new_m, artifacts=arts,
                        artifact_stats={a.path: [(work / a.path).stat().st_size, (work / a.path).stat().st_mtime_ns]
                                        for a in arts})
        new_m.write(work)
    return new_m.to_dict()


def _tune_record(bundle: Path, r) -> TuneRecord:
    w, acc = r.window, r.acceptance
    return TuneRecord(
        from_revision={"bundle": str(bundle), "manifest_sha256": sha256_file(bundle / MANIFEST_NAME)},
        window={"source": w.source, "start": w.start, "seconds": w.seconds, "mean_concurrency": w.mean_concurrency,
                "max_concurrency": w.max_concurrency},
        drafts=w.drafts, draft_tokens=w.draft_tokens, accepted=w.accepted, accepted_per_pos=w.accepted_per_pos,
        acceptance={"tau": acc.tau, "survival": acc.survival, "measured_positions": acc.measured_positions},
        cost_model=r.cost_source, changes=[asdict(c) | {"gain": c.gain} for c in r.changes],
        recommendations=r.recommendations, tuned=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _source_line(r) -> str:
    return (f"re-planned from {r.window.drafts:.0f} drafts served over {r.window.seconds:.0f} s ({r.window.source}), "
            f"tau {r.acceptance.tau:.2f}; {r.cost_source}")


def changed_files(old: Path, new: Path) -> list[str]:
    """Bundle-relative paths whose content differs between two revisions (or exist in one only)."""
    a = {x.path: x.sha256 for x in Manifest.read(old).artifacts}
    b = {x.path: x.sha256 for x in Manifest.read(new).artifacts}
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


def values_diff(old: Path, new: Path, path: Path) -> list[str]:
    """The chart values that differ between the two revisions, written as a values file for
    `helm upgrade --reuse-values -f`: deploy's values of each, plus the annotations naming the schedule
    (so that the pods roll onto the new configs even when nothing else in the values changed)."""
    a, _ = deploy_values(old)
    b, _ = deploy_values(new)
    sched = Manifest.read(new).draft_schedule.schedule
    b.setdefault("podAnnotations", {}).update({
        "dflash-trt/draft-schedule": ",".join(f"{x}-{y}:{k}" for x, y, k in sched["ranges"]),
        "dflash-trt/bundle-manifest-sha256": sha256_file(new / "manifest.json")[:16]})

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out |= flat(v, key + ".") if isinstance(v, dict) else {key: v}
        return out
    fa, fb = flat(a), flat(b)
    keys = sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
    upgrade: dict = {}
    for k in keys:
        node = upgrade
        *parents, leaf = k.split(".")
        src = b
        for p in parents:
            node = node.setdefault(p, {})
            src = src.get(p, {})
        node[leaf] = src.get(leaf)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# helm upgrade RELEASE deploy/helm/dflash-trt --reuse-values -f " + path.name + "\n"
                    "# written by dflash-trt tune: the values that differ from the previous revision's\n"
                    + yaml.safe_dump(upgrade, sort_keys=True))
    return keys
