"""SIMD kernels for BitNet inference (C with intrinsics + thin Cython wrappers).

`simd.features()` -> CPU features seen by the dispatcher; `simd.active()` -> the chosen path
("avx512" | "avxvnni" | "avx2" | "scalar" | "neon"). `BITNET_ISA=scalar|avx2|avxvnni|avx512` forces a path
(avxvnni: AVX2 + 256-bit VNNI; on AVX-512 cores it runs the EVEX twin of those bodies); forcing one the
CPU cannot run raises simd.errors.KernelError (at `import simd._kernels`, or at the first use of `simd.*`,
so that `python -m simd` / `bitnet info` can report it as one line). Everything else lives in
simd._kernels (see engine/INTERFACES.md).
"""
from .errors import BitNetError as _BitNetError

import os as _os

# simd._ops still uses OpenMP next to the kernels' own worker pool. libgomp's default wait policy spins
# idle workers for a while after each parallel region, so on 2 cores they steal the core the pool needs
# (measured on the 2B-4T shape with another process busy: decode 3.8 -> 26 tok/s, prefill-512 45 -> 85
# tok/s with PASSIVE). libgomp reads this when it is loaded, i.e. on the import below; the user can override.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
