"""simd._ops.attention_paged: several sequences, each over its own pages of a shared pool, give bit-identical
rows to ops.attention on each sequence alone in a contiguous cache (every ISA path, f16, f32 and int8 caches, query
groups of 2 and of 4 heads: a group of 4 decoding over f16 pages runs its items with the next item's prefetch, whose
page-table reads must stay within each sequence's positions), and bad page tables / positions are refused at the
Cython boundary."""
import numpy as np
import pytest

import bitnet_cpu.simd._ops as ops
from bitnet_cpu.engine.errors import KernelError
from helpers import rope_tables

NH, NKV, HD = 4, 2, 64
QD, KVD = NH * HD, NKV * HD
W = QD + 2 * KVD
B = ops.KEY_BLOCK


def _rope(n_ctx):
    return rope_tables(n_ctx, HD)


def _isas():
    out = []
    for name in ("scalar", "avx2", "avx512"):
        try:
            ops.set_isa(name)
            out.append(name)
        except KernelError:
            pass
    ops.set_isa(None)
    return out


def _alone(qkv_hist, qkv_step, n_ctx, dt, cos, sin, nh=NH):
    qd = nh * HD
    if dt == np.int8:   # the int8 cache (kv q8): its own wrapper and shapes
        kc, vc = np.zeros(ops.q8_cache_shape(NKV, n_ctx, HD), dt), np.zeros(ops.q8_cache_shape(NKV, n_ctx, HD), dt)

        def att(qkv, pos0, out):
            ops.attention_q8(qkv, nh, NKV, HD, cos, sin, pos0, n_ctx, kc, vc, out, scr)
    else:
        kc, vc = np.zeros(ops.key_cache_shape(NKV, n_ctx, HD), dt), np.zeros((NKV, n_ctx, HD), dt)

        def att(qkv, pos0, out):
            ops.attention(qkv, nh, NKV, HD, cos, sin, pos0, kc, vc, out, scr)
    scr = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)
    h = qkv_hist.shape[0]
    if h:
        att(qkv_hist.copy(), 0, np.zeros((h, qd), np.float32))
    out = np.zeros((qkv_step.shape[0], qd), np.float32)
    att(qkv_step.copy(), h, out)
    return out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("kv", ["f16", "f32", "q8"])
@pytest.mark.parametrize("nh", [NH, 2 * NH], ids=["group2", "group4"])
def test_paged_equals_contiguous(isa, kv, nh):
    rng = np.random.default_rng(7)
    qd, w = nh * HD, (nh + 2 * NKV) * HD
    dt = {"f16": np.uint16, "f32": np.float32, "q8": np.int8}[kv]
    n_ctx, max_pages = 700, 22
    cos, sin = _rope(n_ctx)
    # (history, step rows): decode rows, a long prefill chunk, a chunk crossing a page boundary, fresh prompt;
    # past 256 positions (attention in pieces): decode rows with 3 pieces, a chunk across a piece boundary
    # (and runs of decode rows next to each other: one item's prefetch reaches into the next sequence's pages)
    shapes = [(70, 1), (0, 37), (30, 5), (95, 1), (0, 1), (64, 33), (600, 1), (240, 40), (300, 1), (511, 1), (33, 1),
              (256, 1), (1, 1)]
    n_pages = len(shapes) * max_pages + 3
    seqs = [(rng.standard_normal((h, w)).astype(np.float32), rng.standard_normal((r, w)).astype(np.float32))
            for h, r in shapes]
    perm = rng.permutation(n_pages).astype(np.int32)
    pt = perm[: len(seqs) * max_pages].reshape(len(seqs), max_pages).copy()
    if kv == "q8":
        kp, vp = (np.zeros(ops.paged_q8_pool_shape(n_pages, NKV, HD), dt) for _ in range(2))
        paged = ops.attention_paged_q8
    else:
        kp = np.zeros(ops.paged_key_pool_shape(n_pages, NKV, HD), dt)
        vp = np.zeros(ops.paged_value_pool_shape(n_pages, NKV, HD), dt)
        paged = ops.attention_paged
    scr = np.zeros((2 * ops.ATTENTION_SCRATCH_ROWS, n_ctx), np.float32)
    ops.set_isa(isa)
    try:
        want = [_alone(h, s, n_ctx, dt, cos, sin, nh) for h, s in seqs]

        def run(parts, pos0):
            rows = np.concatenate([[0], np.cumsum([p.shape[0] for p in parts])]).astype(np.int32)
            qkv = np.ascontiguousarray(np.concatenate(parts), np.float32) if rows[-1] else np.zeros((1, w), np.float32)
            out = np.zeros((qkv.shape[0], qd), np.float32)
            paged(qkv, nh, NKV, HD, cos, sin, rows, np.asarray(pos0, np.int32), pt, kp, vp, out, scr)
            return [out[rows[i]: rows[i + 1]] for i in range(len(parts))]

        run([h for h, _ in seqs], [0] * len(seqs))  # history of every sequence in one call (empty ones skip)
        got = run([s for _, s in seqs], [h.shape[0] for h, _ in seqs])
    finally:
        ops.set_isa(None)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_paged_boundary_checks():
    n_pages = 4
    cos, sin = _rope(256)
    kp = np.zeros(ops.paged_key_pool_shape(n_pages, NKV, HD), np.uint16)
    vp = np.zeros(ops.paged_value_pool_shape(n_pages, NKV, HD), np.uint16)
    scr = np.zeros((ops.ATTENTION_SCRATCH_ROWS, 256), np.float32)
    qkv = np.zeros((2, W), np.float32)
    out = np.zeros((2, QD), np.float32)
    rows = np.array([0, 2], np.int32)
    good = np.array([[0, 1, 2]], np.int32)
    ops.attention_paged(qkv, NH, NKV, HD, cos, sin, rows, np.array([40], np.int32), good, kp, vp, out, scr)
    cases = {
        "page outside the pool": (np.array([[0, 4, 2]], np.int32), [40]),
        "negative page": (np.array([[-1, 1, 2]], np.int32), [0]),
        "past the page table": (good, [95]),
        "negative position": (good, [-1]),
    }
    for what, (table, pos) in cases.items():
        with pytest.raises(KernelError):
            ops.attention_paged(qkv, NH, NKV, HD, cos, sin, rows, np.array(pos, np.int32), table, kp, vp, out, scr)
    with pytest.raises(KernelError):  # rows beyond qkv
        ops.attention_paged(qkv, NH, NKV, HD, cos, sin, np.array([0, 3], np.int32), np.array([0], np.int32), good,
                            kp, vp, out, scr)
    with pytest.raises(KernelError):  # decreasing rows
        ops.attention_paged(qkv, NH, NKV, HD, cos, sin, np.array([0, 2, 1], np.int32), np.array([0, 0], np.int32),
                            np.zeros((2, 3), np.int32), kp, vp, out, scr)
    with pytest.raises(KernelError):  # pools of different sizes
        ops.attention_paged(qkv, NH, NKV, HD, cos, sin, rows, np.array([0], np.int32), good, kp,
                            np.zeros(ops.paged_value_pool_shape(3, NKV, HD), np.uint16), out, scr)
    with pytest.raises(KernelError):  # scratch shorter than the positions
        ops.attention_paged(qkv, NH, NKV, HD, cos, sin, rows, np.array([40], np.int32), good, kp, vp, out,
                            np.zeros((ops.ATTENTION_SCRATCH_ROWS, 32), np.float32))


# ---- gemm_i8: the batched int8 LM head ------------------------------------------------------------------------

def _supported_kernel_isas():
    import bitnet_cpu.simd._kernels as K
    return K.supported_isas()


@pytest.mark.parametrize("isa", _supported_kernel_isas())
@pytest.mark.parametrize("n,k,m", [(1, 4, 1), (37, 100, 3), (250, 68, 8), (517, 2560, 13), (2000, 256, 17)])
def test_gemm_i8_rows_equal_gemv_i8(isa, n, k, m):
    import bitnet_cpu.simd._kernels as K
    from bitnet_cpu.simd import layout

    rng = np.random.default_rng(n + 7 * k + m)
    wq, sc = layout.quantize_rows_i8(rng.standard_normal((n, k)).astype(np.float32))
    wq[0, : min(k, 5)] = -127
    w, rowsum = layout.pack_i8(wq), wq.astype(np.int32).sum(axis=1).astype(np.int32)
    k_pad = layout.pad_to(k, 64)
    xq = np.zeros((m, k_pad), np.int8)
    xq[:, :k] = rng.integers(-128, 128, (m, k))
    xq[0, :k] = -128   # the extreme activation code
    s = rng.uniform(0.5, 40, m).astype(np.float32)
    K.set_isa(isa)
    try:
        out = np.zeros((m, n), np.float32)
        K.gemm_i8(w, sc, rowsum, xq, s, out)
        raw = np.zeros((m, n), np.int32)
        K.gemm_i8_i32(w, rowsum, xq, raw)
        one = np.zeros(n, np.float32)
        for r in range(m):
            K.gemv_i8(w, sc, rowsum, xq[r], float(s[r]), one)
            np.testing.assert_array_equal(out[r], one)
    finally:
        K.set_isa(None)
    np.testing.assert_array_equal(raw, xq[:, :k].astype(np.int64) @ wq.T.astype(np.int64))


def test_gemm_i8_checks():
    import bitnet_cpu.simd._kernels as K
    from bitnet_cpu.simd import layout

    wq = np.ones((20, 64), np.int8)
    w, rowsum, sc = layout.pack_i8(wq), np.full(20, 64, np.int32), np.ones(20, np.float32)
    xq, s = np.ones((3, 64), np.int8), np.ones(3, np.float32)
    K.gemm_i8(w, sc, rowsum, xq, s, np.zeros((3, 20), np.float32))
    for bad in [dict(out=np.zeros((2, 20), np.float32)), dict(s=np.ones(2, np.float32)),
                dict(xq=np.ones((3, 60), np.int8)), dict(out=np.zeros((3, 40), np.float32)),
                dict(rowsum=np.ones(10, np.int32))]:
        a = dict(w=w, sc=sc, rowsum=rowsum, xq=xq, s=s, out=np.zeros((3, 20), np.float32))
        a.update(bad)
        with pytest.raises(KernelError):
            K.gemm_i8(a["w"], a["sc"], a["rowsum"], a["xq"], a["s"], a["out"])


@pytest.mark.parametrize("isa", _supported_kernel_isas())
def test_gemm_f16_rows_equal_gemv_f16(isa):
    import bitnet_cpu.simd._kernels as K
    from bitnet_cpu.simd import layout

    rng = np.random.default_rng(2)
    K.set_isa(isa)
    try:
        # the register-blocked bodies take 4 rows x 4 tiles (AVX-512) or 4 rows x 1 tile (AVX2) at a time: rows
        # 1..9 and 17 leave every remainder; N = 300 / 17 / 64 leave 1-3 tiles of a block and a partial tile;
        # two threads split the tiles at other points than one
        for threads in (1, 2):
            K.set_num_threads(threads)
            for n, k in ((300, 192), (17, 64), (64, 80), (1000, 48)):
                w = layout.pack_f16(rng.standard_normal((n, k)).astype(np.float16))
                for m in (1, 2, 3, 4, 5, 7, 8, 9, 17):
                    x = rng.standard_normal((m, k)).astype(np.float32)
                    out = np.full((m, n), np.nan, np.float32)
                    K.gemm_f16(w, x, out)
                    one = np.zeros(n, np.float32)
                    for r in range(m):
                        K.gemv_f16(w, x[r], one)
                        np.testing.assert_array_equal(out[r], one, err_msg=f"n={n} k={k} m={m} row {r}")
        n, k, m = 300, 192, 5
        w = layout.pack_f16(rng.standard_normal((n, k)).astype(np.float16))
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.zeros((m, n), np.float32)
        with pytest.raises(KernelError):
            K.gemm_f16(w, x, np.zeros((m - 1, n), np.float32))
        with pytest.raises(KernelError):
            K.gemm_f16(w, x[:, :100], out)
    finally:
        K.set_isa(None)
        K.set_num_threads(0)
