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

    upgrade, keys = _differ(a, b)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# helm upgrade RELEASE deploy/helm/dflash-trt --reuse-values -f " + path.name + "\n"
                    "# written by dflash-trt tune: the values that differ from the previous revision's\n"
                    + yaml.safe_dump(upgrade, sort_keys=True))
    return sorted(keys)


def _differ(a: dict, b: dict, prefix: str = "") -> tuple[dict, list[str]]:
    """(b's values where they differ from a's, nested as in b; their dotted keys): a leaf a alone has gets None."""
    out, keys = {}, []
    for k in sorted(a.keys() | b.keys()):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict | None) or isinstance(vb, dict) and va is None:
            sub, subkeys = _differ(va or {}, vb or {}, f"{prefix}{k}.")
            out, keys = (out | {k: sub}, keys + subkeys) if sub else (out, keys)
        elif va != vb:
            out[k] = vb
            keys.append(f"{prefix}{k}")
    return out, keys
