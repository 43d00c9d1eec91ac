"""`dflash-trt build`: from a (target, drafter) pair to one deployable, self-describing bundle.

Resolve the options (bundle/options.py, resolve_settings here), then the manifest's first part, the plan
and the draft schedule, run PIPELINE (bundle/stages.py), hash every file and write the manifest
(bundle/package.py). A re-run reuses (io/clone.carry_tree) the previous bundle's outputs of every stage
whose inputs hash is unchanged (`--force` redoes all). The bundle is assembled beside the destination and
renamed into place only when complete.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from dflash_trt import __version__, engines, stacks
from dflash_trt.bundle.options import (
    BACKENDS,
    BuildOptions,
    DRAFTER_QUANTS,
    KV_CACHES,
    QUANTS,
    WEIGHT_STAGES,
    configs_only_pair,
    default_out,
    dir_bytes,
    drafter_exclusions,
    reference_layout,
    refuse_other_hardware,
    resolve_gpu,
    resolve_pair,
    resolve_stacks,
)
from dflash_trt.bundle.package import configs_index, write_manifest
from dflash_trt.bundle.stages import PIPELINE, Stage, code_hash, not_needed, without_weights
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_has_fp4
from dflash_trt.io.atomic import atomic_output_dir, refuse_inside
from dflash_trt.io.checkpoint import load_config
from dflash_trt.io.clone import carry_tree
from dflash_trt.io.draft_schedule import DraftSchedule
from dflash_trt.io.manifest import (
    SCHEMA_VERSION,
    DrafterRecord,
    HashCache,
    Manifest,
    ParallelRecord,
    QuantRecord,
    ReferenceRuntimeRecord,
    ServingProfileRecord,
    ServingStacksRecord,
    StageRecord,
    TargetRecord,
    WeightsRecord,
    is_bundle,
    list_artifacts,
    sha256_file,
    sha256_json,
)
from dflash_trt.models.config import load_drafter_config, require_target_config
from dflash_trt.models.families import ships_mxfp4
from dflash_trt.plan import planner
from dflash_trt.plan.record import plan_bundle, schedule_basis, write_plan
from dflash_trt.plan.schedule_cost import build_schedule
from dflash_trt.presets.hub import snapshot_revision
from dflash_trt.stacks.base import draft_schedule_record
from dflash_trt.stacks.layer_ids import layer_ids_by_stack
from dflash_trt.stacks.trtllm.engine import detect_toolchain, toolchain_fingerprint
from dflash_trt.stacks.trtllm.profiles import DRAFTER_ATTENTION_BACKEND, drafter_attention_backend, profile_settings


def resolve_settings(o: BuildOptions, cfg: dict, name: str, tc: dict) -> dict:
    """Arch, GPU, quantization, KV cache and parallelism, checked against the target's config (`tc`: the
    toolchain detect_toolchain found, for --arch auto)."""
    for flag, value, allowed in (("--backend", o.backend, BACKENDS), ("--quant", o.quant, QUANTS),
                                 ("--kv-cache", o.kv_cache, KV_CACHES),
                                 ("--drafter-quant", o.drafter_quant, DRAFTER_QUANTS)):
        if value not in allowed:
            raise DFlashError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
    hw = resolve_gpu(o, tc)
    arch = hw["arch"]
    if ships_mxfp4(cfg):
        if o.quant in ("fp8", "nvfp4"):
            raise DFlashError(f"--quant {o.quant}: {name} ships MXFP4 experts and TensorRT-LLM serves gpt-oss only as "
                              "MXFP4 weights (with an FP8 KV cache); its experts are kept as they are: use --quant auto")
        if o.backend == "engine":
            raise DFlashError(f"--backend engine: TensorRT-LLM has no engine (TensorRT checkpoint) layout for {name} "
                              "(gpt-oss); use --backend pytorch, which serves its MXFP4 checkpoint directly")
        quant = "mxfp4"
    elif o.quant == "auto":
        quant = "nvfp4" if arch_has_fp4(arch) else "fp8"
    else:
        quant = o.quant
    if quant == "nvfp4" and not arch_has_fp4(arch):
        raise DFlashError(f"--quant nvfp4 with --arch {arch}: NVFP4 needs Blackwell FP4 tensor cores (sm_100 / sm_103); "
                          "Hopper (sm_90) runs FP8: use --quant fp8 or --quant auto")
    kv = o.kv_cache if o.kv_cache != "auto" else ("bf16" if quant == "none" else "fp8")
    # auto = none: bf16 is what every stack's DFlash loader takes; a quantized drafter only where the
    # stacks' loaders take it (drafter_exclusions)
    dq = "none" if o.drafter_quant == "auto" else o.drafter_quant
    if dq == "nvfp4" and not arch_has_fp4(arch):
        raise DFlashError(f"--drafter-quant nvfp4 with --arch {arch}: NVFP4 needs Blackwell FP4 tensor cores "
                          "(sm_100 / sm_103); use --drafter-quant fp8")
    check_parallel(o, cfg, name)
    return {**hw, "quant": quant, "kv_cache": kv, "drafter_quant": dq}


def check_parallel(o: BuildOptions, cfg: dict, name: str) -> None:
    """--tp / --ep / --pp against the target's heads, experts and layers."""
    for flag, v in (("--tp", o.tp), ("--ep", o.ep), ("--pp", o.pp)):
        if v < 1:
            raise DFlashError(f"{flag} {v}: must be at least 1")
    heads = int(cfg.get("num_attention_heads", 0))
    kvh = int(cfg.get("num_key_value_heads") or heads)
    if heads % o.tp:
        raise DFlashError(f"--tp {o.tp} does not divide the target's num_attention_heads = {heads}")
    if kvh % o.tp and o.tp % kvh:
        raise DFlashError(f"--tp {o.tp}: the target's num_key_value_heads = {kvh} can be neither split nor "
                          "duplicated evenly across ranks")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if o.ep > 1:
        if not experts:
            raise DFlashError(f"--ep {o.ep}: {name} is not a mixture-of-experts model (no num_local_experts)")
        if experts % o.ep:
            raise DFlashError(f"--ep {o.ep} does not divide the target's number of experts = {experts}")
        if o.tp % o.ep:
            raise DFlashError(f"--ep {o.ep} must divide --tp {o.tp} (TensorRT-LLM splits the tp ranks into "
                              "expert-parallel x expert-tensor-parallel groups)")
    layers = int(cfg.get("num_hidden_layers", 0))
    if o.pp > 1 and layers % o.pp:
        raise DFlashError(f"--pp {o.pp} does not divide the target's num_hidden_layers = {layers}")


# --------------------------------------------------------------------------------- the build
class Builder:
    """One build: runs PIPELINE into `self.work`, reusing the previous bundle's outputs where allowed."""

    def __init__(self, o: BuildOptions, progress: bool = True):
        self.o = o
        self.progress = progress
        self.reports: list[dict] = []   # each stage's outcome in this run, for the summary

    def log(self, msg: str) -> None:
        if self.progress:
            print(f"dflash-trt build: {msg}", file=sys.stderr, flush=True)

    # one stage: hash inputs, reuse or run, record
    def stage(self, name: str, inputs: dict, fn, outputs: list[str]) -> dict:
        digest = sha256_json(inputs)
        t0 = time.perf_counter()
        prev = (self.prev.stages or {}).get(name) if self.prev else None
        if prev and prev.inputs_sha256 == digest and prev.status not in ("failed", "skipped") \
                and self._outputs_intact(name, prev.outputs):
            for p in prev.outputs:
                carry_tree(self.dest / p, self.work / p)
            # `status` stays the stage's outcome (done / deferred / not-needed: what deploy reads);
            # `skipped` says that this run reused it
            entry = asdict(prev) | {"skipped": True}
            self.reused |= set(prev.outputs)
            self.log(f"{name}: skipped (inputs unchanged since the last build)")
        else:
            self.log(f"{name}: running")
            entry = {"status": "done", "inputs_sha256": digest, "outputs": outputs}
            entry.update(fn() or {})
            entry["skipped"] = False
        entry["inputs_sha256"] = digest
        secs = time.perf_counter() - t0
        entry["seconds"] = round(secs, 2)
        size = sum(dir_bytes(self.work / p) for p in entry["outputs"] if (self.work / p).exists())
        self.stages[name] = entry
        status = "skipped" if entry["skipped"] else entry["status"]
        self.reports.append({"name": name, "status": status, "seconds": round(secs, 2), "outputs": entry["outputs"],
                             "bytes": size, "note": entry.get("reason") or ""})
        return entry

    def _outputs_intact(self, name: str, outputs: list[str]) -> bool:
        """Are a stage's outputs in the previous bundle exactly what its manifest recorded?
        (A file edited since is re-made, not carried into the new bundle.)"""
        arts = {a.path: a for a in self.prev.artifacts}
        stats = self.prev.artifact_stats or {}
        for out in outputs:
            root = self.dest / out
            if not root.exists():
                return False
            files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
            for f in files:
                rel = f.relative_to(self.dest).as_posix()
                a, st = arts.get(rel), f.stat()
                if a is None or a.bytes != st.st_size or \
                        stats.get(rel) != [st.st_size, st.st_mtime_ns] and sha256_file(f) != a.sha256:
                    self.log(f"{name}: {rel} changed since the last build; re-running the stage")
                    return False
        return True

    def run(self) -> dict:
        self._resolve()
        self._read_previous()
        refuse_other_hardware(self.prev, self.settings, self.dest)
        self._hash_inputs()
        self._start_manifest()
        with atomic_output_dir(self.dest) as work:
            self.work = work
            for st in PIPELINE:
                self._run_stage(st)
            write_plan(work, self.manifest, self.plan)   # hashed with the rest: what deploy and plan --bundle read
            self.manifest = write_manifest(work, self._finish_manifest(), list_artifacts(work, self._known_sha256))
            deploy_plan = self.o.deployable(work) if self.o.deployable is not None else None
        return {"bundle": str(self.dest), "manifest": self.manifest, "stages": self.reports,
                "deploy_plan": deploy_plan}

    def _resolve(self) -> None:
        """The pair, its configs, the settings, the block size and the bundle folder."""
        o = self.o
        if o.configs_only:
            self.tdir, self.ddir, self.name, self.hf_id, self.downloads = configs_only_pair(o)
        else:
            (self.tdir, self.ddir, self.name, self.hf_id), self.downloads = resolve_pair(o), []
        self.tcfg = require_target_config(load_config(self.tdir), str(self.tdir / "config.json"))
        self.toolchain = detect_toolchain()   # once: the GPU --arch auto finds and the stages' inputs hash
        self.settings = resolve_settings(o, self.tcfg, self.name, self.toolchain)
        self.dcfg = load_drafter_config(self.ddir)
        self.block_size = B = o.block_size or self.dcfg.block_size
        if not 2 <= B <= self.dcfg.block_size:
            raise DFlashError(f"--block-size {B}: must be between 2 and the drafter's trained block size "
                              f"{self.dcfg.block_size}")
        self.stacks, self.skipped_stacks = resolve_stacks(o, self.settings, B, self.dcfg)
        self.drafter_exclude = drafter_exclusions(self.stacks, self.settings["drafter_quant"], o.calib is not None)
        self.profile = profile_settings(o.profile, self.tcfg, B, o.max_batch_size)
        for st in stacks.served(self.stacks):   # what each stack would refuse at start (TensorRT-LLM's budget)
            st.check_build(target_config=self.tcfg, drafter_config=self.dcfg.raw, target_dir=self.tdir,
                           gpu=self.settings["gpu"], quant=self.settings["quant"], tp=o.tp, profile_name=o.profile,
                           profile=self.profile)
        self.dest = dest = Path(o.out) if o.out else default_out(self.name, self.settings, o)
        if dest.exists() and not dest.is_dir():
            raise DFlashError(f"--out {dest}: exists and is not a folder")
        refuse_inside(dest, "--out", ("--target", self.tdir), ("--drafter", self.ddir), ("--calib", o.calib))
        if dest.exists() and any(dest.iterdir()) and not is_bundle(dest) and not o.force:
            raise DFlashError(f"--out {dest}: folder exists, is not empty and is not a dflash-trt bundle "
                              "(no manifest.json); choose another --out or pass --force to replace it")

    def _draft_schedule(self, m: Manifest) -> tuple[DraftSchedule | None, str]:
        """(the draft schedule, its source or why there is none), priced on the bundle's one-node plan as
        plan.json records it (`self.plan`: no layout search of its own), or the planner's refusal of it."""
        o, s, case = self.o, self.settings, next(iter(self.plan.cases), None)
        return build_schedule(
            o.draft_schedule, target_name=self.name, target_config=self.tcfg, drafter_config=self.dcfg.raw,
            gpu=s["gpu"], quant=s["quant"], kv_cache=s["kv_cache"], drafter_quant=s["drafter_quant"], tp=o.tp,
            ep=o.ep, block_size=self.block_size, max_batch_size=int(self.profile["max_batch_size"]),
            max_seq_len=m.max_seq_len, attention_dp=bool(self.profile.get("enable_attention_dp", False)),
            plan=case and (case.refused or planner.Plan.from_dict(case.plan)))

    def _read_previous(self) -> None:
        """The bundle already at the destination, whose unchanged stages are reused (`self.prev`)."""
        self.prev = None
        if is_bundle(self.dest) and not self.o.force:
            try:
                self.prev = Manifest.read(self.dest)
            except DFlashError as e:
                self.log(f"previous bundle unreadable, rebuilding every stage ({e})")

    def _hash_inputs(self) -> None:
        """`self.facts`: every value a stage's inputs hash may name (Stage.inputs)."""
        o, s = self.o, self.settings
        self.cache = HashCache(self.prev and self.prev.input_files)
        self.stages, self.reused = {}, set()
        t_hash = self.cache.tree(self.tdir)
        d_hash = self.cache.tree(self.ddir)
        if o.calib is not None and not Path(o.calib).is_file():
            raise DFlashError(f"--calib {o.calib}: no such file")
        self.facts = {
            "tool_version": __version__, "target": t_hash, "drafter": d_hash,
            "calib": self.cache.sha256(Path(o.calib)) if o.calib else None,
            "arch": s["arch"], "gpu": s["gpu"], "quant": s["quant"], "kv_cache": s["kv_cache"],
            "drafter_quant": s["drafter_quant"], "drafter_exclude": self.drafter_exclude, "backend": o.backend,
            "tp": o.tp, "ep": o.ep, "pp": o.pp, "block_size": self.block_size,
            "toolchain": toolchain_fingerprint(self.toolchain), "trt_drafter": o.trt_drafter,
            "allow_nonfinite": o.allow_nonfinite}

    def _start_manifest(self) -> None:
        """The manifest's first part, which compile and package read (and package hashes), the bundle's plan
        (plan.json, `self.plan`: planned once, from it and what its stacks will write) and the draft schedule
        priced on that plan's one-node case, before anything is written."""
        o, s, tcfg, dcfg = self.o, self.settings, self.tcfg, self.dcfg
        ids = layer_ids_by_stack(dcfg.target_layer_ids, int(tcfg["num_hidden_layers"]))
        served = stacks.served(self.stacks)
        self.manifest = m = Manifest(
            schema_version=SCHEMA_VERSION, tool_version=__version__,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            target=TargetRecord(name=self.name, hf_id=self.hf_id, path=str(self.tdir), bundle_path="target",
                                revision=snapshot_revision(self.tdir), sha256=self.facts["target"], config=tcfg),
            drafter=DrafterRecord(path=str(self.ddir), bundle_path="drafter", sha256=self.facts["drafter"],
                                  revision=snapshot_revision(self.ddir), block_size=self.block_size,
                                  trained_block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                                  target_layer_ids=ids, config=dcfg.raw),
            arch=s["arch"], gpu=s["gpu"], node=s["node"], gpu_source=s["gpu_source"], sm=s["sm"],
            quant=QuantRecord(target=s["quant"], drafter=s["drafter_quant"], kv_cache=s["kv_cache"]),
            parallel=ParallelRecord(tp=o.tp, ep=o.ep, pp=o.pp), backend=o.backend,
            max_seq_len=min(int(tcfg.get("max_position_embeddings", 8192)), 32768),
            triton_model_repository=stacks.TRITON.repository, triton_models=stacks.TRITON.model_list(served),
            # which stacks got a config, and why the others did not (their own DFlash rules)
            serving_stacks=ServingStacksRecord(served=list(self.stacks), skipped=dict(self.skipped_stacks)),
            trt_drafter_engine=o.trt_drafter,
            # each served stack's engine: first version with DFlash, the contract's, the images (engines.json)
            engines=engines.manifest_record(list(self.stacks)),
            serving_profile=ServingProfileRecord(
                profile=o.profile, source=self.profile.get("source"),
                enable_attention_dp=self.profile.get("enable_attention_dp"),
                max_batch_size=self.profile.get("max_batch_size"), max_num_tokens=self.profile.get("max_num_tokens"),
                drafter_attention_backend=drafter_attention_backend(s["arch"]),
                drafter_attention_backend_source=DRAFTER_ATTENTION_BACKEND.get(
                    s["arch"], ("", "DFlashDecodingConfig default"))[1]),
            reference_runtime=ReferenceRuntimeRecord(layout=reference_layout(s, self.tdir, self.ddir, o.configs_only)))
        if o.configs_only:
            revision = {role: getattr(m, role).revision or next(
                (d["revision"] for d in self.downloads if d["role"] == role), None) for role in ("target", "drafter")}
            self.manifest = m = replace(m, weights=WeightsRecord(present=False, downloads=self.downloads),
                                        target=replace(m.target, revision=revision["target"]),
                                        drafter=replace(m.drafter, revision=revision["drafter"]))
        self.plan = plan_bundle(None, m)
        schedule, source = self._draft_schedule(m)
        self.manifest = m = replace(m, draft_schedule=draft_schedule_record(schedule, source, served))
        self.plan = replace(self.plan, schedule=schedule_basis(m))
        self.facts["manifest"] = {k: v for k, v in m.to_dict().items() if k != "created"}

    def _run_stage(self, st: Stage) -> None:
        engine, trt = self.o.backend == "engine", self.o.trt_drafter
        needed = {"": True, "engine": engine, "trt_drafter": trt, "compile": engine or trt}[st.needs]
        inputs = {k: self.facts[k] for k in st.inputs}
        inputs |= {key: self.stages[name]["inputs_sha256"] for key, name in st.after}
        if st.code:
            inputs["code"] = code_hash(*st.code) if needed else None  # code counts only where it runs
        run = partial(st.run, self) if needed else partial(not_needed, st)
        if needed and self.o.configs_only and st.name in WEIGHT_STAGES:
            run = partial(without_weights, self, st)
        self.stage(st.name, inputs, run, list(st.outputs) if needed else [])

    def _finish_manifest(self) -> Manifest:
        m = self.manifest
        configs = m.serving_configs
        if configs is None:  # package was reused
            configs = self.stages["package"].get("serving_configs") or configs_index(m)
        self.stages["package"]["serving_configs"] = configs
        return replace(m, serving_configs=configs,
                       stages={st.name: StageRecord(**self.stages[st.name]) for st in PIPELINE},
                       input_files=self.cache.entries,
                       serve=serve_commands(m))

    def copied(self, src: Path, dst: Path) -> None:
        """A source file copied into the bundle has the sha256 hashed from the source (not re-read)."""
        digest = self.cache.linked(src)
        if digest is not None:
            self.cache.remember(dst, digest)

    def _known_sha256(self, rel: str, st) -> str | None:
        """A file's sha256 known without reading it: one reused unchanged from the previous bundle keeps its
        recorded sha256 when its size and mtime are those recorded (a hard link or copy keeps both), so a
        re-run does not re-read multi-GB checkpoints (`verify` always re-hashes everything); an input's copy
        (clone_tree, copied), or what export-onnx hashed as it wrote, is known already."""
        prev = {a.path: a for a in self.prev.artifacts}.get(rel) if self.prev else None
        stats = (self.prev and self.prev.artifact_stats) or {}
        reused = any(rel == r or rel.startswith(r + "/") for r in self.reused)
        if reused and prev and prev.bytes == st.st_size and stats.get(rel) == [st.st_size, st.st_mtime_ns]:
            return prev.sha256
        return self.cache.linked(self.work / rel)


def serve_commands(m: Manifest) -> dict:
    """How to serve the bundle, from its root: every stack's commands (Triton's CPU model first)."""
    served = m.served_stacks
    out: dict = {}
    for st in [stacks.TRITON, *stacks.served(served)]:
        out |= st.serve_commands(served)
    return out


def build(o: BuildOptions, progress: bool = True) -> dict:
    return Builder(o, progress).run()


