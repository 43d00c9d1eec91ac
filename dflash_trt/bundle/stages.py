"""`dflash-trt build`'s stages, and the pipeline that lists them (PIPELINE):

    check -> quantize -> convert (engine backend) -> plugin -> export-onnx -> compile -> package

Each stage is a function of the build (bundle/build.py Builder) that writes its outputs into the work
folder and returns its manifest entry's fields, with the equivalent `dflash-trt` command lines."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from dflash_trt import stacks
from dflash_trt.bundle.onnx_export import export_onnx
from dflash_trt.bundle.options import (
    DRAFTER_CALIB_SAMPLES,
    WEIGHT_SUFFIXES,
    configs_only_fill_command,
    dflash_command,
)
from dflash_trt.bundle.package import SERVING_FILES, reference_pair, serving_files
from dflash_trt.errors import DFlashError
from dflash_trt.io.clone import clone_file, clone_tree
from dflash_trt.io.manifest import sha256_file, sha256_json
from dflash_trt.models.check import NONFINITE_NOTE, check_pair
from dflash_trt.models.config import load_drafter_config
from dflash_trt.paths import package_path
from dflash_trt.quant.calibrate import load_calib_samples
from dflash_trt.quant.int8_drafter import write_int8_drafter
from dflash_trt.quant.quantize import quantize_checkpoint
from dflash_trt.runtime.drafter_calibration import drafter_input_amax
from dflash_trt.stacks.trtllm.convert import convert_checkpoint
from dflash_trt.stacks.trtllm.engine import run_compile
from dflash_trt.stacks.trtllm.plugin import build_plugin

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


def check_stage(b) -> dict:
    report = check_pair(b.tdir, b.ddir, scan=True)
    if probs := [p for p in report["problems"] if not (b.o.allow_nonfinite and p.endswith(f"({NONFINITE_NOTE})"))]:
        first = next((p for p in probs if "target" in p), probs[0])  # pair mismatches first
        hint = "; pass --allow-nonfinite to build anyway" if first.endswith(f"({NONFINITE_NOTE})") else ""
        raise DFlashError(f"check: the drafter does not fit the target ({len(probs)} problem(s)): {first}{hint}")
    if report.get("runtime_note"):
        b.log(report["runtime_note"])
    (b.work / "reports").mkdir(exist_ok=True)
    (b.work / "reports" / "check.json").write_text(json.dumps(report, indent=2) + "\n")
    return {}


def quantize_stage(b) -> dict:
    o, s, work, tdir, ddir = b.o, b.settings, b.work, b.tdir, b.ddir
    notes, cmds = [], []
    if s["quant"] in ("fp8", "nvfp4"):
        kv = "fp8" if s["kv_cache"] == "fp8" else None
        cmds.append(dflash_command("quantize", "--model", tdir, "--format", s["quant"], "--out", "target",
                         *(["--kv-cache", "fp8"] if kv else []), *(["--calib", o.calib] if o.calib else [])))
        rep = quantize_checkpoint(tdir, work / "target", s["quant"], kv_cache=kv, calib=o.calib,
                                  progress=b.progress)
        notes += list(getattr(rep, "not_calibrated", None) or [])
    else:
        clone_tree(tdir, work / "target", b.copied)
        notes.append("target kept as is" + (" (MXFP4 experts)" if s["quant"] == "mxfp4" else ""))
    if s["drafter_quant"] == "int8":   # compressed-tensors W8A8, vLLM's (quant/int8_drafter.py)
        write_int8_drafter(ddir, work / "drafter")
        notes.append("drafter: compressed-tensors INT8 W8A8")
    elif s["drafter_quant"] != "none":
        dq, exclude = s["drafter_quant"], b.drafter_exclude
        calib = ["--target", tdir, "--calib", o.calib, "--calib-samples", DRAFTER_CALIB_SAMPLES] if o.calib else []
        cmds.append(dflash_command("quantize", "--model", ddir, "--format", dq, *[a for g in exclude for a in ("--exclude", g)],
                         *calib, "--out", "drafter"))
        prompts = [t.tolist() for t in load_calib_samples(o.calib, tdir, DRAFTER_CALIB_SAMPLES)] if o.calib else []
        amax = drafter_input_amax(tdir, ddir, prompts, progress=b.progress) if prompts else None
        quantize_checkpoint(ddir, work / "drafter", dq, exclude=exclude, input_amax=amax, progress=b.progress)
        notes.append(f"drafter {dq.upper()}" + (f", {', '.join(exclude)} kept" if exclude else ""))
    else:
        clone_tree(ddir, work / "drafter", b.copied)
        notes.append("drafter kept as is")
    return {"commands": cmds, "reason": "; ".join(notes)}


def without_weights(b, st: Stage) -> dict:
    """check / quantize of a configs-only build: deferred until the weights are here. target/ and
    drafter/ get the source folders' small files (config.json, tokenizer, ...) and no weights."""
    if st.name == "quantize":
        for src, dst in ((b.tdir, b.work / "target"), (b.ddir, b.work / "drafter")):
            dst.mkdir(parents=True, exist_ok=True)
            for f in sorted(src.rglob("*")):   # never the weights, even where the folder has them
                if f.is_file() and f.suffix not in WEIGHT_SUFFIXES and "__pycache__" not in f.parts:
                    (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                    clone_file(f, dst / f.relative_to(src))
    todo = [d["command"] for d in b.downloads if d["command"]]
    return {"status": "deferred", "outputs": list(st.outputs) if st.name == "quantize" else [],
            "commands": todo + [configs_only_fill_command(b.o, b.dest)],
            "reason": "configs only: the weights are not here; download them and run the build again into "
                      "the same --out (the last command) to fill the bundle in"}


def not_needed(st: Stage) -> dict:
    """A stage whose artifacts this build does not ask for (nothing in the serving files loads them)."""
    why = {"engine": "the pytorch backend loads the Hugging Face checkpoint directly",
           "trt_drafter": "no --trt-drafter-engine: every serving stack runs its own DFlash drafter from drafter/",
           "compile": "nothing to compile: no --backend engine and no --trt-drafter-engine"}[st.needs]
    return {"status": "not-needed", "outputs": [], "reason": why}


def convert_stage(b) -> dict:
    o, s = b.o, b.settings
    q = "none" if s["quant"] == "none" else s["quant"]
    kv = "fp8" if s["kv_cache"] == "fp8" else None
    convert_checkpoint(b.tdir, b.work / "trtllm_ckpt", tp=o.tp, pp=o.pp, ep=o.ep, quant=q, kv_cache=kv,
                       calib=o.calib, progress=b.progress)
    return {"commands": [dflash_command("convert", "--model", b.tdir, "--quant", q, "--tp", o.tp, "--pp", o.pp,
                              "--ep", o.ep, *(["--kv-cache", "fp8"] if kv else []),
                              *(["--calib", o.calib] if o.calib else []), "--out", "trtllm_ckpt")]}


def plugin_stage(b) -> dict:
    arch = b.settings["arch"]
    build_plugin(arch, b.work / "plugins", progress=b.progress)
    return {"commands": [dflash_command("plugin", "build", "--arch", arch, "--out", "plugins")]}


def export_onnx_stage(b) -> dict:
    export_onnx(b.ddir, b.tdir, b.work / "onnx" / "drafter.onnx", hashes=b.cache)
    return {"commands": [dflash_command("export-onnx", "--drafter", b.ddir, "--target", b.tdir,
                              "--out", "onnx/drafter.onnx")]}


def compile_stage(b) -> dict:
    res = run_compile(b.work, b.manifest, b.toolchain)
    if res["status"] == "deferred":
        b.log(f"compile: deferred ({res['reason']}); run `dflash-trt compile --bundle {b.dest}` on the "
                 "GPU node")
    return {k: v for k, v in res.items() if k in ("status", "outputs", "commands", "reason", "engine_key")}


def package_stage(b) -> dict:
    """Serving configs, the Triton repository and engines/README.txt (bundle/package.py)."""
    layout = b.manifest.reference_runtime.layout
    ctx = stacks.BundleContext(work=b.work, manifest=b.manifest, target_config=b.tcfg,
                               block_size=b.block_size, target_dir=b.tdir, drafter_dir=b.ddir,
                               drafter=load_drafter_config(b.work / "drafter"), serving_profile=b.profile)
    ctx.reference = reference_pair(b.work, layout, b.tdir, b.ddir, b.copied)
    b.manifest = serving_files(ctx)
    # the reference model's copy of the pair, when it has one
    return {"outputs": [*SERVING_FILES, "reference"]} if layout == "copy" else {}


# --------------------------------------------------------------------------------- the pipeline
@dataclass(frozen=True)
class Stage:
    """One step of the pipeline. Its inputs hash covers `inputs` (keys of Builder.facts), the
    inputs hashes of the stages in `after` (as key -> stage name) and, as "code", the package
    source files in `code`; an unchanged hash reuses the previous bundle's `outputs`."""
    name: str
    run: Callable[..., dict]                 # the stage: the build (Builder) -> its manifest entry's fields
    inputs: tuple[str, ...]
    code: tuple[str, ...] = ()               # package-relative paths (code_hash)
    outputs: tuple[str, ...] = ()            # bundle-relative paths it writes
    after: tuple[tuple[str, str], ...] = ()
    # when it runs: "" always; "engine" with --backend engine; "trt_drafter" with --trt-drafter-engine;
    # "compile" with either. Otherwise not-needed: no outputs, code not hashed
    needs: str = ""


COMMON = ("tool_version", "target", "drafter")
PIPELINE = (
    Stage("check", check_stage, (*COMMON, "allow_nonfinite"), code=("models/check.py", "models/config.py", "models/target.py",
                                                                "models/shapes.py", "models/families",
                                                                "io/checkpoint.py"), outputs=("reports/check.json",)),
    Stage("quantize", quantize_stage, (*COMMON, "quant", "kv_cache", "drafter_quant", "drafter_exclude", "calib"),
          code=("quant/quantize.py", "quant/linear.py", "io/formats.py", "kernels/csrc", "kernels/c_loader.py",
                "runtime/drafter_calibration.py",
                "quant/calibrate.py", "io/checkpoint.py", "models/shapes.py", "models/families",
                "quant/int8_drafter.py", "io/compressed_tensors.py"),
          outputs=("target", "drafter")),
    Stage("convert", convert_stage, (*COMMON, "backend", "quant", "tp", "pp", "ep", "calib", "kv_cache"),
          code=("stacks/trtllm/convert.py", "quant/linear.py", "io/formats.py", "kernels/csrc", "kernels/c_loader.py",
                "io/checkpoint.py", "quant/calibrate.py", "models/shapes.py"), outputs=("trtllm_ckpt",),
          needs="engine"),
    Stage("plugin", plugin_stage, ("tool_version", "arch"),
          code=("kernels/kv_inject_triton.py", "kernels/kv_inject_trt.py", "runtime/kv_inject.py",
                "stacks/trtllm/plugin.py", "hardware.json"), outputs=("plugins",),  # the catalog gives the SMs
          needs="trt_drafter"),
    Stage("export-onnx", export_onnx_stage, COMMON,
          code=("bundle/onnx_export.py", "models/drafter.py", "models/layers.py", "models/config.py",
                "runtime/kv_inject.py", "kernels/kv_inject_trt.py"),
          outputs=("onnx",), needs="trt_drafter"),
    Stage("compile", compile_stage, (*COMMON, "backend", "arch", "gpu", "quant", "tp", "pp", "block_size", "toolchain",
                                  "trt_drafter"),
          after=(("onnx", "export-onnx"), ("plugin", "plugin"), ("convert", "convert")),
          needs="compile"),
    Stage("package", package_stage, (*COMMON, "manifest"),
          code=("stacks", "assets/triton_templates", "bundle/package.py"),
          outputs=SERVING_FILES),
)
