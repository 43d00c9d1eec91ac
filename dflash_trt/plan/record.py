"""The bundle's plan: plan.json at the bundle root, the layout search `build` ran, read by everything after it.

`build` plans the bundle once, before its stages (its target, drafter, resolved formats, TP / EP, GPU node and the
limits its served stacks' config files will fix: served_settings) for 1, 2, 4 and 8 nodes of its node type
(BUILD_NODE_COUNTS: the planner is arithmetic, so `deploy --nodes N` of these reads the record), prices its draft
schedule on the one-node case, and writes the result here before the manifest hashes the bundle, so plan.json is
an artifact like any other (`verify` refuses it edited). `deploy`, `plan --bundle`, Dynamo rendering, `bench
--plan-bundle` and build's own deployable check read it and run no layout search: a later planner cannot silently
deploy another layout than the one verified. A case the record does not hold (another GPU, GPUs per node, sequence
length or serving limit) is one line naming `plan --bundle B --refresh ... --out NEW`, which re-plans the bundle into
a revision with its own plan.json.
The draft schedule stays in manifest.json (`draft_schedule`); the record keeps the speed figures it was planned
from (per concurrency: AR and DFlash step seconds, the break-even acceptance length).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dflash_trt import __version__, stacks
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import Hardware, get_hardware, hardware_for_gpu
from dflash_trt.io.jsonio import read_json
from dflash_trt.io.manifest import Manifest
from dflash_trt.plan import planner
from dflash_trt.plan.layouts import RANKING
from dflash_trt.plan.monitoring_figures import planned_figures

PLAN_FILE = "plan.json"
PLAN_RECORD_VERSION = 1
BUILD_NODE_COUNTS = (1, 2, 4, 8)


@dataclass
class PlanCase:
    """One planner run of the bundle: what it was made for, and the plan (planner.Plan.to_dict()) or the
    planner's one line why the bundle cannot be placed so."""
    hardware: str
    nodes: int
    gpus_per_node: int
    max_seq_len: int | None
    limits: dict = field(default_factory=dict)   # serving limits given over the bundle's (plan --refresh)
    plan: dict | None = None
    refused: str | None = None

    def key(self) -> tuple:
        return self.hardware, self.nodes, self.gpus_per_node, self.max_seq_len, json.dumps(self.limits, sort_keys=True)


@dataclass
class PlanRecord:
    version: int
    planner_version: str                  # the dflash-trt that planned it
    quant: dict                           # resolved formats: target, drafter, kv_cache
    parallel: dict                        # tp / ep the bundle's model files were written for (the search keeps them)
    serving: dict                         # what the served stacks' config files fix (kv_fraction, windows, batch)
    cases: list[PlanCase]                 # the first: the bundle's own node, one node, its max_seq_len
    schedule: dict | None = None          # the speed figures manifest.json's draft schedule was planned from

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> PlanRecord:
        try:
            return cls(**{**d, "cases": [PlanCase(**c) for c in d["cases"]]})
        except (TypeError, KeyError) as e:
            raise DFlashError(f"{where}: not a plan record ({e})") from None

    def plan_for(self, bundle: Path, hw: Hardware, *, nodes: int, gpus_per_node: int | None, max_seq_len: int | None,
                 objective: str = "latency", limits: dict | None = None) -> planner.Plan:
        """The recorded plan of this case; one line naming `plan --refresh` where the record has none."""
        limits = {k: v for k, v in (limits or {}).items() if self.serving.get(k) != v}   # the bundle's own: no limit
        want = PlanCase(hw.name, nodes, gpus_per_node or hw.gpus_per_node, max_seq_len, limits)
        case = next((c for c in self.cases if c.key() == want.key()), None)
        if case is None:
            have = "; ".join(dict.fromkeys(_describe(c, self.cases) for c in self.cases)) or "no GPU"
            raise DFlashError(f"{bundle}/{PLAN_FILE}: planned for {have}; not for {_describe(want, [want])}: re-plan "
                              f"it into a revision: `dflash-trt plan --bundle {bundle} --refresh {_flags(want)}--out NEW`")
        if case.refused:
            raise DFlashError(case.refused)
        p = planner.Plan.from_dict(case.plan)
        return p if objective == p.objective else replace(p, objective=objective,
                                                          layouts=sorted(p.layouts, key=RANKING[objective]))


def _describe(c: PlanCase, cases: list[PlanCase]) -> str:
    """"1/2/4/8 × dgx-b300 (8 GPUs), max_seq_len 32768": the node counts of the cases alike in all else."""
    nodes = [x.nodes for x in cases if x.key()[:1] + x.key()[2:] == c.key()[:1] + c.key()[2:]]
    return (f"{'/'.join(map(str, nodes))} × {c.hardware} ({c.gpus_per_node} GPUs), max_seq_len {c.max_seq_len}"
            + "".join(f", {k} {v}" for k, v in c.limits.items()))


def _flags(c: PlanCase) -> str:
    limits = {"max_batch_size": "--max-batch-size", "max_attention_window": "--max-attention-window"}
    return (f"--hardware {c.hardware} --nodes {c.nodes} --gpus-per-node {c.gpus_per_node} "
            + (f"--max-seq-len {c.max_seq_len} " if c.max_seq_len else "")
            + "".join(f"{limits[k]} {','.join(map(str, v)) if isinstance(v, list) else v} " for k, v in c.limits.items()))


def read_plan(bundle: str | Path) -> PlanRecord:
    """<bundle>/plan.json; a missing or too old record is one line (rebuild, or plan --refresh), never a re-plan."""
    bundle = Path(bundle)
    path = bundle / PLAN_FILE
    d = read_json(path) if path.is_file() else None
    version = d.get("version") if isinstance(d, dict) else None
    if d is None or version != PLAN_RECORD_VERSION:
        state = "missing" if d is None else f"version {version}, this dflash-trt reads {PLAN_RECORD_VERSION}"
        raise DFlashError(f"{bundle}/{PLAN_FILE}: {state}: rebuild the bundle, or "
                          f"`dflash-trt plan --bundle {bundle} --refresh --out NEW`")
    return PlanRecord.from_dict(d, str(path))


# ---------------------------------------------------------------------------------------------
# Planning a bundle (build, and plan --refresh): the one place its layout search runs


def bundle_hardware(m: Manifest, gpu: str | None = None) -> Hardware | None:
    """The catalog node type of the bundle's GPU (its recorded node), or of `gpu` when given; None = CPU-only."""
    gpu = gpu or m.gpu
    if gpu in (None, "none", ""):
        return None
    hw = get_hardware(m.node) if m.node and gpu == m.gpu else hardware_for_gpu(gpu)
    if m.arch and m.arch != hw.arch:
        raise DFlashError(f"manifest.json: bundle built for arch {m.arch}, but {gpu} is {hw.arch}")
    return hw


def drafter_config(bundle: Path, m: Manifest) -> tuple[str | None, dict | None]:
    """The drafter's config.json: drafter.config in the manifest, else <bundle>/<drafter.bundle_path>
    or drafter.path, else the preset's drafter shapes for target.name; None if none is known."""
    d = m.drafter
    if isinstance(d.config, dict):
        return "drafter", d.config
    for rel in (d.bundle_path, d.path) if bundle else ():
        if rel:
            p = Path(rel)
            p = p if p.is_absolute() else bundle / p
            if (p / "config.json").is_file():
                return p.name, read_json(p / "config.json")
    name = m.target.name
    try:
        _, _, dcfg = planner.target_configs(name) if name else (None, None, None)
    except DFlashError:
        dcfg = None
    if dcfg is not None:
        return f"{name} drafter (preset shapes)", dcfg
    return None, None


def served_settings(bundle: Path | None, m: Manifest) -> dict:
    """What the served stacks' own config files fix for the planner (KV fraction, per-layer
    windows, batch and token limits: what the server will really use), stack by stack; `bundle` None (build,
    before it writes them): what their writers will write for `m`."""
    out: dict = {}
    for st in stacks.served(m.served_stacks):
        out |= st.planner_settings(bundle, m)
    return out


def _plan_case(bundle: Path | None, m: Manifest, case: PlanCase, hw: Hardware) -> PlanCase:
    """The planner's layout search of one case, TP / EP fixed to the bundle's (its model files are written for them)."""
    try:
        if m.parallel.pp != 1:
            raise DFlashError("manifest.json: parallel.pp > 1 is not planned; set the chart's parallel.pp by hand")
        dname, dcfg = drafter_config(bundle, m)
        llm = {**served_settings(bundle, m), **case.limits}
        p = planner.plan(m.target.config, dcfg, hw, target_name=m.target.name or "target", drafter_name=dname,
                         quant=m.quant.target or "auto", kv_cache=m.quant.kv_cache or "auto",
                         drafter_quant=m.quant.drafter, max_seq_len=case.max_seq_len, nodes=case.nodes,
                         gpus_per_node=case.gpus_per_node, tp=m.parallel.tp, ep=m.parallel.ep, **llm,
                         # the bundle's serving config fixes max_batch_size; a layout cannot lower it
                         batch_pinned="max_batch_size" in llm and "max_batch_size" not in case.limits)
        return replace(case, plan=p.to_dict())
    except DFlashError as e:
        return replace(case, refused=str(e))


def plan_bundle(bundle: str | Path | None, m: Manifest, extra: list[tuple[Hardware, PlanCase]] = ()) -> PlanRecord:
    """The bundle planned for BUILD_NODE_COUNTS nodes of its own node (none for a CPU-only bundle), and `extra`;
    `bundle` None: the one build is about to write (`m`, the manifest's first part: served_settings)."""
    bundle = Path(bundle) if bundle else None
    hw = bundle_hardware(m)
    todo = [(hw, PlanCase(hw.name, n, hw.gpus_per_node, m.max_seq_len)) for n in BUILD_NODE_COUNTS] if hw else []
    try:
        serving = served_settings(bundle, m)
    except DFlashError:
        serving = {}    # the cases say why (refused)
    for h, c in extra:   # a limit the bundle's own config already sets is none (PlanRecord.plan_for)
        c = replace(c, limits={k: v for k, v in c.limits.items() if serving.get(k) != v})
        todo += [(h, c)] if c.key() not in {t.key() for _, t in todo} else []
    cases = [_plan_case(bundle, m, c, h) for h, c in todo]
    first = next((c.plan for c in cases if c.plan), None) or {"quant": asdict(m.quant)}
    return PlanRecord(version=PLAN_RECORD_VERSION, planner_version=__version__, quant=first["quant"],
                      parallel={"tp": m.parallel.tp, "ep": m.parallel.ep, "pp": m.parallel.pp}, serving=serving,
                      cases=cases, schedule=schedule_basis(m))


def schedule_basis(m: Manifest) -> dict | None:
    """What the draft schedule was planned from, per concurrency: the AR step and the DFlash step of its K (seconds
    per user step) and the acceptance length at which drafting K just pays (monitoring_figures' break-even)."""
    rec = m.draft_schedule
    if rec is None or not rec.schedule or not rec.schedule.get("levels"):
        return None       # none, or one given as ranges only (build --draft-schedule FILE): no speed figures
    figures = planned_figures(rec.schedule, where="manifest.json draft_schedule.schedule")
    ar = {int(lv["concurrency"]): 1 / float(lv["ar_tokens_per_s_per_user"]) for lv in rec.schedule["levels"]}
    return {"source": rec.source, "by_concurrency": [
        {"concurrency": f.first, "k": f.k, "ar_step_s": ar[f.first],
         "dflash_step_s": f.break_even_acceptance_length * ar[f.first],
         "break_even_acceptance_length": f.break_even_acceptance_length} for f in figures.by_concurrency]}


def write_plan(folder: str | Path, m: Manifest, rec: PlanRecord | None = None) -> Path:
    """<folder>/plan.json: `rec`, else the bundle assembled in `folder` (its manifest `m`) planned (build)."""
    path = Path(folder) / PLAN_FILE
    path.write_text(json.dumps((rec or plan_bundle(folder, m)).to_dict(), indent=1) + "\n")
    return path
