"""A `tune` revision as bundle/package.py writes it (tune_change), and the chart values that differ between
two revisions for `helm upgrade` (values_diff)."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import yaml

from dflash_trt.bundle.package import RevisionChange
from dflash_trt.deploy.values import deploy_values
from dflash_trt.io.manifest import MANIFEST_NAME, Manifest, TuneRecord, sha256_file


def tune_change(r) -> RevisionChange:
    """The revision `tune` writes: plan/tune.Retune's schedule, and the served acceptance it came from."""
    w, acc = r.window, r.acceptance
    source = (f"re-planned from {w.drafts:.0f} drafts served over {w.seconds:.0f} s ({w.source}), "
              f"tau {acc.tau:.2f}; {r.cost_source}")
    record = TuneRecord(
        window={"source": w.source, "start": w.start, "seconds": w.seconds, "mean_concurrency": w.mean_concurrency,
                "max_concurrency": w.max_concurrency},
        drafts=w.drafts, draft_tokens=w.draft_tokens, accepted=w.accepted, accepted_per_pos=w.accepted_per_pos,
        acceptance={"tau": acc.tau, "survival": acc.survival, "measured_positions": acc.measured_positions},
        cost_model=r.cost_source, changes=[asdict(c) | {"gain": c.gain} for c in r.changes],
        recommendations=r.recommendations, tuned=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return RevisionChange(kind="tune", summary=f"draft schedule {source}", record=record, draft_schedule=r.after,
                          schedule_source=f"tune: {source}")


def values_diff(old: Path, new: Path, path: Path) -> list[str]:
    """The chart values that differ between the two revisions, written as a values file for
    `helm upgrade --reuse-values -f`: deploy's values of each, plus the annotations naming the schedule
    (so that the pods roll onto the new configs even when nothing else in the values changed)."""
    a, _ = deploy_values(old)
    b, _ = deploy_values(new)
    sched = Manifest.read(new).draft_schedule.schedule
    b.setdefault("podAnnotations", {}).update({
        "dflash-trt/draft-schedule": ",".join(f"{x}-{y}:{k}" for x, y, k in sched["ranges"]),
        "dflash-trt/bundle-manifest-sha256": sha256_file(new / MANIFEST_NAME)[:16]})

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
