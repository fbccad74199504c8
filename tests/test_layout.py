"""The packed layouts of simd/layout.py round-trip and place codes exactly where the kernels expect."""
import numpy as np
import pytest

from bitnet_cpu.simd import layout


@pytest.mark.parametrize("n,k", [(1, 4), (16, 64), (17, 68), (40, 3200 // 10), (33, 130)])
def test_ternary_round_trip(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    w = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    p = layout.pack_ternary(w)
    n_pad, k_pad = layout.padded_shape(n, k)
    assert p.dtype == np.uint8 and p.size == n_pad * k_pad // 4
    assert np.array_equal(layout.unpack_ternary(p, n, k), w)


def test_ternary_bit_positions():
    # W[16t + r, 16b + 4i + j] sits at byte ((t*KB + b)*64 + r*4 + j), bits 2i
    n, k = 32, 128
    w = np.zeros((n, k), dtype=np.int8)
    w[16 + 3, 16 * 2 + 4 * 1 + 2] = 1  # t=1 r=3 b=2 i=1 j=2 -> code 2
    p = layout.pack_ternary(w)
    kb = 128 // 16
    byte = (1 * kb + 2) * 64 + 3 * 4 + 2
    assert (p[byte] >> 2) & 3 == 2
    others = np.delete(p, byte)
    assert np.all(others == 0b01010101)


def test_rejects_non_ternary():
    with pytest.raises(ValueError):
        layout.pack_ternary(np.full((2, 4), 2))


@pytest.mark.parametrize("n,k", [(1, 4), (16, 64), (35, 100)])
def test_i8_and_f16_round_trip(n, k):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, s = layout.quantize_rows_i8(w)
    assert np.abs(q).max() <= 127
    np.testing.assert_allclose(q * s[:, None], w, atol=float(s.max()) / 2 + 1e-7)
    assert np.array_equal(layout.unpack_i8(layout.pack_i8(q), n, k), q)
    h = layout.pack_f16(w)
    assert np.array_equal(layout.unpack_f16(h, n, k), w.astype(np.float16))
