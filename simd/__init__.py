"""SIMD kernels for BitNet inference (C with intrinsics + thin Cython wrappers).

`simd.features()` -> CPU features seen by the dispatcher; `simd.active()` -> the chosen path
("avx512" | "avxvnni" | "avx2" | "scalar" | "neon" | "dotprod" | "i8mm"). `BITNET_ISA=scalar|avx2|avxvnni|avx512`
(x86) or `BITNET_ISA=scalar|neon|dotprod|i8mm` (aarch64) forces a path (avxvnni: AVX2 + 256-bit VNNI; on AVX-512
cores it runs the EVEX twin of those bodies; dotprod: NEON + sdot; i8mm: dotprod + smmla); forcing one the
CPU cannot run raises simd.errors.KernelError (at `import simd._kernels`, or at the first use of `simd.*`,
so that `python -m simd` / `bitnet info` can report it as one line). Everything else lives in
simd._kernels (see engine/INTERFACES.md).
"""
from .errors import BitNetError as _BitNetError

try:
    from . import _kernels  # noqa: F401
    from ._kernels import *  # noqa: F401,F403
    from ._kernels import supported_isas  # noqa: F401
except ImportError as _e:  # pragma: no cover - only when the package was not built
    _import_error = _e

    def __getattr__(name):
        raise ImportError(
            f"simd kernels are not built ({_import_error}); run `pip install .` (or `pip install -e .`)"
        )
except _BitNetError as _e:  # a bad BITNET_ISA: raise it where the kernels are first used
    _isa_error = _e

    def __getattr__(name):
        raise _isa_error
