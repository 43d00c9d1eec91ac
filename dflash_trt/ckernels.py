"""Small C kernels for CPU hot loops, compiled on first use with the system's C compiler.

Why hand-written C: at the sizes the CPU runtime and the quantizer hit, eager torch spends its time
in per-op dispatch and extra passes over memory, not arithmetic; one C loop does the work in one
call. Plain C (no torch headers), so it compiles in well under a second into a private temp
folder, once per process. Without a compiler (or with DFLASH_TRT_NO_CKERNEL=1) `load` returns None
and callers use their torch code, which tests compare the kernels against. No -ffast-math: results
must stay IEEE so that bytes and tolerances are what the tests pin.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

_LIBS: dict[str, ctypes.CDLL | None] = {}


def load(name: str, source: str, signatures: dict[str, list], openmp: bool = False) -> ctypes.CDLL | None:
    """Compile `source` once per process and return the library with argtypes set from
    `signatures` ({function: [ctypes types]}, all returning void), or None if unavailable."""
    if name in _LIBS:
        return _LIBS[name]
    lib = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc and os.environ.get("DFLASH_TRT_NO_CKERNEL") != "1":
        d = tempfile.mkdtemp(prefix=f"dflash-trt-{name}-")
        src, so = os.path.join(d, "k.c"), os.path.join(d, "k.so")
        with open(src, "w") as f:
            f.write(source)
        for flags in ((["-fopenmp"], []) if openmp else ([],)):  # OpenMP when asked and available
            r = subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", *flags, src, "-o", so],
                               capture_output=True)
            if r.returncode != 0:  # a compiler without -march=native
                r = subprocess.run([cc, "-O3", "-ffp-contract=off", "-shared", "-fPIC", *flags, src, "-o", so],
                                   capture_output=True)
            if r.returncode == 0:
                try:
                    lib = ctypes.CDLL(so)
                except OSError:
                    lib = None
                if lib is not None:
                    break
        if lib is not None:
            for fn, args in signatures.items():
                getattr(lib, fn).argtypes = args
                getattr(lib, fn).restype = None
        shutil.rmtree(d, ignore_errors=True)  # the library stays mapped after unlinking
    _LIBS[name] = lib
    return lib
