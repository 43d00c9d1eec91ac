"""`doctor`: is this node ready for the bundle, before rollout. Each check runs what the machine allows and
says so: `ok`, `fail` (with what failed), or `not run` (with why: no GPU, no driver, no --bundle, ...), never
a pass it did not measure. On a GPU node every check runs; on a CPU machine the CUDA checks say they could not.

The checks, in order (CHECKS):
- driver: nvidia-smi's GPU, driver and CUDA version; torch's CUDA build sees the GPU and runs a kernel on it.
- bundle-gpu: the node's GPU is the bundle's (manifest `gpu`, `sm`).
- plugin-compile: the KV-injection kernel (kernels/kv_inject_triton.py) AOT-compiles to a cubin for the node's
  SM (stacks/trtllm/plugin.build_plugin; without a GPU: for the bundle's architecture).
- plugin-load: the driver loads that cubin and finds its kernel (cuModuleLoadData, cuModuleGetFunction).
- kv-inject-cuda: the Triton kernel on CUDA equals the reference KV injection (runtime/kv_inject.py) on the CPU.
- runtime-cpu / runtime-cuda: a tiny random pair (models/tiny.py) decodes with DFlash token-identically to AR.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt.errors import DFlashError
from dflash_trt.hardware import arch_sms
from dflash_trt.io.manifest import Manifest
from dflash_trt.models.config import DrafterConfig
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.tiny import make_tiny
from dflash_trt.runtime.kv_inject import inject_paged, quantize_fp8, reference_inject_paged
from dflash_trt.runtime.pair import generate, load_pair
from dflash_trt.stacks.trtllm.plugin import build_plugin

OK, FAIL, NOT_RUN = "ok", "fail", "not run"
KV_TOLERANCE = 1e-4   # float32 K/V: the GPU's FMA and summation order against the CPU reference


class NotRun(Exception):
    """A check that this machine cannot run; the message says why."""


@dataclass
class Node:
    """What the checks share: the GPU as nvidia-smi and torch see it, the bundle's manifest."""
    gpu_name: str | None = None
    driver: str | None = None
    cuda_driver: str | None = None      # the CUDA version the driver supports (nvidia-smi's header)
    sm: int | None = None               # compute capability as an SM number (9.0 -> 90)
    cuda_ok: bool = False               # torch can run a kernel on the GPU
    bundle: Path | None = None
    manifest: Manifest | None = None
    plugin_dir: Path | None = None      # the compiled plugin (plugin-compile), for plugin-load
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dflash-trt-doctor-")))


@dataclass
class Result:
    name: str
    status: str
    detail: str
    seconds: float


def _nvidia_smi(node: Node) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    try:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        head = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    if first := next((line for line in q.stdout.splitlines() if line.count(",") >= 2), None):
        name, driver, cap = (s.strip() for s in first.rsplit(",", 2))
        node.gpu_name, node.driver = name, driver
        if re.fullmatch(r"\d+\.\d+", cap):
            node.sm = int(cap.replace(".", ""))
    m = re.search(r"CUDA Version:\s*([\d.]+)", head)
    node.cuda_driver = m.group(1) if m else None


def check_driver(node: Node) -> str:
    import torch

    _nvidia_smi(node)
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"
    if node.gpu_name is None:
        smi = "found no GPU" if shutil.which("nvidia-smi") else "is not installed"
        raise NotRun(f"no NVIDIA GPU: nvidia-smi {smi}; {build}")
    if torch.version.cuda is None:
        raise DFlashError(f"{node.gpu_name} (driver {node.driver}) but {build} cannot use it: install a CUDA build")
    if not torch.cuda.is_available():
        raise DFlashError(f"{node.gpu_name} (driver {node.driver}, CUDA {node.cuda_driver}) but "
                          f"torch.cuda.is_available() is false with {build}: is the driver older than torch's CUDA?")
    x = torch.ones(64, 64, device="cuda")
    if float((x @ x).sum()) != 64.0 ** 3:
        raise DFlashError("a 64x64 matmul on the GPU gave a wrong result")
    node.cuda_ok = True
    major, minor = torch.cuda.get_device_capability(0)
    node.sm = major * 10 + minor
    return (f"{node.gpu_name}, driver {node.driver}, driver CUDA {node.cuda_driver}, {build}, "
            f"compute capability {major}.{minor}, {torch.cuda.device_count()} GPU(s)")


def check_bundle_gpu(node: Node) -> str:
    if node.manifest is None:
        raise NotRun("no --bundle given")
    m = node.manifest
    want = f"{m.gpu or 'none'} (sm {', '.join(map(str, m.sm)) or 'none'})"
    if not m.gpu or not m.sm:
        raise NotRun(f"{node.bundle} is a CPU-only bundle (--gpu none): no GPU to match")
    if node.sm is None:
        raise NotRun(f"no GPU on this machine to compare with the bundle's {want}")
    problems = []
    if node.sm not in m.sm:
        problems.append(f"the node's sm_{node.sm} is not one the bundle was built for ({want})")
    if m.gpu.lower() not in (node.gpu_name or "").lower():
        problems.append(f"the node's {node.gpu_name} is not the bundle's {m.gpu} (its plan and memory budget are for "
                        f"{m.gpu}; rebuild with --gpu for this node)")
    if problems:
        raise DFlashError("; ".join(problems))
    return f"{node.gpu_name} sm_{node.sm}: the bundle's {want}"


def _plugin_arch(node: Node) -> tuple[str, list[int]]:
    """The architecture to compile for (the node's SM, else the bundle's) and its SMs."""
    sms_of = arch_sms()
    sm = node.sm if node.sm is not None else (node.manifest.sm[0] if node.manifest and node.manifest.sm else None)
    if sm is None:
        raise NotRun("no GPU and no GPU bundle: no SM to compile for")
    arch = next((a for a, sms in sms_of.items() if sm in sms), None)
    if arch is None:
        known = ", ".join(f"{a}: {s}" for a, s in sms_of.items())
        raise DFlashError(f"sm_{sm} is neither Hopper nor Blackwell ({known})")
    return arch, [sm]


def check_plugin_compile(node: Node) -> str:
    if importlib.util.find_spec("triton") is None:
        raise NotRun("triton is not installed (the `plugin` extra)")
    arch, sms = _plugin_arch(node)
    out = node.work / "plugin"
    manifest = build_plugin(arch, out)
    mine = [k for k in manifest["kernels"] if k["sm"] in sms]
    node.plugin_dir = out
    return f"{len(mine)} cubin(s) for sm_{sms[0]} ({arch}, triton {manifest['triton_version']})"


def check_plugin_load(node: Node) -> str:
    if not node.cuda_ok:
        raise NotRun("no usable CUDA GPU (see driver)")
    if node.plugin_dir is None:
        raise NotRun("no cubin (plugin-compile did not run)")
    import torch

    torch.zeros(1, device="cuda")   # the primary context, current on this thread
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise NotRun(f"no CUDA driver library (libcuda.so.1: {e})") from None
    manifest = json.loads((node.plugin_dir / "plugin.json").read_text())
    loaded = []
    for k in (k for k in manifest["kernels"] if k["sm"] == node.sm):
        data = (node.plugin_dir / k["cubin"]).read_bytes()
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        rc = cuda.cuModuleLoadData(ctypes.byref(mod), data)
        if rc == 0:
            rc = cuda.cuModuleGetFunction(ctypes.byref(fn), mod, k["name"].encode())
            cuda.cuModuleUnload(mod)
        if rc != 0:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(rc, ctypes.byref(name))
            raise DFlashError(f"{k['cubin']}: the driver refuses it ({(name.value or b'?').decode()}, code {rc})")
        loaded.append(k["cubin"])
    if not loaded:
        raise DFlashError(f"no cubin for sm_{node.sm} in {node.plugin_dir}")
    return f"{len(loaded)} cubin(s) loaded, kernel {manifest['kernel']} found: {', '.join(loaded)}"


def _random_drafter(hd: int, bias: bool):
    import torch

    H = 96
    cfg = DrafterConfig.from_dict(dict(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
        intermediate_size=2 * H, vocab_size=64, block_size=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=1024, attention_bias=bias,
        dflash_config=dict(mask_token_id=1, target_layer_ids=[0, 1])))
    g = torch.Generator().manual_seed(hd)
    d = DFlashDrafter(cfg, max_len=1024)
    with torch.no_grad():
        for n, p in d.named_parameters():   # norms away from 1, biases non-zero: every weight matters
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1 and "norm" in n
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return d, g


def check_kv_inject_cuda(node: Node) -> str:
    if not node.cuda_ok:
        raise NotRun("no usable CUDA GPU (see driver)")
    if importlib.util.find_spec("triton") is None:
        raise NotRun("triton is not installed (the `plugin` extra)")
    import torch

    worst = []
    for hd, fp8, bias in ((64, False, True), (128, True, False)):
        d, g = _random_drafter(hd, bias)
        T, page, pages = 37, 16, 8
        feats = torch.randn(T, 2 * 96, generator=g)
        pos = torch.randint(0, 1024, (T,), generator=g)
        slots = torch.randperm(pages * page, generator=g)[:T]
        shape = (pages, 2, 2, page, hd)
        ref_k, ref_v = torch.zeros(shape), torch.zeros(shape)
        reference_inject_paged(d, feats, pos, slots, ref_k, ref_v, page)
        dt = torch.float8_e4m3fn if fp8 else torch.float32
        k, v = torch.zeros(shape, dtype=dt, device="cuda"), torch.zeros(shape, dtype=dt, device="cuda")
        scales = (0.02, 0.05) if fp8 else (None, None)
        inject_paged(d.to("cuda"), feats.cuda(), pos.cuda(), slots.cuda(), k, v, page, *scales, backend="triton")
        torch.cuda.synchronize()
        for name, got, ref, scale in (("K", k.cpu(), ref_k, scales[0]), ("V", v.cpu(), ref_v, scales[1])):
            if fp8:   # codes outside the rounding of ref +- tolerance
                lo = quantize_fp8(ref - KV_TOLERANCE, scale).float()
                hi = quantize_fp8(ref + KV_TOLERANCE, scale).float()
                if bad := int(((got.float() < lo) | (got.float() > hi)).sum()):
                    raise DFlashError(f"hd {hd} FP8 cache: {bad} {name} codes differ from the reference's")
                worst.append(f"hd {hd} fp8 {name}: every code within rounding")
            else:
                err = float((got - ref).abs().max())
                if not err <= KV_TOLERANCE:
                    raise DFlashError(f"hd {hd}: max |{name} - reference| = {err:.3g} > {KV_TOLERANCE}")
                worst.append(f"hd {hd} {name}: max err {err:.2g}")
    return "Triton kernel on CUDA equals the reference: " + "; ".join(worst)


def _tiny_lossless(node: Node, device: str) -> str:
    import torch

    if device == "cuda" and not node.cuda_ok:
        raise NotRun("no usable CUDA GPU (see driver)")
    t, d = node.work / "tiny" / "target", node.work / "tiny" / "drafter"
    if not t.exists():
        make_tiny("llama", t, d, seed=7)
    # float64: far from any near-tie of the random logits, whatever order the device's GEMMs sum in
    dtype = "float64" if device == "cuda" else "float32"
    with torch.device(device):
        pair = load_pair(t, d, dtype)
        taus = []
        for ids in ([5, 17, 99, 3, 250, 42], [8, 1, 240, 66, 12, 13, 150, 151], [3, 3, 3]):
            ar = generate(pair, ids, max_new_tokens=32, mode="ar").token_ids
            res = generate(pair, ids, max_new_tokens=32)
            if res.token_ids != ar:
                raise DFlashError(f"DFlash on {device} differs from AR for prompt {ids}: {res.token_ids} vs {ar}")
            taus.append(res.tau)
    where = next(pair.target.parameters()).device
    return f"3 prompts x 32 tokens on {where} ({dtype}): DFlash == AR, tau {', '.join(f'{x:.2f}' for x in taus)}"


CHECKS: tuple[tuple[str, Callable[[Node], str]], ...] = (
    ("driver", check_driver),
    ("bundle-gpu", check_bundle_gpu),
    ("plugin-compile", check_plugin_compile),
    ("plugin-load", check_plugin_load),
    ("kv-inject-cuda", check_kv_inject_cuda),
    ("runtime-cpu", lambda node: _tiny_lossless(node, "cpu")),
    ("runtime-cuda", lambda node: _tiny_lossless(node, "cuda")),
)


def run_doctor(bundle: str | Path | None = None, progress: Callable[[Result], None] = lambda r: None) -> dict:
    """Every check, in order; a check's own failure is its result, never the end of the run."""
    node = Node(bundle=Path(bundle) if bundle else None)
    if node.bundle is not None:
        node.manifest = Manifest.read(node.bundle)
    results = []
    try:
        for name, check in CHECKS:
            t0 = time.perf_counter()
            try:
                status, detail = OK, check(node)
            except NotRun as e:
                status, detail = NOT_RUN, str(e)
            except (DFlashError, RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
                status, detail = FAIL, f"{type(e).__name__}: {e}" if not isinstance(e, DFlashError) else str(e)
            r = Result(name, status, detail, round(time.perf_counter() - t0, 2))
            results.append(r)
            progress(r)
    finally:
        shutil.rmtree(node.work, ignore_errors=True)
    counts = {s: sum(r.status == s for r in results) for s in (OK, FAIL, NOT_RUN)}
    return {"bundle": str(node.bundle) if node.bundle else None, "gpu": node.gpu_name, "sm": node.sm,
            "checks": [asdict(r) for r in results], "counts": counts, "ok": counts[FAIL] == 0}
