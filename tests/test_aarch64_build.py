"""The package builds for aarch64: every C source of simd/ and the C that Cython makes of every .pyx compile
with Debian's aarch64 cross compiler, with the flags setup.py uses (an x86-only macro once broke
`pip install .` on every ARM machine, and no x86 test could see it).

Needs `aarch64-linux-gnu-gcc` (Debian: gcc-aarch64-linux-gnu); skips naming it when absent. The Python and
numpy headers are the host's: what the generated C uses of them (LP64, little-endian) is the same on aarch64.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMD = os.path.join(ROOT, "simd")
CC = shutil.which("aarch64-linux-gnu-gcc")

pytestmark = pytest.mark.skipif(
    CC is None, reason="aarch64-linux-gnu-gcc not found (Debian: apt-get install gcc-aarch64-linux-gnu)"
)

# setup.py's COMPILE_ARGS, plus -Werror for the mistakes that are errors-in-waiting on another architecture
FLAGS = ["-O3", "-pthread", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing", "-std=c11", "-Wall",
         "-Wno-unused-function", "-Wno-unknown-pragmas", "-Werror=implicit-function-declaration",
         "-Werror=incompatible-pointer-types", "-Werror=int-conversion"]
HEADER_DIRS = sorted({os.path.dirname(h) for h in glob.glob(os.path.join(SIMD, "**", "*.h"), recursive=True)})
INCLUDES = [f"-I{d}" for d in HEADER_DIRS]
# the hand-written sources (the generated _*.c next to the .pyx files are build output)
C_SOURCES = sorted(c for c in glob.glob(os.path.join(SIMD, "**", "*.c"), recursive=True)
                   if not os.path.basename(c).startswith("_"))
PYX = sorted(glob.glob(os.path.join(SIMD, "*.pyx")))


def _compile(src, out):
    r = subprocess.run([CC, *FLAGS, *INCLUDES, "-c", src, "-o", out], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{os.path.relpath(src, ROOT)} does not compile for aarch64:\n{r.stderr}"
    return r.stderr


def test_sources_are_found():
    # a moved folder must not turn the test below into a loop over nothing
    names = {os.path.relpath(c, SIMD) for c in C_SOURCES}
    assert {"kernels/dispatch.c", "kernels/threadpool.c", "ops/attention.c", "faultguard/fault_guard.c"} <= names
    assert len(PYX) >= 3


@pytest.mark.parametrize("src", C_SOURCES, ids=lambda p: os.path.relpath(p, SIMD))
def test_c_source_compiles_for_aarch64(src, tmp_path):
    _compile(src, str(tmp_path / "out.o"))


@pytest.mark.parametrize("pyx", PYX, ids=os.path.basename)
def test_cython_module_compiles_for_aarch64(pyx, tmp_path):
    numpy = pytest.importorskip("numpy")
    pytest.importorskip("Cython")
    c_file = tmp_path / (os.path.basename(pyx)[:-4] + ".c")
    # the directives setup.py passes to cythonize
    r = subprocess.run([sys.executable, "-m", "cython", "-3", "--directive",
                        "boundscheck=False,wraparound=False,cdivision=True",
                        "--module-name", "bitnet_cpu.simd." + os.path.basename(pyx)[:-4], "-o", str(c_file), pyx],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    py_inc = sysconfig.get_paths()["include"]
    # -O1: the generated C is large (minutes at -O3 on a shared machine); no error depends on the level
    r = subprocess.run([CC, *FLAGS, "-O1", "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION", f"-I{py_inc}",
                        f"-I{numpy.get_include()}", *INCLUDES, "-c", str(c_file), "-o", str(tmp_path / "m.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{os.path.basename(pyx)} (Cython's C) does not compile for aarch64:\n{r.stderr}"
