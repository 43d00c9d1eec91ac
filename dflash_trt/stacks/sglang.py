"""SGLang: `python -m sglang.launch_server --speculative-algorithm DFLASH`, configs/sglang.json.
Rules read from sglang 0.5.23 (PyPI wheel); tests/test_stack_conformance.py runs SGLang's own
parsing code on our files. No draft schedule is written for it: --speculative-adaptive runs for EAGLE /
EAGLE3 only (sglang/srt/speculative/adaptive_spec_params.py:56-64, arg_groups/speculative_hook.py:261-262;
ADAPTIVE_REFUSED), so DFLASH would drop it with a warning.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from dflash_trt.errors import DFlashError
from dflash_trt.io.jsonio import read_json
from dflash_trt.stacks.base import BundleContext, LaunchArgs, Metric, Server, Stack, StackMetrics, non_causal_windowed
from dflash_trt.stacks.layer_ids import sglang_capture_points, zlab_to_sglang

CHECKED_AGAINST = "sglang 0.5.23 (PyPI wheel): sglang/srt/arg_groups/speculative_hook.py, sglang/srt/models/dflash.py"
# --kv-cache-dtype choices ("fp8_e4m3", "fp8_e5m2", ...; no bare "fp8")
KV_CACHE_FP8 = "fp8_e4m3"

# Why build writes no draft schedule for SGLang: its adaptive control does not run for DFLASH.
ADAPTIVE_REFUSED = ("SGLang 0.5.23 adapts the draft length (--speculative-adaptive, --speculative-adaptive-config) for "
                    "EAGLE / EAGLE3 only: sglang/srt/speculative/adaptive_spec_params.py:56-64 "
                    "adaptive_unsupported_reason returns \"speculative_algorithm=DFLASH (only EAGLE/EAGLE3 are "
                    "supported)\" and arg_groups/speculative_hook.py:261-262 (_maybe_disable_adaptive, :1374) turns the "
                    "flag off with a warning, so DFLASH drafts its whole block at every batch size")

# SGLang 0.5.23's metrics on /metrics, read in its PyPI wheel (pip download --no-deps sglang==0.5.23):
# sglang/srt/observability/metrics_collector.py; the page exists only with --enable-metrics
# (sglang/srt/arg_groups/fields/observability.py:70, default False), which configs/sglang.json passes.
_MC = "sglang/srt/observability/metrics_collector.py"
_SCHED = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")   # metrics_collector.py:1382-1388
_TOK = ("model_name", "engine_type")                                       # metrics_collector.py:1807-1812
METRICS = StackMetrics(
    prefix="sglang:",
    metrics_path="/metrics",
    enable="--enable-metrics (configs/sglang.json)",
    kind="gauge",    # bench --endpoint reads the scheduler's acceptance gauge of its last log interval
    metrics={
        "acceptance_length": Metric("sglang:spec_accept_length", "gauge", _SCHED, f"{_MC}:512"),
        "accept_rate": Metric("sglang:spec_accept_rate", "gauge", _SCHED, f"{_MC}:518"),
        "verify_calls": Metric("sglang:spec_verify_calls_total", "counter", _TOK, f"{_MC}:1866"),
        "generation_tokens": Metric("sglang:generation_tokens_total", "counter", (*_TOK, "is_streaming"),
                                    f"{_MC}:1861"),
        "running": Metric("sglang:num_running_reqs", "gauge", _SCHED, f"{_MC}:365"),
        "ttft": Metric("sglang:time_to_first_token_seconds", "histogram", (*_TOK, "is_streaming"), f"{_MC}:2041"),
        "itl": Metric("sglang:inter_token_latency_seconds", "histogram", _TOK, f"{_MC}:2051"),
        "tpot": Metric("sglang:request_time_per_output_token_seconds", "histogram", _TOK, f"{_MC}:2058"),
    },
    # tokens generated per verify call, both counted per finished request (observe_one_finished_request,
    # metrics_collector.py:2092-2112): the mean acceptance length over the window, bonus token included
    acceptance_length="sum by ({by}) (rate(sglang:generation_tokens_total[{w}])) "
                      "/ sum by ({by}) (rate(sglang:spec_verify_calls_total[{w}]))",
    per_position="",    # SGLang exports no per-position acceptance
    draft_efficiency="avg by ({by}) (sglang:spec_accept_rate)",
    source="sglang 0.5.23 PyPI wheel",
    notes=("no per-position acceptance on SGLang's page",
           ("draft efficiency is the scheduler's gauge of its last log interval (accepted / proposed drafts), "
            "not a rate over the window")),
)


def sglang_launch(*, target_path: str, drafter_path: str, block_size: int, zlab_ids: list[int], tp: int, ep: int,
                  pp: int, kv_cache: str, extra_args: tuple[str, ...] = ()) -> dict:
    """configs/sglang.json; extra_args: the drafter's own (sglang_drafter_args)."""
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter_path,
             "--speculative-dflash-block-size", str(block_size),
             "--tp-size", str(tp), "--pp-size", str(pp), "--enable-metrics"]
    if ep > 1:
        flags += ["--ep-size", str(ep)]
    if kv_cache == "fp8":
        flags += ["--kv-cache-dtype", KV_CACHE_FP8]
    launch = LaunchArgs(program=("python", "-m", "sglang.launch_server"), model=target_path, model_flag="--model-path",
                        flags=(*flags, *extra_args), tp=tp, ep=ep, pp=pp)
    return {"launch": launch.record(), "argv": launch.argv(), "command": launch.command(),
            "dflash_config": {"target_layer_ids": zlab_to_sglang(zlab_ids)},
            "capture_before_layer": sglang_capture_points(zlab_ids)}


def sglang_drafter_args(dcfg) -> list[str]:
    """Extra SGLang launch arguments for this drafter. Non-causal sliding-window layers: the
    trtllm_mha draft backend places every query of the block at its last position and so gives
    the earlier ones a window up to block_size - 1 keys too narrow, silently
    (sgl-project/sglang#35209, open). Pin flashinfer, which takes per-layer windows
    (`--speculative-draft-attention-backend`, choices in sglang 0.5.23 arg_groups/choices.py)."""
    return ["--speculative-draft-attention-backend", "flashinfer"] if non_causal_windowed(dcfg) else []


def sglang_drafter_problems(dcfg) -> list[str]:
    """sglang 0.5.23 sglang/srt/models/dflash.py `_get_dflash_layer_attention_params` and
    speculative/dflash_utils.py `get_dflash_attention_sliding_window_size` read only is_causal,
    layer_types and sliding_window (use_swa / swa_window_size only for Nemotron 3.5 drafters;
    dflash_config.causal never): a drafter whose window or causality lives in those keys would be
    served with other attention than it was trained with."""
    dc = dcfg.raw.get("dflash_config") if isinstance(dcfg.raw.get("dflash_config"), dict) else {}
    types = dcfg.raw.get("layer_types") or []
    causal = dcfg.raw.get("is_causal")
    # no layer_types: every layer full and non-causal (is_causal not read on that path)
    sglang_sees = [(dcfg.raw.get("sliding_window") if t == "sliding_attention" else None,
                    bool(causal) if causal is not None else t == "sliding_attention") for t in types] \
        or [(None, False)] * len(dcfg.layer_attention)
    if sglang_sees != [(w, c) for w, c in dcfg.layer_attention]:
        keys = [k for k in ("use_swa", "swa_window_size", "causal") if k in dc]
        names = ", ".join("dflash_config." + k for k in keys)
        return [(f"SGLang 0.5.23 reads a drafter's attention from is_causal / layer_types / sliding_window only "
                 f"(sglang/srt/models/dflash.py); this drafter sets {names}, which SGLang would ignore")]
    return []


class SGLang(Stack):
    name = "sglang"
    title = "SGLang"
    checked_against = CHECKED_AGAINST
    servers = (Server("sglang"),)
    config_files: ClassVar[dict[str, str]] = {"sglang": "configs/sglang.json"}
    metrics: ClassVar[StackMetrics | None] = METRICS

    def layout_problems(self, *, tp, pp, block_size):
        # sglang/srt/arg_groups/speculative_hook.py _handle_dflash
        out = []
        if pp != 1:
            out.append(f"--pp {pp}: SGLang's _handle_dflash raises \"Currently DFLASH speculative decoding only "
                       "supports pp_size == 1\"")
        if block_size <= 0:
            out.append(f"block size {block_size}: --speculative-dflash-block-size must be positive")
        return out

    def drafter_problems(self, dcfg):
        return sglang_drafter_problems(dcfg)

    def draft_schedule_problem(self, schedule=None):
        return ADAPTIVE_REFUSED

    def write_configs(self, ctx: BundleContext) -> None:
        m = ctx.manifest
        p = m.parallel
        # extra_args: the drafter's attention layout may need some
        sg = sglang_launch(target_path="target", drafter_path="drafter", block_size=ctx.block_size,
                           zlab_ids=m.drafter.target_layer_ids["zlab"], tp=p.tp, ep=p.ep, pp=p.pp,
                           kv_cache=m.quant.kv_cache, extra_args=tuple(sglang_drafter_args(ctx.drafter)))
        (ctx.work / "configs" / "sglang.json").write_text(json.dumps(sg, indent=2) + "\n")

    def serve_commands(self, served):
        return {"sglang": "see configs/sglang.json (command)"}

    def launch_args(self, bundle: Path) -> LaunchArgs:
        path = Path(bundle) / "configs" / "sglang.json"
        rec = read_json(path).get("launch")
        if not isinstance(rec, dict):
            raise DFlashError(f"{path}: no `launch` record (written by an older dflash-trt: build the bundle again)")
        return LaunchArgs.from_record(rec, str(path))


STACK = SGLang()
