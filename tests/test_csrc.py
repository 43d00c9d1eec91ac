"""The C kernels in dflash_trt/kernels/csrc compile without a single warning (-Wall -Wextra -Werror),
both with the CPU-specific code (-march=native) and with the portable loops only (-DDFLASH_PORTABLE,
for the generic target a compiler without -march=native builds); and the loader reports a source
that does not compile instead of passing it off as a machine without a compiler."""
import ctypes
import subprocess

import pytest

from dflash_trt.kernels import c_loader

SOURCES = sorted(p.name for p in c_loader.CSRC_DIR.glob("*.c"))
BUILDS = {"native": ["-march=native"], "portable": ["-DDFLASH_PORTABLE"]}
# -O3 as the loader builds: some warnings (maybe-uninitialized, array bounds) need the optimizer;
# -fopenmp, or -Wall flags every OpenMP pragma as unknown
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-fopenmp", "-Wall", "-Wextra", "-Werror", "-I", str(c_loader.CSRC_DIR)]


def test_sources_found():
    assert {"formats.c", "kv_inject.c"} <= set(SOURCES)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_without_warnings(source, build, tmp_path):
    cc = c_loader.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    cmd = [cc, *FLAGS, *BUILDS[build], "-c", str(c_loader.CSRC_DIR / source), "-o", str(tmp_path / "k.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"


def test_loader_reports_a_source_that_does_not_compile(tmp_path, capsys):
    if c_loader.compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "broken.c"
    src.write_text('#include "dflash_kernels.h"\n'
                   "void broken(float *x) { *x = ld_f32(x, 0) + not_declared_anywhere; }\n")
    sigs = {"broken": [ctypes.c_void_p]}
    assert c_loader.load("test_csrc_broken", sigs, path=src) is None
    error = c_loader.build_error("test_csrc_broken")
    assert error is not None and "broken.c" in error and "not_declared_anywhere" in error, error
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1, warning
    assert warning[0].startswith("dflash-trt: warning: broken.c did not compile, using the torch code instead: ")
    assert "error" in warning[0] and "not_declared_anywhere" in warning[0], warning
    # once per process: another build of the same library fails quietly, the first error kept
    assert c_loader.load("test_csrc_broken", sigs, cflags=("-DDFLASH_PORTABLE",), path=src) is None
    assert capsys.readouterr().err == "" and c_loader.build_error("test_csrc_broken") == error


def test_loader_builds_a_source_from_a_path(tmp_path, monkeypatch):
    if c_loader.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DFLASH_TRT_HOME", str(tmp_path / "home"))
    src = tmp_path / "double_bf16.c"
    src.write_text('#include "dflash_kernels.h"\n'
                   "void double_bf16(void *x, int64_t n) { for (int64_t i = 0; i < n; i++) st_bf16(x, i, 2 * ld_bf16(x, i)); }\n")
    sigs = {"double_bf16": [ctypes.c_void_p, ctypes.c_int64]}
    lib = c_loader.load("test_csrc_double", sigs, path=src)
    assert lib is not None and c_loader.build_error("test_csrc_double") is None
    assert [p.name.split("-")[0] for p in (tmp_path / "home" / "kernels").iterdir()] == ["test_csrc_double"]
    x = (ctypes.c_uint16 * 2)(0x3F80, 0xC040)   # bf16 1.0, -3.0
    lib.double_bf16(x, 2)
    assert list(x) == [0x4000, 0xC0C0]           # 2.0, -6.0
    with c_loader.disabled():                    # the tests' torch path
        assert c_loader.load("test_csrc_double", sigs, path=src) is None
    assert c_loader.load("test_csrc_double", sigs, path=src) is lib
