"""The bundle manifest: `manifest.json` at the root of every `dflash-trt build` bundle.

It makes a bundle self-describing: what went in (paths and content hashes), what was decided, what each
pipeline stage did, and every file that came out with its size and sha256 (`dflash-trt verify`). The
schema is data (a JSON Schema, checked with `jsonschema` when installed): deploy and compile read it too.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from dflash_trt import __version__, engines
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_sms, catalog, gpus
from dflash_trt.io.atomic import MARKER, atomic_write_text
from dflash_trt.io.jsonio import read_json

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)   # version 2: a revision's `revision` record (version 1: `tune`)
STAGES = ("check", "quantize", "convert", "plugin", "export-onnx", "compile", "package")
STAGE_STATUSES = ("done", "skipped", "deferred", "failed", "not-needed")
# How build chose the bundle's GPU: --gpu named it, nvidia-smi showed it, the architecture's default
# node (hardware.json arch_default_nodes), or --gpu none (a CPU-only bundle: gpu and node null).
GPU_SOURCES = ("option", "detected", "arch_default", "none")

def _enum(values) -> dict:
    return {"enum": list(values)}


# The values' rules (enums, bounds, required fields), checked with jsonschema when it is installed; the shape
# (every field's name and type) is the records' (Manifest.from_dict).
MANIFEST_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dflash-trt bundle manifest",
    "type": "object",
    "required": ["schema_version", "tool_version", "target", "drafter", "arch", "gpu", "quant", "parallel",
                 "backend", "stages", "triton_model_repository", "triton_models", "artifacts"],
    "properties": {
        "schema_version": _enum(READ_VERSIONS),
        "target": {"required": ["name", "path", "config"]},
        "drafter": {"required": ["path", "block_size", "mask_token_id", "target_layer_ids"],
                    "properties": {"block_size": {"minimum": 2}, "mask_token_id": {"minimum": 0},
                                   "target_layer_ids": {"required": ["zlab", "speculators", "vllm", "sglang"],
                                                        "additionalProperties": {"items": {"minimum": 0}}}}},
        "arch": _enum(arch_sms()),
        "gpu": _enum([*gpus(), None]),
        "node": _enum([*catalog(), None]),          # the hardware.json node type deploy plans for
        "gpu_source": _enum(GPU_SOURCES),
        "quant": {"required": ["target", "kv_cache"],
                  "properties": {"target": _enum(["nvfp4", "fp8", "none", "mxfp4"]),
                                 "drafter": _enum(["nvfp4", "fp8", "int8", "none"]), "kv_cache": _enum(["fp8", "bf16"])}},
        "parallel": {"required": ["tp", "ep", "pp"], "additionalProperties": {"minimum": 1}},
        "backend": _enum(["pytorch", "engine"]),
        "stages": {"additionalProperties": {"required": ["status", "inputs_sha256", "outputs"],
                                            "properties": {"status": _enum(STAGE_STATUSES)}}},
        # which stacks got a config; a skipped stack maps to the upstream rule the layout breaks
        "serving_stacks": {"required": ["served", "skipped"],
                           "properties": {"served": {"items": _enum(engines.facts()["stacks"])}}},
        # each served stack's engine facts and its servers' images (engines.json, dflash_trt/engines.py)
        "engines": {"additionalProperties": {
            "required": ["engine", "dflash_since", "contract", "servers"],
            "properties": {"servers": {"additionalProperties": {"required": ["image", "engine_version"]}}}}},
        "serving_profile": {"required": ["profile"], "properties": {"profile": _enum(["latency", "throughput"])}},
        # per served stack: the fields written into its own control (and why not the context axis), or why nothing
        "draft_schedule": {"required": ["source", "schedule", "stacks"],
                           "properties": {"stacks": {"additionalProperties": {"minProperties": 1, "maxProperties": 2,
                                                                              "not": {"required": ["skipped",
                                                                                                   "fields"]}}}}},
        "artifacts": {"items": {"required": ["path", "bytes", "sha256"],
                                "properties": {"bytes": {"minimum": 0}, "sha256": {"pattern": "^[0-9a-f]{64}$"}}}},
    },
}


def validate(manifest: dict, source: str = MANIFEST_NAME) -> None:
    """Raise DFlashError naming the first field that does not fit the schema."""
    try:
        import jsonschema
    except ImportError:  # the library is optional at run time; fall back to the required keys
        if missing := [k for k in MANIFEST_SCHEMA["required"] if k not in manifest]:
            raise DFlashError(f"{source}: missing field(s) {', '.join(missing)}") from None
        return
    errors = sorted(jsonschema.Draft202012Validator(MANIFEST_SCHEMA).iter_errors(manifest), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise DFlashError(f"{source}: field {where}: {e.message}")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


HUB_LFS_BLOB = re.compile(r"[0-9a-f]{64}")


def hub_blob_sha256(resolved: Path) -> str | None:
    """The sha256 of a Hugging Face cache blob of a large (LFS) file: its name (models--org--name/blobs/<sha256>),
    so a cached 65 GB checkpoint is not read to be hashed. Small files' blobs are named by their git sha1."""
    p = Path(resolved)
    if p.parent.name == "blobs" and p.parent.parent.name.startswith("models--") and HUB_LFS_BLOB.fullmatch(p.name):
        return p.name
    return None


class HashCache:
    """sha256 of files, remembered by (size, mtime_ns) so that re-runs do not re-read unchanged
    multi-GB checkpoints. Stored in the manifest under `input_files`."""

    def __init__(self, entries: dict | None = None):
        self.entries: dict[str, dict] = dict(entries or {})
        self._inodes: dict[tuple, str] = {}   # (dev, inode, size, mtime_ns) -> sha256, this run only

    def sha256(self, path: Path) -> str:
        path = Path(path).resolve()
        st = path.stat()
        key = str(path)
        hit = self.entries.get(key)
        if hit and hit.get("bytes") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            digest = hit["sha256"]
        elif not (digest := hub_blob_sha256(path)):
            digest = sha256_file(path)
            self.entries[key] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self._inodes[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = digest
        return digest

    def remember(self, path: Path, digest: str) -> None:
        """The sha256 of a file just written by this run, computed while writing it."""
        st = Path(path).stat()
        self._inodes[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = digest

    def linked(self, path: Path) -> str | None:
        """The sha256 of a file that is (a hard link of) one hashed or remembered in this run (same
        inode, size and mtime: the same bytes), e.g. a bundle's copy of a multi-GB input; else None."""
        st = Path(path).stat()
        return self._inodes.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    def tree(self, folder: Path) -> str:
        """One digest over every file under folder (relative names and content hashes)."""
        folder = Path(folder)
        if folder.is_file():
            return self.sha256(folder)
        return sha256_json([[p.relative_to(folder).as_posix(), self.sha256(p)] for p in sorted(folder.rglob("*"))
                            if p.is_file() and "__pycache__" not in p.parts])


def bundle_files(bundle: str | Path) -> list[str]:
    """Relative paths of every file of a bundle except manifest.json (and Python caches that a
    Triton Python backend may leave beside a model.py, and the partial-output marker of a bundle
    still being assembled: io.atomic removes it before publishing)."""
    bundle = Path(bundle)
    return [p.relative_to(bundle).as_posix() for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.relative_to(bundle).as_posix() not in (MANIFEST_NAME, MARKER)
            and "__pycache__" not in p.parts]


def list_artifacts(bundle: str | Path, known=None) -> list[ArtifactRecord]:
    """Every file of the bundle but manifest.json, with its size and sha256: `known(rel, stat)` where the caller
    knows it (a copy of a hashed source, a file reused unchanged), else read."""
    bundle, out = Path(bundle), []
    for rel in bundle_files(bundle):
        st = (bundle / rel).stat()
        out.append(ArtifactRecord(rel, st.st_size, (known and known(rel, st)) or sha256_file(bundle / rel)))
    return out


# ------------------------------------------------------------------ the manifest, typed
# Bundles written before `serving_stacks` existed served the stack of their Triton GPU model.
LEGACY_STACK_OF_TRITON_MODEL = {"tensorrt_llm": "trtllm"}


def _optional(default=None):
    """A field that bundles of earlier versions (or builds that decide nothing there) lack: left out of the
    JSON when None, so that what is written is what was read."""
    return field(default=default, metadata={"omit_none": True})


def _dump(value):
    """A record (or a value holding records) as manifest.json's JSON value: keys in field order, optional
    fields left out when None."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _dump(getattr(value, f.name)) for f in fields(value)
                if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)}
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def record(cls=None, *, kw_only: bool = False):
    """A manifest record: a frozen dataclass whose JSON is read strictly (Manifest.from_dict): a field it does
    not have, or a value of another type, is refused naming the field (pydantic's extra="forbid")."""
    def make(cls):
        cls = dataclass(frozen=True, kw_only=kw_only)(cls)
        cls.__pydantic_config__ = {"extra": "forbid", "strict": True}
        return cls
    return make(cls) if cls is not None else make


def _upgraded(m: dict, source: str) -> dict:
    """A manifest of a schema version this dflash-trt reads (READ_VERSIONS) as the current one (filling in what
    version 1 lacks); any other version refused in one line."""
    v = m.get("schema_version")
    if v not in READ_VERSIONS:
        raise DFlashError(f"{source}: manifest schema version {v!r}; this dflash-trt ({__version__}) reads versions "
                          f"{', '.join(map(str, READ_VERSIONS))}: rebuild the bundle with it, or use the dflash-trt "
                          "that wrote the bundle")
    if v == SCHEMA_VERSION:
        return m
    m = {**m, "schema_version": SCHEMA_VERSION}
    if "serving_stacks" not in m:
        m["serving_stacks"] = {"served": [LEGACY_STACK_OF_TRITON_MODEL[x] for x in m.get("triton_models", [])
                                          if x in LEGACY_STACK_OF_TRITON_MODEL], "skipped": {}}
    if isinstance(m.get("quant"), dict):
        m["quant"] = {"drafter": "none", **m["quant"]}
    if "tune" in m:
        tune = dict(m.pop("tune"))
        parent = tune.pop("from_revision")
        rewritten = ("configs/", "triton/")   # what a version 1 tune wrote anew
        m["revision"] = {"kind": "tune", "summary": (m.get("draft_schedule") or {}).get("source", "tune"),
                         "parent": {"path": parent["bundle"], "manifest_sha256": parent["manifest_sha256"]},
                         "changed": [a["path"] for a in m.get("artifacts", []) if a["path"].startswith(rewritten)],
                         "tune": tune}
    return m


@record
class TargetRecord:
    name: str
    hf_id: str | None = None
    path: str = ""
    bundle_path: str = "target"
    revision: str | None = None         # the hub commit (a cache snapshot)
    sha256: str | None = None           # of the source folder (HashCache.tree)
    config: dict = field(default_factory=dict)   # the target's config.json


@record
class DrafterRecord:
    path: str
    bundle_path: str | None = _optional()   # absent in early bundles, as are sha256, trained_block_size, config
    sha256: str | None = _optional()
    revision: str | None = None
    block_size: int = 0                 # the block served
    trained_block_size: int | None = _optional()
    mask_token_id: int = 0
    target_layer_ids: dict = field(default_factory=dict)   # convention -> ids (stacks/layer_ids.py)
    config: dict | None = _optional()   # the drafter's config.json


@record
class QuantRecord:
    target: str                         # nvfp4 | fp8 | mxfp4 | none
    drafter: str = "none"               # nvfp4 | fp8 | int8 | none
    kv_cache: str = "bf16"              # fp8 | bf16


@record
class ParallelRecord:
    tp: int = 1
    ep: int = 1
    pp: int = 1


@record
class ServingStacksRecord:
    served: list[str]                   # the stacks with a config in the bundle
    skipped: dict[str, str] = field(default_factory=dict)   # stack -> the upstream rule its layout breaks


@record
class ServingProfileRecord:
    """build --profile: the TensorRT-LLM settings written (stacks/trtllm/profiles.py), their source, and
    the drafter attention backend."""
    profile: str = "latency"
    source: str | None = _optional()
    enable_attention_dp: bool | None = _optional()
    max_batch_size: int | None = _optional()
    max_num_tokens: int | None = _optional()
    drafter_attention_backend: str | None = _optional()
    drafter_attention_backend_source: str | None = _optional()


@record
class ReferenceRuntimeRecord:
    """Where the dflash_reference model finds its unquantized pair: bundle | copy | source (bundle/build.py)."""
    layout: str


@record
class StackScheduleRecord:
    """One served stack's draft schedule: the fields written into its own control, or why none."""
    fields: dict | None = _optional()
    skipped: str | None = _optional()
    context: str | None = _optional()      # a schedule with a context axis: why this stack's fields have none


@record
class DraftScheduleRecord:
    """build --draft-schedule: the schedule (DraftSchedule.to_dict(), or None) and where it comes from or
    why there is none, and per served stack what its writer writes (stacks/base.draft_schedule_record)."""
    source: str
    schedule: dict | None = None
    stacks: dict[str, StackScheduleRecord] = field(default_factory=dict)

    def fields_for(self, stack: str) -> dict:
        """The fields a stack's writer writes (empty: nothing; the record says why)."""
        rec = self.stacks.get(stack)
        return dict(rec.fields) if rec is not None and rec.fields is not None else {}


@record
class StageRecord:
    """One pipeline stage's entry (STAGES): its outcome, the hash of its inputs, what it wrote."""
    status: str                             # STAGE_STATUSES
    inputs_sha256: str
    outputs: list[str] = field(default_factory=list)
    commands: list[str] | None = _optional()   # the equivalent `dflash-trt` command lines
    engine_key: str | None = _optional()       # compile: engines/<key>/
    reason: str | None = _optional()
    skipped: bool | None = _optional()         # this run reused the previous bundle's outputs
    seconds: float | None = _optional()        # a run fact (STAGE_RUN_FACTS)
    serving_configs: dict | None = _optional()   # package: the configs index it wrote
    toolchain: dict | None = _optional()       # compile, run by `dflash-trt compile`: the GPU toolchain


@record
class ArtifactRecord:
    """One file of the bundle (every file but manifest.json)."""
    path: str                               # bundle-relative
    bytes: int
    sha256: str


@record
class WeightsRecord:
    """A configs-only bundle's weights (build --configs-only): absent, and how to get them."""
    present: bool
    downloads: list[dict] = field(default_factory=list)   # {role, hf_id, revision, command} per download


@record
class TuneRecord:
    """A revision written by `dflash-trt tune`: the served acceptance its draft schedule was re-planned from."""
    window: dict                        # {source, start, seconds, mean_concurrency, max_concurrency}
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: list
    acceptance: dict                    # {tau, survival, measured_positions}
    cost_model: str
    changes: list[dict] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    tuned: str | None = None            # when (UTC)


@record
class PlanRefreshRecord:
    """A revision written by `dflash-trt plan --bundle B --refresh`: plan.json planned anew (by this planner
    version, for these cases); the bundle's files and manifest fields are the parent's."""
    planner_version: str
    cases: list[str]                    # "<nodes> x <hardware> (<gpus_per_node> GPUs), max_seq_len N" per case


@record
class AdaptRecord:
    """A revision written by `dflash-trt adapt` (adapt.py): the traffic its drafter was fine-tuned on, the
    training, and the gate on held-out traffic it passed (the parent is the revision record's)."""
    traffic: list[dict]                 # {path, sha256, rows} per file, in reading order
    rows: dict                          # {rows, train, held_out, held_out_fraction, duplicates, skipped, ...}
    training: dict                      # {step, labels, distill_k, lr, train_seconds, first_loss, last_loss, ...}
    gate: dict                          # {min_gain, gain, paired_se, passed, before: figures, after: figures}
    adapted: str | None = None          # when (UTC)


@record
class RevisionParent:
    path: str                           # the parent bundle's folder (absolute)
    manifest_sha256: str                # of its manifest.json: which build (or revision) of that folder


@record
class RevisionRecord:
    """A bundle written from another by bundle/package.py write_revision: which kind of revision, why, its
    immediate parent, the bundle-relative paths whose sha256 differs from the parent's, and the kind's record
    (the field named like the kind)."""
    kind: str                           # a REVISION_KINDS key
    summary: str
    parent: RevisionParent
    changed: list[str]
    tune: TuneRecord | None = _optional()
    plan: PlanRefreshRecord | None = _optional()
    adapt: AdaptRecord | None = _optional()

    @property
    def record(self):
        return getattr(self, self.kind)


@record
class RevisionKind:
    record: type                        # the kind's record (RevisionRecord's field of the kind's name)
    revises: tuple[str, ...]            # the manifest fields such a revision writes anew; it keeps every other


# A row per kind of revision; every revision also writes REVISION_REWRITES anew.
REVISION_KINDS = {"tune": RevisionKind(TuneRecord, ("draft_schedule",)),
                  "adapt": RevisionKind(AdaptRecord, ("drafter", "draft_schedule")),
                  "plan": RevisionKind(PlanRefreshRecord, ())}
REVISION_REWRITES = ("tool_version", "created", "serving_configs", "artifacts", "artifact_stats", "revision")


@record(kw_only=True)
class Manifest:
    """manifest.json as one typed object, both ways: `build` writes it (Manifest.write), every other command
    reads it (Manifest.read). Fields in the JSON's order; optional ones left out when None."""
    schema_version: int
    tool_version: str
    created: str | None = _optional()
    target: TargetRecord
    drafter: DrafterRecord
    arch: str
    gpu: str | None
    node: str | None = None             # hardware.json node type (bundles before it: the GPU's first node)
    gpu_source: str | None = _optional()   # GPU_SOURCES; None for bundles before it
    sm: list[int] = field(default_factory=list)
    quant: QuantRecord
    parallel: ParallelRecord
    backend: str
    max_seq_len: int | None = _optional()
    triton_model_repository: str
    triton_models: list[str]
    serving_stacks: ServingStacksRecord
    trt_drafter_engine: bool = False
    engines: dict = field(default_factory=dict)   # stack -> engine facts and its servers' images (engines.json)
    serving_profile: ServingProfileRecord | None = _optional()
    reference_runtime: ReferenceRuntimeRecord | None = _optional()
    draft_schedule: DraftScheduleRecord | None = _optional()
    weights: WeightsRecord | None = _optional()   # None: the weights are in the bundle
    revision: RevisionRecord | None = _optional()   # a bundle written from another (tune, adapt)
    serving_configs: dict | None = _optional()   # key -> bundle path of each served stack's config
    stages: dict[str, StageRecord] | None = _optional()   # stage name -> its entry, in STAGES order
    input_files: dict | None = _optional()       # HashCache entries: the inputs' sha256 by (size, mtime)
    artifacts: list[ArtifactRecord] | None = _optional()   # every file but manifest.json
    serve: dict | None = _optional()             # how to serve the bundle, from its root
    artifact_stats: dict | None = _optional()    # path -> [bytes, mtime_ns]: the next build's reuse check

    @property
    def served_stacks(self) -> list[str]:
        return list(self.serving_stacks.served)

    @property
    def skipped_stacks(self) -> dict[str, str]:
        return dict(self.serving_stacks.skipped)

    @classmethod
    def from_dict(cls, m: dict, source: str = MANIFEST_NAME) -> Manifest:
        """A manifest.json object as the typed object: upgraded, its values checked (MANIFEST_SCHEMA), its shape
        read strictly: an unknown field or a value of another type is refused naming the field."""
        m = _upgraded(m, source)
        validate(m, source)
        try:
            return _reader().validate_json(json.dumps(m))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "(top level)"
            what = {"unexpected_keyword_argument": f"unknown field (manifest schema version {SCHEMA_VERSION})",
                    "missing_argument": "missing"}.get(err["type"], err["msg"])
            raise DFlashError(f"{source}: field {where}: {what}") from None

    def to_dict(self) -> dict:
        """The JSON object manifest.json holds (keys in field order; optional fields left out when None)."""
        return _dump(self)

    @classmethod
    def read(cls, bundle: str | Path) -> Manifest:
        """manifest.json of a bundle (from_dict)."""
        path = Path(bundle) / MANIFEST_NAME
        if not Path(bundle).is_dir():
            raise DFlashError(f"{bundle}: not a folder")
        if not path.is_file():
            raise DFlashError(f"{path}: missing; {bundle} is not a dflash-trt bundle")
        return cls.from_dict(read_json(path), str(path))

    def write(self, bundle: str | Path) -> Path:
        """Validate, then write manifest.json atomically (temp file + rename)."""
        path, manifest = Path(bundle) / MANIFEST_NAME, self.to_dict()
        validate(manifest, str(path))
        return atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")


@functools.cache
def _reader() -> TypeAdapter:
    return TypeAdapter(Manifest)


# The facts of one build run rather than of its inputs: what two builds of the same inputs may differ in
# (tests/test_reproducible.py compares everything else byte for byte).
RUN_FACTS = ("created", "artifact_stats")
STAGE_RUN_FACTS = ("seconds",)


def is_bundle(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def verify(bundle: str | Path) -> list[str]:
    """Problems found when re-hashing every artifact the manifest lists (empty list: intact), files in the
    bundle that the manifest does not list, and, for a revision whose parent is here, what it changed
    without saying so (revision_problems)."""
    bundle = Path(bundle)
    m = Manifest.read(bundle)
    problems = []
    for a in m.artifacts:
        p = bundle / a.path
        if ".." in Path(a.path).parts or Path(a.path).is_absolute():
            problems.append(f"{a.path}: artifact path leaves the bundle")
        elif not p.is_file():
            problems.append(f"{a.path}: missing")
        elif p.stat().st_size != a.bytes:
            problems.append(f"{a.path}: size {p.stat().st_size} bytes, manifest says {a.bytes}")
        elif (digest := sha256_file(p)) != a.sha256:
            problems.append(f"{a.path}: sha256 {digest[:16]}… does not match the manifest's {a.sha256[:16]}…")
    listed = {a.path for a in m.artifacts}
    problems += [f"{rel}: not listed in the manifest" for rel in bundle_files(bundle) if rel not in listed]
    return problems + revision_problems(m)


def revision_problems(m: Manifest) -> list[str]:
    """A revision against its parent, when the parent is still there and as it was: a manifest field the kind
    keeps (REVISION_KINDS) that differs, and a file that differs but is not in revision.changed."""
    rev = m.revision
    if rev is None:
        return []
    if rev.kind not in REVISION_KINDS:
        return [f"{MANIFEST_NAME}: field revision.kind: {rev.kind!r}, expected one of {', '.join(REVISION_KINDS)}"]
    parent = Path(rev.parent.path)
    if not is_bundle(parent) or sha256_file(parent / MANIFEST_NAME) != rev.parent.manifest_sha256:
        return []
    before, now = Manifest.read(parent).to_dict(), m.to_dict()
    kept = [k for k in before if k not in (*REVISION_REWRITES, *REVISION_KINDS[rev.kind].revises)]
    problems = [f"{MANIFEST_NAME}: field {k} differs from its parent's ({parent}), which a {rev.kind} revision keeps"
                for k in kept if before[k] != now.get(k)]
    a = {x["path"]: x["sha256"] for x in before["artifacts"]}
    b = {x.path: x.sha256 for x in m.artifacts}
    return problems + [f"{p}: differs from its parent's ({parent}) but the revision does not list it as changed"
                       for p in sorted(a.keys() | b.keys()) if a.get(p) != b.get(p) and p not in rev.changed]
