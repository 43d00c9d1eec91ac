"""The GPU stage of a bundle: TensorRT engines for the drafter (its ONNX graph with the
`dflash::KVInject` plugin) and, for the engine backend, the target (TensorRT-LLM's builder).

TensorRT builds an engine for the GPU it runs on, so this stage can only run on the GPU node.
Where no GPU or no TensorRT is present (a CPU build machine) the stage is recorded `deferred`,
with the exact commands; `dflash-trt compile --bundle DIR` runs them later on the GPU node (by
hand: the Helm chart compiles nothing at pod start) and adds the engines to the bundle under
`engines/<gpu>-trt<version>/`, a key that lets a volume cache engines per GPU product and
TensorRT version. Nothing here ever writes an engine file it did not get from TensorRT.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import Manifest, list_artifacts, verify
from dflash_trt.kernels import kv_inject_trt


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_toolchain() -> dict:
    """What this machine has: GPUs (from nvidia-smi), TensorRT, TensorRT-LLM, trtllm-build."""
    smi = shutil.which("nvidia-smi")
    gpus = []
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            for line in out.stdout.splitlines():
                if "," in line:
                    name, cap = (s.strip() for s in line.rsplit(",", 1))
                    gpus.append({"name": name, "compute_cap": cap})
        except (OSError, subprocess.SubprocessError):
            pass
    trt = _version("tensorrt") or _version("tensorrt-cu12") or _version("tensorrt-cu13")
    if trt is None and importlib.util.find_spec("tensorrt") is not None:
        trt = "unknown"
    return {"nvidia_smi": smi, "gpus": gpus, "tensorrt": trt,
            "tensorrt_llm": _version("tensorrt_llm") or _version("tensorrt-llm"),
            "trtllm_build": shutil.which("trtllm-build")}


def toolchain_fingerprint(tc: dict) -> dict:
    """The parts of the toolchain that change what compile produces (for the stage's input hash)."""
    return {"gpus": [g["name"] for g in tc["gpus"]], "tensorrt": tc["tensorrt"], "tensorrt_llm": tc["tensorrt_llm"]}


def engine_key(tc: dict) -> str:
    gpu = tc["gpus"][0]["name"] if tc["gpus"] else "nogpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"{slug}-trt{tc['tensorrt'] or 'none'}"


def compile_jobs(manifest: Manifest, key: str = "<gpu>-trt<version>") -> list[dict]:
    """The commands of the compile stage, relative to the bundle root (run from there)."""
    jobs = []
    if manifest.trt_drafter_engine:  # opt-in (build --trt-drafter-engine): no serving file loads it
        jobs.append({
            "name": "drafter-engine", "outputs": [f"engines/{key}/drafter.plan"],
            "argv": [sys.executable if key != "<gpu>-trt<version>" else "python", "-m", "dflash_trt.stacks.trtllm.engine",
                     "drafter", "--onnx", "onnx/drafter.onnx", "--plugins", "plugins",
                     "--max-tokens", str(max(64, 4 * manifest.drafter.block_size)),
                     "--out", f"engines/{key}/drafter.plan"],
        })
    if manifest.backend == "engine":
        p = manifest.parallel
        B = manifest.drafter.block_size
        jobs.append({
            "name": "target-engine", "outputs": [f"engines/{key}/target"],
            "argv": ["trtllm-build", "--checkpoint_dir", "trtllm_ckpt", "--output_dir", f"engines/{key}/target",
                     "--max_batch_size", "64", "--max_seq_len", str(manifest.max_seq_len or 8192),
                     "--gemm_plugin", "auto", "--use_paged_context_fmha", "enable",
                     # the draft tokens come from the DFlash drafter engine, outside this engine
                     "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(B - 1),
                     "--workers", str(p.tp * p.pp)],
        })
    return jobs


def commands_text(jobs: list[dict]) -> list[str]:
    return [shlex.join(j["argv"]) for j in jobs]


def missing_prerequisites(tc: dict, backend: str) -> list[str]:
    why = []
    if not tc["nvidia_smi"] or not tc["gpus"]:
        why.append("no NVIDIA GPU on this machine (nvidia-smi not found or lists no GPU)")
    if not tc["tensorrt"]:
        why.append("TensorRT (Python package `tensorrt`) is not installed")
    if backend == "engine" and not tc["trtllm_build"]:
        why.append("TensorRT-LLM's `trtllm-build` is not on PATH")
    return why


def run_compile(bundle: Path, manifest: Manifest, tc: dict) -> dict:
    """Run the compile stage in `bundle` (a folder being built, or a published bundle) with the toolchain
    `tc` (detect_toolchain). Returns the stage entry fields: status, outputs, commands, reason, engine_key."""
    if why := missing_prerequisites(tc, manifest.backend):
        return {"status": "deferred", "outputs": [], "commands": ["dflash-trt compile --bundle <bundle>"]
                + commands_text(compile_jobs(manifest)), "reason": "; ".join(why)}
    key = engine_key(tc)
    jobs = compile_jobs(manifest, key)
    for job in jobs:
        proc = subprocess.run(job["argv"], cwd=bundle, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise DFlashError(f"compile: `{shlex.join(job['argv'])}` failed with exit code {proc.returncode}: {tail[0]}")
        for o in job["outputs"]:
            if not (bundle / o).exists():
                raise DFlashError(f"compile: `{shlex.join(job['argv'])}` exited 0 but wrote no {o}")
    return {"status": "done", "outputs": [f"engines/{key}"], "commands": commands_text(jobs),
            "engine_key": key, "reason": ""}


def compile_bundle(bundle: str | Path) -> dict:
    """`dflash-trt compile --bundle DIR`: verify the bundle, run the GPU commands, add the
    engines to it and update its manifest (stage entry + artifact list)."""
    bundle = Path(bundle)
    if problems := verify(bundle):
        raise DFlashError(f"{bundle}: bundle does not match its manifest ({len(problems)} problem(s)), first: {problems[0]}")
    m = Manifest.read(bundle)
    if not compile_jobs(m):
        raise DFlashError(f"{bundle}: nothing to compile: the bundle was built without --trt-drafter-engine and "
                          "--backend engine; its serving files load the checkpoints as they are")
    tc = detect_toolchain()
    res = run_compile(bundle, m, tc)
    if res["status"] == "deferred":
        raise DFlashError(f"compile: cannot run here: {res['reason']}")
    entry = replace(m.stages["compile"], status="done", skipped=False,
                    outputs=sorted(set(m.stages["compile"].outputs) | set(res["outputs"])), commands=res["commands"],
                    engine_key=res["engine_key"], toolchain=toolchain_fingerprint(tc), reason=None)
    replace(m, stages={**m.stages, "compile": entry}, artifacts=list_artifacts(bundle)).write(bundle)
    return {"bundle": str(bundle), "engine_key": res["engine_key"], "outputs": res["outputs"]}


# ------------------------------------------------------------------------ drafter engine (GPU)
def build_drafter_engine(onnx_path: str, plugins_dir: str, out: str, max_tokens: int) -> None:
    """ONNX drafter + KV-injection plugin -> serialized TensorRT engine, with TensorRT's Python
    API. Runs only where TensorRT and a GPU are present (never on the CPU build machine)."""
    import tensorrt as trt

    # registers dflash::KVInject with tensorrt.plugin; its AOT implementation hands TensorRT the
    # bundle's precompiled kernel for this GPU
    kv_inject_trt.register_plugin(Path(plugins_dir) / "plugin.json")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise DFlashError(f"{onnx_path}: TensorRT's ONNX parser failed: {errs[0] if errs else 'unknown error'}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.BF16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims = list(t.shape)
        if any(d < 0 for d in dims):  # dynamic token axes: 1 .. max_tokens
            lo = [1 if d < 0 else d for d in dims]
            opt = [min(16, max_tokens) if d < 0 else d for d in dims]
            hi = [max_tokens if d < 0 else d for d in dims]
            profile.set_shape(t.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise DFlashError(f"{onnx_path}: TensorRT could not build an engine (see the TensorRT log above)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_bytes(bytes(blob))


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_trt.stacks.trtllm.engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drafter", help="build the drafter's TensorRT engine (GPU node)")
    d.add_argument("--onnx", required=True)
    d.add_argument("--plugins", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args(argv)
    try:
        build_drafter_engine(a.onnx, a.plugins, a.out, a.max_tokens)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
