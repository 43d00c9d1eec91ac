"""Small C kernels for CPU hot loops (kernels/csrc/*.c), compiled on first use with the system's C compiler.

Why: at the CPU runtime's and the quantizer's sizes, eager torch spends its time in per-op dispatch and
extra passes over memory. Plain C (no torch headers), compiled once per machine under
$DFLASH_TRT_HOME/kernels. Without a compiler (or with DFLASH_TRT_NO_CKERNEL=1) `load` returns None and
callers use their torch code; a failing compiler also gives None, warning once (`build_error`). No
-ffast-math: results must stay IEEE so that bytes and tolerances are what the tests pin.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_trt.paths import dflash_home

CSRC_DIR = Path(__file__).parent / "csrc"
HEADER = CSRC_DIR / "dflash_kernels.h"   # included by every source; on the include path of every build

_LIBS: dict[tuple, ctypes.CDLL | None] = {}
_BUILD_ERRORS: dict[str, str] = {}   # name -> the failed build's compiler output (this process)
_disabled = False


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH; None without one or with DFLASH_TRT_NO_CKERNEL=1."""
    if os.environ.get("DFLASH_TRT_NO_CKERNEL") == "1":
        return None
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def capturing() -> bool:
    """torch is capturing a graph (jit trace, compile, export, ONNX): a ctypes call would be invisible to it."""
    import torch

    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def build_error(name: str) -> str | None:
    """What the compiler said when library `name` failed to build in this process, or None (it
    built, was not asked for, or there is no compiler)."""
    return _BUILD_ERRORS.get(name)


@contextlib.contextmanager
def disabled():
    """While active, `load` returns None, so callers take their torch path (tests run both)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features: part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def load(name: str, signatures: dict[str, list], openmp: bool = False, cflags: tuple[str, ...] = (),
         path: str | os.PathLike | None = None) -> ctypes.CDLL | None:
    """Compile kernels/csrc/<name>.c (or the C file at `path`) with extra `cflags` and return the
    library with argtypes set from `signatures` ({function: [ctypes types]}, all returning void), or
    None if unavailable. Compiled once per machine: the library is kept under $DFLASH_TRT_HOME/kernels,
    keyed by the source and header bytes, compiler, flags and CPU features (compiling costs ~0.5 s,
    a whole quantize of 1 GB)."""
    if _disabled:
        return None
    key = (name, None if path is None else os.fspath(path), *cflags)   # before any Path: callers poll this
    if key in _LIBS:
        return _LIBS[key]
    src = Path(path) if path is not None else CSRC_DIR / f"{name}.c"
    lib, cc = None, compiler()
    if cc:
        lib, error = _build(name, src, cc, openmp, list(cflags))
        if lib is None:
            _report(name, src, error)
        else:
            for fn, args in signatures.items():
                getattr(lib, fn).argtypes = args
                getattr(lib, fn).restype = None
    _LIBS[key] = lib
    return lib


def _build(name: str, src: Path, cc: str, openmp: bool, cflags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The cached library, else a fresh compile: (library, "") or (None, why not)."""
    try:
        code = [src.read_bytes(), HEADER.read_bytes()]
    except OSError as e:   # an install without its C sources: reported as a failed build
        return None, f"{src}: cannot read the C source: {e}"
    build = [os.path.realpath(cc), repr(openmp), *cflags, _cpu_signature()]
    digest = hashlib.sha256(b"\0".join(code + [s.encode() for s in build])).hexdigest()[:20]
    cached = os.path.join(dflash_home() / "kernels", f"{name}-{digest}.so")
    lib = _dlopen(cached) if os.path.exists(cached) else None
    return (lib, "") if lib is not None else _compile(cc, src, openmp, cflags, cached)


def _report(name: str, src: Path, error: str) -> None:
    """Keep the build error and warn once per library and process: the torch fallback is correct but
    slower, and a silent fallback would hide a broken C source."""
    if name in _BUILD_ERRORS:
        return
    _BUILD_ERRORS[name] = error
    lines = [line for line in error.splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line), lines[0] if lines else "no output")
    print(f"dflash-trt: warning: {src.name} did not compile, using the torch code instead: {first}",
          file=sys.stderr)


def _dlopen(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _compile(cc: str, src: Path, openmp: bool, cflags: list[str], cached: str) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or, when every attempt failed, (None, what the last attempt's compiler said)."""
    d = tempfile.mkdtemp(prefix="dflash-trt-cc-")
    try:
        so, error = os.path.join(d, "k.so"), ""
        for flags in ((["-fopenmp"], []) if openmp else ([],)):  # OpenMP when asked and available
            for march in (["-march=native"], []):                 # a compiler without -march=native
                r = subprocess.run([cc, "-O3", *march, "-ffp-contract=off", "-I", str(CSRC_DIR), "-shared", "-fPIC",
                                    *flags, *cflags, str(src), "-o", so], capture_output=True)
                if r.returncode == 0:
                    break
            if r.returncode != 0:
                error = r.stderr.decode(errors="replace")
                continue
            try:
                ctypes.CDLL(so)
            except OSError as e:
                error = f"{src}: compiled, but the library does not load: {e}"
                continue
            try:   # publish atomically; a read-only cache folder only costs the next process a compile
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                tmp = f"{cached}.{os.getpid()}.tmp"
                shutil.copyfile(so, tmp)
                os.replace(tmp, cached)
                return _dlopen(cached), ""
            except OSError:
                return _dlopen(so), ""   # the library stays mapped after its folder is removed
        return None, error
    finally:
        shutil.rmtree(d, ignore_errors=True)
