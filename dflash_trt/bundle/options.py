"""`dflash-trt build`'s options (BuildOptions), resolved before anything is written against this machine, the
pair and the serving stacks' own rules (the GPU, the pair's folders and names, which stacks get a config, what a
quantized drafter keeps unquantized, where the bundle goes, configs-only builds). Quantization and parallelism, checked
against the target's config, are bundle/build.py resolve_settings."""
from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt import engines, stacks
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_default_node, arch_sms, gpus, hardware_for_gpu, sm_number
from dflash_trt.io.manifest import Manifest
from dflash_trt.presets.catalog import PRESETS, missing_pair, resolve_config_pair, resolve_drafter, resolve_target
from dflash_trt.presets.hub import HubMissing

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
    # the draft length per concurrency each stack's control gets: auto|off|FILE.json (plan/schedule_cost.py)
    draft_schedule: str = "auto"
    # refuses (DFlashError) a finished bundle folder, before it is published, that `deploy` would refuse, and
    # returns deploy's plan of it (the command line passes deploy's own check: the planner's layout rules and
    # the chart's; build's result carries it as deploy_plan); None: no check
    deployable: Callable[[Path], object] | None = None
    # every config, the Triton repository, the manifest and the plan, without the weights (configs_only_*)
    configs_only: bool = False


def dir_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def dflash_command(*args) -> str:
    """The `dflash-trt` command line equivalent to a stage step (recorded in the manifest;
    output paths relative to the bundle root)."""
    return "dflash-trt " + shlex.join(str(a) for a in args)


def detect_arch(tc: dict) -> tuple[str, str | None]:
    """This machine's first GPU (`tc`: detect_toolchain's): its architecture, from the compute capability,
    and its bundle GPU id when the name shows one."""
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


NO_GPU = "none"   # --gpu none: a CPU-only bundle (manifest gpu_source "none")


def resolve_gpu(o: BuildOptions, tc: dict) -> dict:
    """{arch, gpu, node, gpu_source, sm} from --arch / --gpu or this machine. Without --gpu the bundle
    is for the architecture's default node; only --gpu none gives a CPU-only bundle (gpu and node null)."""
    by_id, sms_of = gpus(), arch_sms()
    gpu = o.gpu.lower() if o.gpu else None
    if gpu is not None and gpu != NO_GPU and gpu not in by_id:
        raise DFlashError(f"--gpu {o.gpu!r}: expected one of {', '.join([*by_id, NO_GPU])}")
    arch, source = o.arch, "option" if gpu else None
    if arch == "auto":
        if gpu and gpu != NO_GPU:
            arch = by_id[gpu].arch
        else:
            arch, detected = detect_arch(tc)
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
        if refused := st.drafter_quant_problem(s["drafter_quant"]):
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
    """The drafter modules a quantized drafter keeps unquantized (globs): every served stack's DFlash loader's
    needs together. Refused: a set one of the loaders cannot take, and no --calib for static input scales."""
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


def pair_name(spec: str | None, tdir: Path) -> tuple[str, str | None]:
    """(the target's name, its hub id): a preset's, an org/name hub id's, else the folder's name."""
    hub = spec is not None and not Path(spec).exists() and spec not in PRESETS  # an org/name hub id
    name = spec if spec in PRESETS or hub else ("smollm2-135m" if spec is None else tdir.name)
    return name, PRESETS[name].hf_id if name in PRESETS else (spec if hub else None)


def resolve_pair(o: BuildOptions) -> tuple[Path, Path, str, str | None]:
    """(target dir, drafter dir, target name, hub id). Presets and hub ids: presets/hub.py."""
    spec = o.target
    try:
        tdir = Path(resolve_target(spec)).resolve()
    except HubMissing as e:   # name the drafter's download too, in the same line
        raise missing_pair(spec, o.drafter, e) from None
    ddir = Path(resolve_drafter(o.drafter, spec)).resolve()
    name, hf_id = pair_name(spec, tdir)
    for folder, what in ((tdir, "target"), (ddir, "drafter")):
        if not (folder / "config.json").is_file():
            raise DFlashError(f"{folder}: the {what} folder has no config.json")
        if not any(folder.glob("*.safetensors")):
            raise DFlashError(f"{folder}: the {what} folder has no *.safetensors weights")
    return tdir, ddir, name, hf_id


def refuse_other_hardware(prev: Manifest | None, s: dict, dest: Path) -> None:
    """A rebuild into an --out holding a bundle for another architecture or GPU would silently turn,
    say, a Blackwell NVFP4 bundle into a Hopper FP8 one: refused unless --force (which reads no
    previous bundle: prev None)."""
    if prev and (prev.arch, prev.gpu) != (s["arch"], s["gpu"]):
        raise DFlashError(f"--out {dest}: holds a bundle for {prev.arch} ({prev.gpu or 'CPU-only'}, "
                          f"{prev.quant.target}), this build is for {s['arch']} ({s['gpu'] or 'CPU-only'}, "
                          f"{s['quant']}); pass --force to replace it, or choose another --out")


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
    return tdir, ddir, *pair_name(o.target, tdir), [d.to_dict() for d in downloads]


def configs_only_fill_command(o: BuildOptions, dest: Path) -> str:
    """The build that fills a configs-only bundle in, once the weights are downloaded."""
    args = ["build", *(["--target", o.target] if o.target else []), *(["--drafter", o.drafter] if o.drafter else []),
            "--arch", o.arch, *(["--gpu", o.gpu] if o.gpu else []),
            *(["--tp", o.tp] if o.tp != 1 else []), *(["--ep", o.ep] if o.ep != 1 else []),
            *(["--quant", o.quant] if o.quant != "auto" else []), "--out", dest]
    return dflash_command(*args)


def default_out(name: str, s: dict, o: BuildOptions) -> Path:
    # the GPU when one was named or detected; the architecture otherwise (its default node, or CPU-only)
    parts = [name.replace("/", "-"), s["gpu"] if s["gpu_source"] in ("option", "detected") else s["arch"], s["quant"]]
    if o.tp > 1 or o.ep > 1:
        parts.append(f"tp{o.tp}" + (f"ep{o.ep}" if o.ep > 1 else ""))
    if o.backend == "engine":
        parts.append("engine")
    return Path("engines") / "-".join(parts)


def reference_layout(s: dict, tdir: Path, ddir: Path, configs_only: bool = False) -> str:
    """Where the dflash_reference model finds its unquantized pair: "bundle" (the bundle's own target/ and
    drafter/), "copy" (under reference/: small models) or "source" (the source folders: too big to carry)."""
    if s["quant"] not in ("fp8", "nvfp4") and s["drafter_quant"] == "none":
        return "bundle"
    if configs_only:   # the size of the weights is not known here; the full build decides again
        return "source"
    return "copy" if dir_bytes(tdir) + dir_bytes(ddir) <= REFERENCE_COPY_MAX_BYTES else "source"
