"""Is a dequantized GGUF weight really ternary, and what is its scale?

llama.cpp's converter stores the `bitnet` architecture's linear weights already ternarized (every value -s, 0 or +s
of its tensor), so a GGUF of such a model in any tensor type (F16, Q8_0, Q4_K_M, IQ3_M ...) still holds a ternary
model, blurred only by the container's rounding. A weight that is not ternary (an ordinary Llama GGUF) must not be
ternarized silently: that would print garbage.

    fit = fit_ternary(w, type_name)     # w: f32 [out, in] as dequantized
    fit.codes (int8 {-1,0,1}), fit.scale (multiplies), fit.off_share, fit.tolerance, fit.blur, fit.ok
    check_ternary(path, name, w, type_name) -> TernaryFit, or UnsupportedError (one line, names the tensor)

The measure: the share of values farther than `tolerance * s` from the nearest of {-s, 0, +s}, where the tolerance
is the type's own rounding error for ternary data (a fraction of s; TOLERANCE below). A ternary file shows ~0%;
a Gaussian weight shows tens of percent in every type.
The scale: s = mean |w| over the values coded +-1 (least squares for the given codes), computed in float64, so it is
exact wherever the container keeps every +-s value identical (F32/F16/BF16, Q8_0: `blur` 0). Where the container
blurs them (Q4_0 stores the block maximum's sign exactly and the other sign at 7/8, Q2_K/Q3_K/IQ* quantize their
sub-block scales coarsely) it is the best fit, and `blur` (largest |w - s*code| / s) says by how much values moved.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError, UnsupportedError

# Largest distance |w - s*code| / s a ternary tensor shows after rounding into each type, with a margin.
# Measured (tests/test_gguf_types.py files: gguf's quantizers, llama.cpp's llama_model_quantize) -> tolerance:
# F16/BF16/Q8_0 0 -> 1%; Q6_K 0.4% -> 2%; Q5_K 1.6%, Q4_K 1.4% -> 4%; Q5_0 3.4%, Q5_1 3.2% -> 6%;
# Q4_0 7.0%, Q4_1 6.7% -> 10%; IQ4_NL 10.3%, IQ4_XS 9.5% -> 15%; Q3_K 23% -> 30%; Q2_K 33% -> 40%;
# IQ3_S 47% (0.6% of values beyond 40%: its grid cannot hold every ternary pattern) -> 40%.
# Not measured (llama.cpp makes them only with an importance matrix): IQ3_XXS, IQ2_*, IQ1_*; MXFP4.
TOLERANCE: dict[str, float] = {
    "F32": 0.01, "F16": 0.01, "BF16": 0.01, "F64": 0.01, "Q8_0": 0.01, "Q8_1": 0.01,
    "Q6_K": 0.02, "Q5_K": 0.04, "Q4_K": 0.04, "Q5_0": 0.06, "Q5_1": 0.06, "Q4_0": 0.1, "Q4_1": 0.1,
    "IQ4_NL": 0.15, "IQ4_XS": 0.15, "Q3_K": 0.3, "Q2_K": 0.4, "IQ3_S": 0.4, "IQ3_XXS": 0.4, "MXFP4": 0.3,
    "IQ2_XXS": 0.45, "IQ2_XS": 0.45, "IQ2_S": 0.45, "IQ1_S": 0.45, "IQ1_M": 0.45,
}
DEFAULT_TOLERANCE = 0.45   # a type not listed: still below 1/2 (the point where a code would flip)
MAX_OFF_SHARE = 0.01       # more than 1% of a tensor's values off {-s, 0, +s}: not ternary
KEPT_BLUR = 0.01           # every value within 1% of -s, 0, +s: the container kept the scale


@dataclass(frozen=True)
class TernaryFit:
    codes: np.ndarray   # int8 [out, in] in {-1, 0, +1}
    scale: float        # s (multiplies the codes)
    off_share: float    # share of values farther than tolerance * s from the nearest of {-s, 0, +s}
    tolerance: float    # the type's own rounding error, as a fraction of s
    blur: float         # largest |w - s*code| / s over the tensor (0: exact)

    @property
    def ok(self) -> bool:
        return self.off_share <= MAX_OFF_SHARE

    def note(self) -> dict:
        """What the store's ternary_stats and `bitnet inspect` report for this tensor."""
        return {"off": self.off_share, "tol": self.tolerance, "blur": self.blur, "scale_kind": scale_kind(self.blur)}


def scale_kind(blur: float) -> str:
    if blur == 0:
        return "exact"
    if blur <= KEPT_BLUR:
        return f"kept (values within {blur:.2%})"
    return f"best effort (values blurred up to {blur:.1%})"


def fit_ternary(w: np.ndarray, type_name: str) -> TernaryFit:
    w = np.asarray(w, dtype=np.float32)
    tol = TOLERANCE.get(type_name, DEFAULT_TOLERANCE)
    a = np.abs(w)
    m = float(a.max()) if a.size else 0.0
    if not np.isfinite(m):
        raise FormatError("holds NaN/inf values")
    if m == 0:
        return TernaryFit(np.zeros(w.shape, np.int8), 1.0, 0.0, tol, 0.0)
    # the +-s cluster: values above half the largest magnitude (ternary data: zeros stay far below it)
    s0 = float(a[a > np.float32(m / 2)].mean(dtype=np.float64))
    half = np.float32(s0 / 2)
    nonzero = a > half
    codes = nonzero.astype(np.int8)
    codes[w < -half] = -1
    n_nz = int(np.count_nonzero(nonzero))
    s = float(np.sum(a, where=nonzero, dtype=np.float64) / n_nz)
    s32 = np.float32(s)
    # distance to the nearest point, in place on a: |w| - s for coded values, |w| for zeros
    np.subtract(a, s32, out=a, where=nonzero)
    np.abs(a, out=a)
    off = int(np.count_nonzero(a > np.float32(tol * s))) / a.size
    blur = float(a.max()) / s
    return TernaryFit(codes, s, off, tol, blur)


def check_ternary(path: str, name: str, w: np.ndarray, type_name: str) -> TernaryFit:
    """fit_ternary, refusing a tensor that is not ternary in one line that says so."""
    try:
        fit = fit_ternary(w, type_name)
    except FormatError as e:
        raise FormatError(f"{path}: tensor {name!r} {e}") from None
    if not fit.ok:
        raise UnsupportedError(
            f"{path}: tensor {name!r} ({type_name}) is not ternary: {fit.off_share:.1%} of its values lie farther"
            f" than {fit.tolerance:.0%} of the scale from -s, 0, +s (a ternary model's file: under"
            f" {MAX_OFF_SHARE:.0%}); this engine runs BitNet b1.58 ternary models only",
            hint="run ordinary (non-ternary) GGUF models with llama.cpp")
    return fit
