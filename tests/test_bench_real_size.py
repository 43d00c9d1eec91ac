"""bench/bench_build_real_size.py writes the tensors openai/gpt-oss-20b ships: checked against
transformers' own GptOss model (built on the meta device from the preset's config.json), with
its experts stored as MXFP4 blocks / scales the way transformers' mxfp4 integration reads them."""
from __future__ import annotations

import importlib.util
import json
import struct

import torch

from dflash_trt.paths import package_path
from dflash_trt.presets.catalog import get_preset


def _bench():
    spec = importlib.util.spec_from_file_location("bench_build_real_size",
                                                  package_path().parent / "bench" / "bench_build_real_size.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_target_tensors_are_the_gpt_oss_20b_checkpoint():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = get_preset("gpt-oss-20b").config()
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    want = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):   # [E, in, out] -> MXFP4 over `in`
            E, n_in, n_out = t.shape
            want[name + "_blocks"] = ("U8", (E, n_out, n_in // 32, 16))
            want[name + "_scales"] = ("U8", (E, n_out, n_in // 32))
        else:
            want[name] = ("BF16", tuple(t.shape))
    got = {n: (d, tuple(s)) for n, d, s in _bench().target_tensors(cfg)}
    assert got == want
    total = sum(torch.Size(s).numel() * (2 if d == "BF16" else 1) for d, s in got.values())
    assert 13.7e9 < total < 13.8e9   # the published gpt-oss-20b safetensors: 13.8 GB


def test_streamed_safetensors_file_reads_back(tmp_path):
    import numpy as np
    from safetensors import safe_open

    b = _bench()
    tensors = [("a.weight", "BF16", (3, 5)), ("e_blocks", "U8", (2, 4, 16)), ("e_scales", "U8", (2, 4))]
    path = tmp_path / "x.safetensors"
    b.write_safetensors(path, tensors, np.random.default_rng(0))
    with safe_open(str(path), "pt") as f:
        assert {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()} == {  # noqa: SIM118
            "a.weight": (torch.bfloat16, (3, 5)), "e_blocks": (torch.uint8, (2, 4, 16)), "e_scales": (torch.uint8, (2, 4))}
        assert torch.isfinite(f.get_tensor("a.weight").float()).all()
        assert int(f.get_tensor("e_scales").min()) >= 118 and int(f.get_tensor("e_scales").max()) < 130
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + n) % 8 == 0 and json.loads(path.read_bytes()[8:8 + n])["__metadata__"] == {"format": "pt"}
