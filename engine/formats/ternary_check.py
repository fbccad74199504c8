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

from ..errors import FormatError, UnsupportedError

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
        kind = scale_kind(self.blur) if self.ok else "meaningless: NOT TERNARY"
        return {"off": self.off_share, "tol": self.tolerance, "blur": self.blur, "scale_kind": kind}


def scale_kind(blur: float) -> str:
    if blur == 0:
        return "exact"
    if blur <= KEPT_BLUR:
        return f"kept (values within {blur:.2%})"
    return f"best effort (values blurred up to {blur:.1%})"


CHUNK = 1 << 16  # values per step: the temporaries stay in L2 (one pass over a whole 2B-4T matrix allocating
                 # f32 temporaries cost 0.7-1.5 s per 17.7M values, mostly page faults; chunked: see bench_convert)


def _chunks(flat: np.ndarray):
    for i in range(0, flat.size, CHUNK):
        yield i, flat[i: i + CHUNK]


def fit_ternary(w: np.ndarray, type_name: str) -> TernaryFit:
    w = np.asarray(w, dtype=np.float32)
    tol = TOLERANCE.get(type_name, DEFAULT_TOLERANCE)
    flat = np.ascontiguousarray(w).reshape(-1)
    codes = np.zeros(flat.size, np.int8)
    if flat.size == 0:
        return TernaryFit(codes.reshape(w.shape), 1.0, 0.0, tol, 0.0)
    m = max(float(flat.max()), -float(flat.min()))
    if not np.isfinite(m):
        raise FormatError("holds NaN/inf values")
    if m == 0:
        return TernaryFit(codes.reshape(w.shape), 1.0, 0.0, tol, 0.0)
    n = min(CHUNK, flat.size)
    a, t = np.empty(n, np.float32), np.empty(n, np.float32)
    mk, neg = np.empty(n, bool), np.empty(n, bool)
    # 1. the +-s cluster: magnitudes above half the largest one (a ternary tensor's zeros stay far below it)
    total, count = 0.0, 0
    for _, c in _chunks(flat):
        aa, kk, tt = a[: c.size], mk[: c.size], t[: c.size]
        np.abs(c, out=aa)
        np.greater(aa, np.float32(m / 2), out=kk)
        count += int(np.count_nonzero(kk))
        total += float(np.multiply(aa, kk, out=tt).sum())
    half = np.float32(total / count / 2)
    # 2. codes: nearest of {-s0, 0, +s0}; s = mean |w| of the coded values (least squares), exact when all equal
    total, count, lo = 0.0, 0, np.inf
    for i, c in _chunks(flat):
        aa, kk, nn, tt, cc = a[: c.size], mk[: c.size], neg[: c.size], t[: c.size], codes[i: i + c.size]
        np.abs(c, out=aa)
        np.greater(aa, half, out=kk)
        np.less(c, -half, out=nn)
        cc += kk
        cc -= nn
        cc -= nn
        count += int(np.count_nonzero(kk))
        total += float(np.multiply(aa, kk, out=tt).sum())
        lo = min(lo, float(np.min(aa, where=kk, initial=np.inf)))
    s = m if lo == m else total / count  # every +-s value identical (F16, Q8_0 ...): that value, exactly
    # 3. distance of every value to its point s*code: the off share and the largest one (blur)
    s32, lim = np.float32(s), np.float32(tol * s)
    off, worst = 0, 0.0
    for i, c in _chunks(flat):
        aa, kk, tt = a[: c.size], mk[: c.size], t[: c.size]
        np.abs(c, out=aa)
        np.not_equal(codes[i: i + c.size], 0, out=kk)
        np.multiply(kk, s32, out=tt)
        np.subtract(aa, tt, out=aa)
        np.abs(aa, out=aa)
        off += int(np.count_nonzero(np.greater(aa, lim, out=kk)))
        worst = max(worst, float(aa.max()))
    return TernaryFit(codes.reshape(w.shape), float(s), off / flat.size, tol, worst / s)


_BITS = {"F16": ("<u2", 0x7FFF, "<f2"), "BF16": ("<u2", 0x7FFF, None), "F32": ("<u4", 0x7FFFFFFF, "<f4")}


def fit_exact_raw(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> TernaryFit | None:
    """Fast path on the stored bits for the containers that keep a ternary tensor exactly (F16, BF16, F32: three
    bit patterns 0, +s, -s; Q8_0: codes 0/+-Q under one block scale). None when the tensor is not stored that
    way (then dequantize and fit_ternary decide). ~10x cheaper than dequantizing to f32 and fitting."""
    tol = TOLERANCE.get(type_name, DEFAULT_TOLERANCE)
    n = int(np.prod(shape, dtype=np.int64))
    codes = np.zeros(n, np.int8)
    if type_name in _BITS:
        ut, mask, ft = _BITS[type_name]
        u = raw.view(ut)
        nz = np.flatnonzero(u[: min(u.size, 1 << 16)] & mask)
        first = int(u[nz[0]]) & mask if nz.size else 0
        if first == 0 or first >= (0x7C00 if type_name == "F16" else 0x7F80 if type_name == "BF16" else 0x7F800000):
            return None  # all zero in its first chunk (rare: let the general fit decide) or NaN/inf
        pos, neg = u.dtype.type(first), u.dtype.type(first | (mask + 1))
        for i in range(0, n, CHUNK):
            c, cc = u[i: i + CHUNK], codes[i: i + CHUNK]
            cp, cn = c == pos, c == neg
            if int(np.count_nonzero(cp)) + int(np.count_nonzero(cn)) + int(np.count_nonzero((c & mask) == 0)) != c.size:
                return None
            cc += cp
            cc -= cn
        if type_name == "BF16":
            s = float(np.array([first << 16], np.uint32).view(np.float32)[0])
        else:
            s = float(np.array([first], ut).view(ft)[0])
        return TernaryFit(codes.reshape(shape), s, 0.0, tol, 0.0)
    if type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view("<u2").reshape(-1)
        q = blocks[:, 2:].view(np.int8)
        live = q.any(axis=1)
        if not live.any():
            return None
        dl = np.unique(d[live])
        qmax = int(np.abs(q[live][0].astype(np.int16)).max())
        if dl.size != 1 or qmax == 0:
            return None
        step = max(1, CHUNK // 32)
        for b in range(0, q.shape[0], step):
            qq = q[b: b + step]
            cp, cn = qq == qmax, qq == -qmax
            if int(np.count_nonzero(cp)) + int(np.count_nonzero(cn)) + int(np.count_nonzero(qq == 0)) != qq.size:
                return None
            cc = codes[b * 32: (b + qq.shape[0]) * 32].reshape(qq.shape)
            cc += cp
            cc -= cn
        s = float(np.float32(np.array([dl[0]], "<u2").view("<f2")[0]) * np.float32(qmax))  # as dequantized
        return TernaryFit(codes.reshape(shape), s, 0.0, tol, 0.0)
    return None


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
