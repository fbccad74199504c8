"""Group-scaled ternary weights ("tg128", the Ternary Bonsai / GGUF Q2_0 format): layout round trip, the per-group
activation quantizer and the kernel bit for bit against the numpy oracle on every ISA path (1 and 2 threads,
M = 1..9 rows, N not a multiple of 16), the float math they stand for, and the boundary checks."""
import numpy as np
import pytest

from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import layout
from bitnet_cpu.simd import reference as R
from test_kernels import ISAS  # the isa fixture (forcing a path, then restoring it) is conftest's


def group_ternary(rng, n, k, zero_frac=0.4):
    t = rng.choice(np.array([-1, 0, 1], np.int8), size=(n, k), p=[(1 - zero_frac) / 2, zero_frac, (1 - zero_frac) / 2])
    sc = (rng.uniform(0.002, 0.05, size=(n, k // 128))).astype(np.float16)
    return t, sc


def quantize(x):
    m, k = x.shape
    xq = np.empty((m, k), np.int8)
    xd = np.empty((m, k // 128), np.float32)
    xs = np.empty((m, k // 128), np.int32)
    K.quantize_act_g128(x, xq, xd, xs)
    return xq, xd, xs


def test_tg128_layout_round_trip():
    rng = np.random.default_rng(1)
    t, sc = group_ternary(rng, 37, 384)
    packed = layout.pack_tg128(t, sc)
    assert packed.size == layout.tg128_bytes(37, 384) == 3 * 3 * 544
    t2, sc2 = layout.unpack_tg128(packed, 37, 384)
    assert np.array_equal(t2, t) and np.array_equal(sc2.view(np.uint16), sc.view(np.uint16))
    with pytest.raises(ValueError, match="multiple of 128"):
        layout.pack_tg128(t[:, :100], sc[:, :1])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_quantize_act_g128_matches_the_oracle(isa):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 300)) * 3).astype(np.float32)
    x[1, 128:256] = 0.0                       # an all-zero group: xq 0, xd 0
    x[2, 5] = 1e4                             # an outlier only costs its own group precision
    xq = np.full((5, 384), 99, np.int8)
    xd, xs = np.empty((5, 3), np.float32), np.empty((5, 3), np.int32)
    K.quantize_act_g128(x, xq, xd, xs)
    rq, rd, rs = np.empty_like(xq), np.empty_like(xd), np.empty_like(xs)
    R.quantize_act_g128(x, rq, rd, rs)
    assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
    assert np.all(xq[:, 300:] == 0) and xd[1, 1] == 0 and np.all(xq[1, 128:256] == 0)
    assert np.abs(xq).max() <= 127
    deq = xq[:, :300].astype(np.float32) * np.repeat(xd, 128, axis=1)[:, :300]
    assert np.all(np.abs(deq - x) <= np.repeat(xd, 128, axis=1)[:, :300] * 0.5 + 1e-6)
    assert np.abs(deq[2, 128:] - x[2, 128:]).max() < 0.05  # the outlier's group is coarse, the others are not


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k,m", [(1, 128, 1), (37, 384, 1), (37, 384, 3), (300, 2048, 1), (250, 1024, 9),
                                   (1024, 6144, 2)])
def test_gemv_tg_bit_exact_on_every_path(isa, threads, n, k, m):
    K.set_num_threads(threads)
    rng = np.random.default_rng(n * 7 + k + m)
    t, sc = group_ternary(rng, n, k)
    w = layout.pack_tg128(t, sc)
    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    xq, xd, xs = quantize(x)
    xq[0, :4] = -127                          # the activation extremes
    xq[0, 4:8] = 127
    xs[0, 0] = xq[0, :128].astype(np.int32).sum()
    out = np.full((m, n), np.nan, np.float32)
    K.gemv_tg(w, xq, xd, xs, out)
    ref = np.empty_like(out)
    R.gemv_tg(w, xq, xd, xs, ref)
    assert np.array_equal(out, ref)
    if m == 1:                                # the 1-D forms give the same bits
        o1 = np.empty(n, np.float32)
        K.gemv_tg(w, xq[0], xd[0], xs[0], o1)
        assert np.array_equal(o1, out[0])
    # ... and they stand for the float product of the dequantized operands
    wf = t.astype(np.float64) * np.repeat(sc.astype(np.float64), 128, axis=1)
    xf = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 128, axis=1)
    exact = xf @ wf.T
    assert np.allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


def test_gemv_tg_checks_its_arguments():
    rng = np.random.default_rng(3)
    t, sc = group_ternary(rng, 32, 256)
    w = layout.pack_tg128(t, sc)
    xq, xd, xs = quantize(rng.standard_normal((1, 256)).astype(np.float32))
    out = np.empty((1, 32), np.float32)
    with pytest.raises(KernelError, match="w has"):
        K.gemv_tg(w[:-1], xq, xd, xs, out)
    with pytest.raises(KernelError, match="xd has"):
        K.gemv_tg(w, xq, xd[:, :1].copy(), xs, out)
    with pytest.raises(KernelError, match="not a multiple of 128"):
        K.gemv_tg(w, np.zeros((1, 192), np.int8), xd, xs, out)
    with pytest.raises(KernelError, match="rows"):
        K.gemv_tg(w, xq, xd, xs, np.empty((2, 32), np.float32))
    with pytest.raises(KernelError, match="dtype"):
        K.gemv_tg(w, xq.astype(np.int16), xd, xs, out)
    with pytest.raises(KernelError, match="columns"):
        K.quantize_act_g128(np.zeros((1, 300), np.float32), np.zeros((1, 256), np.int8), xd, xs)


def test_quantize_act_g128_first_k_columns():
    """k= quantizes the first k columns of each row (the gate half of [gate | up]) as a copy of them would be."""
    rng = np.random.default_rng(4)
    gu = rng.standard_normal((3, 512)).astype(np.float32)
    xq, xd, xs = np.empty((3, 256), np.int8), np.empty((3, 2), np.float32), np.empty((3, 2), np.int32)
    K.quantize_act_g128(gu, xq, xd, xs, 256)
    rq, rd, rs = quantize(np.ascontiguousarray(gu[:, :256]))
    assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
    with pytest.raises(KernelError, match="more than"):
        K.quantize_act_g128(gu, xq, xd, xs, 600)
