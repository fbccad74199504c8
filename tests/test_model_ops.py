"""simd._ops (runtime helpers) against plain numpy, on every ISA path this CPU runs."""
import os
import subprocess
import sys

import numpy as np
import pytest

import bitnet_cpu.simd._kernels as K
import bitnet_cpu.simd._ops as ops
import bitnet_cpu.simd.reference as ref
from bitnet_cpu.engine.errors import KernelError
from helpers import rope_tables

PATHS = K.supported_isas()  # the helpers follow the kernels' path (avxvnni -> their 256-bit bodies)


@pytest.fixture(params=PATHS)
def isa(request):
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa(None)


def rmsnorm(x, w, eps=1e-5):
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32) * w


@pytest.mark.parametrize("d", [200, 256, 1000])
def test_add_rmsnorm_quant(isa, d):
    rng = np.random.default_rng(d)
    m = 9  # > 8 rows: the threaded row loop
    x = rng.standard_normal((m, d)).astype(np.float32) * 3
    delta = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    k_pad = (d + 63) // 64 * 64
    xx, h = x.copy(), np.empty_like(x)
    xq, s, sm = np.full((m, k_pad), 7, np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    ops.add_rmsnorm_quant(xx, delta, w, 1e-5, h, xq, s, sm)
    np.testing.assert_array_equal(xx, x + delta)
    np.testing.assert_allclose(h, rmsnorm(x + delta, w), rtol=2e-6, atol=2e-6)
    # the quantization of h is exactly simd._kernels' (the numpy oracle's) quantize_act
    xq2, s2, sm2 = np.empty_like(xq), np.empty_like(s), np.empty_like(sm)
    ref.quantize_act(h, xq2, s2, sm2)
    np.testing.assert_array_equal(xq, xq2)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(sm, sm2)
    out = np.empty_like(x)
    xx = x.copy()
    ops.add_rmsnorm(xx, None, w, 1e-5, out)
    np.testing.assert_allclose(out, rmsnorm(x, w), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("act", [ops.ACT_RELU2, ops.ACT_SILU])
def test_glu_rmsnorm_quant(isa, act):
    rng = np.random.default_rng(act)
    m, inter = 3, 300
    gu = rng.standard_normal((m, 2 * inter)).astype(np.float32) * 4
    gu[0, :4] = [-100.0, 100.0, -87.5, 89.0]  # far tails of exp inside silu
    w = rng.standard_normal(inter).astype(np.float32)
    g, u = gu[:, :inter].astype(np.float64), gu[:, inter:].astype(np.float64)
    f = (np.maximum(g, 0) ** 2 if act == ops.ACT_RELU2 else g / (1 + np.exp(-g))) * u
    want = rmsnorm(f.astype(np.float32), w)
    xq, s, sm = np.empty((m, 320), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    work = gu.copy()
    ops.glu_rmsnorm_quant(work, act, w, 1e-5, xq, s, sm)
    np.testing.assert_allclose(work[:, :inter], want, rtol=1e-5, atol=1e-5)
    xq2, s2, sm2 = np.empty_like(xq), np.empty_like(s), np.empty_like(sm)
    ref.quantize_act(work[:, :inter], xq2, s2, sm2)
    np.testing.assert_array_equal(xq, xq2)
    # w None (no FFN sub-norm): the activation product itself, quantized like quantize_act
    work = gu.copy()
    ops.glu_rmsnorm_quant(work, act, None, 1e-5, xq, s, sm)
    np.testing.assert_allclose(work[:, :inter], f.astype(np.float32), rtol=1e-5, atol=1e-4)
    ref.quantize_act(work[:, :inter], xq2, s2, sm2)
    np.testing.assert_array_equal(xq, xq2)
    np.testing.assert_array_equal(s, s2)


def _attention_numpy(qkv, nh, nkv, hd, cos, sin, kv_f16):
    n = qkv.shape[0]
    half = hd // 2

    def rope(v, p):
        v = v.reshape(-1, hd)
        x1, x2 = v[:, :half], v[:, half:]
        return np.concatenate([x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]], 1)

    q = np.stack([rope(qkv[p, : nh * hd], p) for p in range(n)])
    k = np.stack([rope(qkv[p, nh * hd: (nh + nkv) * hd], p) for p in range(n)])
    v = qkv[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
    if kv_f16:
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    out = np.zeros((n, nh, hd))
    for p in range(n):
        for h in range(nh):
            j = h // (nh // nkv)
            sc = k[: p + 1, j].astype(np.float64) @ q[p, h] / np.sqrt(hd)
            e = np.exp(sc - sc.max())
            out[p, h] = (e / e.sum()) @ v[: p + 1, j]
    return out.reshape(n, nh * hd), k


@pytest.mark.parametrize("kv_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 16), (3, 3, 20), (4, 1, 100)])
def test_attention_prefill_and_decode(isa, kv_dtype, nh, nkv, hd):
    rng = np.random.default_rng(hd)
    n, ctx = 11, 24
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    cos, sin = rope_tables(ctx, hd)
    want, k_rot = _attention_numpy(qkv, nh, nkv, hd, cos, sin, kv_dtype == np.uint16)
    # the cache starts as NaN: a kernel that lets a position past the current one (a vector tail's spare lanes)
    # reach a score, a softmax sum or an output turns the result into NaN
    nan = np.uint16(0x7E00) if kv_dtype == np.uint16 else np.float32(np.nan)
    kc, vc = np.full(ops.key_cache_shape(nkv, ctx, hd), nan, kv_dtype), np.full((nkv, ctx, hd), nan, kv_dtype)
    scratch = np.full((nh * ops.ATTENTION_SCRATCH_ROWS, ctx), np.nan, np.float32)
    out = np.zeros((n, nh * hd), np.float32)
    a = qkv[:7].copy()  # a 7-row prefill chunk, then 4 single-row decode steps
    ops.attention(a, nh, nkv, hd, cos, sin, 0, kc, vc, out[:7], scratch)
    for p in range(7, n):
        r = qkv[p: p + 1].copy()
        ops.attention(r, nh, nkv, hd, cos, sin, p, kc, vc, out[p: p + 1], scratch)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    kb = ops.KEY_BLOCK
    cached = kc.view(np.float16).astype(np.float32) if kv_dtype == np.uint16 else kc
    cached = cached.transpose(0, 1, 3, 2).reshape(nkv, -1, hd)[:, :n]  # blocks back to [n_kv, position, hd]
    assert kb * kc.shape[1] >= ctx
    np.testing.assert_allclose(cached, k_rot.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)


def test_embed_f16(isa):
    table = np.random.default_rng(0).standard_normal((50, 72)).astype(np.float16)
    ids = np.array([3, 0, 49, 3], np.int32)
    out = np.empty((4, 72), np.float32)
    ops.embed_f16(table.view(np.uint16), ids, out)
    np.testing.assert_array_equal(out, table[ids].astype(np.float32))
    with pytest.raises(KernelError, match="outside the vocabulary"):
        ops.embed_f16(table.view(np.uint16), np.array([50], np.int32), out)


def test_bad_arguments_raise():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(KernelError):
        ops.add_rmsnorm_quant(x, None, np.ones(63, np.float32), 1e-5, x.copy(), np.zeros((2, 64), np.int8),
                              np.zeros(2, np.float32), np.zeros(2, np.int32))
    with pytest.raises(KernelError):  # xq last dim not a multiple of 64
        ops.add_rmsnorm_quant(x, None, np.ones(64, np.float32), 1e-5, x.copy(), np.zeros((2, 65), np.int8),
                              np.zeros(2, np.float32), np.zeros(2, np.int32))
    kc, vc = np.zeros(ops.key_cache_shape(1, 4, 8), np.float32), np.zeros((1, 4, 8), np.float32)
    with pytest.raises(KernelError):  # position past the cache
        ops.attention(np.zeros((1, 24), np.float32), 1, 1, 8, np.zeros((8, 4), np.float32),
                      np.zeros((8, 4), np.float32), 4, kc, vc, np.zeros((1, 8), np.float32),
                      np.zeros((4, 4), np.float32))
    with pytest.raises(KernelError):
        ops.set_isa("sse9")


def test_attention_threads_give_identical_results():
    """Enough work to take the threaded path (heads split over threads): the same bits as one thread."""
    rng = np.random.default_rng(9)
    nh, nkv, hd, ctx, m = 8, 2, 64, 64, 48
    qkv = rng.standard_normal((m, (nh + 2 * nkv) * hd)).astype(np.float32)
    cos = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    outs = []
    before = ops.get_num_threads()
    try:
        for threads in (1, 2, 3):
            ops.set_num_threads(threads)
            kc, vc = np.zeros(ops.key_cache_shape(nkv, ctx, hd), np.uint16), np.zeros((nkv, ctx, hd), np.uint16)
            out = np.zeros((m, nh * hd), np.float32)
            ops.attention(qkv.copy(), nh, nkv, hd, cos, sin, 0, kc, vc, out,
                          np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, ctx), np.float32))
            outs.append(out)
    finally:
        ops.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("n,k", [(1000, 40), (50, 50), (7, 1), (128256, 40), (77, 64)])
def test_topk(isa, n, k):
    # many ties (rounded values): the k largest values, and the very indices the scalar path picks
    r = np.round(np.random.default_rng(n + 1).standard_normal(n) * 4).astype(np.float32)
    idx, heap = np.zeros(k, np.int32), np.zeros(k, np.float32)
    assert ops.topk(r, heap, idx) == min(k, n)
    assert np.array_equal(np.sort(r[idx]), np.sort(r)[::-1][:k][::-1])
    got = set(idx.tolist())
    ops.set_isa("scalar")
    ops.topk(r, heap, idx)
    ops.set_isa(isa)
    assert got == set(idx.tolist())
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    idx, heap = np.zeros(k, np.int32), np.zeros(k, np.float32)
    assert ops.topk(x, heap, idx) == min(k, n)
    assert set(idx[:min(k, n)].tolist()) == set(np.argsort(-x, kind="stable")[:k].tolist())
    x[:3] = np.nan  # NaN logits never get picked
    x[5] = np.inf
    got = ops.topk(x, heap, idx)
    assert got == min(k, n - 3) and 5 in idx[:got] and not {0, 1, 2} & set(idx[:got].tolist())
    with pytest.raises(KernelError):
        ops.topk(x, np.zeros(k - 1, np.float32), idx)


# ---------------------------------------------------------------- one dispatch, one pool
def test_ops_follow_the_kernels_isa_and_thread_count():
    before = K.get_num_threads()
    try:
        for name in PATHS:
            K.set_isa(name)
            assert ops.active() == name == K.active()
        ops.set_isa("scalar")
        assert K.active() == "scalar"
        ops.set_num_threads(3)
        assert K.get_num_threads() == 3 == ops.get_num_threads()
    finally:
        K.set_isa(None)
        K.set_num_threads(before)


def _child(code, **env):
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("name", PATHS)
def test_bitnet_isa_env_governs_ops_case_insensitively(name):
    got = _child("import bitnet_cpu.simd._ops as o, bitnet_cpu.simd._kernels as K; print(o.active(), K.active())",
                 BITNET_ISA=name.upper())
    assert got == [name, name]


def test_one_thread_count_and_no_openmp_in_the_runtime():
    # OMP_NUM_THREADS=1 used to give the kernels 1 thread and the OpenMP helpers all cores; libgomp is gone
    code = ("import os, bitnet_cpu.simd, bitnet_cpu.simd._ops as o, bitnet_cpu.simd._kernels as K\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(K.get_num_threads(), o.get_num_threads(), 'libgomp' in maps, 'OMP_WAIT_POLICY' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1", "False", "False"]


@pytest.mark.parametrize("isa", PATHS, indirect=True)
def test_norms_threaded_give_identical_results(isa):
    """Enough rows to go to the pool: 1, 2 and 3 threads give the same bits."""
    rng = np.random.default_rng(5)
    m, d, inter = 64, 4096, 4096
    x = rng.standard_normal((m, d)).astype(np.float32)
    delta = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    gu = rng.standard_normal((m, 2 * inter)).astype(np.float32)
    outs = []
    before = K.get_num_threads()
    try:
        for threads in (1, 2, 3):
            K.set_num_threads(threads)
            xx, h = x.copy(), np.empty_like(x)
            xq, s, sm = np.empty((m, d), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
            ops.add_rmsnorm_quant(xx, delta, w, 1e-5, h, xq, s, sm)
            g, gq, gs, gsm = gu.copy(), np.empty((m, inter), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
            ops.glu_rmsnorm_quant(g, ops.ACT_SILU, w, 1e-5, gq, gs, gsm)
            outs.append([xx, h, xq, s, sm, g, gq, gs, gsm])
    finally:
        K.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_attention_uses_only_the_threads_its_scratch_has_rows_for():
    """Workers started by a 3-thread kernel call stay out of a job capped at 2 threads (scratch rows for 2):
    a third thread would write past the scratch (ASan run) or change the result."""
    rng = np.random.default_rng(12)
    nh, nkv, hd, ctx, m = 8, 2, 64, 128, 96
    qkv = rng.standard_normal((m, (nh + 2 * nkv) * hd)).astype(np.float32)
    cos = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    before = K.get_num_threads()
    outs = []
    try:
        for threads in (1, 3):
            K.set_num_threads(threads)
            big = np.ones((4096, 1024), np.float32)
            K.quantize_act(big, np.empty((4096, 1024), np.int8), np.empty(4096, np.float32),
                           np.empty(4096, np.int32))  # the pool now has threads - 1 workers
            kc, vc = np.zeros(ops.key_cache_shape(nkv, ctx, hd), np.float32), np.zeros((nkv, ctx, hd), np.float32)
            out = np.zeros((m, nh * hd), np.float32)
            scratch = np.zeros((2 * ops.ATTENTION_SCRATCH_ROWS, ctx), np.float32)
            ops.attention(qkv.copy(), nh, nkv, hd, cos, sin, 0, kc, vc, out, scratch)
            outs.append(out)
    finally:
        K.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_head_rmsnorm_equals_add_rmsnorm_on_each_head():
    """Qwen3's q/k norm in place over heads inside [q | k | v] rows: the same floats as add_rmsnorm on a copy of
    every head, on every path; the rest of the row untouched."""
    from bitnet_cpu.simd import _kernels as K

    rng = np.random.default_rng(11)
    hd, nh = 64, 3
    qkv = (rng.standard_normal((5, 7 * hd)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    for isa in K.supported_isas():
        K.set_isa(isa)
        try:
            x = qkv.copy()
            ops.head_rmsnorm(x, 2 * hd, nh, w, 1e-6)
            heads = np.ascontiguousarray(qkv[:, 2 * hd: 5 * hd].reshape(-1, hd))
            want = np.empty_like(heads)
            ops.add_rmsnorm(heads, None, w, 1e-6, want)
            assert np.array_equal(x[:, 2 * hd: 5 * hd].reshape(-1, hd), want)
            assert np.array_equal(x[:, :2 * hd], qkv[:, :2 * hd]) and np.array_equal(x[:, 5 * hd:], qkv[:, 5 * hd:])
        finally:
            K.set_isa(None)
    with pytest.raises(Exception, match="do not fit"):
        ops.head_rmsnorm(qkv.copy(), 5 * hd, 3, w, 1e-6)


@pytest.mark.parametrize("with_norm", [True, False])
def test_glu_rmsnorm_is_glu_rmsnorm_quant_without_the_quantization(with_norm):
    """The group-scaled path's MLP product (ops.glu_rmsnorm): the same gate half, bit for bit, on every path."""
    rng = np.random.default_rng(12)
    inter = 96
    gu = rng.standard_normal((3, 2 * inter)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(inter)).astype(np.float32) if with_norm else None
    for isa in K.supported_isas():
        K.set_isa(isa)
        try:
            for act in (ops.ACT_RELU2, ops.ACT_SILU):
                a, b = gu.copy(), gu.copy()
                ops.glu_rmsnorm(a, act, w, 1e-5)
                xq = np.zeros((3, 128), np.int8)
                ops.glu_rmsnorm_quant(b, act, w, 1e-5, xq, np.zeros(3, np.float32), np.zeros(3, np.int32))
                assert np.array_equal(a, b) and np.any(xq != 0)
        finally:
            K.set_isa(None)


def test_silu_gate_gives_the_scalar_paths_bits_on_every_path():
    """silu(g) * u on one exp polynomial (not libm's expf) on every path: the same bits as the scalar body, gates
    past exp's range (|g| > 87.3: exp(-|g|) taken as 0), a NaN gate, infinities and tails of 1-7 included."""
    rng = np.random.default_rng(5)
    for inter in (1, 7, 8, 13, 300):
        gu = (rng.standard_normal((2, 2 * inter)) * 6).astype(np.float32)
        gu[0, :min(inter, 7)] = [-100.0, 100.0, -87.5, 89.0, np.nan, -np.inf, np.inf][:min(inter, 7)]
        outs = {}
        for isa in ["scalar"] + [p for p in K.supported_isas() if p != "scalar"]:
            K.set_isa(isa)
            try:
                outs[isa] = gu.copy()
                ops.glu_rmsnorm(outs[isa], ops.ACT_SILU, None, 1e-5)
            finally:
                K.set_isa(None)
            assert outs[isa].tobytes() == outs["scalar"].tobytes(), (isa, inter)
        if inter >= 7:  # the far tails: exp(-100) is taken as 0, so silu(-100) * u is -0 * u
            g = outs["scalar"][0]
            assert g[0] == 0 and np.isinf(g[6])
            assert g[1] == np.float32(100.0) * gu[0, inter + 1] and np.isnan(g[4]) and np.isnan(g[5])


@pytest.mark.parametrize("hd", [32, 128])
def test_grouped_decode_same_bits_as_one_head_per_group(isa, hd):
    # GQA with 4 query heads per KV head (the decode path that weighs the values for all four in one pass over an
    # f16 cache, in blocks of 64 positions) gives the same floats as plain multi-head attention whose KV heads
    # hold copies: past 64 positions and across key blocks, every decode step. One thread and 2 KV heads, so a
    # KV head's group of 4 is not split across threads (it would be with more threads than groups).
    rng = np.random.default_rng(hd)
    nh, nkv, n, ctx = 8, 2, 150, 160
    cos, sin = rope_tables(ctx, hd)
    q = rng.standard_normal((n, nh * hd)).astype(np.float32)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    gqa = np.concatenate([q, k.reshape(n, -1), v.reshape(n, -1)], axis=1)
    rep = lambda a: np.repeat(a, nh // nkv, axis=1).reshape(n, -1)     # KV head j -> query heads 4j .. 4j+3
    mha = np.concatenate([q, rep(k), rep(v)], axis=1)
    before = K.get_num_threads()
    K.set_num_threads(1)
    try:
        outs = []
        for rows, kvh in ((gqa, nkv), (mha, nh)):
            kc, vc = np.zeros(ops.key_cache_shape(kvh, ctx, hd), np.uint16), np.zeros((kvh, ctx, hd), np.uint16)
            scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, ctx), np.float32)
            out = np.zeros((n, nh * hd), np.float32)
            ops.attention(rows[:20].copy(), nh, kvh, hd, cos, sin, 0, kc, vc, out[:20], scratch)
            for p in range(20, n):
                ops.attention(rows[p: p + 1].copy(), nh, kvh, hd, cos, sin, p, kc, vc, out[p: p + 1], scratch)
            outs.append(out)
    finally:
        K.set_num_threads(before)
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))


@pytest.mark.parametrize("kv_dtype,hd", [(np.uint16, 128), (np.float32, 64)])
def test_attention_long_context_in_pieces(isa, kv_dtype, hd):
    # Rows that see more than 256 positions are computed in pieces of 256 (a softmax per piece, folded in order).
    # Against the float64 reference; decode rows (pieces as separate work items) bit-equal to the same rows of a
    # prefill chunk (pieces folded inside the item: what speculative verification relies on); the same bits on
    # 1 and 2 threads. The cache starts as NaN, so a piece that reads past its row's positions shows.
    rng = np.random.default_rng(hd + 1)
    nh, nkv, ctx, n = 8, 2, 800, 620
    cos, sin = rope_tables(ctx, hd)
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    want, _ = _attention_numpy(qkv, nh, nkv, hd, cos, sin, kv_dtype == np.uint16)
    nan = np.uint16(0x7E00) if kv_dtype == np.uint16 else np.float32(np.nan)

    def run(threads, decode_from):
        K.set_num_threads(threads)
        kc, vc = np.full(ops.key_cache_shape(nkv, ctx, hd), nan, kv_dtype), np.full((nkv, ctx, hd), nan, kv_dtype)
        scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, ctx), np.float32)
        out = np.zeros((n, nh * hd), np.float32)
        for a, b in ((0, 250), (250, 530), (530, decode_from)):   # chunks across the 256 / 512 boundaries
            if b > a:
                ops.attention(qkv[a:b].copy(), nh, nkv, hd, cos, sin, a, kc, vc, out[a:b], scratch)
        for p in range(decode_from, n):
            ops.attention(qkv[p: p + 1].copy(), nh, nkv, hd, cos, sin, p, kc, vc, out[p: p + 1], scratch)
        return out

    before = K.get_num_threads()
    try:
        dec1, dec2, chunk = run(1, 500), run(2, 500), run(2, n)
    finally:
        K.set_num_threads(before)
    np.testing.assert_allclose(dec1, want.astype(np.float32), rtol=3e-5, atol=3e-5)
    assert np.array_equal(dec1.view(np.int32), dec2.view(np.int32))
    assert np.array_equal(dec1[500:].view(np.int32), chunk[500:].view(np.int32))


# ---------------------------------------------------------------- the int8 KV cache (kv q8)
def _q8(x):
    """Per-row int8 quantization as the cache stores it (scale = max|x| / 127, round half to even), dequantized."""
    amax = np.abs(x).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv), -127, 127)
    return (q * (amax / np.float32(127)).astype(np.float32)).astype(np.float64)


def _attention_q8_reference(qkv, nh, nkv, hd, cos, sin, quantized):
    """float64 attention; quantized: over K/V rounded to int8 as the cache holds them and each query head rounded
    the same way (the scores are integer dot products), else exact q, K, V."""
    n, half = qkv.shape[0], hd // 2

    def rope(v, p):
        v = v.reshape(-1, hd)
        x1, x2 = v[:, :half], v[:, half:]
        return np.concatenate([x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]], 1)

    q = np.stack([rope(qkv[p, : nh * hd], p) for p in range(n)]).astype(np.float64)
    k = np.stack([rope(qkv[p, nh * hd: (nh + nkv) * hd], p) for p in range(n)])
    v = qkv[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
    if quantized:
        q, k, v = _q8(q.astype(np.float32)), _q8(k), _q8(v)
    else:
        k, v = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((n, nh, hd))
    for p in range(n):
        for h in range(nh):
            j = h // (nh // nkv)
            sc = k[: p + 1, j] @ q[p, h] / np.sqrt(hd)
            e = np.exp(sc - sc.max())
            out[p, h] = (e / e.sum()) @ v[: p + 1, j]
    return out.reshape(n, nh * hd)


def _run_q8(qkv, nh, nkv, hd, cos, sin, ctx, chunks, decode_from):
    """Prefill chunks [a, b), then single-row decode steps from decode_from; the cache starts as 0x7f bytes
    (scales NaN), so a kernel that reads a position it should not shows as NaN."""
    n = qkv.shape[0]
    kc = np.full(ops.q8_cache_shape(nkv, ctx, hd), 0x7F, np.int8)
    vc = np.full(ops.q8_cache_shape(nkv, ctx, hd), 0x7F, np.int8)
    scratch = np.full((nh * ops.ATTENTION_SCRATCH_ROWS, ctx), np.nan, np.float32)
    out = np.zeros((n, nh * hd), np.float32)
    for a, b in chunks:
        ops.attention_q8(qkv[a:b].copy(), nh, nkv, hd, cos, sin, a, ctx, kc, vc, out[a:b], scratch)
    for p in range(decode_from, n):
        ops.attention_q8(qkv[p: p + 1].copy(), nh, nkv, hd, cos, sin, p, ctx, kc, vc, out[p: p + 1], scratch)
    return out


@pytest.mark.parametrize("nh,nkv,hd,n", [(4, 2, 16, 11), (3, 3, 20, 11), (4, 1, 100, 40), (8, 2, 128, 300), (6, 2, 36, 50)])
def test_attention_q8_against_float64_and_identical_on_every_path(nh, nkv, hd, n):
    """int8 K/V: against float64 attention over the same rounded q, K, V (2e-5: only f32 arithmetic differs), against
    exact K/V with the int8 rounding's tolerance (measured max error 0.008-0.019 here on N(0,1) data: 0.05), and the
    same bits on every ISA path (integer-valued inputs to one FMA order, one exp polynomial, fixed-lane sums)."""
    rng = np.random.default_rng(hd + n)
    ctx = n + 13
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    cos, sin = rope_tables(ctx, hd)
    split = min(7, n // 2)
    outs = {}
    for name in PATHS:
        ops.set_isa(name)
        try:
            outs[name] = _run_q8(qkv, nh, nkv, hd, cos, sin, ctx, [(0, split)], split)
        finally:
            ops.set_isa(None)
    got = outs[PATHS[0]]
    np.testing.assert_allclose(got, _attention_q8_reference(qkv, nh, nkv, hd, cos, sin, True), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, _attention_q8_reference(qkv, nh, nkv, hd, cos, sin, False), rtol=0, atol=0.05)
    for name in PATHS[1:]:
        assert np.array_equal(outs[name].view(np.int32), got.view(np.int32)), name


def test_attention_q8_subnormal_weights_count_as_zero_on_every_path():
    """A weight p x value scale under FLT_MIN is 0 on every path, the scalar body's too (Intel cores take a microcode
    assist on each FMA a subnormal enters; the term moves an output by under 1e-35). q = 0 makes the scores equal,
    p = 1 / (row + 1); values of 1e-36 give value scales near 2.4e-38: from row 100 on every weight is subnormal and
    the row is exactly 0, while the first rows (p near 1, weights normal) are not."""
    nh, nkv, hd, n = 4, 2, 64, 160
    rng = np.random.default_rng(11)
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    qkv[:, : nh * hd] = 0
    qkv[:, (nh + nkv) * hd:] *= np.float32(1e-36)
    cos, sin = rope_tables(n, hd)
    outs = {}
    for name in PATHS:
        ops.set_isa(name)
        try:
            outs[name] = _run_q8(qkv, nh, nkv, hd, cos, sin, n, [(0, 50)], 50)
        finally:
            ops.set_isa(None)
    got = outs[PATHS[0]]
    assert np.abs(got[:2]).max() > 0
    assert not got[100:].any()
    for name in PATHS[1:]:
        assert np.array_equal(outs[name].view(np.int32), got.view(np.int32)), name


@pytest.mark.parametrize("kv_dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("nh,nkv", [(8, 2), (3, 1)])
def test_attention_subnormal_softmax_weights_count_as_zero_on_every_path(kv_dtype, nh, nkv):
    """A softmax weight under FLT_MIN is 0 for f16 and f32 caches too, on every path (the four-, two- and one-query
    weighted sums). RoPE off (cos 1, sin 0), q = c e0, key e0 of +1 at positions 0 and 1 and -1 after: each row's
    later positions score 2c / 8 below its max, and with two positions at the max the sum is 2. A gap of 87 gives
    them exp(-87) / 2 = 8e-39 (subnormal): rows from 2 on, whose values are 0 at positions 0 and 1 and 1000 after,
    are exactly 0. A gap of 80 (weights 9e-36, normal) leaves them nonzero: the case that shows a flush is there."""
    hd, n = 64, 160
    cos, sin = np.ones((n, hd // 2), np.float32), np.zeros((n, hd // 2), np.float32)

    def run(gap):
        qkv = np.zeros((n, (nh + 2 * nkv) * hd), np.float32)
        q = qkv[:, : nh * hd].reshape(n, nh, hd)
        k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
        q[:, :, 0] = np.float32(gap * 4)  # scores +-gap / 2 (scale 1 / sqrt(64))
        k[:, :, 0] = -1
        k[:2, :, 0] = 1
        v[2:] = 1000
        kc = np.zeros(ops.key_cache_shape(nkv, n, hd), kv_dtype)
        vc = np.zeros((nkv, n, hd), kv_dtype)
        scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, n), np.float32)
        out = np.zeros((n, nh * hd), np.float32)
        ops.attention(qkv[:50].copy(), nh, nkv, hd, cos, sin, 0, kc, vc, out[:50], scratch)
        for p in range(50, n):
            ops.attention(qkv[p: p + 1].copy(), nh, nkv, hd, cos, sin, p, kc, vc, out[p: p + 1], scratch)
        return out

    for gap, flushed in ((87, True), (80, False)):
        outs = {}
        for name in PATHS:
            ops.set_isa(name)
            try:
                outs[name] = run(gap)
            finally:
                ops.set_isa(None)
        got = outs[PATHS[0]]
        assert not got[:2].any()
        assert (not got[2:].any()) if flushed else (got[2:] > 0).all(), gap
        for name in PATHS[1:]:
            assert np.array_equal(outs[name].view(np.int32), got.view(np.int32)), (gap, name)


@pytest.mark.parametrize("hd", [4, 20, 64, 100, 128])
def test_attention_q8_cache_bytes_identical_on_every_path_ties_nan_inf(hd):
    """The int8 cache's bytes (codes and scales) are the same on every path, and the codes are round-half-to-even
    of x * 127 / max|x| clamped to +-127: rows whose scaled values fall on .5 ties, rows holding a NaN or an inf
    (codes -127 where x * inv is NaN, the scalar body's rule; a NaN never wins the max), all-zero rows, tiny rows, head sizes with a tail of
    4-12 past the vector width. RoPE off (cos 1, sin 0), so keys and values go in as written."""
    nh, nkv, n = 2, 1, 24
    rng = np.random.default_rng(hd)
    cos, sin = np.ones((n, hd // 2), np.float32), np.zeros((n, hd // 2), np.float32)
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    kv = qkv[:, nh * hd:].reshape(n, 2, hd)            # this row's key, then its value
    ties = (np.arange(hd) % 254 - 126.5).astype(np.float32)
    ties[0] = 127.0                                    # max|x| = 127: inv is 1, x * inv = x, every value a tie
    kv[0, :] = ties
    kv[1, :] = -ties
    kv[2, :, hd // 2] = np.nan
    kv[3, :, 1] = np.inf
    kv[4, :, 2] = -np.inf
    kv[5, :] = 0.0
    kv[6, :] *= np.float32(1e-30)
    kv[7, :] *= np.float32(3e4)
    got = {}
    for name in PATHS:
        ops.set_isa(name)
        try:
            kc = np.zeros(ops.q8_cache_shape(nkv, n, hd), np.int8)
            vc = np.zeros(ops.q8_cache_shape(nkv, n, hd), np.int8)
            scratch = np.zeros((nh * ops.ATTENTION_SCRATCH_ROWS, n), np.float32)
            out = np.zeros((n, nh * hd), np.float32)
            ops.attention_q8(qkv.copy(), nh, nkv, hd, cos, sin, 0, n, kc, vc, out, scratch)
            got[name] = (kc.tobytes(), vc.tobytes())
        finally:
            ops.set_isa(None)
    for name in PATHS[1:]:
        assert got[name][0] == got[PATHS[0]][0], (name, "keys")
        assert got[name][1] == got[PATHS[0]][1], (name, "values")
    # the value codes, against numpy: a block is [32 positions][hd] codes, then 32 f32 scales
    vblock = np.frombuffer(got[PATHS[0]][1], np.int8)[: 32 * hd].reshape(32, hd)[:n]
    x = kv[:, 1].astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.where(np.isnan(x), 0, np.abs(x)).max(1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        r = np.rint(x * inv)
    want = np.where(np.isnan(r), -127, np.clip(np.nan_to_num(r, nan=-127), -127, 127)).astype(np.int8)
    assert np.array_equal(vblock, want)
    assert (vblock[0] == np.rint(ties)).all() and vblock[0, 1] == -126   # -125.5 rounds to the even -126
    # an inf makes max|x| inf and inv 0: its own code is -127 (inf * 0 is NaN), the row's others 0
    assert vblock[2, hd // 2] == -127 and vblock[3, 1] == -127 and np.count_nonzero(vblock[3]) == 1
    assert not vblock[5].any()


def test_attention_q8_decode_rows_equal_verify_rows_and_threads(isa):
    """Past 256 positions (pieces): decode rows bit-equal to the same rows of a prefill chunk (what prompt lookup's
    verify relies on), and 1 and 2 threads give the same bits."""
    rng = np.random.default_rng(3)
    nh, nkv, hd, ctx, n = 8, 2, 128, 700, 620
    cos, sin = rope_tables(ctx, hd)
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * hd)).astype(np.float32)
    before = K.get_num_threads()
    try:
        K.set_num_threads(1)
        dec1 = _run_q8(qkv, nh, nkv, hd, cos, sin, ctx, [(0, 250), (250, 530)], 530)
        K.set_num_threads(2)
        dec2 = _run_q8(qkv, nh, nkv, hd, cos, sin, ctx, [(0, 250), (250, 530)], 530)
        chunk = _run_q8(qkv, nh, nkv, hd, cos, sin, ctx, [(0, 250), (250, 530), (530, n)], n)
    finally:
        K.set_num_threads(before)
    assert not np.isnan(dec1).any()
    assert np.array_equal(dec1.view(np.int32), dec2.view(np.int32))
    assert np.array_equal(dec1[530:].view(np.int32), chunk[530:].view(np.int32))


def test_attention_without_query_heads_or_head_width_raises_instead_of_crashing():
    """n_heads 0 divided by zero in the C work split (SIGFPE killed Python) and a negative count passed; every
    attention entry point refuses them, and a head_dim below 2, at the boundary."""
    ctx, hd = 8, 8
    cos = sin = np.zeros((ctx, hd // 2), np.float32)
    kc = np.zeros(ops.key_cache_shape(1, ctx, hd), np.float32)
    vc = np.zeros((1, ctx, hd), np.float32)
    q8 = np.zeros(ops.q8_cache_shape(1, ctx, hd), np.int8)
    out, scr = np.zeros((1, 0), np.float32), np.zeros((4, ctx), np.float32)
    for n_heads in (0, -2):
        qkv = np.zeros((1, n_heads * hd + 2 * hd), np.float32)   # a width that fits the head counts
        with pytest.raises(KernelError, match="heads"):
            ops.attention_plan([3], [0], n_heads, 1, hd, 2)
        with pytest.raises(KernelError, match="heads"):
            ops.attention(qkv, n_heads, 1, hd, cos, sin, 0, kc, vc, out, scr)
        with pytest.raises(KernelError, match="heads"):
            ops.attention_q8(qkv, n_heads, 1, hd, cos, sin, 0, ctx, q8, q8.copy(), out, scr)
        with pytest.raises(KernelError, match="heads"):
            ops.attention_paged(qkv, n_heads, 1, hd, cos, sin, np.array([0, 1], np.int32), np.array([0], np.int32),
                                np.zeros((1, 1), np.int32), np.zeros(ops.paged_key_pool_shape(1, 1, hd), np.float32),
                                np.zeros(ops.paged_value_pool_shape(1, 1, hd), np.float32), out, scr)
    with pytest.raises(KernelError, match="heads"):
        ops.attention(np.zeros((1, 0), np.float32), 1, 1, 0, cos[:, :0].copy(), sin[:, :0].copy(), 0,
                      np.zeros(ops.key_cache_shape(1, ctx, 0), np.float32), np.zeros((1, ctx, 0), np.float32),
                      np.zeros((1, 0), np.float32), scr)


def test_attention_q8_bad_arguments_raise():
    cos = sin = np.zeros((8, 4), np.float32)
    kc = np.zeros(ops.q8_cache_shape(1, 8, 8), np.int8)
    out, scr = np.zeros((1, 8), np.float32), np.zeros((4, 8), np.float32)
    with pytest.raises(KernelError, match="q8_cache_shape"):  # n_ctx that does not match the cache
        ops.attention_q8(np.zeros((1, 24), np.float32), 1, 1, 8, cos, sin, 0, 40, kc, kc.copy(), out, scr)
    with pytest.raises(KernelError, match="q8_cache_shape"):  # value cache of another shape
        ops.attention_q8(np.zeros((1, 24), np.float32), 1, 1, 8, cos, sin, 0, 8, kc, kc[:, :, :-4].copy(), out, scr)
    with pytest.raises(KernelError, match="do not fit"):      # position past the cache
        ops.attention_q8(np.zeros((1, 24), np.float32), 1, 1, 8, cos, sin, 8, 8, kc, kc.copy(), out, scr)
    with pytest.raises(KernelError, match="multiple of 4"):
        k6 = np.zeros(ops.q8_cache_shape(1, 8, 6), np.int8)
        ops.attention_q8(np.zeros((1, 18), np.float32), 1, 1, 6, cos[:, :3].copy(), sin[:, :3].copy(), 0, 8, k6,
                         k6.copy(), np.zeros((1, 6), np.float32), scr)
    with pytest.raises(KernelError, match="paged_q8_pool_shape"):
        ops.attention_paged_q8(np.zeros((1, 24), np.float32), 1, 1, 8, cos, sin, np.array([0, 1], np.int32),
                               np.array([0], np.int32), np.zeros((1, 1), np.int32), np.zeros((2, 1, 100), np.int8),
                               np.zeros((2, 1, 100), np.int8), out, scr)
