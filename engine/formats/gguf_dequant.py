"""Dequantizers for the GGUF tensor types our own reader does not decode itself: the `gguf` package's numpy
implementations (llama.cpp's own, maintained with it) for Q4_0..Q8_1, every K-quant, the IQ types, MXFP4 ...

Which decoder runs for which type, and why (conversion time is what counts; bench/bench_convert.py measures it):
- ours (engine/gguf.py decode_blocks): F32, F16, BF16, Q8_0 (2-3x faster than gguf's on a 2560x2560 tensor:
  F16 0.05 s vs 0.11 s, Q8_0 0.011 s vs 0.034 s), TQ1_0 / TQ2_0 / I2_S (ternary codes are read directly,
  never as floats);
- gguf's: everything else, Q4_K and Q6_K included (ours were hand-written copies: Q4_K 0.13 s vs gguf's 0.075 s,
  Q6_K 0.087 s vs 0.091 s, so they were dropped).

`gguf` is imported only when such a type is met, so I2_S / TQ / F16 files load without it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import UnsupportedError

# decoded by engine/gguf.py itself
OWN_DECODERS = frozenset({"F32", "F16", "BF16", "Q8_0", "TQ1_0", "TQ2_0", "Q2_0", "Q2_0_G128", "I2_S"})


def _gguf_module():
    try:
        import gguf.quants  # noqa: F401  (the numpy dequantizers)
        import gguf
    except ImportError:
        return None
    return gguf


@lru_cache(maxsize=None)
def gguf_decodable() -> frozenset[str]:
    """Type names the installed `gguf` package can dequantize (empty if it is not installed)."""
    g = _gguf_module()
    if g is None:
        return frozenset()
    names = {"F32", "F16"}  # gguf.quants.dequantize handles these two without a trait class
    for qt in g.GGMLQuantizationType:
        cls = g.quants._type_traits.get(qt) if hasattr(g.quants, "_type_traits") else None
        if cls is not None and "dequantize_blocks" in vars(cls):
            names.add(qt.name)
    return frozenset(names)


def decode_with_gguf(raw: np.ndarray, type_name: str, n_rows: int) -> np.ndarray:
    """Whole rows of raw block bytes (uint8, n_rows rows) -> flat f32 values, through gguf.quants.dequantize."""
    g = _gguf_module()
    if g is None:
        raise UnsupportedError(f"tensor type {type_name} needs the `gguf` package to be decoded",
                               hint="pip install gguf")
    try:
        qt = g.GGMLQuantizationType[type_name]
        out = g.quants.dequantize(np.ascontiguousarray(raw).reshape(n_rows, -1), qt)
    except (KeyError, NotImplementedError):
        raise UnsupportedError(f"tensor type {type_name} cannot be decoded by gguf {_version(g)}",
                               hint="pip install -U gguf") from None
    return np.asarray(out, dtype=np.float32).reshape(-1)


def _version(g) -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001  (only for a message)
        return getattr(g, "__version__", "?")
