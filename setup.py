"""Build the C SIMD kernels and their thin Cython wrappers.

Three extension modules (the import package is `bitnet_cpu`, see pyproject.toml):
  simd._kernels  ternary / int8 / f16 GEMV + GEMM, activation quantization, CPU dispatch, the worker pool,
                 and the runtime helpers (RMSNorm, RoPE, attention over the KV cache, activations) that
                 Python imports as simd._ops (simd/_ops.py): one C library, so one ISA choice and one pool
                 (sources: simd/_kernels.pyx, which includes simd/_ops.pxi, + simd/kernels/*.c + simd/ops/*.c)
  simd._faultguard  a C SIGBUS handler for memory-mapped files (simd/_faultguard.pyx + simd/faultguard/*.c)
  simd._probes   benchmark-only machine-limit probes (simd/_probes.pyx + simd/probes/*.c)

Never -march=native: every ISA variant is compiled in one build with per-function
target attributes and chosen at run time (see simd/kernels/dispatch.c).
"""
import glob
import os

import numpy
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

from Cython.Build import cythonize   # a build requirement (pyproject.toml [build-system])

HERE = os.path.dirname(os.path.abspath(__file__))

COMPILE_ARGS = [
    "-O3",
    "-pthread",
    # bit-identical float results across ISA paths: never fuse a*b+c behind our back
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-std=c11",
    "-Wall",
    "-Wno-unused-function",
    "-Wno-unknown-pragmas",
]
if os.environ.get("BITNET_SANITIZE"):
    COMPILE_ARGS += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"]
LINK_ARGS = ["-pthread"] + (["-fsanitize=address,undefined"] if os.environ.get("BITNET_SANITIZE") else [])


def _extension(name, pyx, c_dirs, include_dirs):
    c_files = [c for d in c_dirs for c in sorted(glob.glob(os.path.join(HERE, d, "*.c")))]   # from any working directory
    return Extension(
        name,
        sources=[pyx] + [os.path.relpath(c, HERE) for c in c_files],   # setuptools wants them relative
        # an edited header rebuilds the module in place (without this, build_ext --inplace kept the old code)
        depends=[os.path.relpath(h, HERE) for d in sorted(set(c_dirs + include_dirs))
                 for h in sorted(glob.glob(os.path.join(HERE, d, "*.h")))],
        include_dirs=[numpy.get_include()] + include_dirs,
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=LINK_ARGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


# (module, its .pyx, the C folders compiled into it, header folders)
extensions = [
    _extension("bitnet_cpu.simd._kernels", "simd/_kernels.pyx", ["simd/kernels", "simd/ops"], ["simd/kernels", "simd/ops"]),
    _extension("bitnet_cpu.simd._faultguard", "simd/_faultguard.pyx", ["simd/faultguard"], ["simd/faultguard"]),
    _extension("bitnet_cpu.simd._probes", "simd/_probes.pyx", ["simd/probes"], ["simd/kernels"]),
]


class BuildPy(build_py):
    """The package root `bitnet_cpu` is the repository root (pyproject's package-dir): ship its
    __init__/__main__, not this build script."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "bitnet_cpu" and m[1] == "setup")]


setup(
    cmdclass={"build_py": BuildPy},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
