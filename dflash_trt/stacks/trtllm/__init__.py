"""TensorRT-LLM: `trtllm-serve` (PyTorch backend, DFlashDecodingConfig) and Triton's tensorrt_llm
model, the default stack of a GPU bundle. Its pieces, one concept a module:

    serve_config.py  configs/trtllm-serve.yaml (and the Triton model's model.yaml), its rules
    profiles.py      --profile latency|throughput: NVIDIA's curated settings per model family
    budget.py        the DFlash draft-context buffer per rank and the budget it must fit
    convert.py       the engine path's checkpoint (`dflash-trt convert`, --backend engine)
    engine.py        the GPU compile stage: TensorRT engines (deferred without a GPU)
    plugin.py        the dflash::KVInject plugin's AOT kernels (--trt-drafter-engine)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import yaml

from dflash_trt import engines
from dflash_trt.errors import DFlashError
from dflash_trt.hardware import hardware_for_gpu
from dflash_trt.io.manifest import Manifest
from dflash_trt.stacks.base import BundleContext, LaunchArgs, Metric, Server, Stack, StackMetrics
from dflash_trt.stacks.tritonserver.repo import llmapi_model_yaml
from dflash_trt.stacks.trtllm.budget import draft_context_budget
from dflash_trt.stacks.trtllm.profiles import drafter_attention_backend, profile_settings
from dflash_trt.stacks.trtllm.serve_config import (
    CHECKED_AGAINST,
    TRTLLM_KV_FRACTION,
    trtllm_draft_schedule,
    trtllm_drafter_options,
    trtllm_serve_config,
)

# Bytes per weight element of a bf16 checkpoint after quantization (scales included), to estimate
# the resident weights before quantize runs (plan/cost.py ELEMENT_BYTES / bf16's 2 bytes).
QUANT_BYTES_RATIO = {"fp8": 0.5, "nvfp4": (0.5 + 1 / 16) / 2}
TRITON_MODEL = "tensorrt_llm"
SERVE_CONFIG = "configs/trtllm-serve.yaml"
# trtllm-serve on a bundle: the LLM API settings (and the layout) in its config file
TRTLLM_SERVE = LaunchArgs(program=("trtllm-serve",), model="target", config_file=SERVE_CONFIG, config_flag="--config")
# trtllm-serve's metrics (Stack.metrics): NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py
# @050f80def8df236e326949c8bd9dee10fd896a83 (MetricsCollector.__init__, cited by attribute); trtllm-serve's
# /metrics is JSON iteration stats, the Prometheus page is mounted at /prometheus/metrics only when the LLM args
# set return_perf_metrics: true (tensorrt_llm/serve/openai_server.py @00057725d9a6591f033e44f31c219e2426827bb7
# mount_metrics; llmapi/llm_args.py `return_perf_metrics: bool = Field(default=False)`), which
# configs/trtllm-serve.yaml sets.
_COL = "tensorrt_llm/metrics/collector.py @050f80def8df MetricsCollector"
_LBL = ("model_name", "engine_type")      # the labels OpenAIServer gives MetricsCollector (its docstring's example)
METRICS = StackMetrics(
    prefix="trtllm_",
    metrics_path="/prometheus/metrics",
    enable="return_perf_metrics: true (configs/trtllm-serve.yaml)",
    metrics={
        # no draft count of its own: every draft drafts position 0, so position 0's drafted tokens are the drafts;
        # per-position counters, logged per finished request
        "drafts": Metric("trtllm_spec_decode_drafted_tokens_total", "counter", (*_LBL, "token_position"),
                         f"{_COL}.counter_tokens_drafted_per_position"),
        "draft_tokens": Metric("trtllm_spec_decode_drafted_tokens_total", "counter", (*_LBL, "token_position"),
                               f"{_COL}.counter_tokens_drafted_per_position"),
        "accepted": Metric("trtllm_spec_decode_accepted_tokens_total", "counter", (*_LBL, "token_position"),
                           f"{_COL}.counter_tokens_accepted_per_position"),
        "accepted_per_position": Metric("trtllm_spec_decode_accepted_tokens_total", "counter",
                                        (*_LBL, "token_position"), f"{_COL}.counter_tokens_accepted_per_position"),
        "generation_tokens": Metric("trtllm_generation_tokens_total", "counter", _LBL,
                                    f"{_COL}.counter_generation_tokens"),
        "running": Metric("trtllm_num_requests_running", "gauge", _LBL, f"{_COL}.num_requests_running"),
        "ttft": Metric("trtllm_time_to_first_token_seconds", "histogram", _LBL,
                       f"{_COL}.histogram_time_to_first_token"),
        "tpot": Metric("trtllm_time_per_output_token_seconds", "histogram", _LBL,
                       f"{_COL}.histogram_time_per_output_token"),
    },
    acceptance_length="1 + sum by ({by}) (rate(trtllm_spec_decode_accepted_tokens_total[{w}])) "
                      "/ sum by ({by}) (rate(trtllm_spec_decode_drafted_tokens_total{{token_position=\"0\"}}[{w}]))",
    per_position='label_replace(sum by ({by}, token_position) (rate(trtllm_spec_decode_accepted_tokens_total[{w}])), '
                 '"position", "$1", "token_position", "(.*)") '
                 "/ ignoring(position, token_position) group_left "
                 "sum by ({by}) (rate(trtllm_spec_decode_drafted_tokens_total{{token_position=\"0\"}}[{w}]))",
    draft_efficiency="sum by ({by}) (rate(trtllm_spec_decode_accepted_tokens_total[{w}])) "
                     "/ sum by ({by}) (rate(trtllm_spec_decode_drafted_tokens_total[{w}]))",
    source="NVIDIA/TensorRT-LLM @050f80def8df236e326949c8bd9dee10fd896a83",
    notes=("no inter-token-latency histogram: the per-token latency is trtllm_time_per_output_token_seconds",),
)


def serve_config(m: Manifest | dict, tcfg: dict, B: int, dcfg=None, schedule_fields: dict | None = None,
                 profile: dict | None = None) -> dict:
    """configs/trtllm-serve.yaml of a bundle, from its manifest's first part (a manifest dict is read as the
    typed Manifest); schedule_fields: the draft schedule's DFlashDecodingConfig fields as recorded
    (manifest draft_schedule); profile: the serving profile's settings build decided (BundleContext
    .serving_profile), else derived from the manifest's serving_profile record."""
    m = m if isinstance(m, Manifest) else Manifest.from_dict(m)
    d, p, sp = m.drafter, m.parallel, m.serving_profile
    if profile is None:
        profile = profile_settings(sp.profile if sp else "latency", tcfg, B, sp.max_batch_size if sp else None)
    cfg = trtllm_serve_config(target_cfg=tcfg, drafter_path="drafter", block_size=B, mask_token_id=d.mask_token_id,
                              zlab_ids=d.target_layer_ids["trtllm"], tp=p.tp, ep=p.ep, pp=p.pp,
                              kv_cache=m.quant.kv_cache, arch=m.arch, max_seq_len=m.max_seq_len, profile=profile,
                              drafter_attention_backend=drafter_attention_backend(m.arch))
    # A drafter's own rules last: non-causal sliding-window layers pin VANILLA over the per-GPU choice.
    if dcfg is not None:
        cfg["speculative_config"].update(trtllm_drafter_options(dcfg))
    if schedule_fields:
        cfg["speculative_config"].update(schedule_fields)
    return cfg


def check_draft_context(*, target_config: dict, drafter_config: dict, target_dir: Path, gpu: str | None, quant: str,
                        tp: int, profile_name: str, profile: dict) -> None:
    """Refuse, before any stage runs, a layout whose DFlash draft-context buffer exceeds the budget
    TensorRT-LLM checks it against (budget.py), with the numbers. Weights per rank: the target's
    on-disk bytes / tp (the estimate TensorRT-LLM's check uses), scaled to the target format when
    build quantizes a bf16 checkpoint. Needs the bundle's GPU (its memory; none for --gpu none)."""
    if not gpu:
        return
    hw = hardware_for_gpu(gpu)
    weights = sum(f.stat().st_size for f in Path(target_dir).glob("*.safetensors"))
    if quant in QUANT_BYTES_RATIO and not (target_config.get("quantization_config") or {}):
        weights = int(weights * QUANT_BYTES_RATIO[quant])
    max_seq_len = min(int(target_config.get("max_position_embeddings", 8192)), 32768)
    b = draft_context_budget(max_batch=profile["max_batch_size"], max_seq_len=max_seq_len, drafter_cfg=drafter_config,
                             gpu_memory_bytes=hw.reported_memory_bytes, weights_bytes_per_rank=weights // tp,
                             free_gpu_memory_fraction=TRTLLM_KV_FRACTION)
    if not b.fits:
        raise DFlashError(f"{gpu} ({hw.name}), --tp {tp} --profile {profile_name}: {b.describe()}: TensorRT-LLM "
                          f"refuses this layout at start; pass --max-batch-size {b.largest_batch} or less, or a "
                          "wider --tp")


def read_llm_api_settings(bundle: Path, repository: str) -> dict:
    """KV fraction, per-layer attention windows, batch and token limits from the bundle's
    TensorRT-LLM settings (what the server will really use), where present: the Triton model's
    model.yaml, then configs/trtllm-serve.yaml (it wins where both set a key)."""
    out: dict = {}
    for path in (bundle / repository / TRITON_MODEL / "1" / "model.yaml", bundle / "configs" / "trtllm-serve.yaml"):
        if not path.is_file():
            continue
        try:
            y = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise DFlashError(f"{path}: invalid YAML ({e})") from None
        if not isinstance(y, dict):
            raise DFlashError(f"{path}: expected a mapping of TensorRT-LLM settings")
        out |= llm_api_settings(y, path)
    return out


def llm_api_settings(y: dict, where: Path | str) -> dict:
    """What the planner takes from one mapping of TensorRT-LLM settings (a config file's, or serve_config's)."""
    out: dict = {}
    kv = y.get("kv_cache_config") or {}
    if kv.get("free_gpu_memory_fraction") is not None:
        out["kv_fraction"] = float(kv["free_gpu_memory_fraction"])
    if kv.get("max_attention_window") is not None:
        maw = kv["max_attention_window"]
        if not (isinstance(maw, list) and maw and all(isinstance(w, int) and w > 0 for w in maw)):
            raise DFlashError(f"{where}: kv_cache_config.max_attention_window must be a list of positive "
                              f"integers (one window per layer, repeated), got {maw!r}")
        out["max_attention_window"] = maw
    for key in ("max_batch_size", "max_num_tokens"):
        if y.get(key):
            out[key] = int(y[key])
    if "enable_attention_dp" in y:
        out["attention_dp"] = bool(y["enable_attention_dp"])
    return out


class TensorRTLLM(Stack):
    name = "trtllm"
    title = "TensorRT-LLM"
    checked_against = CHECKED_AGAINST
    # trtllm-serve, and Triton's tensorrt_llm model (stacks/tritonserver), both MPI-launched across nodes
    servers = (Server("trtllm-serve", mpi_launch=True),)
    config_files: ClassVar[dict[str, str]] = {"trtllm_serve": SERVE_CONFIG}
    triton_models = (TRITON_MODEL,)
    metrics: ClassVar[StackMetrics | None] = METRICS

    def layout_problems(self, *, tp, pp, block_size):
        # DFlashDecodingConfig: max_draft_len (NonNegativeInt) = B - 1 drafted tokens per step
        return [] if block_size - 1 > 0 else [f"max_draft_len = {block_size - 1}: must be > 0"]

    def check_build(self, **kw):
        check_draft_context(**kw)

    def draft_schedule_problem(self, schedule=None):
        # DFlash honours max_concurrency / draft_len_schedule (serve_config.py: DRAFT_SCHEDULE_SOURCE); a
        # schedule whose length rises past its first cannot be said in them
        return None if schedule is None else trtllm_draft_schedule(list(schedule.ranges))[1]

    def draft_schedule_fields(self, schedule) -> dict:
        return trtllm_draft_schedule(list(schedule.ranges))[0]

    def _serve_config(self, ctx: BundleContext) -> dict:
        """configs/trtllm-serve.yaml's settings: the draft schedule fields build recorded for this stack
        (manifest draft_schedule.stacks.trtllm), the serving profile build decided."""
        rec = ctx.manifest.draft_schedule
        return serve_config(ctx.manifest, ctx.target_config, ctx.block_size, ctx.drafter,
                            rec.fields_for(self.name) if rec is not None else {}, profile=ctx.serving_profile)

    def write_configs(self, ctx: BundleContext) -> None:
        (ctx.work / SERVE_CONFIG).write_text(
            f"# {TRTLLM_SERVE.command()}   (run from the bundle root)\n"
            + yaml.safe_dump(self._serve_config(ctx), sort_keys=False))

    def triton_inputs(self, ctx: BundleContext) -> dict:
        return {"llm_yaml": llmapi_model_yaml(self._serve_config(ctx), "target", decoupled=True, max_batch_size=0)}

    def serve_commands(self, served):
        return {"triton": "tritonserver --model-repository triton",
                "triton_multinode": "trtllm-llmapi-launch tritonserver --model-repository triton",
                "trtllm_serve": TRTLLM_SERVE.command()}

    def launch_args(self, bundle: Path) -> LaunchArgs:
        """trtllm-serve on the bundle's configs/trtllm-serve.yaml, with the layout that file sets."""
        serve = Path(bundle) / SERVE_CONFIG
        if not serve.is_file():
            raise DFlashError(f"{serve}: missing (the bundle's TensorRT-LLM config)")
        try:
            cfg = yaml.safe_load(serve.read_text()) or {}
        except yaml.YAMLError as e:
            raise DFlashError(f"{serve}: invalid YAML ({e})") from None
        if not isinstance(cfg, dict) or (cfg.get("speculative_config") or {}).get("decoding_type") != "DFlash":
            raise DFlashError(f"{serve}: speculative_config.decoding_type is not DFlash")
        return replace(TRTLLM_SERVE, tp=int(cfg.get("tensor_parallel_size", 1)),
                       ep=int(cfg.get("moe_expert_parallel_size", 1)), pp=int(cfg.get("pipeline_parallel_size", 1)))

    def planner_settings(self, bundle, manifest):
        if bundle is None:    # build, before writing: the settings of the serve_config its writers write
            return llm_api_settings(serve_config(manifest, manifest.target.config, manifest.drafter.block_size),
                                    SERVE_CONFIG)
        return read_llm_api_settings(Path(bundle), manifest.triton_model_repository)

    def image_engine_version(self, image):
        # an NGC tritonserver image: Triton's compatibility matrix says which TensorRT-LLM it carries
        if image["repository"].endswith("/tritonserver") and engines.triton_image_engine(image["tag"]):
            return engines.triton_image_engine(image["tag"]), "Triton's compatibility matrix"
        return None


STACK = TensorRTLLM()
