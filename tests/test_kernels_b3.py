"""The base-3 ternary layout (tile16b3, `--weights t1.6`) against tile16 and the exact oracle, on every ISA path.

The b3 kernels must give the same int32 dots and the same f32 outputs as the tile16 kernels (equality, never a
tolerance): their AVX-512 GEMV reads the digits with the division-free rule u = (3m - (3m mod 256)) / 256 inside
two dot products, every other body decodes tiles into tile16 first. Shapes cover every superblock remainder
(kb % 5 = 0..4), partial tiles, the 2B-4T layers, and a K past the GEMV's P/Q fold (256 superblocks).
"""
import platform
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import layout

ISAS = K.supported_isas()
# (N, K): between them every remainder kb % 5 of the superblocks (kb = K_pad / 16; checked below)
SHAPES = [(1, 4), (16, 64), (37, 100), (33, 192), (250, 68), (48, 1024), (17, 8640), (100, 3200),
          (16, 80), (20, 320), (31, 960), (9, 256), (3, 1280)]
BIG_SHAPES = [(2560, 2560), (3840, 2560), (13824, 2560), (2560, 6912)]


def _case(rng, n, k, m):
    wt = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    k_pad = layout.pad_to(k, 64)
    xq = np.zeros((m, k_pad), np.int8)
    xq[:, :k] = rng.integers(-127, 128, size=(m, k))
    s = (rng.random(m, dtype=np.float32) + np.float32(0.5)) * np.float32(40)
    sm = xq.astype(np.int32).sum(axis=1).astype(np.int32)
    rs = rng.random(n, dtype=np.float32) + np.float32(0.25)
    return wt, layout.pack_ternary(wt), layout.pack_ternary_b3(wt), xq, s, sm, rs


def test_shapes_cover_every_superblock_remainder():
    assert {layout.pad_to(k, 64) // 16 % 5 for _, k in SHAPES} == {0, 1, 2, 3, 4}


def test_layout_roundtrip_and_size():
    rng = np.random.default_rng(3)
    for n, k in SHAPES + [(5, 4), (2560, 6912)]:
        wt = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
        p = layout.pack_ternary_b3(wt)
        assert p.dtype == np.uint8 and p.size == layout.tile16b3_bytes(n, k)
        assert np.array_equal(layout.unpack_ternary_b3(p, n, k), wt)
    # 2B-4T: 0.8 of the tile16 bytes (down_proj: 430 of 432 blocks in superblocks)
    assert layout.tile16b3_bytes(2560, 2560) / (2560 * 2560 // 4) == 0.8
    assert layout.tile16b3_bytes(2560, 6912) / (2560 * 6912 // 4) < 0.802
    with pytest.raises(ValueError):
        layout.pack_ternary_b3(np.full((2, 4), 2, np.int8))


def test_every_digit_value_decodes():
    # all 243 digit combinations, one per row (plane 0 of superblock 0), through the packer and the rule
    v = np.arange(243)
    digits = np.stack([(v // 3 ** (4 - i)) % 3 for i in range(5)], axis=1) - 1      # [243, 5] in {-1,0,1}
    wt = np.zeros((16 * 16, 80), np.int8)
    for idx in range(243):
        wt[idx, [16 * i for i in range(5)]] = digits[idx]
    p = layout.pack_ternary_b3(wt)
    assert np.array_equal(layout.unpack_ternary_b3(p, *wt.shape), wt)
    q = (v * 256 + 242) // 243                             # the bytes the layout stores, decoded by the rule
    m, got = q.copy(), []
    for _ in range(5):
        got.append((3 * m - (3 * m) % 256) // 256)
        m = (3 * m) % 256
    assert np.array_equal(np.stack(got, axis=1), digits + 1)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", SHAPES + BIG_SHAPES)
def test_gemv_b3_equals_tile16(isa, n, k):
    rng = np.random.default_rng(n + 11 * k)
    wt, w16, wb3, xq, s, sm, rs = _case(rng, n, k, 1)
    exact = (xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T)[0]
    raw = np.empty(n, np.int32)
    K.gemv_ternary_b3_i32(wb3, xq[0], int(sm[0]), raw)
    assert np.array_equal(raw, exact)
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    K.gemv_ternary(w16, rs, xq[0], float(s[0]), int(sm[0]), a)
    K.gemv_ternary_b3(wb3, rs, xq[0], float(s[0]), int(sm[0]), b)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", SHAPES[::2] + [(2560, 6912)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])
def test_multi_row_b3_equals_tile16(isa, n, k, m):
    if isa == "scalar" and n * k * m > 5e7:
        n = 64
    rng = np.random.default_rng(n + 7 * k + m)
    wt, w16, wb3, xq, s, sm, rs = _case(rng, n, k, m)
    a, b = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    K.gemm_ternary(w16, rs, xq, s, sm, a)
    K.gemm_ternary_b3(wb3, rs, xq, s, sm, b)
    assert np.array_equal(a, b)
    if m <= K.ROWS_MAX:
        c = np.empty((m, n), np.float32)
        K.gemv_rows_ternary_b3(wb3, rs, xq, s, sm, c)
        assert np.array_equal(a, c)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_decode_to_tile16(isa):
    rng = np.random.default_rng(9)
    for n, k in SHAPES[:6]:
        wt = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
        w16 = layout.pack_ternary(wt)
        out = np.zeros_like(w16)
        K.b3_to_tile16(layout.pack_ternary_b3(wt), n, layout.pad_to(k, 64), out)
        assert np.array_equal(out, w16)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("xval", [-128, 127])
def test_extremes_past_the_fold(isa, xval):
    # all +1 / all -1 weights against saturated activations, K beyond 256 superblocks (the GEMV folds P, Q there)
    n, k = 16, 80 * 260 + 48
    for sign in (1, -1):
        wb3 = layout.pack_ternary_b3(np.full((n, k), sign, np.int8))
        xq = np.zeros((2, layout.pad_to(k, 64)), np.int8)
        xq[:, :k] = xval
        sm = xq.astype(np.int32).sum(axis=1).astype(np.int32)
        raw = np.empty(n, np.int32)
        K.gemv_ternary_b3_i32(wb3, xq[0], int(sm[0]), raw)
        assert (raw == sign * xval * k).all()
        out = np.empty((2, n), np.float32)
        K.gemm_ternary_b3(wb3, np.ones(n, np.float32), xq, np.ones(2, np.float32), sm, out)
        assert (out == np.float32(sign * xval * k)).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_thread_counts_identical(isa):
    rng = np.random.default_rng(21)
    wt, w16, wb3, xq, s, sm, rs = _case(rng, 3840, 2560, 5)
    outs = []
    for t in (1, 2, 3):
        K.set_num_threads(t)
        a, b = np.empty(3840, np.float32), np.empty((5, 3840), np.float32)
        K.gemv_ternary_b3(wb3, rs, xq[0], float(s[0]), int(sm[0]), a)
        K.gemm_ternary_b3(wb3, rs, xq, s, sm, b)
        outs.append((a, b))
    assert all(np.array_equal(o[0], outs[0][0]) and np.array_equal(o[1], outs[0][1]) for o in outs)


def test_bad_arguments_raise_kernel_error():
    rng = np.random.default_rng(1)
    wt, w16, wb3, xq, s, sm, rs = _case(rng, 32, 320, 2)
    out = np.empty(32, np.float32)
    with pytest.raises(KernelError, match="tile16b3"):
        K.gemv_ternary_b3(w16, rs, xq[0], 1.0, 0, out)          # a tile16 matrix is not a b3 one
    with pytest.raises(KernelError):
        K.gemv_ternary_b3(wb3, rs, xq[0][:100], 1.0, 0, out)    # K not a multiple of 64
    with pytest.raises(KernelError):
        K.gemm_ternary_b3(wb3, rs, xq, s[:1], sm, np.empty((2, 32), np.float32))
    with pytest.raises(KernelError, match="tile16b3"):
        K.gemv_rows_ternary_b3(wb3[:-1], rs, xq, s, sm, np.empty((2, 32), np.float32))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the probe times the AVX-512 unpack (x86 intrinsics); it has no other build")
def test_probe_compiles():
    # the probe whose numbers docs/formats.md quotes stays buildable with the command it names
    r = subprocess.run(["gcc", "-O2", "-fopenmp", "-fsyntax-only", "bench/probes/base3_unpack.c"],
                       capture_output=True, text=True, cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0, r.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
