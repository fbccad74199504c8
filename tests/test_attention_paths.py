"""Attention over the f32 and f16 caches gives the scalar path's bytes on every path this CPU runs (AVX2,
AVX-512 where present), for prefill chunks and decode steps, contiguous and paged: the scalar reference fuses each
multiply-add in the order every vector body keeps per lane (one position per lane for a score, one column per
lane for a weighted sum), so the bodies are checked against it byte for byte rather than within a tolerance.

Shapes cover each query-group size the bodies specialise (the four-query f16 weighted sum and R = 1..4 for the
scores), head sizes that are not multiples of 8 or 16 or (80) of 64, a partial last key block, and rows past 256 positions,
whose positions go in pieces folded in order. The NEON bodies are held to the same bytes under qemu
(tests/test_attention_neon.py)."""
import numpy as np
import pytest

import bitnet_cpu.simd._kernels as K
import bitnet_cpu.simd._ops as ops
from helpers import rope_tables

PATHS = [p for p in K.supported_isas() if p != "scalar"]
SHAPES = [(8, 2, 128), (4, 2, 16), (3, 3, 20), (6, 2, 64), (4, 1, 100), (4, 1, 80)]   # (heads, KV heads, head_dim)
CTX = 304
CHUNKS = [7, 64, 64, 162, 1, 1, 1]   # a prefill to 297 positions in chunks, then three decode steps


def _inputs(nh, nkv, hd, seed):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((sum(CHUNKS), (nh + 2 * nkv) * hd)).astype(np.float32)
    qkv[:, : nh * hd] *= 3.0   # sharper softmax rows: a few positions carry most of the weight
    return (qkv, *rope_tables(CTX, hd))


def _contiguous(isa, kv_dtype, nh, nkv, hd, qkv, cos, sin, tiles=None):
    """The rows through attention in CHUNKS on path isa (tiles: a tile mode on top, "emu" or "amx")."""
    ops.set_isa(isa)
    if tiles:
        K.set_tiles(tiles)
    try:
        kc = np.zeros(ops.key_cache_shape(nkv, CTX, hd), kv_dtype)
        vc = np.zeros((nkv, CTX, hd), kv_dtype)
        scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, CTX), np.float32)
        out = np.zeros((len(qkv), nh * hd), np.float32)
        p = 0
        for m in CHUNKS:
            ops.attention(qkv[p: p + m].copy(), nh, nkv, hd, cos, sin, p, kc, vc, out[p: p + m], scratch)
            p += m
        return out, kc, vc
    finally:
        ops.set_isa(None)


def _contiguous_q8(nh, nkv, hd, qkv, cos, sin):
    """The rows through attention_q8 (the int8 cache) in CHUNKS, on the automatic path."""
    kc = np.zeros(ops.q8_cache_shape(nkv, CTX, hd), np.int8)
    vc = np.zeros(ops.q8_cache_shape(nkv, CTX, hd), np.int8)
    scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, CTX), np.float32)
    out = np.zeros((len(qkv), nh * hd), np.float32)
    p = 0
    for m in CHUNKS:
        ops.attention_q8(qkv[p: p + m].copy(), nh, nkv, hd, cos, sin, p, CTX, kc, vc, out[p: p + m], scratch)
        p += m
    return out


def _paged(isa, kv_dtype, nh, nkv, hd, qkv, cos, sin, tiles=None):
    """The same rows through attention_paged, one sequence whose 32-position blocks sit in shuffled pages."""
    kb = ops.KEY_BLOCK
    n_blocks = -(-CTX // kb)
    pages = np.random.default_rng(7).permutation(n_blocks + 3)[:n_blocks].astype(np.int32)[None, :].copy()
    ops.set_isa(isa)
    if tiles:
        K.set_tiles(tiles)
    try:
        k_pool = np.zeros((n_blocks + 3, nkv, hd, kb), kv_dtype)
        v_pool = np.zeros((n_blocks + 3, nkv, kb, hd), kv_dtype)
        scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, CTX), np.float32)
        out = np.zeros((len(qkv), nh * hd), np.float32)
        p = 0
        for m in CHUNKS:
            ops.attention_paged(qkv[p: p + m].copy(), nh, nkv, hd, cos, sin, np.array([0, m], np.int32),
                                np.array([p], np.int32), pages, k_pool, v_pool, out[p: p + m], scratch)
            p += m
        return out
    finally:
        ops.set_isa(None)


@pytest.mark.skipif(not PATHS, reason="this CPU runs only the scalar path: nothing to compare it with")
@pytest.mark.parametrize("kv_dtype", [np.float32, np.uint16], ids=["f32", "f16"])
@pytest.mark.parametrize("nh,nkv,hd", SHAPES)
def test_every_path_gives_the_scalar_bytes(kv_dtype, nh, nkv, hd):
    qkv, cos, sin = _inputs(nh, nkv, hd, seed=hd + nh)
    want, want_k, want_v = _contiguous("scalar", kv_dtype, nh, nkv, hd, qkv, cos, sin)
    assert np.all(np.isfinite(want)) and np.any(want != 0)
    for isa in PATHS:
        out, kc, vc = _contiguous(isa, kv_dtype, nh, nkv, hd, qkv, cos, sin)
        assert kc.tobytes() == want_k.tobytes() and vc.tobytes() == want_v.tobytes(), (isa, "cache")
        bad = np.flatnonzero((out != want).any(axis=1))
        assert bad.size == 0, (f"{isa}: rows {bad[:8].tolist()} differ from the scalar path's, max |diff| "
                               f"{np.abs(out - want).max():.3g}")
        paged = _paged(isa, kv_dtype, nh, nkv, hd, qkv, cos, sin)
        assert paged.tobytes() == want.tobytes(), f"{isa}: paged rows differ from the contiguous scalar ones"
