"""The hardware catalog: node types the planner and the Helm chart know, kept as data in
hardware.json (memory, SM architecture, NVLink bandwidth, FP4/FP8 support, and the
`nvidia.com/gpu.product` node-label values GPU Feature Discovery reports for them)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from dflash_trt import OPENMP_WAIT_VARIABLES
from dflash_trt.errors import DFlashError


@dataclass(frozen=True)
class Hardware:
    name: str                      # catalog key, e.g. "dgx-b300"
    gpu: str                       # short GPU id used by bundles: b300, b200, gb200, h200, h100
    gpu_name: str
    gpu_product_labels: tuple[str, ...]
    gpus_per_node: int
    memory_bytes: int              # per GPU, the vendor's decimal figure
    memory_mib: int                # per GPU, the total the GPU reports (nvidia-smi memory.total)
    hbm_bytes_per_s: int
    sm: str
    arch: str                      # blackwell | hopper
    nvlink: str
    nvlink_bytes_per_s: int
    nvlink_domain_gpus: int
    fp4: bool
    fp8: bool
    # Dense (not 2:4 sparse) tensor-core peak per GPU by math format, "bf16" / "fp8" / "fp4" (FLOP/s),
    # and the datasheets these and the bandwidths come from: the speed model's inputs.
    dense_flops_per_s: dict = field(default_factory=dict, hash=False)
    sources: tuple[str, ...] = ()

    @property
    def reported_memory_bytes(self) -> int:
        """The memory the planner sizes against: what the GPU reports (MiB), in bytes."""
        return self.memory_mib * 2**20

    @property
    def gpu_product(self) -> str:
        """The label value the chart's node affinity selects by default."""
        return self.gpu_product_labels[0]


@lru_cache(maxsize=1)
def _data() -> dict:
    return json.loads(resources.files("dflash_trt").joinpath("hardware.json").read_text())


@lru_cache(maxsize=1)
def catalog() -> dict[str, Hardware]:
    return {name: Hardware(name=name, **dict(d, gpu_product_labels=tuple(d["gpu_product_labels"]),
                                             sources=tuple(d.get("sources", ()))))
            for name, d in _data()["hardware"].items()}


def arch_default_node(arch: str) -> Hardware:
    """The node type a bundle built for `arch` without --gpu deploys on (hardware.json
    arch_default_nodes: blackwell -> dgx-b300, hopper -> hgx-h200)."""
    defaults = _data().get("arch_default_nodes", {})
    if arch not in defaults:
        raise DFlashError(f"hardware.json: arch_default_nodes has no node for {arch!r}; known: {', '.join(defaults)}")
    hw = get_hardware(defaults[arch])
    if hw.arch != arch:
        raise DFlashError(f"hardware.json: arch_default_nodes.{arch} is {hw.name}, a {hw.arch} node")
    return hw


def get_hardware(name: str) -> Hardware:
    try:
        return catalog()[name]
    except KeyError:
        raise DFlashError(f"unknown hardware {name!r}; known: {', '.join(catalog())}") from None


def hardware_for_gpu(gpu: str) -> Hardware:
    """The catalog node type for a bundle's `gpu` field (b300 → dgx-b300, ...)."""
    for hw in catalog().values():
        if hw.gpu == gpu:
            return hw
    known = ", ".join(hw.gpu for hw in catalog().values())
    raise DFlashError(f"unknown GPU {gpu!r}; known: {known}")


# The GPU / architecture / SM facts every stage uses (build's --gpu and --arch, the plugin's
# cubins, quantize's FP4 check, the manifest schema, click choices) derive from the catalog.
def gpus() -> dict[str, Hardware]:
    """Bundle GPU id (b300, h200, ...) -> its node type, in catalog order."""
    out: dict[str, Hardware] = {}
    for hw in catalog().values():
        out.setdefault(hw.gpu, hw)
    return out


def sm_number(hw: Hardware) -> int:
    """"sm_103" -> 103."""
    return int(hw.sm.removeprefix("sm_"))


def arch_sms() -> dict[str, list[int]]:
    """Architecture (blackwell, hopper) -> the SM versions of its GPUs, ascending."""
    out: dict[str, set[int]] = {}
    for hw in catalog().values():
        out.setdefault(hw.arch, set()).add(sm_number(hw))
    return {arch: sorted(sms) for arch, sms in out.items()}


def arch_has_fp4(arch: str) -> bool:
    """FP4 tensor cores on every GPU of the architecture (Blackwell yes, Hopper no)."""
    hws = [hw for hw in catalog().values() if hw.arch == arch]
    return bool(hws) and all(hw.fp4 for hw in hws)


# The CPU the reference runtime runs on: benchmarks report it, because the same pair decodes at very
# different speeds on AVX2-only, AVX-512 and AMX machines (and `--dtype auto` depends on it).
_CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu() -> dict:
    """{"model", "features" (the ones that decide the GEMM paths), "cores", "openmp_wait"} of this machine
    (the OpenMP wait settings this process runs with: dflash_trt/__init__.py `openmp_wait`)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model or "unknown", "features": [f for f in _CPU_FEATURES if f in flags],
            "cores": os.cpu_count(),
            "openmp_wait": {k: os.environ[k] for k in OPENMP_WAIT_VARIABLES if k in os.environ}}
