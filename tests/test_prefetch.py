"""The software prefetch of the x86 GEMV bodies (bk_prefetch_ahead, BK_GEMV_PREFETCH_DEFAULT in kernels.h):
a hint that must never change a result and never fault, even when it runs past the end of the weights, and the
switch that sets its distance (simd.set_gemv_prefetch, BITNET_PREFETCH).

The weights of each case end exactly at a page that may not be read (PROT_NONE): a body that prefetched with a
plain load, or read past its matrix, would die here. Every vector path runs the cases (the x86 ones prefetch;
the others ignore the setting)."""
import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import layout

VECTOR_ISAS = [i for i in K.supported_isas() if i != "amx"]
DISTANCES = [0, 64, K.GEMV_PREFETCH_DEFAULT, K.GEMV_PREFETCH_DEFAULT_256, 1 << 20]
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_keep = []  # the guarded mappings live as long as the arrays on them


def at_guard(a: np.ndarray) -> np.ndarray:
    """A copy of a whose last byte is the last readable byte before a PROT_NONE page."""
    data = -(-a.nbytes // PAGE) * PAGE
    mm = mmap.mmap(-1, data + PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert _libc.mprotect(base + data, PAGE, 0) == 0, os.strerror(ctypes.get_errno())
    out = np.frombuffer(mm, dtype=a.dtype, count=a.size, offset=data - a.nbytes).reshape(a.shape)
    out[...] = a
    _keep.append(mm)
    return out


@pytest.fixture(params=VECTOR_ISAS)
def isa(request):
    K.set_isa(request.param)
    yield request.param
    K.set_gemv_prefetch(None)
    K.set_isa(None)


def quantized(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    xq = np.empty((m, layout.pad_to(k, 64)), np.int8)
    s, sm = np.empty(m, np.float32), np.empty(m, np.int32)
    K.quantize_act(x, xq, s, sm)
    return xq, s, sm


def run_at_every_distance(fn):
    """fn() -> an output array; the same bits at every distance, and the first one kept as the reference."""
    outs = []
    for d in DISTANCES:
        K.set_gemv_prefetch(d)
        assert K.gemv_prefetch() == d
        outs.append(fn().copy())
    for d, o in zip(DISTANCES[1:], outs[1:]):
        assert np.array_equal(o.view(np.int32), outs[0].view(np.int32)), f"prefetch {d} changed the result"
    return outs[0]


@pytest.mark.parametrize("n,k", [(16, 64), (48, 2560), (37, 6912)])
def test_ternary_gemv_and_rows_at_a_guard_page(isa, n, k):
    rng = np.random.default_rng(n + k)
    wt = rng.integers(-1, 2, (n, k)).astype(np.int8)
    w = at_guard(layout.pack_ternary(wt))
    rs = rng.random(layout.pad_to(n, 16)).astype(np.float32)
    xq, s, sm = quantized(rng, 3, k)
    exact = xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T

    def one():
        out = np.empty(n, np.float32)
        K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
        return out

    def raw():
        out = np.empty(n, np.int32)
        K.gemv_ternary_i32(w, xq[0], int(sm[0]), out)
        return out

    def rows():
        out = np.empty((3, n), np.float32)
        K.gemv_rows_ternary(w, rs, xq, s, sm, out)
        return out

    assert np.array_equal(run_at_every_distance(raw), exact[0] - 0)
    ref = run_at_every_distance(one)
    assert np.array_equal(run_at_every_distance(rows)[0].view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("one_block", [False, True])
@pytest.mark.parametrize("n,k", [(16, 64), (48, 2560), (37, 6912)])
def test_ternary_gemv_either_loop_at_a_guard_page(isa, one_block, n, k):
    """The AVX-512 tile16 GEMV's two loops (simd.set_gemv_one_block: one block per step on Intel, two elsewhere)
    give the exact dots and the same f32 bits as the other loop, whichever one this CPU runs by default."""
    rng = np.random.default_rng(3 * n + k)
    wt = rng.integers(-1, 2, (n, k)).astype(np.int8)
    w = at_guard(layout.pack_ternary(wt))
    rs = rng.random(layout.pad_to(n, 16)).astype(np.float32)
    xq, s, sm = quantized(rng, 1, k)
    exact = (xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T)[0]

    def one():
        out = np.empty(n, np.float32)
        K.gemv_ternary(w, rs, xq[0], float(s[0]), int(sm[0]), out)
        return out

    def raw():
        out = np.empty(n, np.int32)
        K.gemv_ternary_i32(w, xq[0], int(sm[0]), out)
        return out

    try:
        K.set_gemv_one_block(not one_block)
        other = one().copy()
        K.set_gemv_one_block(one_block)
        assert K.gemv_one_block() is one_block
        assert np.array_equal(run_at_every_distance(raw), exact)
        assert np.array_equal(run_at_every_distance(one).view(np.int32), other.view(np.int32))
    finally:
        K.set_gemv_one_block(None)


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), None)
    except OSError:
        return None


def test_set_gemv_one_block_checks_its_argument_and_defaults_to_intel():
    before = K.gemv_one_block()
    for bad in (1, 0, "yes", None.__class__):
        with pytest.raises(KernelError):
            K.set_gemv_one_block(bad)
    assert K.gemv_one_block() == before
    K.set_gemv_one_block(not before)
    K.set_isa(None)
    assert K.gemv_one_block() == (not before)   # an explicit choice outlives a change of path
    K.set_gemv_one_block(None)
    vendor = _cpu_vendor()
    if vendor is None:
        pytest.skip("no vendor_id in /proc/cpuinfo (not x86 Linux)")
    assert K.gemv_one_block() == (vendor == "GenuineIntel")


@pytest.mark.parametrize("n,k", [(16, 80), (37, 2560)])
def test_base3_gemv_at_a_guard_page(isa, n, k):
    rng = np.random.default_rng(n * k)
    wt = rng.integers(-1, 2, (n, k)).astype(np.int8)
    w = at_guard(layout.pack_ternary_b3(wt))
    xq, s, sm = quantized(rng, 1, k)

    def raw():
        out = np.empty(n, np.int32)
        K.gemv_ternary_b3_i32(w, xq[0], int(sm[0]), out)
        return out

    assert np.array_equal(run_at_every_distance(raw), (xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T)[0])


@pytest.mark.parametrize("n,k", [(16, 64), (300, 2560)])
def test_q4_head_at_a_guard_page(isa, n, k):
    rng = np.random.default_rng(7 * n + k)
    q, sc4, d = layout.quantize_rows_q4g(rng.standard_normal((n, k)).astype(np.float32))
    codes, gs = at_guard(layout.pack_q4g(q)), at_guard(layout.pack_q4g_scales(sc4))
    xq, s, _ = quantized(rng, 1, k)
    exact = np.einsum("ngc,mgc->mn", q.reshape(n, -1, 32).astype(np.int64) * sc4[:, :, None].astype(np.int64),
                      xq.reshape(1, -1, 32).astype(np.int64))

    def raw():
        out = np.empty((1, n), np.int32)
        K.gemv_q4g_i32(codes, gs, xq, out)
        return out

    assert np.array_equal(run_at_every_distance(raw), exact)


def test_set_gemv_prefetch_checks_its_argument():
    before = K.gemv_prefetch()
    for bad in (-1, (1 << 20) + 1, "4096", 4096.0):
        with pytest.raises(KernelError):
            K.set_gemv_prefetch(bad)
    assert K.gemv_prefetch() == before
    for isa in VECTOR_ISAS:   # None: each path's own default, kept across path changes
        K.set_isa(isa)
        K.set_gemv_prefetch(None)
        want = K.GEMV_PREFETCH_DEFAULT_256 if isa in ("avx2", "avxvnni") else K.GEMV_PREFETCH_DEFAULT
        assert K.gemv_prefetch() == want
        K.set_gemv_prefetch(1024)
        K.set_isa(None)
        assert K.gemv_prefetch() == 1024   # an explicit distance outlives a change of path
    K.set_gemv_prefetch(None)
    K.set_isa(None)


def _child(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=120)


def test_bitnet_prefetch_env():
    code = "from bitnet_cpu import simd; print(simd.gemv_prefetch())"
    r = _child(code, BITNET_PREFETCH="8192")
    assert r.returncode == 0 and r.stdout.split() == ["8192"], r.stderr
    r = _child(code, BITNET_PREFETCH="0")
    assert r.returncode == 0 and r.stdout.split() == ["0"], r.stderr
    for bad in ("far", "-64", str((1 << 20) + 64)):
        r = _child(code, BITNET_PREFETCH=bad)
        assert r.returncode != 0 and f"BITNET_PREFETCH={bad}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu.simd"], env=dict(os.environ, BITNET_PREFETCH="far"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "BITNET_PREFETCH=far" in r.stderr
