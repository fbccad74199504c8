"""simd._kernels against the numpy oracle (simd/reference.py) on every ISA path this CPU runs.

Integer accumulation makes the paths bit-identical, so results are compared with array_equal (int32 dots
and f32 outputs), never with a tolerance; only the f16 GEMV is compared to a float64 oracle with a
tolerance, and to the scalar path exactly. Shapes include the BitNet-2B-4T layers and awkward small ones.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.simd import layout
from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import reference as R

ISAS = K.supported_isas()
SIMD_ISAS = [i for i in ISAS if i != "scalar"]

# (N, K): 2B-4T layers (qkv 2560+2*640=3840, o, gate|up fused, down), then awkward ones
BIG_SHAPES = [(2560, 2560), (640, 2560), (6912, 2560), (13824, 2560), (2560, 6912), (3840, 2560)]
SMALL_SHAPES = [(1, 4), (16, 64), (37, 100), (100, 3200), (17, 8640), (33, 192), (250, 68), (48, 1024)]


def make_ternary(rng, n, k):
    wt = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    return wt, layout.pack_ternary(wt), (rng.random(n, dtype=np.float32) + np.float32(0.25))


def quantized(rng, m, k, scale=3.0):
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    k_pad = layout.pad_to(k, 64)
    xq = np.empty((m, k_pad), np.int8)
    s = np.empty(m, np.float32)
    sm = np.empty(m, np.int32)
    R.quantize_act(x, xq, s, sm)
    return x, xq, s, sm


def exact_dots(wt, xq):
    """Exact int32 dots via float64 BLAS (exact: |sums| << 2^53); checked against R.ternary_dot below."""
    k = wt.shape[1]
    return (xq[:, :k].astype(np.float64) @ wt.astype(np.float64).T).astype(np.int32)


def oracle_out(dots, s, row_scale, n):
    return (dots.astype(np.float32) / s[:, None]) * row_scale[None, :n]


# ---------------------------------------------------------------- dispatch
def test_features_and_active():
    f = K.features()
    assert {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avxvnni", "neon"} <= set(f)
    assert K.active() in ISAS and "scalar" in ISAS
    if f["avx512vnni"] and f["avx512bw"]:
        # the auto choice: avx512, with the AMX tiles on top where the CPU has them and Linux grants them
        assert K.active() == ("amx" if "amx" in ISAS else "avx512")


def test_set_isa_rejects_unknown_and_unsupported():
    with pytest.raises(KernelError, match="unknown ISA"):
        K.set_isa("sse9")
    other = "neon" if sys.platform.startswith("linux") and os.uname().machine == "x86_64" else "avx512"
    if other not in ISAS:
        with pytest.raises(KernelError, match="cannot run"):
            K.set_isa(other)
    assert K.active() in ISAS  # a refused request leaves a working path in place
    K.set_isa(None)


def test_unknown_isa_hint_names_every_choice():
    """The hint of an unknown name lists every name set_isa takes ("amx" and "auto" were missing) and only those."""
    with pytest.raises(KernelError) as e:
        K.set_isa("bogus")
    names = [n.strip() for n in e.value.hint.removeprefix("use one of ").split(",")]
    assert set(names) == set(K.ISA_NAMES) | {"amx", "auto"}, e.value.hint
    try:
        for name in names:   # each is known: run here or refused as one this CPU cannot run
            try:
                K.set_isa(name)
            except KernelError as err:
                assert "unknown ISA" not in str(err), err
    finally:
        K.set_isa(None)


@pytest.mark.parametrize("name", ISAS)
def test_bitnet_isa_env_forces_path(name):
    env = dict(os.environ, BITNET_ISA=name)
    r = subprocess.run([sys.executable, "-c", "from bitnet_cpu import simd; print(simd.active())"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == name


def test_bitnet_isa_env_bad_value_raises_clearly():
    env = dict(os.environ, BITNET_ISA="bogus")
    r = subprocess.run([sys.executable, "-c", "import bitnet_cpu.simd._kernels"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "BITNET_ISA=bogus" in r.stderr


def test_python_m_simd_prints_path():
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu.simd"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"active:   {K.active()}" in r.stdout


# ---------------------------------------------------------------- quantize_act
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m,k", [(1, 4), (3, 100), (8, 2560), (17, 6912), (2, 3200), (5, 8640), (4, 33)])
def test_quantize_act_matches_reference(isa, m, k):
    rng = np.random.default_rng(k * 31 + m)
    x = (rng.standard_normal((m, k)) * 4).astype(np.float32)
    x[0, : min(k, 3)] = 0
    if m > 1:
        x[1] = 0  # all-zero row: scale from the 1e-5 floor
    k_pad = layout.pad_to(k, 64)
    got = np.full((m, k_pad), 77, np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    ref = np.empty((m, k_pad), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    K.quantize_act(x, *got)
    R.quantize_act(x, *ref)
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_quantize_act_rounds_half_to_even_and_1d(isa):
    # max|x| = 127 -> scale exactly 1, so x * scale lands on the .5 ties
    x = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -126.5] + [0.25] * 40, np.float32)
    xq = np.full(64, 9, np.int8)
    s, sm = np.empty(1, np.float32), np.empty(1, np.int32)
    K.quantize_act(x, xq, s, sm)
    assert s[0] == 1.0
    assert list(xq[:9]) == [127, 0, 2, 2, 0, -2, -2, 4, -126]
    assert not xq[x.size:].any() and sm[0] == int(xq.astype(np.int32).sum())


def _nan_inf_rows(k):
    """Rows with a NaN or an infinity where each path meets it: the first element, the first and the last full
    vector (8 and 16 lanes), the middle, the scalar or masked tail; a NaN larger in place than every other value's
    magnitude; all NaN; +inf, -inf beside a NaN."""
    rng = np.random.default_rng(k)
    at = [0, 7, 15, k // 2, k // 8 * 8 - 1, k // 16 * 16 - 1, k - 1]
    x = (rng.standard_normal((len(at) + 4, k)) * 4).astype(np.float32)
    for r, i in enumerate(at):
        x[r, i] = np.nan
    x[len(at), :] = np.nan
    x[len(at) + 1, 5] = np.inf
    x[len(at) + 2, [3, k - 2]] = [-np.inf, np.nan]
    x[len(at) + 3, ::3] = np.nan
    return x


# A NaN in a row never sets the scale (the scalar `a > amax` skips it) and quantizes to -128 (g128: -127); an
# infinity makes the scale 0. AVX2 and AVX-512 kept max_ps(vmax, |x|), which returns |x| when either is NaN, so a
# NaN in a vector lane could become the scale; NEON's vmaxq kept it and vcvtnq made it 0. Every path: the bytes of
# the reference (a NaN model output is garbage either way, but every path's the same garbage, and no UB)
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("k", [300, 2560])
def test_quantize_act_with_nan_and_inf(isa, k):
    x = _nan_inf_rows(k)
    m, k_pad = x.shape[0], layout.pad_to(k, 64)
    got = np.full((m, k_pad), 77, np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    ref = np.empty((m, k_pad), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    K.quantize_act(x, *got)
    R.quantize_act(x, *ref)
    assert np.all(np.isfinite(ref[1])) and ref[0][0, 0] == -128
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)
    k_pad = layout.pad_to(k, 128)
    groups = k_pad // 128
    got = np.full((m, k_pad), 77, np.int8), np.empty((m, groups), np.float32), np.empty((m, groups), np.int32)
    ref = np.empty((m, k_pad), np.int8), np.empty((m, groups), np.float32), np.empty((m, groups), np.int32)
    K.quantize_act_g128(x, *got)
    R.quantize_act_g128(x, *ref)
    assert ref[0][0, 0] == -127
    for g, r in zip(got, ref):
        assert np.array_equal(g, r, equal_nan=g.dtype.kind == "f")


# ---------------------------------------------------------------- ternary GEMV / GEMM
def test_exact_dots_oracle_is_the_reference():
    rng = np.random.default_rng(5)
    wt, w, _ = make_ternary(rng, 37, 100)
    _, xq, _, _ = quantized(rng, 3, 100)
    assert np.array_equal(exact_dots(wt, xq), R.ternary_dot(w, 37, xq))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", SMALL_SHAPES + BIG_SHAPES)
def test_gemv_ternary(isa, n, k):
    rng = np.random.default_rng(n + 7 * k)
    wt, w, rs = make_ternary(rng, n, k)
    _, xq, s, sm = quantized(rng, 1, k)
    dots = exact_dots(wt, xq)
    out = np.empty(n, np.float32)
    K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
    assert np.array_equal(out, oracle_out(dots, s, rs, n)[0])
    if n * k < 2e6:
        ref = np.empty(n, np.float32)
        R.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), ref)
        assert np.array_equal(out, ref)
    raw = np.empty(n, np.int32)
    K.gemv_ternary_i32(w, xq[0], int(sm[0]), raw)
    assert np.array_equal(raw, dots[0])


def _gemm_cases():
    # every token-group size of the AVX-512 body's tail (1-7 after groups of 8), M <= 32 (chunks of one tile pair)
    # and above (larger chunks), a range of one tile, lone last tiles
    for n, k in SMALL_SHAPES:
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 39, 128):
            yield n, k, m
    for n, k in BIG_SHAPES:
        yield n, k, 17
    yield 2560, 2560, 128
    yield 2560, 6912, 8


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k,m", list(_gemm_cases()))
def test_gemm_ternary(isa, n, k, m):
    if isa == "scalar" and n * k * m > 2e8:
        n = min(n, 640)  # the scalar reference is slow: same K and M, fewer rows
    rng = np.random.default_rng(n + 7 * k + 13 * m)
    wt, w, rs = make_ternary(rng, n, k)
    _, xq, s, sm = quantized(rng, m, k)
    dots = exact_dots(wt, xq)
    out = np.empty((m, n), np.float32)
    K.gemm_ternary(w, rs, xq, s, sm, out)
    assert np.array_equal(out, oracle_out(dots, s, rs, n))
    if n * k * m < 2e6:
        ref = np.empty((m, n), np.float32)
        R.gemm_ternary(w, rs, xq, s, sm, ref)
        assert np.array_equal(out, ref)
    raw = np.empty((m, n), np.int32)
    K.gemm_ternary_i32(w, xq, sm, raw)
    assert np.array_equal(raw, dots)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("xval", [-128, 127])
def test_ternary_extremes_do_not_overflow(isa, xval):
    # all +1 or all -1 weights against saturated activations: the largest partial sums any body keeps
    n, k, m = 32, 8640, 3
    for sign in (1, -1):
        wt = np.full((n, k), sign, np.int8)
        w = layout.pack_ternary(wt)
        xq = np.zeros((m, layout.pad_to(k, 64)), np.int8)
        xq[:, :k] = xval
        sm = xq.astype(np.int32).sum(axis=1).astype(np.int32)
        raw = np.empty((m, n), np.int32)
        K.gemm_ternary_i32(w, xq, sm, raw)
        assert (raw == sign * xval * k).all()
        raw1 = np.empty(n, np.int32)
        K.gemv_ternary_i32(w, xq[0], int(sm[0]), raw1)
        assert (raw1 == sign * xval * k).all()


# ---------------------------------------------------------------- LM head: int8 and f16
def make_i8(rng, n, k):
    wq, sc = layout.quantize_rows_i8(rng.standard_normal((n, k)).astype(np.float32))
    wq[0, : min(k, 5)] = -127
    wq[-1, : min(k, 5)] = 127
    return wq, layout.pack_i8(wq), sc, wq.astype(np.int32).sum(axis=1).astype(np.int32)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,k", [(1, 4), (37, 100), (250, 68), (100, 3200), (2000, 2560), (33, 8640)])
def test_gemv_i8(isa, n, k):
    rng = np.random.default_rng(3 * n + k)
    wq, w, sc, rowsum = make_i8(rng, n, k)
    _, xq, s, _ = quantized(rng, 1, k)
    xq[0, : min(k, 7)] = -128  # |-128| only fits the u8 side: the AVX2 sign trick must not negate it
    dots = (wq.astype(np.int64) @ xq[0, :k].astype(np.int64)).astype(np.int32)
    out, ref = np.empty(n, np.float32), np.empty(n, np.float32)
    K.gemv_i8(w, sc, rowsum, xq[0], float(s[0]), out)
    R.gemv_i8(w, sc, rowsum, xq[0], float(s[0]), ref)
    assert np.array_equal(out, ref)
    raw = np.empty(n, np.int32)
    K.gemv_i8_i32(w, rowsum, xq[0], raw)
    assert np.array_equal(raw, dots)


@pytest.mark.parametrize("n,k", [(1, 3), (37, 100), (250, 68), (300, 2560), (33, 8640)])
def test_gemv_f16_paths_identical_and_close(n, k):
    rng = np.random.default_rng(n * k)
    wf = rng.standard_normal((n, k)).astype(np.float16)
    wf[0, 0] = np.float16(6e-8)  # a subnormal half
    w = layout.pack_f16(wf)
    x = rng.standard_normal(k).astype(np.float32)
    ref = np.empty(n, np.float32)
    R.gemv_f16(w, x, ref)
    outs = {}
    try:
        for name in ISAS:
            K.set_isa(name)
            outs[name] = np.empty(n, np.float32)
            K.gemv_f16(w, x, outs[name])
            K.gemv_f16(w.view(np.uint16), x, outs[name])  # both dtypes accepted
    finally:
        K.set_isa(None)
    for name, o in outs.items():
        assert np.array_equal(o, outs["scalar"]), name
    np.testing.assert_allclose(outs["scalar"], ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))


# ---------------------------------------------------------------- threads
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_thread_counts_give_identical_results(isa):
    rng = np.random.default_rng(11)
    n, k, m = 1000, 2560, 9
    _, w, rs = make_ternary(rng, n, k)
    x, xq, s, sm = quantized(rng, m, k)
    _, wi, sci, rsi = make_i8(rng, n, k)
    wf = layout.pack_f16(rng.standard_normal((n, k)).astype(np.float16))
    results = []
    for threads in (1, 2, 3):
        K.set_num_threads(threads)
        assert K.get_num_threads() == threads
        q = np.empty_like(xq), np.empty_like(s), np.empty_like(sm)
        K.quantize_act(x, *q)
        o = [np.empty((m, n), np.float32), np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)]
        K.gemm_ternary(w, rs, xq, s, sm, o[0])
        K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), o[1])
        K.gemv_i8(wi, sci, rsi, xq[0], float(s[0]), o[2])
        K.gemv_f16(wf, x[0], o[3])
        results.append(list(q) + o)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert np.array_equal(a, b)


def test_i8_head_exact_at_its_widest_rows():
    """The int8 head's bound (I8_MAX_K columns) is real: its most extreme dots there are exact int32s on every path
    (past it they wrapped silently, and the wrappers now refuse)."""
    kp, n = K.I8_MAX_K, 16
    w = np.full(n * kp, -128, np.int8)
    xq = np.full(kp, 127, np.int8)
    rowsum = np.full(n, -128 * kp, np.int32)
    for isa in K.supported_isas():
        K.set_isa(isa)
        try:
            raw = np.zeros(n, np.int32)
            K.gemv_i8_i32(w, rowsum, xq, raw)
        finally:
            K.set_isa("auto")
        assert (raw == -128 * 127 * kp).all(), isa


# ---------------------------------------------------------------- bad arguments
def _good():
    n, k = 40, 128
    rng = np.random.default_rng(0)
    _, w, rs = make_ternary(rng, n, k)
    _, xq, s, sm = quantized(rng, 2, k)
    return n, k, w, rs, xq, s, sm


def test_bad_arguments_raise_kernel_error():
    n, k, w, rs, xq, s, sm = _good()
    out = np.empty(n, np.float32)
    bad_calls = [
        lambda: K.gemv_ternary(w.astype(np.int8), rs, xq[0], 1.0, 0, out),             # w dtype
        lambda: K.gemv_ternary(w[:-1], rs, xq[0], 1.0, 0, out),                         # w size
        lambda: K.gemv_ternary(w, rs[:10], xq[0], 1.0, 0, out),                         # row_scale short
        lambda: K.gemv_ternary(w, rs, xq[0, :100], 1.0, 0, out),                        # K_pad % 64
        lambda: K.gemv_ternary(w, rs, xq[:, ::2][0], 1.0, 0, out),                      # K_pad mismatch
        lambda: K.gemv_ternary(w, rs, np.zeros((1 << 18) + 64, np.int8), 1.0, 0, out),  # K_pad too large
        lambda: K.gemv_ternary(w, rs, np.asfortranarray(xq)[:, 0], 1.0, 0, out),        # non-contiguous
        lambda: K.gemv_ternary(w, rs, xq[0], 1.0, 0, out[::2]),                         # non-contiguous out
        lambda: K.gemv_ternary(w, rs, xq[0], 1.0, 0, out.astype(np.float64)),           # out dtype
        lambda: K.gemv_ternary(list(w), rs, xq[0], 1.0, 0, out),                        # not an array
        lambda: K.gemv_ternary(w, rs, xq[0], 1.0, 0, np.empty(0, np.float32)),          # N = 0
        lambda: K.gemv_ternary(w, rs.astype(">f4"), xq[0], 1.0, 0, out),                # byte order
        lambda: K.gemm_ternary(w, rs, xq, s, sm, np.empty((3, n), np.float32)),         # M mismatch
        lambda: K.gemm_ternary(w, rs, xq, s[:1], sm, np.empty((2, n), np.float32)),     # act_scale len
        lambda: K.gemm_ternary(w, rs, xq, s, sm[:1], np.empty((2, n), np.float32)),     # act_sum len
        lambda: K.gemm_ternary(w, rs, xq[0], s, sm, np.empty((2, n), np.float32)),      # xq ndim
        lambda: K.quantize_act(np.zeros((2, k), np.float32), xq[:1], s, sm),            # rows
        lambda: K.quantize_act(np.zeros((2, 200), np.float32), xq, s, sm),              # K > K_pad
        lambda: K.quantize_act(np.zeros((2, k), np.float64), xq, s, sm),                # x dtype
        lambda: K.quantize_act(np.zeros((2, k), np.float32), xq, s[:1], sm),            # scale len
        lambda: K.gemv_i8(np.zeros(n * k, np.uint8), rs, sm, xq[0], 1.0, out),         # i8 dtype
        lambda: K.gemv_i8(np.zeros(48 * k + 1, np.int8), rs, np.zeros(n, np.int32), xq[0], 1.0, out),
        lambda: K.gemv_i8(np.zeros(48 * k, np.int8), rs, np.zeros(3, np.int32), xq[0], 1.0, out),
        lambda: K.gemv_i8(np.zeros(48 * (k + (1 << 16)), np.int8), rs, np.zeros(n, np.int32),  # K_pad past the
                          np.zeros(k + (1 << 16), np.int8), 1.0, out),                    # int32 dot bound
        lambda: K.gemv_f16(np.zeros(48 * k, np.float32), np.zeros(k, np.float32), out),
        lambda: K.gemv_f16(np.zeros(48 * k - 1, np.uint16), np.zeros(k, np.float32), out),
        lambda: K.gemv_f16(np.zeros(48 * k, np.uint16), np.zeros(0, np.float32), out),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(KernelError):
            call()
            pytest.fail(f"bad call #{i} did not raise")


def test_read_only_output_is_refused():
    n, k, w, rs, xq, s, sm = _good()
    out = np.empty(n, np.float32)
    out.flags.writeable = False
    with pytest.raises(KernelError, match="read-only"):
        K.gemv_ternary(w, rs, xq[0], 1.0, 0, out)


def test_read_only_weights_are_accepted():
    # the weight store hands out read-only views of an mmap
    n, k, w, rs, xq, s, sm = _good()
    w.flags.writeable = False
    rs.flags.writeable = False
    out = np.empty(n, np.float32)
    K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
    assert np.isfinite(out).all()


def test_kernel_error_is_a_value_error():
    assert issubclass(KernelError, ValueError)


def test_bench_probes_run():
    # benchmark-only probes live in their own extension, not in the runtime's simd._kernels
    from bitnet_cpu.simd import _probes

    buf = np.ones(1 << 20, np.uint8)
    assert isinstance(_probes.stream_read(buf), int)
    assert _probes.peak_dot(10) >= 0
    assert not hasattr(K, "stream_read") and not hasattr(K, "peak_dot")


@pytest.mark.parametrize("threads", [1, 2])
def test_fma_probe_counts_its_multiply_adds(threads):
    """peak_fma: 12 chains of 16 (zmm) or 8 (ymm) lanes per iteration on every thread; none on scalar / NEON."""
    from bitnet_cpu.simd import _probes

    lanes = {"avx512": 16, "amx": 16, "avx2": 8, "avxvnni": 8}.get(K.active(), 0)
    K.set_num_threads(threads)
    try:
        assert _probes.peak_fma(1000) == 1000 * 12 * lanes * threads
        assert _probes.peak_fma(0) == 0
    finally:
        K.set_num_threads(0)


# ---------------------------------------------------------------- worker pool
def _pool_case():
    rng = np.random.default_rng(21)
    n, k = 2000, 2560
    _, w, rs = make_ternary(rng, n, k)
    _, xq, s, sm = quantized(rng, 1, k)
    ref = np.empty(n, np.float32)
    K.set_num_threads(1)
    K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), ref)
    return w, rs, xq, s, sm, ref


def test_concurrent_calls_from_python_threads():
    # the GIL is released: two Python threads may call kernels at once (one gets the pool, one runs alone)
    import threading

    w, rs, xq, s, sm, ref = _pool_case()
    K.set_num_threads(2)
    bad = []

    def worker():
        out = np.empty_like(ref)
        for _ in range(50):
            K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
            if not np.array_equal(out, ref):
                bad.append(1)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    K.set_num_threads(0)
    assert not bad and not any(t.is_alive() for t in threads)


def test_forked_child_can_use_threaded_kernels():
    # the pool's workers do not survive fork(); the child must neither hang nor compute garbage
    import multiprocessing as mp

    w, rs, xq, s, sm, ref = _pool_case()
    K.set_num_threads(2)
    out = np.empty_like(ref)
    K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)  # workers exist now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_gemv, args=(q, w, rs, xq, s, sm))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    K.set_num_threads(0)
    assert np.array_equal(got, ref)


def _child_gemv(q, w, rs, xq, s, sm):
    out = np.empty(2000, np.float32)
    K.set_num_threads(2)
    K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
    q.put(out)
