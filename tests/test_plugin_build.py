"""AOT build of the KV-injection kernel: cubin + PTX for every SM of the chosen --arch, whose
SASS architecture cuobjdump (CUDA 13.x, from PyPI) confirms; the manifest's launch parameters
are what the TensorRT plugin module's plain-Python logic returns; bad input gives one-line errors."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_sms
from dflash_trt.kernels import kv_inject_trt
from dflash_trt.paths import package_path
from dflash_trt.stacks.trtllm.plugin import build_plugin

from helpers import run_cli


def find_cuobjdump() -> tuple[Path, dict]:
    """cuobjdump to inspect the cubins, and the environment to run it with. Prefers the CUDA 13.x
    one from PyPI (nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm: decodes sm_90, sm_100 and sm_103),
    then triton's bundled 12.8 copy (decodes up to sm_100), then one on PATH."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(root) / "cu13" / "bin" / "cuobjdump")
    tspec = importlib.util.find_spec("triton")
    if tspec and tspec.origin:
        candidates.append(Path(tspec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    which = shutil.which("cuobjdump")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            env = dict(os.environ)
            env["PATH"] = f"{c.parent}{os.pathsep}{env.get('PATH', '')}"  # its nvdisasm sits beside it
            return c, env
    raise DFlashError("cuobjdump: not found (pip install 'dflash-trt[plugin]' brings nvidia-cuda-cuobjdump)")


def sass_info(cubin) -> dict:
    """Disassemble a cubin with cuobjdump -sass: {"arch": "sm_100a", "functions": [...], "instructions": n}."""
    exe, env = find_cuobjdump()
    r = subprocess.run([str(exe), "-sass", str(cubin)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise DFlashError(f"{cubin}: cuobjdump -sass failed ({(r.stderr or r.stdout).strip().splitlines()[-1]})")
    arch = re.search(r"code for (sm_\w+)", r.stdout)
    return {"arch": arch.group(1) if arch else None,
            "functions": re.findall(r"Function : (\S+)", r.stdout),
            "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", r.stdout, re.MULTILINE))}


@pytest.fixture(scope="module", params=["blackwell", "hopper"])
def built(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "plugin"
    manifest = build_plugin(request.param, out)
    return request.param, out, manifest


@pytest.fixture(scope="module")
def trt_mod():
    return kv_inject_trt


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_every_arch_compiled_and_sass_confirmed(built):
    arch, out, m = built
    assert json.loads((out / "plugin.json").read_text()) == m
    assert m["sms"] == list(arch_sms()[arch]) and {k["sm"] for k in m["kernels"]} == set(arch_sms()[arch])
    assert {(k["head_dim"], k["cache_dtype"]) for k in m["kernels"]} == {(64, "bf16"), (64, "fp8e4m3"),
                                                                         (128, "bf16"), (128, "fp8e4m3")}
    for k in m["kernels"]:
        cubin, ptx = out / k["cubin"], out / k["ptx"]
        assert _sha(cubin) == k["cubin_sha256"] and _sha(ptx) == k["ptx_sha256"]
        sass = sass_info(cubin)  # cuobjdump -sass: decodes the machine code, not just the header
        assert sass["arch"] == f"sm_{k['sm']}a", (k["cubin"], sass)
        assert sass["functions"] == [k["name"]] and sass["instructions"] > 100
        assert re.search(rf"^\.target\s+sm_{k['sm']}a\b", ptx.read_text(), re.M)


def test_manifest_source_hashes(built):
    m = built[2]
    assert m["source"]["kernel"]["sha256"] == _sha(package_path("kernels", "kv_inject_triton.py"))
    assert m["source"]["plugin"]["sha256"] == _sha(package_path("kernels", "kv_inject_trt.py"))


@pytest.mark.parametrize("T", [1, 7, 16, 100])
def test_launch_params_match_plugin_logic(built, trt_mod, T):
    m = built[2]
    for k in m["kernels"]:
        for L, nkv in ((1, 3), (8, 8), (5, 2)):
            names = dict(T=T, num_layers=L, num_kv_heads=nkv, BLOCK_T=k["constexprs"]["BLOCK_T"])
            grid_from_manifest = [eval(f, {"__builtins__": {}}, names) for f in m["grid"]["formula"]]
            cfg = trt_mod.kernel_config(k["head_dim"])   # what register_plugin's aot_impl launches with
            assert list(trt_mod.grid(T, L, nkv, cfg["BLOCK_T"])) == grid_from_manifest
            assert [cfg["num_warps"] * 32, 1, 1] == k["block"] == [k["num_warps"] * 32, 1, 1]  # compiled metadata
            assert cfg["BLOCK_K"] == k["constexprs"]["BLOCK_K"]


def test_kernel_parameters_match_plugin_calling_convention(built, trt_mod):
    """The compiled entry takes: the plugin inputs, the scalar extra_args, the outputs (TensorRT's
    AOT order), then Triton's two hidden scratch pointers."""
    out, m = built[1], built[2]
    ptr_in = ["ctx_ptr", "w_ptr", "b_ptr", "knorm_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr", "scal_ptr",
              "k_in_ptr", "v_in_ptr"]
    assert m["arg_order"] == ptr_in + list(trt_mod.SCALAR_NAMES) + ["k_out_ptr", "v_out_ptr"]
    assert len(ptr_in) == len(trt_mod.INPUT_NAMES)
    for k in m["kernels"]:
        ptx = (out / k["ptx"]).read_text()
        params = re.findall(rf"\.param \.(\w+)(?: \.ptr \.global \.align \d+)? {k['name']}_param_(\d+)", ptx)
        kinds = [t for t, _ in params]
        n = len(m["arg_order"])
        assert len(kinds) == n + len(m["hidden_trailing_args"])
        assert kinds[:11] == ["u64"] * 11 and kinds[11:20] == ["u32"] * 9 and kinds[20:] == ["u64"] * 4
        assert k["global_scratch_size"] == 0  # so the hidden scratch pointers may be null


def test_scalar_args_match_torch_strides(trt_mod):
    P, L, nkv, page, hd, T, H = 5, 3, 2, 16, 64, 7, 96
    cache = torch.empty(P, L, nkv, page, hd)
    got = dict(zip(trt_mod.SCALAR_NAMES, trt_mod.paged_cache_scalars(T, H, L, nkv, hd, page)))
    assert (got["stride_page"], got["stride_layer"], got["stride_head"], got["stride_tok"]) == cache.stride()[:4]
    assert got["page_shift"] == 4 and got["T"] == T and got["H"] == H and got["stride_ctx"] == H


def test_bad_page_size_and_head_dim(trt_mod):
    L, nkv, hd, T, H = 2, 2, 64, 5, 96
    with pytest.raises(ValueError, match="power of two"):
        trt_mod.paged_cache_scalars(T, H, L, nkv, hd, 12)
    with pytest.raises(ValueError, match="head_dim 80"):
        trt_mod.kernel_config(80)


def test_select_kernel(built, trt_mod):
    arch, _, m = built
    sm = arch_sms()[arch][-1]
    k = trt_mod.select_kernel(m, sm, 128, "bf16", "fp8e4m3")
    assert (k["sm"], k["head_dim"], k["cache_dtype"]) == (sm, 128, "fp8e4m3")
    with pytest.raises(ValueError, match="no kernel for sm_80"):
        trt_mod.select_kernel(m, 80, 128, "bf16", "bf16")


def test_unknown_arch(tmp_path):
    with pytest.raises(DFlashError, match="--arch 'ampere': expected one of blackwell, hopper"):
        build_plugin("ampere", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_cli(tmp_path):
    code, out, _ = run_cli("plugin", "build", "--arch", "hopper", "--out", str(tmp_path / "p"), "--json")
    assert code == 0
    m = json.loads(out)
    assert m["arch"] == "hopper" and (tmp_path / "p" / "plugin.json").is_file()
    code, _, err = run_cli("plugin", "build", "--arch", "volta", "--out", str(tmp_path / "q"))
    assert code == 1
    assert err.strip() == "error: --arch 'volta': expected one of blackwell, hopper"
