"""What a serving stack is to the pipeline: one small interface, one module per stack.

`build`, `deploy`, `serve` and `plan` never ask which stack they hold; they loop over the
registry (stacks/__init__.py) and call these methods. A stack answers for:

- the layouts and drafters it refuses, with the upstream rule each breaks (build picks the
  stacks that fit; --stacks names one that does not: an error before anything is written);
- the files it writes into a bundle (configs/, its Triton model), and what it checks first;
- how to serve the bundle with it (the manifest's `serve` commands, a local server for `serve`);
- its chart values: the servers it runs (the chart's server.stack), their launch, what the
  planner reads back from its config;
- its engine facts, from engines.json (dflash_trt/engines.py): images, first DFlash version.

A method a stack does not need keeps the default here (nothing to refuse, nothing to write).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dflash_trt import engines
from dflash_trt.io.draft_schedule import DraftSchedule
from dflash_trt.io.manifest import DraftScheduleRecord, Manifest, StackScheduleRecord


@dataclass(frozen=True)
class Server:
    """One value of the chart's server.stack: a server process of a pod."""
    name: str                     # trtllm-serve, triton, vllm, sglang
    mpi_launch: bool = False      # the chart's multi-node (LeaderWorkerSet) launch runs it under mpirun
    loads_triton_models: bool = False  # the pod loads the bundle's Triton models (chart bundle.models)
    cpu_reference: bool = False   # serves the dflash_reference model, the one a bundle without a GPU runs

    @property
    def engine_stack(self) -> str:
        """The stack whose bundle config this server loads (engines.json servers.<name>.stack)."""
        return engines.server_stack(self.name)


@dataclass
class BundleContext:
    """What a stack's writer reads while `build` packages a bundle (paths inside the bundle being
    assembled; the manifest's first part is final by then: each writer writes what it records, e.g. its
    draft schedule fields, manifest.draft_schedule.fields_for(stack))."""
    work: Path                    # the bundle folder being written
    manifest: Manifest
    target_config: dict           # the target's config.json
    block_size: int
    target_dir: Path              # the source target (unquantized)
    drafter_dir: Path             # the source drafter
    drafter: object               # models.config.DrafterConfig of the bundle's drafter/
    reference: dict = field(default_factory=dict)  # where the dflash_reference model finds its pair
    # the TensorRT-LLM serving profile's settings build decided (stacks/trtllm/profiles.profile_settings;
    # the manifest's serving_profile records its source and limits); None: the writer derives them
    serving_profile: dict | None = None


class Stack:
    """The defaults of every method; a stack module overrides what it has."""
    name: str = ""                # the manifest's serving_stacks name
    title: str = ""               # for people: TensorRT-LLM, vLLM, SGLang, Triton
    checked_against: str = ""     # the upstream source every rule in the module was read from
    writes_config: bool = True    # one of build's --stacks (a config in configs/); False: written for every bundle
    servers: tuple[Server, ...] = ()
    config_files: ClassVar[dict[str, str]] = {}   # the manifest's serving_configs index: key -> bundle path
    triton_models: tuple[str, ...] = ()  # its models in the bundle's Triton repository (manifest triton_models)
    # its server's speculative-decoding figures on its Prometheus page (bench --endpoint): prefix,
    # metrics_paths, kind ("counters" | "gauge"), {name, where} per figure, source
    spec_decode_metrics: ClassVar[dict] = {}

    # -------------------------------------------------------------- what it refuses
    def layout_problems(self, *, tp: int, pp: int, block_size: int) -> list[str]:
        """The stack's DFlash rules this layout breaks (empty: it can serve it)."""
        return []

    def drafter_problems(self, dcfg) -> list[str]:
        """Why the stack cannot serve this drafter (dcfg: models.config.DrafterConfig)."""
        return []

    def drafter_quant_problem(self, drafter_quant: str) -> str | None:
        """Why the stack's DFlash loader at the pinned version cannot load a drafter quantized to this
        scheme (None: it can), in one line naming the version that would, from engines.json
        (stacks.<name>.drafter_quant: its schemes, why, loads_from, source)."""
        q = self.facts.get("drafter_quant")
        if drafter_quant == "none" or q is None or drafter_quant in q["schemes"]:
            return None
        later = f"{q['loads_from']} loads it" if q.get("loads_from") else "no release loads one yet"
        return (f"{self.facts['engine']} {engines.pinned_version(self.name)}'s DFlash loader takes no "
                f"{drafter_quant.upper()} drafter ({q['why'].split(';')[0]}); {later}")

    def drafter_unquantized(self) -> list[str]:
        """Drafter modules (globs over its checkpoint names) its DFlash loader needs unquantized."""
        return list((self.facts.get("drafter_quant") or {}).get("unquantized", []))

    def drafter_layer_exclusions(self) -> bool:
        """Whether its DFlash loader honours a quantized drafter's exclusion of a decoder-layer module."""
        return bool((self.facts.get("drafter_quant") or {}).get("layer_exclusions", True))

    def drafter_activation_scales(self, scheme: str) -> str:
        """"static": its quantized Linears in this scheme read an input_scale from the checkpoint;
        "dynamic": they don't (engines.json: one value, or one per scheme)."""
        v = (self.facts.get("drafter_quant") or {}).get("activation_scales", "dynamic")
        return v.get(scheme, "dynamic") if isinstance(v, dict) else v

    def draft_schedule_problem(self, schedule: DraftSchedule | None = None) -> str | None:
        """Why this stack's DFlash path does not honour a draft-length schedule (with the upstream source
        read), so build writes none for it; None: it does (draft_schedule_fields writes it). With a
        schedule: also why its control cannot express that one (e.g. a draft length that rises again)."""
        return "no draft-length control of this stack's DFlash path has been read"

    def draft_schedule_fields(self, schedule: DraftSchedule) -> dict:
        """The stack's own control for a draft schedule, as the fields its config writer merges into its
        speculative config. Called once per build (draft_schedule_record); the writer reads the record."""
        return {}

    def check_build(self, *, target_config: dict, drafter_config: dict, target_dir: Path, gpu: str | None,
                    quant: str, tp: int, profile_name: str, profile: dict) -> None:
        """Refuse, before any stage runs, what the stack would refuse at start (raise DFlashError)."""

    # -------------------------------------------------------------- what it writes
    def write_configs(self, ctx: BundleContext) -> None:
        """Its files under configs/ (config_files lists them)."""

    def triton_inputs(self, ctx: BundleContext) -> dict:
        """What the Triton model repository takes from this stack (keyword arguments of
        stacks.tritonserver.repo.write_triton_repo)."""
        return {}

    def serve_commands(self, served: list[str]) -> dict:
        """The manifest's `serve` entries: how to serve the bundle with this stack, from its root."""
        return {}

    # -------------------------------------------------------------- deploy and plan
    def planner_settings(self, bundle: Path, manifest) -> dict:
        """Serving settings the planner must take from the bundle's own config files (what the
        server will really run with): kv_fraction, max_batch_size, ... ; empty when none."""
        return {}

    def image_engine_version(self, image: dict) -> tuple[str, str] | None:
        """(engine version, where it comes from) that a published image is known to carry, which
        wins over a user's declaration; None where the stack knows no such table."""
        return None

    # -------------------------------------------------------------- engine facts
    @property
    def facts(self) -> dict:
        """engines.json stacks.<name>: engine, dflash_since, contract, their sources."""
        return engines.facts()["stacks"][self.name]

    def __repr__(self) -> str:
        return f"<stack {self.name}>"


def non_causal_windowed(dcfg) -> bool:
    """Any drafter layer both sliding-window and non-causal (the DFlash2 fixture: all of them);
    the TensorRT-LLM and SGLang drafter backends each pin a backend for it."""
    return any(w is not None and not c for w, c in dcfg.layer_attention)


def draft_schedule_record(schedule: DraftSchedule | None, source: str, served: list[Stack]) -> DraftScheduleRecord:
    """manifest.json `draft_schedule`, decided once per build: the schedule (or why none) and, per served
    stack, the fields its own control gets or why it gets none (its draft_schedule_problem, with the
    upstream source read). Each stack's writer writes exactly the fields recorded here."""
    out: dict[str, StackScheduleRecord] = {}
    for st in served:
        why = st.draft_schedule_problem()      # a stack whose DFlash has no such control says so first
        if why:
            pass
        elif schedule is None:
            why = f"no draft schedule: {source}"
        elif not schedule.adaptive:
            last = schedule.ranges[-1][1]
            why = (f"nothing to write: the schedule drafts K = {schedule.max_k} at every concurrency 1-{last}, "
                   "what the config does without one")
        else:
            why = st.draft_schedule_problem(schedule)
        out[st.name] = StackScheduleRecord(skipped=why) if why else \
            StackScheduleRecord(fields=st.draft_schedule_fields(schedule))
    return DraftScheduleRecord(source=source, schedule=schedule.to_dict() if schedule is not None else None,
                               stacks=out)
