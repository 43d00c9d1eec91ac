"""float32 linear layers for the CPU runtime's decode sizes: a prepacked weight and csrc/gemm.c.

`linear(x, w, b)` is F.linear; in float32, at up to MAX_ROWS rows, without autograd, it runs the packed
C kernel (faster than MKL at M = 1..17, bench/bench_gemm.py, and batch-invariant). The packed copy is kept
on the weight tensor itself and remade if the weight changes in place; bf16 weights use oneDNN (`path`).
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from dflash_trt.kernels import c_loader

# Prefill and training run through torch: at hundreds of rows MKL's blocked GEMM is as fast, and only
# verify-sized blocks need to match one-row steps bitwise.
MAX_ROWS = 64

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"gemm_pack_f32": [_P, _P, _I, _I, ctypes.c_int],
               "gemm_f32": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]}


@functools.cache
def _library_facts(lib: ctypes.CDLL) -> tuple[int, str]:
    """(panel width, path name) compiled into `lib`: the packed layout depends on the CPU target."""
    width = ctypes.c_int32.in_dll(lib, "dflash_gemm_panel_width").value
    name = ctypes.c_char_p(ctypes.addressof(ctypes.c_char.in_dll(lib, "dflash_gemm_path"))).value.decode()
    return width, name


def library() -> ctypes.CDLL | None:
    return c_loader.load("gemm", _SIGNATURES, openmp=True)


def path(dtype: torch.dtype = torch.float32) -> str:
    """Which GEMM the decode-time linears of `dtype` run: e.g. "dflash-avx512", "dflash-avx2",
    "torch-onednn" (bf16), "torch-mkl" (float32 without a C compiler)."""
    if dtype != torch.float32:
        return "torch-onednn"
    lib = library()
    return f"dflash-{_library_facts(lib)[1]}" if lib is not None else "torch-mkl"


class PackedWeight:
    """W [N, K] float32 in csrc/gemm.c's panel layout, tagged with the weight version it was made from."""

    def __init__(self, lib: ctypes.CDLL, w: torch.Tensor):
        width, _ = _library_facts(lib)
        self.n, self.k = w.shape
        self.version = w._version
        self.data = torch.empty(-(-self.n // width) * self.k * width, dtype=torch.float32)
        src = w.detach().contiguous()
        lib.gemm_pack_f32(src.data_ptr(), self.data.data_ptr(), self.n, self.k, torch.get_num_threads())


def packed(w: torch.Tensor, lib: ctypes.CDLL | None = None) -> PackedWeight:
    """The packed form of float32 weight `w`, made on first use (needs the C kernel: `lib`, else library())."""
    lib = lib or library()
    p = getattr(w, "_dflash_packed", None)
    if p is None or p.version != w._version or (p.n, p.k) != tuple(w.shape):
        p = PackedWeight(lib, w)
        w._dflash_packed = p
    return p


def _kernel_applies(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    # on every linear call of a forward pass: cheapest tests first
    if x.dtype != torch.float32 or w.dtype != torch.float32 or w.dim() != 2 or x.device.type != "cpu":
        return False
    if c_loader.capturing() or (b is not None and b.dtype != torch.float32):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return False
    return 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); through the packed kernel where it applies (float32, <= MAX_ROWS rows, no grad)."""
    lib = library() if _kernel_applies(x, w, b) else None
    if lib is None:
        return F.linear(x, w, b)
    out = matmul(lib, x.reshape(-1, x.shape[-1]), packed(w, lib), b)
    return out.view(*x.shape[:-1], out.shape[-1])


def linears(x: torch.Tensor, layers: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """layer(x) for each of `layers` (q|k|v, gate|up) in one call over their weights packed side by side where the
    kernel applies (docs/kernels.md: fewer calls a step); bitwise one call per layer (each output its own chain)."""
    ws, bs = [m.weight for m in layers], [m.bias for m in layers]
    hooked = any(m._forward_pre_hooks or m._forward_hooks for m in layers)   # e.g. drafter calibration's
    if hooked or not _kernel_applies(x, ws[0], bs[0]) or (lib := library()) is None:   # one module's dtype, grad
        return tuple(m(x) for m in layers)
    key = tuple((w.data_ptr(), w._version) for w in ws)
    group = getattr(ws[0], "_dflash_packed_group", None)
    if group is None or group[0] != key:
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(ws, bs)])
        group = ws[0]._dflash_packed_group = (key, PackedWeight(lib, torch.cat([w.detach() for w in ws])),
                                              bias if any(b is not None for b in bs) else None)
    out = matmul(lib, x.reshape(-1, x.shape[-1]), group[1], group[2])
    return out.view(*x.shape[:-1], out.shape[-1]).split([w.shape[0] for w in ws], -1)


def stacked_linear(x: torch.Tensor, w: torch.Tensor, e: int, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w[e] (+ b) for stacked [E, K, N] weights (MoE experts), packed per expert on first use."""
    lib = library() if _kernel_applies(x, w[e].t(), b) else None
    if lib is None:
        return x @ w[e] + b if b is not None else x @ w[e]
    cache = getattr(w, "_dflash_packed_stack", None)
    if cache is None or cache[0] != w._version:
        cache = w._dflash_packed_stack = (w._version, {})
    if e not in cache[1]:
        cache[1][e] = PackedWeight(lib, w[e].t())
    return matmul(lib, x, cache[1][e], b)


def matmul(lib: ctypes.CDLL, rows: torch.Tensor, p: PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] float32 times the packed weight (+ b): [M, N], computed by `lib` (a build of csrc/gemm.c)."""
    rows = rows.detach().contiguous()
    out = torch.empty(rows.shape[0], p.n, dtype=torch.float32)
    bias = b.detach().contiguous() if b is not None else None
    lib.gemm_f32(rows.data_ptr(), p.data.data_ptr(), bias.data_ptr() if bias is not None else None,
                 out.data_ptr(), rows.shape[0], p.n, p.k, torch.get_num_threads())
    return out
