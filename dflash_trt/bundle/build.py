"""`dflash-trt build`: from a (target, drafter) pair to one deployable, self-describing bundle.

    check -> quantize -> convert (engine backend) -> plugin -> export-onnx -> compile -> package

Each stage is a function from its inputs to output folder(s) inside the bundle plus a manifest
entry holding the sha256 of its inputs (content hashes of the checkpoints, the options that
matter, the code that produces it). A re-run reuses (io/clone.carry_tree) the previous bundle's outputs
of every stage whose inputs hash is unchanged and reports it `skipped`; `--force` redoes all.

The bundle is assembled in a temporary folder beside the destination and renamed into place
only when complete, so an interrupted or failed build leaves the previous bundle as it was.

Stages call the other tools' library functions (quantize_checkpoint, convert_checkpoint,
build_plugin, export_onnx) and record the equivalent `dflash-trt` command line in the manifest,
so that a stage can be re-run by hand.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from dflash_trt import __version__, engines, stacks
from dflash_trt.bundle.onnx_export import export_onnx
from dflash_trt.bundle.package import (
    SERVING_FILES,
    artifacts,
    configs_index,
    link_tree,
    reference_pair,
    serving_files,
    write_manifest,
)
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_default_node, arch_has_fp4, arch_sms, gpus, hardware_for_gpu, sm_number
from dflash_trt.io.atomic import atomic_output_dir, refuse_inside
from dflash_trt.io.checkpoint import load_config
from dflash_trt.io.clone import carry_tree, clone_file
from dflash_trt.io.draft_schedule import DraftSchedule, SchedulePlanner, ScheduleRequest, no_schedule
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
    sha256_file,
    sha256_json,
)
from dflash_trt.models.check import NONFINITE_NOTE, check_pair
from dflash_trt.models.config import load_drafter_config, require_target_config
from dflash_trt.models.families import family
from dflash_trt.paths import package_path
from dflash_trt.presets.catalog import PRESETS, missing_pair, resolve_config_pair, resolve_drafter, resolve_target
from dflash_trt.presets.hub import HubMissing, snapshot_revision
from dflash_trt.quant.calibrate import load_calib_samples
from dflash_trt.quant.int8_drafter import write_int8_drafter
from dflash_trt.quant.quantize import quantize_checkpoint
from dflash_trt.runtime.drafter_calibration import drafter_input_amax
from dflash_trt.stacks.base import draft_schedule_record
from dflash_trt.stacks.layer_ids import layer_ids_by_stack
from dflash_trt.stacks.trtllm.convert import convert_checkpoint
from dflash_trt.stacks.trtllm.engine import detect_toolchain, run_compile, toolchain_fingerprint
from dflash_trt.stacks.trtllm.plugin import build_plugin
from dflash_trt.stacks.trtllm.profiles import DRAFTER_ATTENTION_BACKEND, drafter_attention_backend, profile_settings

QUANTS = ("auto", "none", "fp8", "nvfp4")
KV_CACHES = ("auto", "fp8", "bf16")
DRAFTER_QUANTS = ("auto", "none", "fp8", "nvfp4", "int8")
DRAFTER_CALIB_SAMPLES = 16   # calibration prompts decoded with the pair for a quantized drafter's input scales
BACKENDS = ("pytorch", "engine")
# the reference model gets its own copy of the unquantized pair up to this size (CPU smoke tests)
REFERENCE_COPY_MAX_BYTES = 4 << 30


@dataclass
class BuildOptions:
    target: str | None = None          # preset name or folder; None = the embedded pair
    drafter: str | None = None         # folder; None = the preset's drafter
    arch: str = "auto"
    gpu: str | None = None             # b300, h200, ...; None = the arch's default node; "none" = CPU-only
    quant: str = "auto"
    kv_cache: str = "auto"
    tp: int = 1
    ep: int = 1
    pp: int = 1
    block_size: int | None = None
    backend: str = "pytorch"
    out: str | None = None
    force: bool = False
    drafter_quant: str = "auto"        # auto = none: the drafter stays bf16, the precision every stack loads
    calib: str | None = None           # calibration prompts (.jsonl) for activation / KV scales
    stacks: tuple[str, ...] | None = None  # serving stacks to write configs for; None = every stack that fits
    trt_drafter: bool = False          # opt-in: plugins/, onnx/ and the drafter.plan compile job
    allow_nonfinite: bool = False      # build from weights holding NaN / Inf (check refuses them otherwise)
    profile: str = "latency"           # TensorRT-LLM settings from NVIDIA's curated configs (serving_profiles.py)
    max_batch_size: int | None = None  # default: the profile's
    # the draft length per concurrency each stack's control gets, planned for the resolved build; the command
    # line passes the planner's (build --draft-schedule); the default plans none
    draft_schedule: SchedulePlanner = no_schedule
    # refuses (DFlashError) a finished bundle folder, before it is published, that `deploy` would refuse, and
    # returns deploy's plan of it (the command line passes deploy's own check: the planner's layout rules and
    # the chart's; build's result carries it as deploy_plan); None: no check
    deployable: Callable[[Path], object] | None = None
    # every config, the Triton repository, the manifest and the plan, without the weights (configs_only_*)
    configs_only: bool = False


@dataclass
class StageReport:
    name: str
    status: str
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    bytes: int = 0
    note: str = ""


# ----------------------------------------------------------------------------- small helpers
def _dir_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def code_hash(*relpaths: str) -> str:
    """sha256 of the package's source files that shape a stage's output (paths relative to the
    package root; a folder counts with every file in it). A path that does not exist is an error:
    a moved file silently left out of the hash would let a stale stage be reused."""
    root = package_path()
    parts = []
    for rel in relpaths:
        p = root / rel
        if p.is_file():
            parts.append([rel, sha256_file(p)])
        elif p.is_dir():
            parts += [[f.relative_to(root).as_posix(), sha256_file(f)] for f in sorted(p.rglob("*"))
                      if f.is_file() and "__pycache__" not in f.parts]
        else:
            raise FileNotFoundError(f"code_hash: {p} does not exist (a stage names a source file that moved)")
    return sha256_json(parts)


def _cmd(*args) -> str:
    """The `dflash-trt` command line equivalent to a stage step (recorded in the manifest;
    output paths relative to the bundle root)."""
    return "dflash-trt " + shlex.join(str(a) for a in args)


# ------------------------------------------------------------------------- inputs and options
def detect_arch() -> tuple[str, str | None]:
    """This machine's first GPU: its architecture, from the compute capability, and its bundle
    GPU id when the name shows one."""
    tc = detect_toolchain()
    sms_of = arch_sms()
    if not tc["gpus"]:
        raise DFlashError("--arch auto: no NVIDIA GPU found on this machine (nvidia-smi); "
                          f"pass {' or '.join(f'--arch {a}' for a in sms_of)} (and --gpu for the exact product)")
    name, cap = tc["gpus"][0]["name"].lower(), tc["gpus"][0]["compute_cap"]
    major = int(cap.split(".")[0]) if cap.split(".")[0].isdigit() else 0
    # the newest architecture the compute capability reaches: 9.x is Hopper, 10.x and above Blackwell
    reached = [(min(sms), arch) for arch, sms in sms_of.items() if major >= min(sms) // 10]
    if not reached:
        all_sms = sorted({sm for sms in sms_of.values() for sm in sms})
        raise DFlashError(f"--arch auto: GPU {tc['gpus'][0]['name']} (compute capability {cap}) is neither Hopper nor "
                          f"Blackwell; DFlash bundles target {' / '.join(f'sm_{sm}' for sm in all_sms)}")
    arch = max(reached)[1]
    # longest id first: "gb200" contains "b200"
    ids = sorted((g for g, hw in gpus().items() if hw.arch == arch), key=len, reverse=True)
    return arch, next((g for g in ids if g in name), None)


def is_mxfp4(cfg: dict) -> bool:
    return (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4" or \
        family(cfg.get("model_type")).mxfp4_experts


def num_experts(cfg: dict) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)


NO_GPU = "none"   # --gpu none: a CPU-only bundle (manifest gpu_source "none")


def resolve_gpu(o: BuildOptions) -> dict:
    """{arch, gpu, node, gpu_source, sm} from --arch / --gpu or this machine. Without --gpu the bundle
    is for the architecture's default node (its GPU recorded for deploy, its memory for the build's
    checks); only --gpu none gives a CPU-only bundle (gpu and node null). The kernels cover one SM
    when a GPU was named or detected, every SM of the architecture otherwise."""
    by_id, sms_of = gpus(), arch_sms()
    gpu = o.gpu.lower() if o.gpu else None
    if gpu is not None and gpu != NO_GPU and gpu not in by_id:
        raise DFlashError(f"--gpu {o.gpu!r}: expected one of {', '.join([*by_id, NO_GPU])}")
    arch, source = o.arch, "option" if gpu else None
    if arch == "auto":
        if gpu and gpu != NO_GPU:
            arch = by_id[gpu].arch
        else:
            arch, detected = detect_arch()
            if gpu is None and detected:
                gpu, source = detected, "detected"
    if arch not in sms_of:
        raise DFlashError(f"--arch {o.arch!r}: expected {', '.join(sms_of)} or auto")
    if gpu == NO_GPU:
        return {"arch": arch, "gpu": None, "node": None, "gpu_source": "none", "sm": sms_of[arch]}
    if gpu is None:
        hw = arch_default_node(arch)
        return {"arch": arch, "gpu": hw.gpu, "node": hw.name, "gpu_source": "arch_default", "sm": sms_of[arch]}
    if by_id[gpu].arch != arch:
        raise DFlashError(f"--gpu {gpu} is a {by_id[gpu].arch} GPU but --arch is {arch}")
    return {"arch": arch, "gpu": gpu, "node": hardware_for_gpu(gpu).name, "gpu_source": source,
            "sm": [sm_number(by_id[gpu])]}


def resolve_settings(o: BuildOptions, cfg: dict, name: str) -> dict:
    """Arch, GPU, quantization, KV cache and parallelism, checked against the target's config."""
    if o.backend not in BACKENDS:
        raise DFlashError(f"--backend {o.backend!r}: expected one of {', '.join(BACKENDS)}")
    hw = resolve_gpu(o)
    arch = hw["arch"]
    if o.quant not in QUANTS:
        raise DFlashError(f"--quant {o.quant!r}: expected one of {', '.join(QUANTS)}")
    if is_mxfp4(cfg):
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
    if o.kv_cache not in KV_CACHES:
        raise DFlashError(f"--kv-cache {o.kv_cache!r}: expected one of {', '.join(KV_CACHES)}")
    kv = o.kv_cache if o.kv_cache != "auto" else ("bf16" if quant == "none" else "fp8")
    if o.drafter_quant not in DRAFTER_QUANTS:
        raise DFlashError(f"--drafter-quant {o.drafter_quant!r}: expected one of {', '.join(DRAFTER_QUANTS)}")
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
    experts = num_experts(cfg)
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


def resolve_stacks(o: BuildOptions, s: dict, block_size: int, dcfg=None) -> tuple[list[str], dict[str, str]]:
    """(stacks that get a config, {stack: why not} for the others), by each stack's own DFlash
    rules (dflash_trt/stacks). A stack named in --stacks that cannot serve the layout, or a
    drafter format a stack's loader cannot load, is an error before anything is written."""
    explicit = o.stacks is not None
    wanted = list(o.stacks) if explicit else list(stacks.CONFIG_STACKS)
    unknown = [x for x in wanted if x not in stacks.CONFIG_STACKS]
    if unknown or not wanted:
        raise DFlashError(f"--stacks {','.join(wanted)}: expected a comma list of {', '.join(stacks.CONFIG_STACKS)}")
    served, skipped = [], {}
    for st in stacks.served(wanted):
        refused = st.drafter_quant_problem(s["drafter_quant"])
        if refused:
            loaders = [x.name for x in stacks.served(list(stacks.CONFIG_STACKS))
                       if not x.drafter_quant_problem(s["drafter_quant"])]
            raise DFlashError(f"--drafter-quant {s['drafter_quant']}: {st.title} cannot load an "
                              f"{s['drafter_quant'].upper()} drafter: {refused}; use --drafter-quant none"
                              + (f", or --stacks {','.join(loaders)}" if loaders else ""))
        problems = st.layout_problems(tp=o.tp, pp=o.pp, block_size=block_size)
        problems += st.drafter_problems(dcfg) if dcfg is not None else []
        if problems and explicit:
            raise DFlashError(f"--stacks {st.name}: {st.title} cannot serve this layout: {'; '.join(problems)}")
        if problems:
            skipped[st.name] = "; ".join(problems)
        else:
            served.append(st.name)
    if not served:
        raise DFlashError("no serving stack can serve this layout: "
                          + "; ".join(f"{stacks.get(k).title}: {v}" for k, v in skipped.items()))
    return served, skipped


def drafter_exclusions(served: list[str], drafter_quant: str, calibrated: bool) -> list[str]:
    """The drafter modules a quantized drafter keeps unquantized (globs over its checkpoint names): every
    served stack's DFlash loader's needs together (engines.json stacks.<name>.drafter_quant). Refused in
    one line: a set one of the loaders cannot take (SGLang cannot leave a decoder-layer module
    unquantized), and, for a loader whose quantized Linears read a static input_scale, no --calib."""
    if drafter_quant == "none":
        return []
    sts = stacks.served(served)
    keep = sorted({g for st in sts for g in st.drafter_unquantized()})
    for st in sts:
        extra = [g for g in keep if g not in st.drafter_unquantized()]
        if extra and not st.drafter_layer_exclusions():
            need = next(x for x in sts if extra[0] in x.drafter_unquantized())
            raise DFlashError(f"--drafter-quant {drafter_quant} with --stacks {','.join(served)}: {need.title} needs "
                              f"{', '.join(extra)} unquantized, but {st.title} "
                              f"{engines.pinned_version(st.name)} quantizes every decoder Linear of a DFlash drafter "
                              f"(no layer exclusion reaches it); build one bundle per stack (--stacks)")
        if st.drafter_activation_scales(drafter_quant) == "static" and not calibrated:
            raise DFlashError(f"--drafter-quant {drafter_quant} for {st.title}: its quantized Linears read a static "
                              "input_scale, measured by running the pair; pass --calib FILE.jsonl (the drafter is "
                              "calibrated by DFlash decoding of those prompts with its target)")
    return keep


def resolve_pair(o: BuildOptions) -> tuple[Path, Path, str, str | None]:
    """(target dir, drafter dir, target name, hub id). Presets and hub ids: presets/hub.py."""
    spec = o.target
    try:
        tdir = Path(resolve_target(spec)).resolve()
    except HubMissing as e:   # name the drafter's download too, in the same line
        raise missing_pair(spec, o.drafter, e) from None
    ddir = Path(resolve_drafter(o.drafter, spec)).resolve()
    hub = spec is not None and not Path(spec).exists() and spec not in PRESETS  # an org/name hub id
    name = spec if spec in PRESETS or hub else ("smollm2-135m" if spec is None else tdir.name)
    hf_id = PRESETS[name].hf_id if name in PRESETS else (spec if hub else None)
    for folder, what in ((tdir, "target"), (ddir, "drafter")):
        if not (folder / "config.json").is_file():
            raise DFlashError(f"{folder}: the {what} folder has no config.json")
        if not any(folder.glob("*.safetensors")):
            raise DFlashError(f"{folder}: the {what} folder has no *.safetensors weights")
    return tdir, ddir, name, hf_id


def refuse_other_hardware(prev: dict | None, s: dict, dest: Path) -> None:
    """A rebuild into an --out holding a bundle for another architecture or GPU would silently turn,
    say, a Blackwell NVFP4 bundle into a Hopper FP8 one: refused unless --force (which reads no
    previous bundle: prev None)."""
    if not prev:
        return
    def where(arch, gpu, quant):
        return f"{arch} ({gpu or 'CPU-only'}, {quant})"
    was = where(prev.get("arch"), prev.get("gpu"), (prev.get("quant") or {}).get("target"))
    now = where(s["arch"], s["gpu"], s["quant"])
    if (prev.get("arch"), prev.get("gpu")) != (s["arch"], s["gpu"]):
        raise DFlashError(f"--out {dest}: holds a bundle for {was}, this build is for {now}; pass --force to "
                          "replace it, or choose another --out")


# ------------------------------------------------------------------ configs-only (build --configs-only)
WEIGHT_STAGES = ("check", "quantize")      # what needs the weights; every other stage reads configs only
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def configs_only_pair(o: BuildOptions) -> tuple[Path, Path, str, str | None, list[dict]]:
    """resolve_pair for --configs-only: folders holding the two config.json files (presets/catalog.py
    resolve_config_pair), and the downloads the weights still need."""
    if o.backend == "engine" or o.trt_drafter or o.drafter_quant not in ("auto", "none") or o.calib:
        raise DFlashError("--configs-only writes what needs no weights: drop --backend engine, --trt-drafter-engine, "
                          "--drafter-quant and --calib (they read the weights)")
    tdir, ddir, downloads = resolve_config_pair(o.target, o.drafter)
    spec = o.target
    hub = not Path(spec).exists() and spec not in PRESETS
    name = spec if spec in PRESETS or hub else tdir.name
    hf_id = PRESETS[name].hf_id if name in PRESETS else (spec if hub else None)
    return tdir, ddir, name, hf_id, [d.to_dict() for d in downloads]


def configs_only_record(downloads: list[dict]) -> WeightsRecord:
    """manifest.json `weights` of a configs-only bundle: absent, and how to get them."""
    return WeightsRecord(present=False, downloads=downloads)


def configs_only_fill_command(o: BuildOptions, dest: Path) -> str:
    """The build that fills a configs-only bundle in, once the weights are downloaded."""
    args = ["build", *(["--target", o.target] if o.target else []), *(["--drafter", o.drafter] if o.drafter else []),
            "--arch", o.arch, *(["--gpu", o.gpu] if o.gpu else []),
            *(["--tp", o.tp] if o.tp != 1 else []), *(["--ep", o.ep] if o.ep != 1 else []),
            *(["--quant", o.quant] if o.quant != "auto" else []), "--out", dest]
    return _cmd(*args)


def default_out(name: str, s: dict, o: BuildOptions) -> Path:
    # the GPU when one was named or detected; the architecture otherwise (its default node, or CPU-only)
    parts = [name.replace("/", "-"), s["gpu"] if s["gpu_source"] in ("option", "detected") else s["arch"], s["quant"]]
    if o.tp > 1 or o.ep > 1:
        parts.append(f"tp{o.tp}" + (f"ep{o.ep}" if o.ep > 1 else ""))
    if o.backend == "engine":
        parts.append("engine")
    return Path("engines") / "-".join(parts)


# --------------------------------------------------------------------------------- the build
@dataclass(frozen=True)
class Stage:
    """One step of the pipeline. Its inputs hash covers `inputs` (keys of Builder.facts), the
    inputs hashes of the stages in `after` (as key -> stage name) and, as "code", the package
    source files in `code`; an unchanged hash reuses the previous bundle's `outputs`."""
    name: str
    method: str                              # the Builder method that runs it: () -> manifest entry fields
    inputs: tuple[str, ...]
    code: tuple[str, ...] = ()               # package-relative paths (code_hash)
    outputs: tuple[str, ...] = ()            # bundle-relative paths it writes
    after: tuple[tuple[str, str], ...] = ()
    # when it runs: "" always; "engine" with --backend engine; "trt_drafter" with --trt-drafter-engine;
    # "compile" with either. Otherwise not-needed: no outputs, code not hashed
    needs: str = ""
    reads_manifest: bool = False             # needs the manifest's first part (Builder._start_manifest)


COMMON = ("tool_version", "target", "drafter")
PIPELINE = (
    Stage("check", "_check", (*COMMON, "allow_nonfinite"), code=("models/check.py", "models/config.py", "models/target.py",
                                                                "models/shapes.py", "models/families",
                                                                "io/checkpoint.py"), outputs=("reports/check.json",)),
    Stage("quantize", "_quantize", (*COMMON, "quant", "kv_cache", "drafter_quant", "drafter_exclude", "calib"),
          code=("quant/quantize.py", "quant/linear.py", "io/formats.py", "kernels/csrc", "kernels/c_loader.py",
                "runtime/drafter_calibration.py",
                "quant/calibrate.py", "io/checkpoint.py", "models/shapes.py", "models/families",
                "quant/int8_drafter.py", "io/compressed_tensors.py"),
          outputs=("target", "drafter")),
    Stage("convert", "_convert", (*COMMON, "backend", "quant", "tp", "pp", "ep", "calib", "kv_cache"),
          code=("stacks/trtllm/convert.py", "quant/linear.py", "io/formats.py", "kernels/csrc", "kernels/c_loader.py",
                "io/checkpoint.py", "quant/calibrate.py", "models/shapes.py"), outputs=("trtllm_ckpt",),
          needs="engine"),
    Stage("plugin", "_plugin", ("tool_version", "arch"),
          code=("kernels/kv_inject_triton.py", "kernels/kv_inject_trt.py", "runtime/kv_inject.py",
                "stacks/trtllm/plugin.py", "hardware.json"), outputs=("plugins",),  # the catalog gives the SMs
          needs="trt_drafter"),
    Stage("export-onnx", "_export_onnx", COMMON,
          code=("bundle/onnx_export.py", "models/drafter.py", "models/layers.py", "models/config.py",
                "runtime/kv_inject.py", "kernels/kv_inject_trt.py"),
          outputs=("onnx",), needs="trt_drafter"),
    Stage("compile", "_compile", (*COMMON, "backend", "arch", "gpu", "quant", "tp", "pp", "block_size", "toolchain",
                                  "trt_drafter"),
          after=(("onnx", "export-onnx"), ("plugin", "plugin"), ("convert", "convert")), reads_manifest=True,
          needs="compile"),
    Stage("package", "_package", (*COMMON, "manifest"),
          code=("stacks", "assets/triton_templates"),
          outputs=SERVING_FILES, reads_manifest=True),
)


class Builder:
    """One build: runs PIPELINE into `self.work`, reusing the previous bundle's outputs where allowed."""

    def __init__(self, o: BuildOptions, progress: bool = True):
        self.o = o
        self.progress = progress
        self.reports: list[StageReport] = []

    def log(self, msg: str) -> None:
        if self.progress:
            print(f"dflash-trt build: {msg}", file=sys.stderr, flush=True)

    # one stage: hash inputs, reuse or run, record
    def stage(self, name: str, inputs: dict, fn, outputs: list[str]) -> dict:
        digest = sha256_json(inputs)
        t0 = time.perf_counter()
        prev = (self.prev_manifest or {}).get("stages", {}).get(name) if not self.o.force else None
        if prev and prev.get("inputs_sha256") == digest and prev["status"] not in ("failed", "skipped") \
                and self._outputs_intact(name, prev["outputs"]):
            for p in prev["outputs"]:
                carry_tree(self.prev_dir / p, self.work / p)
            # `status` stays the stage's outcome (done / deferred / not-needed: what deploy reads);
            # `skipped` says that this run reused it
            entry = dict(prev, skipped=True)
            self.reused |= set(prev["outputs"])
            self.log(f"{name}: skipped (inputs unchanged since the last build)")
        else:
            self.log(f"{name}: running")
            entry = {"status": "done", "inputs_sha256": digest, "outputs": outputs}
            entry.update(fn() or {})
            entry["skipped"] = False
        entry["inputs_sha256"] = digest
        secs = time.perf_counter() - t0
        entry["seconds"] = round(secs, 2)
        size = sum(_dir_bytes(self.work / p) for p in entry["outputs"] if (self.work / p).exists())
        self.stages[name] = entry
        status = "skipped" if entry["skipped"] else entry["status"]
        self.reports.append(StageReport(name, status, round(secs, 2), entry["outputs"], size, entry.get("reason", "")))
        return entry

    def _outputs_intact(self, name: str, outputs: list[str]) -> bool:
        """Are a stage's outputs in the previous bundle exactly what its manifest recorded?
        (A file edited since is re-made, not carried into the new bundle.)"""
        arts = {a["path"]: a for a in self.prev_manifest.get("artifacts", [])}
        stats = self.prev_manifest.get("artifact_stats", {})
        for out in outputs:
            root = self.prev_dir / out
            if not root.exists():
                return False
            files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
            for f in files:
                rel = f.relative_to(self.prev_dir).as_posix()
                a, st = arts.get(rel), f.stat()
                if a is None or a["bytes"] != st.st_size:
                    self.log(f"{name}: {rel} changed since the last build; re-running the stage")
                    return False
                if stats.get(rel) != [st.st_size, st.st_mtime_ns] and sha256_file(f) != a["sha256"]:
                    self.log(f"{name}: {rel} changed since the last build; re-running the stage")
                    return False
        return True

    def run(self) -> dict:
        self._resolve()
        self._read_previous()
        refuse_other_hardware(self.prev_manifest, self.settings, self.dest)
        self._hash_inputs()
        with atomic_output_dir(self.dest) as work:
            self.work = work
            self.manifest = None
            for st in PIPELINE:
                if st.reads_manifest and self.manifest is None:
                    self._start_manifest()
                self._run_stage(st)
            self.manifest = write_manifest(work, self._finish_manifest(),
                                           artifacts(work, self._known_sha256))
            deploy_plan = self.o.deployable(work) if self.o.deployable is not None else None
        return {"bundle": str(self.dest), "manifest": self.manifest, "stages": [asdict(r) for r in self.reports],
                "deploy_plan": deploy_plan}

    def _resolve(self) -> None:
        """The pair, its configs, the settings, the block size and the bundle folder."""
        o = self.o
        if o.configs_only:
            self.tdir, self.ddir, self.name, self.hf_id, self.downloads = configs_only_pair(o)
        else:
            (self.tdir, self.ddir, self.name, self.hf_id), self.downloads = resolve_pair(o), []
        self.tcfg = require_target_config(load_config(self.tdir), str(self.tdir / "config.json"))
        self.settings = resolve_settings(o, self.tcfg, self.name)
        self.dcfg = load_drafter_config(self.ddir)
        self.block_size = B = o.block_size or self.dcfg.block_size
        if not 2 <= B <= self.dcfg.block_size:
            raise DFlashError(f"--block-size {B}: must be between 2 and the drafter's trained block size "
                              f"{self.dcfg.block_size}")
        self.stacks, self.skipped_stacks = resolve_stacks(o, self.settings, B, self.dcfg)
        self.drafter_exclude = drafter_exclusions(self.stacks, self.settings["drafter_quant"], o.calib is not None)
        self.profile = profile_settings(o.profile, self.tcfg, B, o.max_batch_size)
        self.schedule, self.schedule_source = self._draft_schedule()
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

    def _draft_schedule(self) -> tuple[DraftSchedule | None, str]:
        """(the draft schedule, its source or why there is none), before anything is written."""
        o, s = self.o, self.settings
        return o.draft_schedule(ScheduleRequest(
            target_name=self.name, target_config=self.tcfg, drafter_config=self.dcfg.raw, gpu=s["gpu"],
            quant=s["quant"], kv_cache=s["kv_cache"], drafter_quant=s["drafter_quant"], tp=o.tp, ep=o.ep,
            block_size=self.block_size, max_batch_size=int(self.profile["max_batch_size"]),
            max_seq_len=min(int(self.tcfg.get("max_position_embeddings", 8192)), 32768),
            attention_dp=bool(self.profile.get("enable_attention_dp", False))))

    def _read_previous(self) -> None:
        """The bundle already at the destination, whose unchanged stages are reused."""
        self.prev_dir = self.dest
        self.prev_manifest = None
        if is_bundle(self.dest) and not self.o.force:
            try:
                self.prev_manifest = Manifest.read(self.dest).to_dict()
            except DFlashError as e:
                self.log(f"previous bundle unreadable, rebuilding every stage ({e})")

    def _hash_inputs(self) -> None:
        """`self.facts`: every value a stage's inputs hash may name (Stage.inputs)."""
        o, s = self.o, self.settings
        self.cache = HashCache((self.prev_manifest or {}).get("input_files"))
        self.stages, self.reused = {}, set()
        t_hash = self.cache.tree(self.tdir)
        d_hash = self.cache.tree(self.ddir)
        if o.calib is not None and not Path(o.calib).is_file():
            raise DFlashError(f"--calib {o.calib}: no such file")
        self.toolchain = detect_toolchain()
        self.facts = {
            "tool_version": __version__, "target": t_hash, "drafter": d_hash,
            "calib": self.cache.sha256(Path(o.calib)) if o.calib else None,
            "arch": s["arch"], "gpu": s["gpu"], "quant": s["quant"], "kv_cache": s["kv_cache"],
            "drafter_quant": s["drafter_quant"], "drafter_exclude": self.drafter_exclude, "backend": o.backend, "tp": o.tp, "ep": o.ep, "pp": o.pp,
            "block_size": self.block_size, "toolchain": toolchain_fingerprint(self.toolchain),
            "trt_drafter": o.trt_drafter,
            "allow_nonfinite": o.allow_nonfinite,
        }

    def _start_manifest(self) -> None:
        """The manifest's first part, which compile and package read (and package hashes). Made
        after check: the layer ids below raise for a bad pair, which check explains better."""
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
            reference_runtime=ReferenceRuntimeRecord(layout=reference_layout(s, self.tdir, self.ddir, o.configs_only)),
            draft_schedule=draft_schedule_record(self.schedule, self.schedule_source, served))
        if o.configs_only:
            revision = {role: getattr(m, role).revision or next(
                (d["revision"] for d in self.downloads if d["role"] == role), None) for role in ("target", "drafter")}
            self.manifest = m = replace(m, weights=configs_only_record(self.downloads),
                                        target=replace(m.target, revision=revision["target"]),
                                        drafter=replace(m.drafter, revision=revision["drafter"]))
        self.facts["manifest"] = {k: v for k, v in m.to_dict().items() if k != "created"}

    def _needed(self, st: Stage) -> bool:
        engine, trt = self.o.backend == "engine", self.o.trt_drafter
        return {"": True, "engine": engine, "trt_drafter": trt, "compile": engine or trt}[st.needs]

    def _run_stage(self, st: Stage) -> None:
        needed = self._needed(st)
        inputs = {k: self.facts[k] for k in st.inputs}
        inputs |= {key: self.stages[name]["inputs_sha256"] for key, name in st.after}
        if st.code:
            inputs["code"] = code_hash(*st.code) if needed else None  # code counts only where it runs
        run = getattr(self, st.method) if needed else (lambda: self._not_needed(st))
        if needed and self.o.configs_only and st.name in WEIGHT_STAGES:
            run = partial(self._without_weights, st)
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

    # ---------------------------------------------------------------- the stages (PIPELINE's methods)
    def _check(self) -> dict:
        report = check_pair(self.tdir, self.ddir, scan=True)
        probs = [p for p in report["problems"] if not (self.o.allow_nonfinite and p.endswith(f"({NONFINITE_NOTE})"))]
        if probs:
            first = next((p for p in probs if "target" in p), probs[0])  # pair mismatches first
            hint = "; pass --allow-nonfinite to build anyway" if first.endswith(f"({NONFINITE_NOTE})") else ""
            raise DFlashError(f"check: the drafter does not fit the target ({len(probs)} problem(s)): {first}{hint}")
        if report.get("runtime_note"):
            self.log(report["runtime_note"])
        (self.work / "reports").mkdir(exist_ok=True)
        (self.work / "reports" / "check.json").write_text(json.dumps(report, indent=2) + "\n")
        return {}

    def _quantize(self) -> dict:
        o, s, work, tdir, ddir = self.o, self.settings, self.work, self.tdir, self.ddir
        notes, cmds = [], []
        if s["quant"] in ("fp8", "nvfp4"):
            kv = "fp8" if s["kv_cache"] == "fp8" else None
            cmds.append(_cmd("quantize", "--model", tdir, "--format", s["quant"], "--out", "target",
                             *(["--kv-cache", "fp8"] if kv else []), *(["--calib", o.calib] if o.calib else [])))
            rep = quantize_checkpoint(tdir, work / "target", s["quant"], kv_cache=kv, calib=o.calib,
                                      progress=self.progress)
            notes += list(getattr(rep, "not_calibrated", None) or [])
        else:
            link_tree(tdir, work / "target", self._copied)
            notes.append("target kept as is" + (" (MXFP4 experts)" if s["quant"] == "mxfp4" else ""))
        if s["drafter_quant"] == "int8":   # compressed-tensors W8A8, vLLM's (quant/int8_drafter.py)
            write_int8_drafter(ddir, work / "drafter")
            notes.append("drafter: compressed-tensors INT8 W8A8")
        elif s["drafter_quant"] != "none":
            dq, exclude = s["drafter_quant"], self.drafter_exclude
            calib = ["--target", tdir, "--calib", o.calib, "--calib-samples", DRAFTER_CALIB_SAMPLES] if o.calib else []
            cmds.append(_cmd("quantize", "--model", ddir, "--format", dq, *[a for g in exclude for a in ("--exclude", g)],
                             *calib, "--out", "drafter"))
            prompts = [t.tolist() for t in load_calib_samples(o.calib, tdir, DRAFTER_CALIB_SAMPLES)] if o.calib else []
            amax = drafter_input_amax(tdir, ddir, prompts, progress=self.progress) if prompts else None
            quantize_checkpoint(ddir, work / "drafter", dq, exclude=exclude, input_amax=amax, progress=self.progress)
            notes.append(f"drafter {dq.upper()}" + (f", {', '.join(exclude)} kept" if exclude else ""))
        else:
            link_tree(ddir, work / "drafter", self._copied)
            notes.append("drafter kept as is")
        return {"commands": cmds, "reason": "; ".join(notes)}

    def _without_weights(self, st: Stage) -> dict:
        """check / quantize of a configs-only build: deferred until the weights are here. target/ and
        drafter/ get the source folders' small files (config.json, tokenizer, ...) and no weights."""
        if st.name == "quantize":
            for src, dst in ((self.tdir, self.work / "target"), (self.ddir, self.work / "drafter")):
                dst.mkdir(parents=True, exist_ok=True)
                for f in sorted(src.rglob("*")):   # never the weights, even where the folder has them
                    if f.is_file() and f.suffix not in WEIGHT_SUFFIXES and "__pycache__" not in f.parts:
                        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                        clone_file(f, dst / f.relative_to(src))
        todo = [d["command"] for d in self.downloads if d["command"]]
        return {"status": "deferred", "outputs": list(st.outputs) if st.name == "quantize" else [],
                "commands": todo + [configs_only_fill_command(self.o, self.dest)],
                "reason": "configs only: the weights are not here; download them and run the build again into "
                          "the same --out (the last command) to fill the bundle in"}

    def _copied(self, src: Path, dst: Path) -> None:
        """A source file copied into the bundle has the sha256 hashed from the source (not re-read)."""
        digest = self.cache.linked(src)
        if digest is not None:
            self.cache.remember(dst, digest)

    def _not_needed(self, st: Stage) -> dict:
        """A stage whose artifacts this build does not ask for (nothing in the serving files loads them)."""
        why = {"engine": "the pytorch backend loads the Hugging Face checkpoint directly",
               "trt_drafter": "no --trt-drafter-engine: every serving stack runs its own DFlash drafter from drafter/",
               "compile": "nothing to compile: no --backend engine and no --trt-drafter-engine"}[st.needs]
        return {"status": "not-needed", "outputs": [], "reason": why}

    def _convert(self) -> dict:
        o, s = self.o, self.settings
        q = "none" if s["quant"] == "none" else s["quant"]
        kv = "fp8" if s["kv_cache"] == "fp8" else None
        convert_checkpoint(self.tdir, self.work / "trtllm_ckpt", tp=o.tp, pp=o.pp, ep=o.ep, quant=q, kv_cache=kv,
                           calib=o.calib, progress=self.progress)
        return {"commands": [_cmd("convert", "--model", self.tdir, "--quant", q, "--tp", o.tp, "--pp", o.pp,
                                  "--ep", o.ep, *(["--kv-cache", "fp8"] if kv else []),
                                  *(["--calib", o.calib] if o.calib else []), "--out", "trtllm_ckpt")]}

    def _plugin(self) -> dict:
        arch = self.settings["arch"]
        build_plugin(arch, self.work / "plugins", progress=self.progress)
        return {"commands": [_cmd("plugin", "build", "--arch", arch, "--out", "plugins")]}

    def _export_onnx(self) -> dict:
        export_onnx(self.ddir, self.tdir, self.work / "onnx" / "drafter.onnx", hashes=self.cache)
        return {"commands": [_cmd("export-onnx", "--drafter", self.ddir, "--target", self.tdir,
                                  "--out", "onnx/drafter.onnx")]}

    def _compile(self) -> dict:
        res = run_compile(self.work, self.manifest, self.toolchain)
        if res["status"] == "deferred":
            self.log(f"compile: deferred ({res['reason']}); run `dflash-trt compile --bundle {self.dest}` on the "
                     "GPU node")
        return {k: v for k, v in res.items() if k in ("status", "outputs", "commands", "reason", "engine_key")}

    def _package(self) -> dict:
        """Serving configs, the Triton repository and engines/README.txt (bundle/package.py)."""
        layout = self.manifest.reference_runtime.layout
        ctx = stacks.BundleContext(work=self.work, manifest=self.manifest, target_config=self.tcfg,
                                   block_size=self.block_size, target_dir=self.tdir, drafter_dir=self.ddir,
                                   drafter=load_drafter_config(self.work / "drafter"), serving_profile=self.profile)
        ctx.reference = reference_pair(self.work, layout, self.tdir, self.ddir, self._copied)
        self.manifest = serving_files(ctx)
        # the reference model's copy of the pair, when it has one
        return {"outputs": [*SERVING_FILES, "reference"]} if layout == "copy" else {}

    def _known_sha256(self, rel: str, st) -> str | None:
        """A file's sha256 known without reading it: one reused unchanged from the previous bundle keeps its
        recorded sha256 when its size and mtime are those recorded (a hard link or copy keeps both), so a
        re-run does not re-read multi-GB checkpoints (`verify` always re-hashes everything); an input's copy
        (link_tree, _copied), or what export-onnx hashed as it wrote, is known already."""
        prev = {a["path"]: a for a in (self.prev_manifest or {}).get("artifacts", [])}.get(rel)
        stats = (self.prev_manifest or {}).get("artifact_stats", {})
        reused = any(rel == r or rel.startswith(r + "/") for r in self.reused)
        if reused and prev and prev["bytes"] == st.st_size and stats.get(rel) == [st.st_size, st.st_mtime_ns]:
            return prev["sha256"]
        return self.cache.linked(self.work / rel)


def reference_layout(s: dict, tdir: Path, ddir: Path, configs_only: bool = False) -> str:
    """Where the dflash_reference model finds its pair. The reference runtime loads unquantized
    checkpoints: "bundle" = the bundle's own target/ and drafter/ (not quantized); "copy" = a
    copy of the source pair under reference/ (small models); "source" = the source
    folders by absolute path (too big to carry; CPU smoke tests of such models are impractical)."""
    if s["quant"] not in ("fp8", "nvfp4") and s["drafter_quant"] == "none":
        return "bundle"
    if configs_only:   # the size of the weights is not known here; the full build decides again
        return "source"
    return "copy" if _dir_bytes(tdir) + _dir_bytes(ddir) <= REFERENCE_COPY_MAX_BYTES else "source"


def serve_commands(m: Manifest) -> dict:
    """How to serve the bundle, from its root: every stack's commands (Triton's CPU model first)."""
    served = m.served_stacks
    out: dict = {}
    for st in [stacks.TRITON, *stacks.served(served)]:
        out |= st.serve_commands(served)
    return out


def build(o: BuildOptions, progress: bool = True) -> dict:
    return Builder(o, progress).run()


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
    sched = m.draft_schedule
    if sched:
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
