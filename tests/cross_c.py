"""C harnesses built against simd/kernels and simd/ops: for aarch64 with Debian's cross compiler and run under
qemu-user (the NEON, dotprod and i8mm bodies), or for this machine with its own compiler. Shared by the tests that
compare every path's body with the scalar one byte for byte (test_kernels_neon.py, test_attention_neon.py,
test_ops_paths_c.py).

A harness is C source for a `main` that prints "ALL OK" and exits 0 when every check passed; PREAMBLE gives it
the includes, a fixed random stream and CHECK. The flags are setup.py's that decide float results (-O3, no
contraction of a * b + c into one rounding), so the bodies tested are the ones users get.
"""
import glob
import os
import shutil
import subprocess

import pytest

from helpers import ROOT

KERNELS = os.path.join(ROOT, "simd", "kernels")
OPS = os.path.join(ROOT, "simd", "ops")
CC_AARCH64 = shutil.which("aarch64-linux-gnu-gcc")
QEMU_AARCH64 = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
CC_HOST = shutil.which("gcc") or shutil.which("cc")

needs_aarch64 = pytest.mark.skipif(
    not (CC_AARCH64 and QEMU_AARCH64),
    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
needs_host_cc = pytest.mark.skipif(CC_HOST is None, reason="needs a C compiler (gcc or cc) on PATH")

FLAGS = ["-O3", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing", "-std=c11", "-Wall", "-Wno-unused-function"]

PREAMBLE = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "ops.h"

static unsigned long long rs = 88172645463325252ull;
static unsigned rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (unsigned)rs; }
static int fails = 0, checks = 0;
#define CHECK(cond, ...) do { checks++; if (!(cond)) { printf("FAIL " __VA_ARGS__); printf("\n"); fails++; } } while (0)
/* the last line of main: "ALL OK" is what run_harness looks for */
#define REPORT() (printf(fails ? "FAILED %d of %d\n" : "ALL OK (%d checks)\n", fails ? fails : checks, checks), fails != 0)
"""


def _objects(cc: str, target: str) -> list[str]:
    """Every C file of simd/kernels and simd/ops compiled once per content for this compiler and target, in
    parallel, into a cache under the temp directory: the harness tests link the same objects (compiling the whole
    of simd/ for x86 took 60-90 s of the suite per harness). An object's key hashes the compiler, the flags, its
    source and every header of both directories, so any edit rebuilds it."""
    import concurrent.futures
    import hashlib
    import tempfile

    sources = sorted(glob.glob(os.path.join(KERNELS, "*.c"))) + sorted(glob.glob(os.path.join(OPS, "*.c")))
    headers = sorted(glob.glob(os.path.join(KERNELS, "*.h"))) + sorted(glob.glob(os.path.join(OPS, "*.h")))
    common = hashlib.sha256()
    real = os.path.realpath(cc)
    common.update(f"{real} {os.stat(real).st_mtime_ns} {target} {FLAGS}".encode())
    for h in headers:
        with open(h, "rb") as f:
            common.update(h.encode() + b"\0" + f.read())
    cache = os.path.join(tempfile.gettempdir(), f"bitnet-cross-c-{os.getuid()}")
    os.makedirs(cache, exist_ok=True)

    def build(c: str) -> str:
        key = common.copy()
        with open(c, "rb") as f:
            key.update(f.read())
        obj = os.path.join(cache, f"{os.path.basename(c)}.{key.hexdigest()[:24]}.o")
        if not os.path.exists(obj):
            tmp = f"{obj}.{os.getpid()}.tmp"
            r = subprocess.run([cc, *FLAGS, "-c", "-I", KERNELS, "-I", OPS, c, "-o", tmp], capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0, r.stderr
            os.replace(tmp, obj)   # atomic: a concurrent run sees the whole object or none
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(build, sources))


def host_objects_except(*names: str) -> list[str]:
    """This machine's cached objects of simd/kernels and simd/ops (_objects) without the named C files, for a
    harness that builds those few itself with other flags."""
    return [o for o in _objects(CC_HOST, "host") if os.path.basename(o).split(".c.", 1)[0] + ".c" not in names]


def run_harness(tmp_path, source: str, *, target: str = "aarch64", name: str = "harness") -> str:
    """Compile PREAMBLE + source and link it with every C file of simd/kernels and simd/ops (objects cached by
    content, _objects), for target "aarch64" (static, run under qemu-aarch64: its default CPU, max, has sdot and
    smmla) or "host"; run it; assert it printed ALL OK. Returns its stdout."""
    cc = CC_AARCH64 if target == "aarch64" else CC_HOST
    src = tmp_path / f"{name}.c"
    src.write_text(PREAMBLE + source)
    exe = tmp_path / name
    objects = _objects(cc, target)
    static = ["-static"] if target == "aarch64" else []
    r = subprocess.run([cc, *FLAGS, *static, "-I", KERNELS, "-I", OPS, str(src), *objects, "-o", str(exe), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = [QEMU_AARCH64, str(exe)] if target == "aarch64" else [str(exe)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout + r.stderr
    return r.stdout
