"""What a serving stack is to the pipeline: one small interface, one module per stack (docs/stacks.md).

`build`, `deploy`, `serve` and `plan` never ask which stack they hold; they loop over the registry
(stacks/__init__.py) and call these methods: the layouts and drafters a stack refuses, the files it
writes into a bundle, its launch as data (LaunchArgs), its servers and metrics, its engine facts
(engines.json). A method a stack does not need keeps the default here.
"""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from dflash_trt import engines
from dflash_trt.errors import DFlashError
from dflash_trt.io.draft_schedule import DraftSchedule
from dflash_trt.io.manifest import DraftScheduleRecord, Manifest, StackScheduleRecord
from dflash_trt.io.prometheus import sum_series


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


@dataclass(frozen=True)
class LaunchArgs:
    """How a stack's server starts on a bundle, from the bundle root, as data. The stack's own command
    line (argv(): configs/<stack>.json argv, the manifest's serve entries) and an orchestrator's worker
    arguments (deploy/dynamo.py, with the worker's own flag names from engines.json) are rendered from it."""
    program: tuple[str, ...]          # the engine's launcher: ("vllm", "serve"), ("trtllm-serve",)
    model: str                        # the target's folder, bundle-relative
    model_flag: str | None = None     # how the launcher takes the model: None positionally, else after this flag
    flags: tuple[str, ...] = ()       # the engine's own flags, as its launcher (and Dynamo's worker for it) take them
    config_file: str | None = None    # an engine-args file it reads the rest from (TensorRT-LLM's YAML)
    config_flag: str | None = None    # the launcher's flag for that file
    # the layout (the flags or the config file say it to the launcher; an orchestrator may need it as its own flags)
    tp: int = 1
    ep: int = 1
    pp: int = 1
    env: tuple[tuple[str, str], ...] = ()   # environment the engine needs (name, value), in order

    def argv(self) -> list[str]:
        model = [self.model_flag, self.model] if self.model_flag else [self.model]
        config = [self.config_flag, self.config_file] if self.config_file else []
        return [*self.program, *model, *config, *self.flags]

    def command(self) -> str:
        """argv as one shell line, its environment first."""
        return " ".join([*(f"{k}={v}" for k, v in self.env), shlex.join(self.argv())])

    def record(self) -> dict:
        """As the stack's config file keeps it (its `launch` key)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, rec: dict, where: str) -> LaunchArgs:
        try:
            return cls(**{k: tuple(map(tuple, v)) if k == "env" else tuple(v) if isinstance(v, list) else v
                          for k, v in rec.items()})
        except TypeError as e:
            raise DFlashError(f"{where}: `launch` is not a record of launch arguments ({e})") from None


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


@dataclass(frozen=True)
class Metric:
    """One metric as the engine exposes it on its Prometheus page."""
    name: str                     # the exposed name (a counter with its _total suffix)
    type: str                     # counter | gauge | histogram
    labels: tuple[str, ...]       # its labels, the engine's own (Prometheus' job/instance/pod come on top)
    source: str                   # file:line (or symbol) of the pinned engine version that declares it


@dataclass(frozen=True)
class StackMetrics:
    """A server's metrics for monitoring DFlash: which series, and the PromQL over them.

    Each PromQL is a template with `{w}` (the rate window, e.g. 2m) and `{by}` (the labels kept, e.g.
    `namespace, pod`); every expression yields one series per `{by}` group (per_position: one per position,
    in a label named `position`). An expression the engine cannot answer is "" (no rule, no panel)."""
    prefix: str                   # the engine's metric prefix
    metrics_path: str             # its Prometheus page on the serving port
    enable: str                   # what turns the page on, as the bundle's config writes it
    metrics: dict[str, Metric]    # role -> metric; roles: drafts, draft_tokens, accepted, accepted_per_position,
    # generation_tokens, running (requests in flight), ttft, itl, tpot, prompt_tokens (histograms),
    # acceptance_length (gauge)
    acceptance_length: str        # mean tokens per verify step, bonus token included (tau)
    per_position: str             # share of drafts whose position p was accepted, label position
    draft_efficiency: str         # accepted drafted tokens / drafted tokens
    source: str                   # the release read (each Metric's source is a file:line in it)
    context_tokens: str = ""      # mean prompt tokens of the requests finished over the window (the context axis)
    kind: str = "counters"        # "counters": bench diffs counters around a run; "gauge": reads the last value
    notes: tuple[str, ...] = ()   # where an expression is not the engine's own figure, why

    def promql(self, role: str, w: str, by: str) -> str:
        return getattr(self, role).format(w=w, by=by)

    def histogram(self, role: str) -> str:
        """The histogram's series name (<name>_bucket), "" when the engine has no such histogram."""
        m = self.metrics.get(role)
        return m.name + "_bucket" if m else ""

    def bench_view(self) -> dict:
        """What bench --endpoint reads: {name, where} per figure (counter names without _total: the
        parser accepts either), prefix, metrics_paths, kind, source."""
        out: dict = {"prefix": self.prefix, "metrics_paths": [self.metrics_path], "kind": self.kind}
        for role in ("drafts", "draft_tokens", "accepted", "generation_tokens", "acceptance_length"):
            m = self.metrics.get(role)
            if m:
                name = m.name.removesuffix("_total") if m.type == "counter" else m.name
                out[role] = {"name": name, **({"where": dict(DRAFTS_WHERE[m.name])} if m.name in DRAFTS_WHERE
                                               and role == "drafts" else {})}
        out["source"] = f"{self.source}: " + "; ".join(sorted({m.source for m in self.metrics.values()}))
        return out


@dataclass(frozen=True)
class TuneReader:
    """What `dflash-trt tune` reads of a stack (plan/tune.py): its server's counters as a /metrics page names
    them (a counter without _total), where its bundle config keeps the served draft schedule, and what a
    scheduled K of 0 still costs over plain decoding ("": nothing, there it is plain decoding)."""
    drafts: str
    draft_tokens: str
    accepted: str
    accepted_per_pos: str           # label `position`, 0-based
    running: str                    # requests in the running batch (a gauge)
    schedule_in: tuple[str, str]    # (bundle path of the engine config, its schedule field)
    k0_cost: str = ""

    @classmethod
    def of(cls, metrics: StackMetrics, schedule_in: tuple[str, str], k0_cost: str = "") -> TuneReader:
        """From the metrics' roles drafts, draft_tokens, accepted, accepted_per_position and running."""
        m = metrics.metrics
        return cls(*(m[r].name.removesuffix("_total") for r in ("drafts", "draft_tokens", "accepted",
                                                                "accepted_per_position", "running")),
                   schedule_in, k0_cost)

    def counts(self, samples: list[tuple[str, dict, float]]) -> dict:
        """Its counters on one /metrics page (io/prometheus.parse_prometheus), summed over their series (None:
        absent); accepted_per_pos: a list by position."""
        out = {k: sum_series(samples, {"name": getattr(self, k)}) for k in ("drafts", "draft_tokens", "accepted",
                                                                             "running")}
        per_pos: dict[int, float] = {}
        for name, labels, value in samples:
            if name in (self.accepted_per_pos, self.accepted_per_pos + "_total") and "position" in labels:
                per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
        out["accepted_per_pos"] = [per_pos[k] for k in sorted(per_pos)]
        return out


# A stack with no draft counter counts drafts as the drafted tokens at position 0 (every draft drafts it).
DRAFTS_WHERE = {"trtllm_spec_decode_drafted_tokens_total": (("token_position", "0"),)}


class Stack:
    """The defaults of every method; a stack module overrides what it has."""
    name: str = ""                # the manifest's serving_stacks name
    title: str = ""               # for people: TensorRT-LLM, vLLM, SGLang, Triton
    checked_against: str = ""     # the upstream source every rule in the module was read from
    writes_config: bool = True    # one of build's --stacks (a config in configs/); False: written for every bundle
    runs_here: bool = False       # local_server starts it on this machine (`dflash-trt serve --engine <name>`)
    servers: tuple[Server, ...] = ()
    config_files: ClassVar[dict[str, str]] = {}   # the manifest's serving_configs index: key -> bundle path
    triton_models: tuple[str, ...] = ()  # its models in the bundle's Triton repository (manifest triton_models)
    # its server's Prometheus metrics as typed data (names, types, labels, PromQL, sources): the chart's
    # monitoring (deploy/monitoring.py) and bench --endpoint read them; None: the stack exports none
    metrics: ClassVar[StackMetrics | None] = None
    # what `dflash-trt tune` reads of its server and bundle (plan/tune.py); None: its server does not count the
    # accepted tokens per draft position
    tune_reader: ClassVar[TuneReader | None] = None

    @property
    def spec_decode_metrics(self) -> dict:
        """The speculative-decoding figures bench --endpoint reads off a /metrics page (StackMetrics.bench_view):
        prefix, metrics_paths, kind ("counters" | "gauge"), {name, where} per figure, source; {} when none."""
        return self.metrics.bench_view() if self.metrics else {}

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

    def draft_schedule_context_problem(self) -> str | None:
        """Why this stack's control cannot take the schedule's context axis (DraftSchedule.by_context); None:
        draft_schedule_fields writes it."""
        return (f"{self.title}'s draft-length control is keyed by batch size only: the shortest context bucket's "
                "K holds at every context")

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

    # -------------------------------------------------------------- how it starts
    def launch_args(self, bundle: Path) -> LaunchArgs:
        """How its server starts on this bundle, read from the config the stack wrote into it."""
        raise DFlashError(f"{bundle}: the {self.title or self.name} stack starts no server from a bundle config")

    def local_server(self, bundle: Path | None, opts: dict):
        """(server, endpoints, announcement) of its server on this machine (`dflash-trt serve`; runs_here).
        server: a ServerProcess (serve_until_stopped); opts: the serve command's options (host, ports, envs)."""
        raise DFlashError(f"serve --engine {self.name}: the {self.title or self.name} stack runs no server here")

    # -------------------------------------------------------------- deploy and plan
    def planner_settings(self, bundle: Path, manifest) -> dict:
        """Serving settings the planner must take from the bundle's own config files (what the
        server will really run with): kv_fraction, max_batch_size, ... ; empty when none. `bundle` None:
        what the stack will write for `manifest` (build plans before the files exist)."""
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
        if not why and schedule is None:
            why = f"no draft schedule: {source}"
        elif not why and not schedule.adaptive:
            why = (f"nothing to write: the schedule drafts K = {schedule.max_k} at every concurrency "
                   f"1-{schedule.ranges[-1][1]}, what the config does without one")
        elif not why:
            why = st.draft_schedule_problem(schedule)
        out[st.name] = StackScheduleRecord(skipped=why) if why else StackScheduleRecord(
            fields=st.draft_schedule_fields(schedule),
            context=st.draft_schedule_context_problem() if schedule.by_context else None)
    return DraftScheduleRecord(source=source, schedule=schedule.to_dict() if schedule is not None else None,
                               stacks=out)
