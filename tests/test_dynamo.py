"""`deploy --server dynamo`: a DynamoGraphDeployment for a bundle, checked against Dynamo's own CRD
schema (unknown fields refused) and every worker's command line against that worker's own argument
parser, read with `ast` from the ai-dynamo 1.6.1 wheel (and the engine wheels its workers pass the
rest to: vllm 0.31.0, the version Dynamo 1.6.1 pins; sglang 0.5.23). The wheels are fetched with
`pip download --no-deps` into tests/.cache/wheels, never installed (as tests/test_stack_conformance.py).

The bundles are manifest.json files of presets (no weights: deploy reads the manifest and the
configs) with the configs the stacks' own writers produce for them (stacks/vllm/launch.py,
stacks/trtllm/serve_config.py, stacks/sglang.py)."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from dflash_trt import engines
from dflash_trt.deploy import dynamo
from dflash_trt.errors import DFlashError
from dflash_trt.io.manifest import list_artifacts
from dflash_trt.io.manifest import validate as validate_manifest
from dflash_trt.plan import planner
from dflash_trt.stacks import trtllm as trtllm_stack
from dflash_trt.stacks.sglang import sglang_launch
from dflash_trt.stacks.vllm.launch import vllm_launch

from helpers import add_plan, run_cli, wheel_source

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
WHEELS = {"ai_dynamo": "ai-dynamo==1.6.1", "vllm": "vllm==0.31.0", "sglang": "sglang==0.5.23"}


# ------------------------------------------------------------------------------ the bundles
def write_bundle(root: Path, *, target="gpt-oss-120b", gpu="b300", arch="blackwell", quant="mxfp4", kv="fp8", tp=8,
                 ep=1, stacks=("trtllm", "vllm", "sglang"), spec_extra: dict | None = None) -> Path:
    """A bundle of a preset without weights: its manifest (the shape `build` writes, validated) and the
    serving configs the stacks' own writers produce. spec_extra: keys a draft schedule adds to vLLM's
    speculative config (issue 33), to show they are carried as the file holds them."""
    _, cfg, dcfg = planner.target_configs(target)
    bundle = root / f"{target}-{gpu}-{'-'.join(stacks)}"
    (bundle / "configs").mkdir(parents=True)
    ids = dcfg["dflash_config"]["target_layer_ids"]
    B = dcfg.get("block_size", 8)
    m = {
        "schema_version": 1, "tool_version": "0.1.0",
        "target": {"name": target, "hf_id": None, "path": f"/src/{target}", "bundle_path": "target", "config": cfg},
        "drafter": {"path": "/src/drafter", "bundle_path": "drafter", "block_size": B, "mask_token_id": 0,
                    "config": dcfg,
                    "target_layer_ids": {"zlab": ids, "trtllm": ids, "speculators": [i + 1 for i in ids],
                                         "vllm": ids, "sglang": [i - 1 for i in ids]}},
        "arch": arch, "gpu": gpu, "quant": {"target": quant, "drafter": "none", "kv_cache": kv},
        "parallel": {"tp": tp, "ep": ep, "pp": 1}, "backend": "pytorch", "max_seq_len": 32768,
        "stages": {}, "triton_model_repository": "triton", "triton_models": ["tensorrt_llm", "dflash_reference"],
        "artifacts": [], "serving_stacks": {"served": list(stacks), "skipped": {}},
        "engines": engines.manifest_record(list(stacks)),
    }
    if "vllm" in stacks:
        v = vllm_launch(target_path="target", drafter_path="drafter", block_size=B, zlab_ids=ids, tp=tp, ep=ep, pp=1,
                        kv_cache=kv, dtype=cfg.get("torch_dtype"))
        (bundle / "configs/vllm.json").write_text(json.dumps(v))
        spec = {**v["speculative_config"], **(spec_extra or {})}
        (bundle / "configs/vllm-speculative-config.json").write_text(json.dumps(spec))
    if "trtllm" in stacks:
        (bundle / "configs/trtllm-serve.yaml").write_text(yaml.safe_dump(trtllm_stack.serve_config(m, cfg, B)))
    if "sglang" in stacks:
        g = sglang_launch(target_path="target", drafter_path="drafter", block_size=B, zlab_ids=ids, tp=tp, ep=ep, pp=1,
                          kv_cache=kv)
        (bundle / "configs/sglang.json").write_text(json.dumps(g))
    m["artifacts"] = [dataclasses.asdict(a) for a in list_artifacts(bundle)]   # deploy verifies a bundle first, as `verify` does
    validate_manifest(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    add_plan(bundle)               # plan.json, as build writes it: what deploy reads
    return bundle


def deploy_json(*args: str) -> dict:
    code, out, err = run_cli("deploy", *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("dyn"))


# ------------------------------------------------------------------------------ the CRD copy
def test_crd_copy_is_dynamos_dgd_crd_as_sources_md_says():
    path = ROOT / "deploy/schemas/nvidia.com_dynamographdeployments.yaml"
    sources = (ROOT / "deploy/schemas/SOURCES.md").read_text()
    assert hashlib.sha256(path.read_bytes()).hexdigest() in sources
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["group"] == "nvidia.com" and crd["spec"]["names"]["kind"] == "DynamoGraphDeployment"
    assert "Apache-2.0" in path.read_text()[:400]


# ------------------------------------------------------------------------------ rendering
def _services(d: dict) -> dict:
    return d["dgd_content"]["spec"]["services"]


def test_aggregated_dgd_of_gptoss_on_b300(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--nodes", "2", "--out", str(tmp_path / "o"))
    svc = _services(d)
    assert set(svc) == {"Frontend", "VllmWorker"} and d["engine"] == "vllm"   # vLLM first: Dynamo's DFlash recipes
    fe = svc["Frontend"]["extraPodSpec"]["mainContainer"]
    assert fe["command"] == ["python3", "-m", "dynamo.frontend"] and fe["args"][-2:] == ["--router-mode", "kv"]
    w = svc["VllmWorker"]
    assert w["replicas"] == 2                                   # the planner's: 2 nodes x 8 GPUs / tp 8
    assert w["resources"]["requests"]["gpu"] == w["resources"]["limits"]["gpu"] == "8"
    term = w["extraPodSpec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["NVIDIA-B300-SXM6-AC"]
    assert w["volumeMounts"] == [{"name": "dflash-trt-bundle", "mountPoint": "/bundle"}]
    assert d["dgd_content"]["spec"]["pvcs"] == [{"name": "dflash-trt-bundle", "create": False}]
    mc = w["extraPodSpec"]["mainContainer"]
    assert mc["image"] == "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1" and mc["workingDir"] == "/bundle"
    args = mc["args"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == json.loads((gptoss / "configs/vllm-speculative-config.json").read_text())
    assert spec["method"] == "dflash" and spec["model"] == "drafter"
    assert args[args.index("--tensor-parallel-size") + 1] == "8" and "--disaggregation-mode" not in args
    assert w["livenessProbe"]["httpGet"] == {"path": "/live", "port": 9090}
    assert {"name": "DYN_SYSTEM_PORT", "value": "9090"} in w["envs"]
    assert w["extraPodMetadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    written = yaml.safe_load((tmp_path / "o" / "dgd.yaml").read_text())
    assert written == d["dgd_content"] and d["schema_check"] == "passed"
    dynamo.check_dgd(written)                                   # and again, from the file


def test_disaggregated_dgd_splits_prefill_and_decode_with_the_drafter(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--nodes", "4", "--disaggregated", "--isl", "8192",
                    "--osl", "1024", "--out", str(tmp_path / "o"), "--render")
    svc = _services(d)
    assert set(svc) == {"Frontend", "VllmPrefillWorker", "VllmDecodeWorker"}
    split = d["disaggregated"]
    assert split["prefill_instances"] + split["decode_instances"] == 4 and min(split["prefill_instances"],
                                                                               split["decode_instances"]) >= 1
    for role in ("prefill", "decode"):
        w = svc[f"Vllm{role.capitalize()}Worker"]
        assert w["subComponentType"] == role and w["replicas"] == split[f"{role}_instances"]
        args = w["extraPodSpec"]["mainContainer"]["args"]
        assert args[args.index("--disaggregation-mode") + 1] == role
        assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector"] == "NixlConnector"
        assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "dflash"
    assert (tmp_path / "o/manifests/dgd.yaml").read_text() == (tmp_path / "o/dgd.yaml").read_text()


def test_trtllm_workers_load_the_bundles_trtllm_config(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--engine", "trtllm", "--out", str(tmp_path / "o"))
    args = _services(d)["TrtllmWorker"]["extraPodSpec"]["mainContainer"]["args"]
    assert args[args.index("--extra-engine-args") + 1] == "configs/trtllm-serve.yaml"
    assert d["image"] == {"image": "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.6.1", "engine_version": "1.3.0rc29"}


def test_a_draft_schedule_in_the_speculative_config_is_carried(tmp_path):
    # vLLM's control (vllm/config/speculative.py num_speculative_tokens_per_batch_size: list of (lo, hi, k))
    extra = {"num_speculative_tokens_per_batch_size": [[1, 16, 9], [17, 128, 3]]}
    b = write_bundle(tmp_path, stacks=("vllm",), spec_extra=extra)
    d = deploy_json("--bundle", str(b), "--server", "dynamo", "--out", str(tmp_path / "o"))
    args = _services(d)["VllmWorker"]["extraPodSpec"]["mainContainer"]["args"]
    assert json.loads(args[args.index("--speculative-config") + 1])["num_speculative_tokens_per_batch_size"] == \
        extra["num_speculative_tokens_per_batch_size"]


def test_each_workers_arguments_and_the_stacks_own_command_line_are_one_launch(gptoss):
    """Stack.launch_args is the one record: the stack's own command line (configs/<stack>.json argv, the
    manifest's trtllm_serve entry) is its argv(), and the Dynamo worker's arguments carry its model and
    flags unchanged (their names checked against the workers' parsers in the tests below)."""
    from dflash_trt import stacks

    for name in ("vllm", "sglang"):
        launch = stacks.get(name).launch_args(gptoss)
        assert launch.argv() == json.loads((gptoss / f"configs/{name}.json").read_text())["argv"]
        argv, env = dynamo.worker_argv(name, gptoss, "served")
        assert argv[3:] == [dynamo.facts()["workers"][name]["args"]["model"], launch.model, *launch.flags,
                            "--served-model-name", "served"]
        assert env == dict(launch.env)
    launch = stacks.get("trtllm").launch_args(gptoss)
    assert launch.command() == stacks.get("trtllm").serve_commands(["trtllm"])["trtllm_serve"]
    serve = yaml.safe_load((gptoss / "configs/trtllm-serve.yaml").read_text())
    assert (launch.tp, launch.ep) == (serve["tensor_parallel_size"], serve.get("moe_expert_parallel_size", 1))


# ------------------------------------------------------------------------------ the schema check
def test_schema_check_refuses_unknown_fields_the_api_server_would_prune(gptoss, tmp_path):
    dgd = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--out", str(tmp_path / "o"))["dgd_content"]
    dynamo.check_dgd(dgd)
    raw = yaml.safe_load((ROOT / "deploy/schemas/nvidia.com_dynamographdeployments.yaml").read_text())
    raw_schema = raw["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, key in ((["spec"], "service"), (["spec", "services", "VllmWorker"], "replica"),
                      (["spec", "services", "VllmWorker", "extraPodSpec", "mainContainer"], "workdir"),
                      (["spec", "services", "VllmWorker", "resources", "requests"], "gpus")):
        bad = json.loads(json.dumps(dgd))
        node = bad
        for p in path:
            node = node[p]
        node[key] = "x"
        with pytest.raises(DFlashError, match=f"'{key}' was unexpected"):
            dynamo.check_dgd(bad)
        # the CRD as published leaves additionalProperties out: open, it would accept (and the API server prune)
        jsonschema.Draft7Validator(raw_schema).validate(bad)
    bad = json.loads(json.dumps(dgd))
    bad["spec"]["backendFramework"] = "tensorrt"
    with pytest.raises(DFlashError, match="spec.backendFramework"):
        dynamo.check_dgd(bad)
    bad = json.loads(json.dumps(dgd))
    bad["spec"]["services"]["VllmWorker"]["replicas"] = "2"
    with pytest.raises(DFlashError, match="replicas"):
        dynamo.check_dgd(bad)


def test_the_closing_rule_keeps_preserve_unknown_fields_open():
    """Kubernetes prunes unknown fields except under x-kubernetes-preserve-unknown-fields; this CRD has no
    such node (so everything is closed), and the rule is checked here on a schema that has one."""
    schema = {"type": "object", "properties": {
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
        "kept": {"type": "object", "properties": {"a": {"type": "string"}}, "x-kubernetes-preserve-unknown-fields": True},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "size": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    v = jsonschema.Draft7Validator(dynamo._closed(schema))
    assert v.is_valid({"kept": {"a": "x", "other": 1}, "map": {"any": "x"}, "size": 3})
    assert v.is_valid({"size": "3Gi"})
    assert not v.is_valid({"closed": {"a": "x", "other": 1}})
    assert not v.is_valid({"top": 1})
    assert "x-kubernetes-preserve-unknown-fields" not in (ROOT / "deploy/schemas/"
                                                           "nvidia.com_dynamographdeployments.yaml").read_text()


# ------------------------------------------------------------------------------ refusals: one line, nothing written
@pytest.mark.parametrize("args, stacks, message", [
    # Dynamo 1.6.1's SGLang image pins sglang 0.5.21; DFlash is first read in 0.5.23 (engines.json)
    ([], ("sglang",), "SGLang 0.5.21 predates DFlash"),
    (["--engine", "sglang"], ("vllm", "sglang"), "SGLang 0.5.21 predates DFlash"),
    (["--image", "registry.example.com/vllm-runtime:old", "--engine-version", "0.18.1"], ("vllm",),
     "vLLM 0.18.1 predates DFlash"),
    (["--engine", "trtllm", "--disaggregated", "--nodes", "2"], ("trtllm", "vllm"),
     "--disaggregated with trtllm workers"),
    (["--disaggregated"], ("vllm",), "at least 2 instances"),
    (["--engine", "trtllm"], ("vllm",), "holds no trtllm config"),
    (["--isl", "100"], ("vllm",), "add --disaggregated"),
    (["--multinode-image", "r/x:1"], ("vllm",), "--multinode-image: not used by --server dynamo"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, args, stacks, message):
    b = write_bundle(tmp_path, stacks=stacks)
    out = tmp_path / "out"
    code, _, err = run_cli("deploy", "--bundle", str(b), "--server", "dynamo", "--out", str(out), *args)
    assert code != 0 and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_dynamo_options_refused_for_the_charts_servers(gptoss, tmp_path):
    code, _, err = run_cli("deploy", "--bundle", str(gptoss), "--disaggregated", "--out", str(tmp_path / "o"))
    assert code != 0 and "--disaggregated is for --server dynamo" in err


# ------------------------------------------------------------------------------ item 3: plan --disaggregated
def test_plan_disaggregated_is_an_estimate_that_follows_the_lengths():
    def split(isl, osl):
        code, out, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--nodes", "8",
                                 "--disaggregated", "--isl", str(isl), "--osl", str(osl), "--json")
        assert code == 0, err
        return json.loads(out)["disaggregated"]
    long_prompt, long_answer = split(16384, 256), split(256, 8192)
    for s in (long_prompt, long_answer):
        assert s["prefill_instances"] + s["decode_instances"] == 8 and s["prefill_gpus"] == 8 * s["prefill_instances"]
        assert "estimate" in s["assumptions"][0]
        assert s["prefill_ms_range"][0] <= s["prefill_ms"] <= s["prefill_ms_range"][1]
    # long prompts need more prefill instances than long answers do
    assert long_prompt["prefill_instances"] > long_answer["prefill_instances"]
    assert long_prompt["prefill_ms"] > 5 * long_answer["prefill_ms"]   # 64 x the tokens; fixed costs dominate 256
    code, out, _ = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--nodes", "2",
                           "--disaggregated")
    assert code == 0 and "disaggregated (ESTIMATE) for isl 4096 / osl 1024" in out
    code, _, err = run_cli("plan", "--target", "gpt-oss-120b", "--hardware", "dgx-b300", "--isl", "10")
    assert code != 0 and "add --disaggregated" in err


# ------------------------------------------------------------------------------ each worker's own parser
def _source(name: str, path: str) -> str:
    return wheel_source(WHEELS[name], path)


def _dynamo_module(mod: str) -> str:
    return _source("ai_dynamo", mod.replace(".", "/") + ".py")


def parser_flags(*modules: str) -> tuple[set[str], dict[str, list]]:
    """({--flag}, {--flag: literal choices}) that the Dynamo arg groups of these modules (and the
    dynamo.common.configuration.groups modules they import, transitively) register: the calls of
    add_argument / add_negatable_bool_argument (dynamo/common/configuration/utils.py: flag_name and
    obsolete_flag; negatable flags also as --no-<name>) and argparse's own add_argument("--x")."""
    flags, choices, seen, todo = set(), {}, set(), list(modules)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        tree = ast.parse(_dynamo_module(mod))
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("dynamo.common.configuration.groups."):
                todo.append(n.module)
            if not isinstance(n, ast.Call):
                continue
            fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if fn not in ("add_argument", "add_negatable_bool_argument"):
                continue
            kw = {k.arg: k.value for k in n.keywords if k.arg}
            names = [a.value for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            names += [kw[k].value for k in ("flag_name", "obsolete_flag")
                      if isinstance(kw.get(k), ast.Constant) and isinstance(kw[k].value, str)]
            negatable = fn == "add_negatable_bool_argument" or (
                isinstance(kw.get("action"), ast.Attribute) and kw["action"].attr == "BooleanOptionalAction")
            for name in names:
                flags.add(name)
                if negatable:
                    flags.add("--no-" + name[2:])
                if isinstance(kw.get("choices"), (ast.List, ast.Tuple)):
                    try:
                        choices[name] = ast.literal_eval(kw["choices"])
                    except ValueError:
                        pass
    return flags, choices


def _enum_values(src: str, cls: str) -> set[str]:
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.value.value for s in node.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)}


def _vllm_engine_flags() -> set[str]:
    """vLLM 0.31.0's EngineArgs fields as flags (arg_utils: "--" + name.replace("_", "-")), what dynamo.vllm
    hands the flags it does not know to (dynamo/vllm/args.py: AsyncEngineArgs.add_cli_args)."""
    src = _source("vllm", "vllm/engine/arg_utils.py")
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return {"--" + f.replace("_", "-") for f in fields} | {"--no-" + f.replace("_", "-") for f in fields}


def _flags_of(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def test_frontend_arguments_are_dynamo_frontends(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--out", str(tmp_path / "o"))
    args = _services(d)["Frontend"]["extraPodSpec"]["mainContainer"]["args"]
    flags, choices = parser_flags("dynamo.frontend.frontend_args")
    assert set(_flags_of(args)) <= flags, set(_flags_of(args)) - flags
    assert "kv" in choices["--router-mode"] and args[args.index("--router-mode") + 1] == "kv"
    # negative control: the reader is not vacuous
    assert "--router-mode" in flags and "--speculative-config" not in flags


def test_vllm_worker_arguments_are_dynamo_vllms_or_vllm_0_31s(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--nodes", "2", "--disaggregated",
                    "--out", str(tmp_path / "o"))
    own, choices = parser_flags("dynamo.vllm.backend_args", "dynamo.common.configuration.groups.runtime_args")
    engine = _vllm_engine_flags()
    modes = _enum_values(_dynamo_module("dynamo.common.constants"), "DisaggregationMode")  # vllm/constants re-exports it
    spec_src = _source("vllm", "vllm/config/speculative.py")
    spec_node = next(n for n in ast.walk(ast.parse(spec_src)) if isinstance(n, ast.ClassDef)
                     and n.name == "SpeculativeConfig")
    spec_fields = {s.target.id for s in spec_node.body if isinstance(s, ast.AnnAssign)}
    assert "dflash" in spec_src
    for name in ("VllmPrefillWorker", "VllmDecodeWorker"):
        mc = _services(d)[name]["extraPodSpec"]["mainContainer"]
        assert mc["command"] == ["python3", "-m", "dynamo.vllm"]
        args = mc["args"]
        unknown = [f for f in _flags_of(args) if f not in own and f not in engine]
        assert not unknown, f"{name}: not flags of dynamo.vllm 1.6.1 nor vLLM 0.31.0: {unknown}"
        assert args[args.index("--disaggregation-mode") + 1] in modes
        assert set(json.loads(args[args.index("--speculative-config") + 1])) <= spec_fields
    assert "--disaggregation-mode" in own and "--tensor-parallel-size" in engine and "--bogus-flag" not in engine | own
    assert {"prefill", "decode"} <= modes


def test_trtllm_worker_arguments_are_dynamo_trtllms(gptoss, tmp_path):
    d = deploy_json("--bundle", str(gptoss), "--server", "dynamo", "--engine", "trtllm", "--out", str(tmp_path / "o"))
    own, _ = parser_flags("dynamo.trtllm.backend_args", "dynamo.common.configuration.groups.runtime_args")
    mc = _services(d)["TrtllmWorker"]["extraPodSpec"]["mainContainer"]
    assert mc["command"] == ["python3", "-m", "dynamo.trtllm"]
    # dynamo.trtllm takes only its own flags (and --trtllm.* overrides): no engine parser behind it
    assert set(_flags_of(mc["args"])) <= own, set(_flags_of(mc["args"])) - own


def test_sglang_worker_arguments_with_an_sglang_that_has_dflash(tmp_path):
    """Dynamo 1.6.1's image is refused (sglang 0.5.21); an image declared with 0.5.23 renders, and each flag is
    dynamo.sglang's own or SGLang 0.5.23's (tests/test_stack_conformance.py reads SGLang's fields)."""
    from test_stack_conformance import _sglang_fields

    b = write_bundle(tmp_path, stacks=("sglang",))
    d = deploy_json("--bundle", str(b), "--server", "dynamo", "--image", "registry.example.com/dynamo-sglang:1.6.1-"
                    "sglang0.5.23", "--engine-version", "0.5.23", "--out", str(tmp_path / "o"))
    own, _ = parser_flags("dynamo.sglang.backend_args", "dynamo.common.configuration.groups.runtime_args")
    _, sgl = _sglang_fields()
    args = _services(d)["SglangWorker"]["extraPodSpec"]["mainContainer"]["args"]
    unknown = [f for f in _flags_of(args) if f not in own and f not in sgl]
    assert not unknown, unknown
    assert args[args.index("--speculative-algorithm") + 1] == "DFLASH"
