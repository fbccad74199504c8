"""Plain numpy versions of every kernel in simd._kernels, with the same signatures and the same math
(simd/layout.py). The kernel tests use them as the oracle; they are slow and never used at run time.
"""
from __future__ import annotations

import numpy as np

from . import layout


def quantize_act(x, xq, act_scale, act_sum):
    """x f32 [M, K] -> xq int8 [M, K_pad] (padding 0), act_scale f32 [M] = 127/max(max|x|,1e-5), act_sum i32 [M].
    A NaN never sets the max and quantizes to -128 (the kernels'); an infinity makes the scale 0."""
    x2 = np.atleast_2d(np.asarray(x, dtype=np.float32))
    xq2 = xq.reshape(x2.shape[0], -1)
    amax = np.fmax(np.fmax.reduce(np.abs(x2), axis=1), np.float32(1e-5)).astype(np.float32)
    s = (np.float32(127.0) / amax).astype(np.float32)
    with np.errstate(invalid="ignore"):   # inf * 0
        p = np.rint(x2 * s[:, None])
    q = np.where(np.isnan(p), np.float32(-128), np.clip(p, -128, 127)).astype(np.int8)
    xq2[:] = 0
    xq2[:, : x2.shape[1]] = q
    np.asarray(act_scale).reshape(-1)[:] = s
    np.asarray(act_sum).reshape(-1)[:] = q.astype(np.int32).sum(axis=1)


def ternary_dot(w, n, xq):
    """Exact int32 dots W_t[n, :] . xq for xq [M, K_pad] -> int32 [M, n]."""
    xq2 = np.atleast_2d(xq)
    k_pad = xq2.shape[1]
    wt = layout.unpack_ternary(w, n, k_pad).astype(np.int32)
    return xq2.astype(np.int32) @ wt.T


def gemm_ternary(w, row_scale, xq, act_scale, act_sum, out):
    m, n = out.shape
    dot = ternary_dot(w, n, xq)
    out[:] = (dot.astype(np.float32) / np.asarray(act_scale, np.float32)[:, None]) * row_scale[None, :n]


def gemv_ternary(w, row_scale, xq, act_scale, act_sum, out):
    n = out.shape[0]
    dot = ternary_dot(w, n, xq)[0]
    out[:] = (dot.astype(np.float32) / np.float32(act_scale)) * row_scale[:n]


def gemv_i8(w, row_scale, w_rowsum, xq, act_scale, out):
    n = out.shape[0]
    k_pad = xq.shape[0]
    wq = layout.unpack_i8(w, n, k_pad).astype(np.int32)
    dot = wq @ xq.astype(np.int32)
    out[:] = (dot.astype(np.float32) / np.float32(act_scale)) * row_scale[:n]


def gemv_f16(w, x, out):
    """Sequential-in-k fused multiply-add per row (the canonical order; float64 here, so only close)."""
    n = out.shape[0]
    k = x.shape[0]
    wf = layout.unpack_f16(np.asarray(w).view(np.float16), n, k).astype(np.float64)
    out[:] = (wf @ x.astype(np.float64)).astype(np.float32)


def quantize_act_g128(x, xq, xd, xsum, k=None):
    """x f32 [M, K] -> xq int8 [M, K_pad], xd f32 [M, K_pad/128] = amax/127, xsum int32 [M, K_pad/128] per
    group of 128 (bit-exact with the kernel: the same f32 operations)."""
    x2 = np.atleast_2d(np.asarray(x, dtype=np.float32))
    x2 = x2 if k is None else x2[:, :k]
    m, k = x2.shape
    k_pad = xq.reshape(m, -1).shape[1]
    xp = np.zeros((m, k_pad), np.float32)
    xp[:, :k] = x2
    g = xp.reshape(m, k_pad // layout.TG_GROUP, layout.TG_GROUP)
    amax = np.fmax.reduce(np.abs(g), axis=2).astype(np.float32)   # a NaN never sets it; it quantizes to -127
    amax = np.where(np.isnan(amax), np.float32(0), amax)          # (a group of NaNs alone: amax 0, as in C)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):   # inf * 0
        p = np.rint(g * inv[:, :, None])
    q = np.where(np.isnan(p), np.float32(-127), np.clip(p, -127, 127)).astype(np.int8)
    xq.reshape(m, k_pad)[:] = q.reshape(m, k_pad)
    xd.reshape(m, -1)[:] = (amax / np.float32(127)).astype(np.float32)
    xsum.reshape(m, -1)[:] = q.astype(np.int32).sum(axis=2)


def gemv_tg(w, xq, xd, xsum, out):
    """The group-scaled ternary kernel for xq [M, K] (bit-exact: the same f32 operations in the same order)."""
    xq2 = np.atleast_2d(xq)
    m, k = xq2.shape
    out2 = out.reshape(m, -1)
    n = out2.shape[1]
    wt, sc = layout.unpack_tg128(w, n, k)
    groups = k // layout.TG_GROUP
    d = np.asarray(xd, np.float32).reshape(m, groups)
    dots = np.einsum("ngc,mgc->mng", wt.reshape(n, groups, -1).astype(np.int64),
                     xq2.reshape(m, groups, -1).astype(np.int64)).astype(np.float32)     # [M, N, G]
    acc = np.zeros((m, n), np.float32)
    for g in range(groups):
        s = (sc[:, g].astype(np.float32)[None, :] * d[:, g:g + 1]).astype(np.float32)
        acc = (acc + (dots[:, :, g] * s).astype(np.float32)).astype(np.float32)
    out2[:] = acc
