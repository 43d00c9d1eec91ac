"""Small C kernels for CPU hot loops, compiled on first use with the system's C compiler.

Why hand-written C: at the sizes the CPU runtime and the quantizer hit, eager torch spends its time
in per-op dispatch and extra passes over memory, not arithmetic; one C loop does the work in one
call. Plain C (no torch headers), so it compiles in well under a second, once per machine (kept
under $DFLASH_TRT_HOME/kernels). Without a compiler (or with DFLASH_TRT_NO_CKERNEL=1) `load` returns None
and callers use their torch code, which tests compare the kernels against. No -ffast-math: results
must stay IEEE so that bytes and tolerances are what the tests pin.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

from dflash_trt.paths import dflash_home

_LIBS: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> str:
    return str(dflash_home() / "kernels")


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features: part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def load(name: str, source: str, signatures: dict[str, list], openmp: bool = False,
         cflags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile `source` (with extra `cflags`) and return the library with argtypes set from
    `signatures` ({function: [ctypes types]}, all returning void), or None if unavailable.
    Compiled once per machine: the library is kept under $DFLASH_TRT_HOME/kernels, keyed by the
    source, compiler, flags and CPU features (compiling costs ~0.5 s, a whole quantize of 1 GB)."""
    key = name + "".join(cflags)
    if key in _LIBS:
        return _LIBS[key]
    lib = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc and os.environ.get("DFLASH_TRT_NO_CKERNEL") != "1":
        digest = hashlib.sha256("\0".join([source, os.path.realpath(cc), repr(openmp), *cflags,
                                           _cpu_signature()]).encode()).hexdigest()[:20]
        cached = os.path.join(_cache_dir(), f"{name}-{digest}.so")
        lib = _dlopen(cached) if os.path.exists(cached) else None
        if lib is None:
            lib = _compile(cc, source, openmp, list(cflags), cached)
        if lib is not None:
            for fn, args in signatures.items():
                getattr(lib, fn).argtypes = args
                getattr(lib, fn).restype = None
    _LIBS[key] = lib
    return lib


def _dlopen(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _compile(cc: str, source: str, openmp: bool, cflags: list[str], cached: str) -> ctypes.CDLL | None:
    d = tempfile.mkdtemp(prefix="dflash-trt-cc-")
    try:
        src, so = os.path.join(d, "k.c"), os.path.join(d, "k.so")
        with open(src, "w") as f:
            f.write(source)
        for flags in ((["-fopenmp"], []) if openmp else ([],)):  # OpenMP when asked and available
            for march in (["-march=native"], []):                 # a compiler without -march=native
                r = subprocess.run([cc, "-O3", *march, "-ffp-contract=off", "-shared", "-fPIC", *flags, *cflags,
                                    src, "-o", so], capture_output=True)
                if r.returncode == 0:
                    break
            if r.returncode != 0 or _dlopen(so) is None:
                continue
            try:   # publish atomically; a read-only cache folder only costs the next process a compile
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                tmp = f"{cached}.{os.getpid()}.tmp"
                shutil.copyfile(so, tmp)
                os.replace(tmp, cached)
                return _dlopen(cached)
            except OSError:
                return _dlopen(so)   # the library stays mapped after its folder is removed
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)
