"""`dflash-trt build`'s summary: each stage's outcome, the bundle's files and where it deploys."""
from __future__ import annotations

import json
from pathlib import Path

from dflash_trt import stacks
from dflash_trt.io.manifest import Manifest


def format_summary(res: dict) -> str:
    m: Manifest = res["manifest"]
    rows = [("stage", "status", "time", "size", "output")]
    notes = []
    for r in res["stages"]:
        entry = m.stages[r["name"]]
        status = r["status"]
        if status == "skipped":
            status = "skipped (unchanged" + ("" if entry.status == "done" else f", {entry.status}") + ")"
        rows.append((r["name"], status, f"{r['seconds']:.1f}s", _human(r["bytes"]) if r["outputs"] else "-",
                     ", ".join(r["outputs"]) or "-"))
        if entry.reason:
            notes.append(f"  {r['name']}: {entry.reason}")
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(row[i].ljust(w[i]) for i in range(4)) + "  " + row[4] for row in rows]
    total = sum(a.bytes for a in m.artifacts)
    if notes:
        lines += ["", "notes:"] + notes
    lines.append("")
    lines.append(f"bundle: {res['bundle']}  ({len(m.artifacts)} files, {_human(total)}; manifest.json lists each "
                 "with its sha256)")
    # each served stack's launch file (its first config file)
    files = [next(iter(stacks.get(x).config_files.values())).removeprefix("configs/") for x in m.served_stacks]
    # what is in triton/ (the vllm model is written for every bundle with a vLLM config, though not in
    # triton_models, the models a Triton pod loads by default)
    repo = Path(res["bundle"]) / m.triton_model_repository
    models = sorted(p.name for p in repo.iterdir() if p.is_dir()) if repo.is_dir() else m.triton_models
    lines.append(f"  configs/ {', '.join(files)}; {m.triton_model_repository}/ " + ", ".join(models))
    lines.append("  " + gpu_line(m))
    for stack, why in m.skipped_stacks.items():
        lines.append(f"  no {stacks.get(stack).title} config: {why}")
    if sched := m.draft_schedule:
        s = sched.schedule
        lines.append("  draft schedule: " + (", ".join(f"{a}-{b}: K {k}" for a, b, k in s["ranges"])
                                             + f" ({sched.source})" if s else sched.source))
        unplanned = f"no draft schedule: {sched.source}"
        same = [stacks.get(k).title for k, rec in sched.stacks.items() if rec.skipped == unplanned]
        if same:   # the reason is the schedule's own (said above), not the stack's: once
            lines.append(f"    {', '.join(same)}: not written (no schedule)")
        for stack, rec in sched.stacks.items():
            if rec.skipped == unplanned:
                continue
            title = stacks.get(stack).title
            lines.append(f"    {title}: " + (", ".join(f"{k}: {json.dumps(v)}" for k, v in rec.fields.items())
                                          if rec.fields is not None else f"not written: {rec.skipped}"))
    if m.weights is not None and not m.weights.present:
        lines.append("  configs only: no weights in target/ and drafter/; download them, then build into the same "
                     "--out to fill the bundle in:")
        lines += [f"    {c}" for c in (m.stages["quantize"].commands or [])]
    if m.stages["compile"].status == "deferred":
        lines.append(f"  compile deferred: on the GPU node run `dflash-trt compile --bundle {res['bundle']}`")
    return "\n".join(lines)


def gpu_line(m: Manifest) -> str:
    """Where the bundle deploys, and why there (manifest gpu, node, gpu_source)."""
    if m.gpu is None:
        return (f"no GPU (--gpu none): `deploy` serves {stacks.tritonserver.REFERENCE_MODEL} on a CPU-only pod; "
                f"--gpu <id> deploys on GPUs")
    why = {"option": "--gpu", "detected": "this machine's GPU",
           "arch_default": f"the {m.arch} default node, hardware.json arch_default_nodes; --gpu picks another, "
                           "--gpu none builds a CPU-only bundle"}.get(m.gpu_source, "")
    return f"GPU: {m.gpu} on {m.node or m.gpu}" + (f" ({why})" if why else "")


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
