"""`dflash-trt plan` (capacity planner) and `dflash-trt deploy` (Helm values for a bundle)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from dflash_trt.engines import ORCHESTRATORS, SERVERS, facts
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import catalog, gpus

HARDWARE = click.Choice(sorted(catalog()))


@click.command("plan")
@click.option("--target", help="Preset name (gpt-oss-120b, qwen3-8b, ...) or a folder with config.json.")
@click.option("--drafter", type=click.Path(file_okay=False), help="DFlash drafter folder (z-lab config.json); "
              "default: the preset's drafter, if known.")
@click.option("--bundle", type=click.Path(file_okay=False), help="Plan for a bundle instead: its target, drafter, "
              "formats and GPU (and its TP / EP when it records them) — what `deploy` will write.")
@click.option("--hardware", type=HARDWARE, help="Node type (default for --bundle: the bundle's GPU).")
@click.option("--quant", type=click.Choice(["auto", "none", "fp8", "nvfp4", "mxfp4"]), default="auto", show_default=True,
              help="Target weight format; auto = MXFP4 for gpt-oss, the checkpoint's own if quantized, else NVFP4 "
              "on Blackwell / FP8 on Hopper (as `dflash-trt build`).")
@click.option("--kv-cache", type=click.Choice(["auto", "fp8", "bf16"]), default="auto", show_default=True,
              help="KV-cache format; auto = FP8 when the weights are quantized.")
@click.option("--drafter-quant", type=click.Choice(["none", "fp8", "nvfp4"]), default="none", show_default=True,
              help="Drafter weight format (as `build --drafter-quant`): its decoder Linears FP8 / NVFP4, fc bf16. "
              "With --speed, the draft pass reads these bytes.")
@click.option("--max-seq-len", type=int, help="Tokens per sequence (prompt + output); default min(model max, 32768).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes available (1 to 1024).")
@click.option("--gpus-per-node", type=int, help="Default: the hardware's (1 to 16).")
@click.option("--max-batch-size", type=int, help="TensorRT-LLM max_batch_size: caps the concurrent sequences of one "
              "replica (default 128; for --bundle: the bundle's serving config).")
@click.option("--max-attention-window", help="TensorRT-LLM kv_cache_config.max_attention_window, comma-separated "
              "tokens per layer (repeated over the layers), e.g. 128,32768 for gpt-oss: only then do windowed "
              "layers hold fewer tokens (default for --bundle: the bundle's serving config; else none).")
@click.option("--objective", type=click.Choice(["latency", "throughput"]), default="latency", show_default=True,
              help="How fitting layouts are ranked.")
@click.option("--speed", is_flag=True, help="Also predict decode speed per layout: step times of AR and of a DFlash "
              "verify + draft, tokens/s per user and per GPU against concurrency, with low-high ranges "
              "(docs/speed-model.md).")
@click.option("--tau", type=float, help="DFlash mean accepted length per step, bonus token included (1 to the block "
              "size); default: the preset drafter's published one. `dflash-trt bench` measures it.")
@click.option("--context-tokens", type=int, help="Mean tokens of context per sequence while decoding, for --speed "
              "(default 2048).")
@click.option("--acceptance", "acceptance", type=click.Path(dir_okay=False), help="A `dflash-trt bench --json` report "
              "of this drafter (its acceptance_histogram, at the drafter's block size): the per-position acceptance "
              "the draft schedule is chosen from, and tau (instead of --tau). Default: the geometric shape through "
              "tau, an assumption the report states.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Draw tokens/s per GPU against tokens/s "
              "per user, AR and DFlash per layout, into this PNG (implies --speed).")
@click.option("--profile", type=click.Choice(["latency", "throughput"]), help="Follow NVIDIA's curated TensorRT-LLM "
              "config of the target's family (as `build --profile`): its objective, max_batch_size, max_num_tokens "
              "and attention DP, with its TP / EP ranked first where it fits (gpt-oss throughput: TP 2 x EP 2, "
              "attention DP).")
@click.option("--disaggregated", is_flag=True, help="Also estimate a disaggregated layout (Dynamo prefill / decode "
              "workers, `deploy --server dynamo --disaggregated`): how many of the chosen layout's instances prefill "
              "and how many decode for --isl / --osl, from the speed model plus a compute-bound prefill pass.")
@click.option("--isl", type=int, help="--disaggregated: prompt tokens per request (default 4096).")
@click.option("--osl", type=int, help="--disaggregated: output tokens per request (default 1024).")
@click.option("--refresh", is_flag=True, help="--bundle: re-plan the bundle with this planner and these --hardware / "
              "--nodes / --gpus-per-node / --max-seq-len / limits, into a revision (--out) with its own plan.json (what "
              "deploy reads; without it, the plan `build` recorded).")
@click.option("--out", type=click.Path(file_okay=False), help="--refresh: the revision's folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON only (with --speed: under \"speed\"; "
              "with --disaggregated: under \"disaggregated\").")
def plan_cmd(target, drafter, bundle, hardware, quant, kv_cache, drafter_quant, max_seq_len, nodes, gpus_per_node,
             max_batch_size, max_attention_window, objective, profile, speed, tau, context_tokens, acceptance,
             plot_file, disaggregated, isl, osl, refresh, out, as_json):
    """How many GPUs, which TP / EP, how many concurrent sequences fit — from config.json alone.

    \b
    Per GPU: weights by format (MXFP4 experts, NVFP4, FP8, BF16), drafter weights, activations
    and runtime reserve; the KV-cache pool that is left (target and drafter KV bytes per token);
    TensorRT-LLM's DFlash draft-context buffer per rank against its budget (a layout runs with the
    largest max_batch_size that fits, or does not fit when the bundle fixes it); every TP / EP /
    replica layout, ranked, with the reason for each rejected one. With --speed: per layout and
    concurrency, AR and DFlash decode step times and tokens/s per user and per GPU (a physics
    model with stated assumptions and ranges, docs/speed-model.md), and per layout the draft
    schedule: the K (tokens drafted per step) that gives the most tokens/s at each concurrency,
    against always drafting the whole block and never speculating, and the concurrency from
    which speculation stops paying (what `build` writes into each stack's own control; `build
    --draft-schedule plan.json` takes this command's --speed --json output).

    \b
    Examples:
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300
      dflash-trt plan --target qwen3-8b --hardware hgx-h200 --quant fp8 --max-seq-len 16384 --json
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300 --max-attention-window 128,131072
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300 --profile throughput
      dflash-trt plan --target ./my-model --drafter ./my-drafter --hardware dgx-b200 --nodes 2
      dflash-trt plan --bundle engines/gpt-oss-120b
      dflash-trt plan --bundle engines/gpt-oss-120b --refresh --nodes 3 --out engines/gpt-oss-120b-r2
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300 --speed --plot gptoss-b300.png
      dflash-trt plan --target qwen3-8b --hardware hgx-h200 --quant fp8 --speed --tau 6.5 --json
      dflash-trt plan --target qwen3-8b --hardware dgx-b200 --speed --acceptance bench.json
      dflash-trt plan --target smollm2-135m --hardware dgx-b300 --speed --acceptance bench.json --json > plan.json
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300 --nodes 2 --disaggregated --isl 8192 --osl 1024
      dflash-trt plan --target gpt-oss-120b --hardware dgx-b300 --drafter-quant nvfp4 --speed
    """
    from dflash_trt.plan import speed as speed_model

    speed = speed or plot_file is not None
    _check_speed_flags(speed, tau, context_tokens, acceptance, disaggregated, isl, osl)
    layout = dict(nodes=nodes, gpus_per_node=gpus_per_node, max_seq_len=max_seq_len, objective=objective,
                  max_batch_size=max_batch_size, max_attention_window=max_attention_window,
                  refresh_out=_refresh_out(bundle, refresh, out))
    if bundle:
        p, tcfg, dcfg = _bundle_plan(bundle, hardware, quant, kv_cache, drafter_quant, target, drafter, profile, layout)
    else:
        p, tcfg, dcfg = _target_plan(target, drafter, hardware, quant, kv_cache, drafter_quant, profile, layout)
    ctx = speed_model.DEFAULT_CONTEXT_TOKENS if context_tokens is None else context_tokens
    report = speed_model.speed_for(p, tcfg, dcfg, tau=tau, context_tokens=ctx, acceptance=acceptance) \
        if speed else None
    if plot_file:
        from dflash_trt.plan.speed_plot import plot_speed

        plot_speed(report, plot_file)
    split = None
    if disaggregated:
        from dflash_trt.deploy.dynamo import DEFAULT_ISL, DEFAULT_OSL

        split = speed_model.disaggregated(p, tcfg, dcfg, isl=DEFAULT_ISL if isl is None else isl,
                                          osl=DEFAULT_OSL if osl is None else osl, tau=tau)
    click.echo(_plan_output(p, report, split, plot_file, as_json))


def _check_speed_flags(speed, tau, context_tokens, acceptance, disaggregated, isl, osl) -> None:
    if not speed and (context_tokens is not None or acceptance is not None or (tau is not None and not disaggregated)):
        raise DFlashError("--tau / --context-tokens / --acceptance set the speed model: add --speed (or --plot "
                          "FILE.png; --tau also sizes --disaggregated)")
    if not disaggregated and (isl is not None or osl is not None):
        raise DFlashError("--isl / --osl size a disaggregated layout: add --disaggregated")


def _refresh(bundle, out, rec) -> None:
    """plan --refresh: the bundle with plan.json planned anew by this planner, a revision written by the one
    packager (bundle/package.py), its parent and the cases recorded."""
    from dflash_trt.bundle.package import RevisionChange, write_revision
    from dflash_trt.io.manifest import PlanRefreshRecord

    cases = [f"{c.nodes} x {c.hardware} ({c.gpus_per_node} GPUs), max_seq_len {c.max_seq_len}" for c in rec.cases]
    write_revision(bundle, Path(out), RevisionChange(
        kind="plan", summary=f"plan.json re-planned by dflash-trt {rec.planner_version} ({len(cases)} cases)",
        record=PlanRefreshRecord(planner_version=rec.planner_version, cases=cases), plan=rec))


def _refresh_out(bundle, refresh: bool, out) -> str | None:
    if bool(refresh) != bool(out) or (refresh and not bundle):
        raise DFlashError("--refresh re-plans a bundle into a revision: pass --bundle B --refresh --out NEW together")
    return out


def _layout_overrides(layout: dict) -> dict:
    """The serving limits given on the command line (the rest: the plan's, or the bundle's, defaults)."""
    from dflash_trt.plan import planner

    out = {} if layout["max_batch_size"] is None else {"max_batch_size": layout["max_batch_size"]}
    if layout["max_attention_window"] is not None:
        out["max_attention_window"] = planner.parse_windows(layout["max_attention_window"])
    return out


def _bundle_plan(bundle, hardware, quant, kv_cache, drafter_quant, target, drafter, profile, layout):
    """`plan --bundle`: (plan, target config, drafter config) of the bundle's own models, formats and GPU."""
    from dflash_trt.deploy import values as deploy
    from dflash_trt.io.manifest import Manifest

    given = {"--quant": quant != "auto", "--kv-cache": kv_cache != "auto", "--drafter-quant": drafter_quant != "none",
             "--target": target, "--drafter": drafter, "--profile": profile}
    if any(given.values()):
        raise DFlashError(f"--bundle plans the bundle's own target, drafter, formats and serving config; drop "
                          f"{' / '.join(k for k, v in given.items() if v)}")
    gpu = catalog()[hardware].gpu if hardware else None
    deploy.require_intact(bundle)   # a bundle `verify` refuses is planned no more than deployed
    m = Manifest.read(bundle)
    if layout["refresh_out"]:   # the one layout search after build: into a revision with its own plan.json
        from dflash_trt.plan import record

        hw = deploy.bundle_hardware(m, gpu)
        case = record.PlanCase(hw.name, layout["nodes"], layout["gpus_per_node"] or hw.gpus_per_node,
                               layout["max_seq_len"] or m.max_seq_len, _layout_overrides(layout)) if hw else None
        _refresh(bundle, layout["refresh_out"], record.plan_bundle(bundle, m, [(hw, case)] if hw else []))
        bundle = layout["refresh_out"]
        m = Manifest.read(bundle)
    p = deploy.plan_for_bundle(bundle, nodes=layout["nodes"], gpus_per_node=layout["gpus_per_node"], gpu=gpu,
                               max_seq_len=layout["max_seq_len"], objective=layout["objective"], manifest=m,
                               **_layout_overrides(layout))
    if p is None:
        raise DFlashError(f"{bundle}: the bundle pins no GPU (a CPU-only deployment); pass --hardware")
    return (p, *deploy.bundle_model_configs(bundle, manifest=m))


def _target_plan(target, drafter, hardware, quant, kv_cache, drafter_quant, profile, layout):
    """`plan --target`: (plan, target config, drafter config) of a preset or a folder (and --drafter)."""
    from dflash_trt.plan import planner

    if not target:
        raise DFlashError("--target NAME|DIR (or --bundle DIR) is required")
    if not hardware:
        raise DFlashError(f"--hardware is required: one of {', '.join(sorted(catalog()))}")
    tname, tcfg, dcfg = planner.target_configs(target)
    dname = f"{tname} drafter" if dcfg else None
    if drafter:
        dname, dcfg = planner.drafter_config(drafter)
    p = planner.plan(tcfg, dcfg, hardware, target_name=tname, drafter_name=dname, quant=quant, kv_cache=kv_cache,
                     drafter_quant=drafter_quant, max_seq_len=layout["max_seq_len"], nodes=layout["nodes"],
                     gpus_per_node=layout["gpus_per_node"], objective=layout["objective"], profile=profile,
                     **_layout_overrides(layout))
    return p, tcfg, dcfg


def _plan_output(p, report, split, plot_file, as_json: bool) -> str:
    from dflash_trt.plan import planner
    from dflash_trt.plan import speed as speed_model

    if as_json:
        d = p.to_dict()
        if report:
            d["speed"] = report.to_dict()
        if split:
            d["disaggregated"] = split.to_dict()
        return json.dumps(d, indent=2)
    return (planner.format_plan(p) + (speed_model.format_speed(report) if report else "")
            + (speed_model.format_disaggregated(split) if split else "")
            + (f"\nplot: {plot_file}" if plot_file else ""))


@click.command("deploy")
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False),
              help="Bundle folder written by `dflash-trt build` (reads its manifest.json).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes available for this model (1 to 1024).")
@click.option("--gpus-per-node", type=int, help="1, 2, 4, 8 or 16; default: the bundle GPU's node type (8 on DGX / "
              "HGX, 4 on GB200).")
@click.option("--replicas", type=int, help="Model instances (1 to 1024); default: the planner's (nodes × GPUs / tp).")
@click.option("--server", type=click.Choice([*SERVERS, *ORCHESTRATORS]), help="The server of the pods (the chart's "
              "server.stack): trtllm-serve, triton, vllm or sglang; each loads the bundle's config for its stack. "
              "Default: trtllm-serve when the bundle holds a TensorRT-LLM config, else its first stack (CPU-only: "
              "triton). dynamo: an NVIDIA Dynamo DynamoGraphDeployment instead of Helm values (<out>/dgd.yaml): a "
              "frontend with KV-aware routing and workers of one engine of the bundle (--engine).")
@click.option("--engine", "dynamo_engine", type=click.Choice(list(facts()["dynamo"]["workers"])),
              help="--server dynamo: the engine of the workers (default: the first of vllm, trtllm, sglang the "
              "bundle holds a config for whose Dynamo image has DFlash).")
@click.option("--disaggregated", is_flag=True, help="--server dynamo: separate prefill and decode workers (the "
              "drafter in the decode worker, and in the prefill worker where the engine needs its context there); "
              "the split of the instances is the speed model's estimate for --isl / --osl (`plan --disaggregated`).")
@click.option("--isl", type=int, help="--disaggregated: prompt tokens per request the split is sized for (default 4096).")
@click.option("--osl", type=int, help="--disaggregated: output tokens per request the split is sized for (default 1024).")
@click.option("--image", help="Serving image REPOSITORY:TAG or REPOSITORY@sha256:DIGEST (default: the server's image "
              "recorded in the bundle's manifest, from engines.json; --server triton needs one built from "
              "deploy/triton-trtllm.Dockerfile). Needs --engine-version.")
@click.option("--engine-version", help="The engine version --image carries (TensorRT-LLM, vLLM or SGLang), e.g. "
              "1.4.0rc4: deploy and the chart refuse one older than the engine's first DFlash release.")
@click.option("--multinode-image", help="Image of multi-node (LeaderWorkerSet) pods: the serving image plus sshd, "
              "built from deploy/multinode.Dockerfile; required when an instance spans nodes.")
@click.option("--gpu", type=click.Choice([*gpus(), "none"]),
              help="Override the GPU the bundle records (build's --gpu, by default its --arch's node: b300 for "
              "Blackwell, h200 for Hopper); none = CPU-only smoke test of the reference model, refused when its "
              "weights alone exceed the CPU pod's memory limit. A bundle built with --gpu none deploys CPU-only.")
@click.option("--pvc", help="Existing PersistentVolumeClaim holding the bundle (default: the chart creates one).")
@click.option("--ssh-secret", default="dflash-trt-ssh", show_default=True,
              help="Secret with the MPI ssh keys, for multi-node (LeaderWorkerSet) layouts.")
@click.option("--out", type=click.Path(file_okay=False), help="Output folder (default: <bundle>-deploy beside the "
              "bundle; the bundle itself is left as its manifest lists it).")
@click.option("--render", is_flag=True, help="Also render the manifests with Helm's engine into <out>/manifests.")
@click.option("--chart", type=click.Path(file_okay=False), help="Chart folder (default: deploy/helm/dflash-trt, "
              "shipped in the package).")
@click.option("--release", default="dflash-trt", show_default=True, help="Release name used by --render: a DNS-1123 "
              "label of at most 53 characters (Helm's rule).")
@click.option("--namespace", default="default", show_default=True, help="Namespace used by --render.")
@click.option("--min-tokens-per-user", type=float, help="Per-user decode speed to hold (tokens/s): the speed model "
              "(`plan --speed`) picks the most concurrent sequences per instance that still get it; that becomes the "
              "autoscaling target and the max_batch_size to serve with.")
@click.option("--tau", type=float, help="DFlash mean accepted length for --min-tokens-per-user (default: the preset "
              "drafter's published one).")
@click.option("--monitoring", is_flag=True, help="Monitoring of speculative decoding: a ServiceMonitor, a PrometheusRule "
              "(recording rules on the engine's own metrics; alerts on acceptance below the plan, speculation below "
              "break-even at the measured concurrency, per-token latency over the per-user target, each where the "
              "bundle's draft schedule or --min-tokens-per-user gives the figure) and a Grafana dashboard ConfigMap "
              "(docs/monitoring.md).")
@click.option("--sub-path", help="The bundle's folder inside the claim (the chart's bundle.pvc.subPath). Default: "
              "bundles/<bundle>-<manifest digest>, one folder per bundle version, so an upgrade is a new folder and "
              "`helm rollback` mounts the previous one (docs/rollout.md); '' = the claim's root.")
@click.option("--loader-image", help="REPOSITORY:TAG of an image holding the bundle at /bundle "
              "(deploy/bundle.Dockerfile): the chart's loader Job copies it onto the claim under --sub-path, checking every sha256, and the pods "
              "wait for it. Without it, copy the bundle there with `dflash-trt push`.")
@click.option("--force", is_flag=True, help="Replace an --out folder whose files were edited since deploy wrote "
              "them (without it, deploy refuses and names the edited file).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary only.")
def deploy_cmd(bundle, nodes, gpus_per_node, replicas, server, dynamo_engine, disaggregated, isl, osl, image,
               engine_version, multinode_image, gpu, pvc, ssh_secret, out, render, chart, release, namespace,
               min_tokens_per_user, tau, monitoring, sub_path, loader_image, force, as_json):
    """Write Helm values for a bundle (and, with --render, the Kubernetes manifests).

    \b
    The values carry the bundle's parallelism, GPU product (node affinity), model repository,
    /dev/shm size and memory; the layout is the planner's choice for the bundle
    (`dflash-trt plan --bundle DIR` shows it). The values are rendered with Helm's engine
    before anything is written, so the chart's refusals (values.schema.json and its template
    checks) stop deploy with nothing on disk, and so do names Kubernetes would refuse. Every
    image's engine must have DFlash (engines.json); the summary lists each with its version.
    Nothing compiles at pod start.

    \b
    Examples:
      dflash-trt deploy --bundle engines/gpt-oss-120b --render
      dflash-trt deploy --bundle engines/big --nodes 2 --multinode-image registry/dflash-trt-trtllm-mpi:1.4.0rc4
      dflash-trt deploy --bundle engines/gpt-oss-120b --server vllm --render
      dflash-trt deploy --bundle engines/gpt-oss-120b --server triton --image registry/dflash-trt-triton:26.07 \\
          --engine-version 1.4.0rc4
      dflash-trt deploy --bundle engines/smollm2-135m --gpu none      # CPU-only smoke test
      dflash-trt deploy --bundle engines/gpt-oss-120b --min-tokens-per-user 500
      helm install gptoss deploy/helm/dflash-trt -f engines/gpt-oss-120b-deploy/values.yaml
      dflash-trt deploy --bundle engines/gpt-oss-120b --server dynamo --nodes 2
      dflash-trt deploy --bundle engines/gpt-oss-120b --server dynamo --nodes 2 --disaggregated --isl 8192 --osl 1024
      kubectl apply -f engines/gpt-oss-120b-deploy/dgd.yaml
    """
    from dflash_trt.deploy import rollout
    from dflash_trt.deploy import values as deploy
    from dflash_trt.io.manifest import Manifest

    _check_chart_flags(tau, min_tokens_per_user, release, namespace)
    deploy.require_intact(bundle)   # what verify refuses, deploy refuses: the pods would load it
    if server in ORCHESTRATORS:
        return _deploy_orchestrated(bundle=bundle, nodes=nodes, gpus_per_node=gpus_per_node, replicas=replicas,
                                    engine=dynamo_engine, disaggregated=disaggregated, isl=isl, osl=osl, image=image,
                                    engine_version=engine_version, gpu=gpu, pvc=pvc, out=out, render=render,
                                    release=release, namespace=namespace, tau=tau, as_json=as_json,
                                    unused={"--multinode-image": multinode_image, "--chart": chart,
                                            "--min-tokens-per-user": min_tokens_per_user,
                                            "--monitoring": monitoring or None})
    _refuse_orchestrator_flags(dynamo_engine=dynamo_engine, disaggregated=disaggregated, isl=isl, osl=osl)
    m = Manifest.read(bundle)   # once: every step below takes it
    values, p = deploy.deploy_values(bundle, nodes=nodes, gpus_per_node=gpus_per_node, replicas=replicas,
                                     gpu=gpu, pvc=pvc, ssh_secret=ssh_secret, image=image,
                                     multinode_image=multinode_image, server=server, engine_version=engine_version,
                                     manifest=m)
    rollout.delivery_values(values, bundle, sub_path=sub_path,
                            loader_image=deploy.parse_image(loader_image, "--loader-image") if loader_image else None)
    target_speed = _speed_target(bundle, m, p, values, min_tokens_per_user, tau)
    planned = _monitoring_values(m, values, min_tokens_per_user) if monitoring else None
    rendered = _render_checked(values, chart, release, namespace, monitoring)
    manifests = rendered if render else None
    out = Path(out) if out else deploy.default_out(bundle)
    chart_dir = Path(chart) if chart else deploy.default_chart_dir()
    deploy.write_deployment(out, values, manifests, _values_header(bundle, values, p, target_speed, release,
                                                                  chart_dir, out), force=force)
    _report_deployment(as_json, bundle, m, p, values, rendered, manifests, target_speed, planned, loader_image, out,
                       release, chart_dir)


def _check_chart_flags(tau, min_tokens_per_user, release, namespace) -> None:
    from dflash_trt.deploy import values as deploy

    if tau is not None and min_tokens_per_user is None:
        raise DFlashError("--tau is for --min-tokens-per-user; add it (or drop --tau)")
    if min_tokens_per_user is not None and not min_tokens_per_user > 0:
        raise DFlashError(f"--min-tokens-per-user {min_tokens_per_user:g}: must be a positive tokens/s figure")
    deploy.check_release(release, namespace)


def _refuse_orchestrator_flags(**flags) -> None:
    """The chart's servers run one aggregated engine: Dynamo's flags are refused there."""
    names = {"dynamo_engine": "--engine", "disaggregated": "--disaggregated", "isl": "--isl", "osl": "--osl"}
    for key, v in flags.items():
        if v not in (None, False):
            raise DFlashError(f"{names[key]} is for --server {'/'.join(ORCHESTRATORS)} (the chart's servers run one "
                              "aggregated engine)")


def _speed_target(bundle, m, p, values: dict, min_tokens_per_user, tau) -> dict | None:
    """deploy --min-tokens-per-user: the most concurrent sequences per instance that keep every user at the
    target (the speed model), set as the autoscaling target; None without the flag."""
    if min_tokens_per_user is None:
        return None
    from dflash_trt.deploy import values as deploy
    from dflash_trt.plan import speed as speed_model

    if p is None:
        raise DFlashError("--min-tokens-per-user: a CPU-only deployment has no speed model")
    tcfg, dcfg = deploy.bundle_model_configs(bundle, manifest=m)
    report = speed_model.speed_for(p, tcfg, dcfg, tau=tau)
    batch, user = speed_model.max_concurrency_at(report, p, tcfg, dcfg, min_tokens_per_user)
    # Scale out before an instance holds more sequences than keep every user at the target (or than it batches).
    values["autoscaling"]["targetAverageValue"] = str(min(batch, p.chosen.max_sequences))
    return {"min_tokens_per_s_per_user": min_tokens_per_user, "max_batch_size": batch,
            "predicted_tokens_per_s_per_user": user, "mode": "dflash" if report.tau else "ar",
            "tau": report.tau, "bundle_max_batch_size": p.max_batch_size,
            "autoscaling_target": int(values["autoscaling"]["targetAverageValue"])}


def _monitoring_values(m, values: dict, min_tokens_per_user):
    """deploy --monitoring: the chart's monitoring values from the bundle's planned figures (returned)."""
    from dflash_trt.deploy import monitoring as mon
    from dflash_trt.plan.monitoring_figures import bundle_figures

    planned = bundle_figures(m, min_tokens_per_user=min_tokens_per_user)
    values["monitoring"] = mon.monitoring_values(values["server"]["stack"], planned)
    return planned


def _render_checked(values: dict, chart, release, namespace, monitoring: bool) -> dict:
    """The chart rendered with Helm's engine (its own checks, always), names Kubernetes takes, and the
    monitoring objects against the Prometheus Operator CRDs."""
    from dflash_trt.deploy import values as deploy

    rendered = deploy.render(values, chart, release=release, namespace=namespace)
    deploy.check_names(rendered)
    if monitoring:
        from dflash_trt.deploy import monitoring as mon

        mon.check_objects([obj for _, obj in deploy.rendered_objects(rendered)])
    return rendered


def _values_header(bundle, values: dict, p, target_speed: dict | None, release, chart_dir: Path, out: Path) -> str:
    """The comment lines at the top of values.yaml: what deploy decided, and the Helm commands."""
    return (f"# Written by `dflash-trt deploy --bundle {bundle}`.\n"
            + (f"# Layout: tp {p.chosen.tp}, ep {p.chosen.ep}, {values['replicas']} replica(s) on {p.hardware} "
               f"({p.chosen.reason}).\n" if p else "# CPU-only: the reference-runtime model, no GPU.\n")
            + (f"# Speed target: >= {target_speed['min_tokens_per_s_per_user']:g} tokens/s per user holds up to "
               f"{target_speed['max_batch_size']} sequences per instance (speed model, predicted "
               f"{target_speed['predicted_tokens_per_s_per_user']:,.0f}); autoscaling.targetAverageValue "
               f"{target_speed['autoscaling_target']}; serve with max_batch_size {target_speed['max_batch_size']}.\n"
               if target_speed else "")
            + _delivery_header(bundle, values)
            + f"# Install: helm install {release} {chart_dir} -f {out / 'values.yaml'}\n"
            + f"# Upgrade (a new bundle version: new subPath): helm upgrade {release} {chart_dir} -f "
            f"{out / 'values.yaml'}; back: helm rollback {release} (docs/rollout.md)\n")


def _report_deployment(as_json: bool, bundle, m, p, values: dict, rendered: dict, manifests, target_speed, planned,
                       loader_image, out: Path, release, chart_dir: Path) -> None:
    """deploy's summary: JSON (--json), else one line per decision."""
    from dflash_trt.deploy import values as deploy

    images = deploy.rendered_images(rendered, values)
    if as_json:
        click.echo(json.dumps({"values": str(out / "values.yaml"),
                               "manifests": str(out / "manifests") if manifests is not None else None,
                               "layout": asdict(p.chosen) if p else None, "server": values["server"]["stack"],
                               "images": images, "speed_target": target_speed,
                               "monitoring": planned.to_dict() if planned else None, "values_content": values}, indent=2))
        return
    click.echo(f"wrote {out / 'values.yaml'}")
    if manifests is not None:
        click.echo(f"rendered {sum(1 for t in manifests.values() if t.strip()) - 1} manifest file(s) into {out / 'manifests'}")
    if p:
        c = p.chosen
        click.echo(f"layout: tp {c.tp}, ep {c.ep}, {values['replicas']} replica(s), {values['gpu']['count']} × "
                   f"{values['gpu']['product']} per pod ({values['workload']['kind']})")
    else:
        click.echo("layout: CPU-only, model dflash_reference")
    click.echo(f"server: {values['server']['stack']}")
    if m.weights is not None and not m.weights.present:
        click.echo("note: the bundle holds configs only (no weights): fill it in (`dflash-trt verify --bundle "
                   f"{bundle}` says how) before copying it to the cluster")
    for im in images:
        click.echo(f"image: {im['image']} ({im['what']})")
    if target_speed:
        click.echo(_speed_target_line(target_speed, values))
    if planned:
        alerts = [r["alert"] for g in values["monitoring"]["ruleGroups"] for r in g["rules"] if "alert" in r]
        click.echo(f"monitoring: ServiceMonitor, PrometheusRule (alerts: {', '.join(alerts) or 'none'}; "
                   f"{planned.source}), Grafana dashboard ConfigMap")
    sub = values["bundle"].get("pvc", {}).get("subPath")
    if values["bundle"].get("loader", {}).get("enabled"):
        click.echo(f"bundle: the loader Job copies it from {loader_image} to the claim's {sub}/ (pods wait for it)")
    elif sub:
        click.echo(f"bundle: the pods mount the claim's {sub}/: copy it there with `dflash-trt push --bundle {bundle} "
                   f"--to <the claim, mounted>` (or --loader-image)")
    click.echo(f"install: helm install {release} {chart_dir} -f {out / 'values.yaml'}")


def _speed_target_line(t: dict, values: dict) -> str:
    note = (f"; the bundle's max_batch_size {t['bundle_max_batch_size']} admits more sequences than hold the "
            f"target: serve with max_batch_size {t['max_batch_size']}" if t["bundle_max_batch_size"] >
            t["max_batch_size"] else f"; the bundle's max_batch_size {t['bundle_max_batch_size']} is below it: "
            f"max_batch_size {t['max_batch_size']} would batch more at the same target"
            if t["bundle_max_batch_size"] < t["max_batch_size"] else "")
    return (f"speed target: >= {t['min_tokens_per_s_per_user']:g} tokens/s per user up to {t['max_batch_size']} "
            f"sequences per instance ({t['mode']}, predicted {t['predicted_tokens_per_s_per_user']:,.0f}); "
            f"autoscaling target {values['autoscaling']['targetAverageValue']}{note}")


def _delivery_header(bundle, values: dict) -> str:
    sub = values["bundle"].get("pvc", {}).get("subPath")
    if not sub:
        return ""
    if values["bundle"].get("loader", {}).get("enabled"):
        return f"# Bundle: copied to the claim's {sub}/ by the loader Job (bundle.loader), checked file by file.\n"
    return f"# Bundle: on the claim under {sub}/: `dflash-trt push --bundle {bundle} --to <claim mounted here>`.\n"


@click.command("push")
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False), help="A dflash-trt bundle.")
@click.option("--to", "claim", required=True, type=click.Path(file_okay=False),
              help="The claim (PersistentVolumeClaim) the pods mount, mounted on this machine (an NFS share, a node).")
@click.option("--sub-path", help="Folder inside the claim (default: bundles/<bundle>-<manifest digest>, what `deploy` "
              "sets as bundle.pvc.subPath).")
@click.option("--json", "as_json", is_flag=True)
def push_cmd(bundle, claim, sub_path, as_json):
    """Copy a bundle onto the claim the pods mount, under its version folder: verified first,
    copied into a temp folder beside it (reflinks where the filesystem has them), re-hashed,
    then renamed into place. A version already there is left as it is.

    \b
    Examples:
      dflash-trt push --bundle engines/gpt-oss-120b-b300 --to /mnt/models
      dflash-trt deploy --bundle engines/gpt-oss-120b-b300 --pvc models --render
      helm upgrade gptoss deploy/helm/dflash-trt -f engines/gpt-oss-120b-b300-deploy/values.yaml
    """
    from dflash_trt.deploy.rollout import push

    dest, copied = push(bundle, claim, sub_path)
    if as_json:
        click.echo(json.dumps({"bundle": bundle, "to": str(dest), "copied": copied}, indent=2))
    else:
        click.echo(f"{'copied' if copied else 'already there'}: {dest} (verified against its manifest.json)")


def _deploy_orchestrated(*, bundle, nodes, gpus_per_node, replicas, engine, disaggregated, isl, osl, image,
                         engine_version, gpu, pvc, out, render, release, namespace, tau, as_json, unused):
    """deploy --server dynamo: <out>/dgd.yaml, a DynamoGraphDeployment checked against Dynamo's CRD schema."""
    from dflash_trt.deploy import dynamo
    from dflash_trt.deploy import values as deploy

    for flag, v in unused.items():
        if v is not None:
            raise DFlashError(f"{flag}: not used by --server {dynamo.SERVER} (the DynamoGraphDeployment has no chart, "
                              "no MPI launch and no speed target)")
    if tau is not None and not disaggregated:
        raise DFlashError("--tau: with --server dynamo it sizes the --disaggregated split; add --disaggregated")
    if gpu == "none":
        raise DFlashError("--gpu none: Dynamo's workers serve the bundle on GPUs; a CPU-only smoke test is the chart's "
                          "(drop --server dynamo)")
    dgd, summary = dynamo.render_dgd(bundle, name=release, nodes=nodes, gpus_per_node=gpus_per_node,
                                     replicas=replicas, disaggregated=disaggregated, isl=isl, osl=osl, engine=engine,
                                     image=image, engine_version=engine_version, pvc=pvc, gpu=gpu, tau=tau)
    dgd["metadata"]["namespace"] = namespace
    out = Path(out) if out else deploy.default_out(bundle)
    split = summary["disaggregated"]
    header = (f"# Written by `dflash-trt deploy --bundle {bundle} --server dynamo`: NVIDIA Dynamo {summary['dynamo']}, "
              f"{summary['engine']} workers, tp {summary['layout']['tp']} each, on {summary['gpu_product']}.\n"
              + (f"# Disaggregated split (an ESTIMATE of the speed model for isl {split['isl']} / osl {split['osl']}): "
                 f"{split['prefill_instances']} prefill + {split['decode_instances']} decode.\n" if split else "")
              + f"# Checked against the {dgd['apiVersion']} CRD schema (unknown fields refused). The bundle must be on "
              f"the PersistentVolumeClaim {summary['pvc']} (--pvc).\n# Install: kubectl apply -f {out / dynamo.DGD_FILE}\n")
    dynamo.write_dgd(out, dgd, header, render)
    if as_json:
        click.echo(json.dumps({"dgd": str(out / dynamo.DGD_FILE), **summary, "dgd_content": dgd}, indent=2))
        return
    click.echo(f"wrote {out / dynamo.DGD_FILE} (DynamoGraphDeployment {release}; CRD schema check passed)")
    if render:
        click.echo(f"rendered 1 manifest file(s) into {out / 'manifests'}")
    workers = ", ".join(f"{k} × {v}" for k, v in summary["workers"].items())
    click.echo(f"layout: tp {summary['layout']['tp']}, ep {summary['layout']['ep']} per worker; {workers}; "
               f"{summary['gpus']} × {summary['gpu_product']}")
    if split:
        click.echo(f"split (estimate, isl {split['isl']} / osl {split['osl']}): prefill {split['prefill_ms']:,.0f} ms per "
                   f"prompt, decode {split['decode_tokens_per_s_per_instance']:,.0f} tokens/s per instance, "
                   f"~{split['requests_per_s']:,.2f} requests/s sustained")
    click.echo(f"server: dynamo {summary['dynamo']} (frontend {summary['frontend_image']}, --router-mode kv)")
    click.echo(f"image: {summary['image']['image']} ({summary['engine']} {summary['image']['engine_version']})")
    click.echo(f"install: kubectl apply -f {out / dynamo.DGD_FILE}")
