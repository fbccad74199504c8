"""The matrix-tile kernels (simd/kernels/gemm_tiles.c, tiles.h): the ternary GEMM and the int8 head at M > 1
on AMX tiles must give the same bits as the vector paths.

Every machine runs them on the portable emulation of the tile instructions (tiles_emu.c), with each vector
path underneath (the unpack is AVX-512 on the avx512 path, portable C elsewhere): the blocking, the A tail,
odd tile counts per thread and the epilogue are the real code. Where /proc/cpuinfo shows amx_int8 the same
cases run on the hardware too (and test_kernels.py's whole matrix runs with the "amx" path).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.engine.errors import KernelError
from bitnet_cpu.simd import _kernels as K
from bitnet_cpu.simd import layout
from bitnet_cpu.simd import reference as R

VECTOR_ISAS = [i for i in K.supported_isas() if i != "amx"]
HW = "amx" in K.supported_isas()
HW_WHY = ("" if HW else "no hardware AMX tiles here (" + K.tiles_reason() + "): the emulated tile cases ran, "
          "the hardware ones need an AMX machine (Sapphire Rapids or later, Linux 5.16+)")
CPU_HAS_AMX = os.path.exists("/proc/cpuinfo") and "amx_int8" in open("/proc/cpuinfo").read()
# the tile bodies' settings in force at import (the library's defaults, or the environment's): the variant tests
# change some of them and put these back
BODIES = {"kblock": K.tile_kblock(), "stream": K.tile_stream(), "warm": K.tile_warm(), "overlap": K.tile_overlap()}


def _bodies(kblock=None, stream=None, warm=None, overlap=None):
    """The tile bodies' settings named set, every other one as BODIES has it."""
    K.set_tile_kblock(BODIES["kblock"] if kblock is None else kblock)
    K.set_tile_stream(BODIES["stream"] if stream is None else stream)
    K.set_tile_warm(BODIES["warm"] if warm is None else warm)
    K.set_tile_overlap(BODIES["overlap"] if overlap is None else overlap)


@pytest.fixture(params=[(isa, "emu") for isa in VECTOR_ISAS] + [("amx", "amx")], ids=lambda p: "-".join(p))
def tiles(request):
    """A vector path with the tiles on top (emulated), or the hardware tiles; afterwards the auto choice."""
    isa, mode = request.param
    if mode == "amx" and not HW:
        pytest.skip(HW_WHY)
    K.set_isa(isa)
    K.set_tiles(mode)
    K.set_tile_min_rows(1)      # every multi-row product through the tiles, whatever the crossover
    yield isa
    _bodies()
    K.set_tile_min_rows(0)
    K.set_isa(None)
    K.set_num_threads(0)


def _vector(fn, *args):
    """fn on the vector path alone (tiles off), then the tile mode back."""
    isa, mode = K.active(), K.tiles()
    K.set_isa("avx512" if isa == "amx" else isa)
    try:
        return fn(*args)
    finally:
        if mode == "amx":
            K.set_isa("amx")
        else:
            K.set_tiles(mode)
        K.set_tile_min_rows(1)


def _ternary_case(seed, n, k, m):
    rng = np.random.default_rng(seed)
    wt = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    k_pad = layout.pad_to(k, 64)
    xq, s, sm = np.empty((m, k_pad), np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    R.quantize_act(x, xq, s, sm)
    return wt, layout.pack_ternary(wt), rng.random(n, dtype=np.float32) + np.float32(0.25), xq, s, sm


# odd shapes: N not a multiple of 16 (and 32: a lone tile per pair), K not a multiple of 64, M = 1..40 around
# the 16-row groups, 512 once; then 2B-4T layers
SHAPES_M = [(n, k, m) for n, k in [(37, 100), (16, 64), (250, 200), (33, 1000)]
            for m in (1, 2, 3, 15, 16, 17, 31, 32, 33, 40)] + [(100, 320, 512), (2560, 2560, 24), (640, 6912, 19),
                                                       (48, 200, 128), (48, 200, 129)]


@pytest.mark.parametrize("n,k,m", SHAPES_M)
def test_gemm_ternary_on_tiles_equals_vector_path(tiles, n, k, m):
    wt, w, rs, xq, s, sm = _ternary_case(n + 7 * k + 13 * m, n, k, m)
    dots = (xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T).astype(np.int32)
    raw = np.empty((m, n), np.int32)
    used = K._tile_products()
    K.gemm_ternary_i32(w, xq, sm, raw)
    assert K._tile_products() > used           # the product ran on the tiles
    assert np.array_equal(raw, dots)
    out = np.empty((m, n), np.float32)
    K.gemm_ternary(w, rs, xq, s, sm, out)
    ref = np.empty((m, n), np.float32)
    _vector(K.gemm_ternary, w, rs, xq, s, sm, ref)
    assert np.array_equal(out, ref)
    assert np.array_equal(out, (dots.astype(np.float32) / s[:, None]) * rs[None, :])


@pytest.mark.parametrize("threads", [2, 3])
def test_gemm_ternary_on_tiles_split_over_threads(tiles, threads):
    # 45 tiles over the pool's 4-tile grains: ranges of odd length, so pairs and lone tiles in every thread
    n, k, m = 45 * 16 - 5, 448, 37
    wt, w, rs, xq, s, sm = _ternary_case(5, n, k, m)
    K.set_num_threads(threads)
    out = np.empty((m, n), np.float32)
    K.gemm_ternary(w, rs, xq, s, sm, out)
    ref = np.empty((m, n), np.float32)
    _vector(K.gemm_ternary, w, rs, xq, s, sm, ref)
    assert np.array_equal(out, ref)


def _variant_equals_vector_path(seed, n, k, m, on, off):
    """The ternary GEMM with a tile-body variant set (on(); off() after): exact int32 dots, and the vector path's
    floats on 1 and 3 threads."""
    wt, w, rs, xq, s, sm = _ternary_case(seed, n, k, m)
    dots = (xq[:, :k].astype(np.int64) @ wt.astype(np.int64).T).astype(np.int32)
    raw, out, ref = np.empty((m, n), np.int32), np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    _vector(K.gemm_ternary, w, rs, xq, s, sm, ref)
    on()
    try:
        used = K._tile_products()
        K.gemm_ternary_i32(w, xq, sm, raw)
        assert K._tile_products() > used
        K.gemm_ternary(w, rs, xq, s, sm, out)
        K.set_num_threads(3)
        out3 = np.empty((m, n), np.float32)
        K.gemm_ternary(w, rs, xq, s, sm, out3)
    finally:
        off()
    assert np.array_equal(raw, dots)
    assert np.array_equal(out, ref) and np.array_equal(out3, ref)


# the timing-only mode of bench_tiles.py --vector-side (the tile bodies without their tile instructions): it
# runs the tile bodies (ternary, int8 and q4 heads), says so, is off again when turned off, and then the
# products are the vector path's bytes again
def test_tiles_timing_only_mode_runs_the_bodies_and_goes_away():
    wt, w, rs, xq, s, sm = _ternary_case(3, 45, 640, 20)
    ref, out = np.empty((20, 45), np.float32), np.empty((20, 45), np.float32)
    K.set_isa(VECTOR_ISAS[-1])
    K.gemm_ternary(w, rs, xq, s, sm, ref)
    try:
        K._set_tiles_timing_only(True)
        assert K.tiles() == "timing-only"
        used = K._tile_products()
        K.gemm_ternary(w, rs, xq, s, sm, out)
        q4 = np.zeros(48 * 640 // 2, np.uint8), np.zeros(48 * 640 // 32, np.uint8)
        K.gemv_q4g(q4[0], q4[1], np.ones(45, np.float32), xq, s, out)
        K.gemm_i8(np.zeros(48 * 640, np.int8), rs, np.zeros(45, np.int32), xq, s, out)
        assert K._tile_products() >= used + 3
    finally:
        K._set_tiles_timing_only(False)
    assert K.tiles() == "off"
    out[:] = np.nan
    K.gemm_ternary(w, rs, xq, s, sm, out)
    K.set_isa(None)
    assert np.array_equal(out, ref)


# K-blocking (set_tile_kblock): one 64-k step per block, blocks that do not divide K (a short last block),
# blocks over K (one block), with 1..3 row-group pairs and odd tile pairs; the same bits as the vector path. The
# streamed body (the default at M <= 32) has no k-blocks, so it is off here
@pytest.mark.parametrize("kblock", [64, 192, 1024, 4096])
@pytest.mark.parametrize("n,k,m", [(37, 1000, 5), (50, 640, 40), (33, 2560, 70), (250, 6912, 17)])
def test_gemm_ternary_on_tiles_in_k_blocks(tiles, kblock, n, k, m):
    def on():
        _bodies(kblock=kblock, stream=False)
        assert K.tile_kblock() == kblock

    _variant_equals_vector_path(kblock + n + k + m, n, k, m, on, _bodies)


# the streamed small-M body (set_tile_stream, on by default) and the whole-K unpack it replaces at M <= 32: one
# and two row groups, full and partial, lone and paired weight tiles, K of one 64-k step and of many; above 32
# rows the whole-K body runs either way; the same bits throughout
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("n,k,m", [(37, 64, 1), (16, 100, 7), (250, 200, 16), (33, 1000, 17), (45, 2560, 32),
                                   (100, 6912, 24), (50, 640, 33)])
def test_gemm_ternary_on_tiles_streamed_or_not(tiles, stream, n, k, m):
    def on():
        _bodies(stream=stream)
        assert K.tile_stream() == stream

    _variant_equals_vector_path(3 * n + k + m + stream, n, k, m, on, _bodies)


# the weight warm (set_tile_warm, on by default): a thread's range read ~256 KB at a time before its tiles, so
# ranges of several chunks with a short last one and a lone last tile (K = 6912: 8 tiles a chunk, 19 tiles; K =
# 2560: 24 a chunk, 45 tiles), and a range inside one chunk; on and off, whole-K and streamed bodies: the same bits
@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n,k,m", [(19 * 16 - 5, 6912, 17), (45 * 16, 2560, 40), (33, 1000, 5)])
def test_gemm_ternary_on_tiles_warm_or_not(tiles, warm, stream, n, k, m):
    def on():
        _bodies(warm=warm, stream=stream)
        assert K.tile_warm() == warm

    _variant_equals_vector_path(n + k + m + warm, n, k, m, on, _bodies)


# the on / off settings of the tile bodies: their defaults (all on: the stream and the overlap as an AMX machine
# timed them, the warm as the AVX-512 GEMM did), the environment turning each the other way in a fresh process,
# and a value that is not 0 or 1 refused with one line naming the variable
@pytest.mark.parametrize("name,default", [("tile_stream", True), ("tile_warm", True), ("tile_overlap", True)])
def test_tile_body_settings(name, default):
    var = "BITNET_" + name.upper()
    assert getattr(K, name)() == default
    r = _child(f"from bitnet_cpu import simd; print(simd.{name}())", **{var: "0" if default else "1"})
    assert r.returncode == 0 and r.stdout.split() == [str(not default)], r.stderr
    r = _child("from bitnet_cpu import simd; simd.tiles()", **{var: "yes"})
    assert r.returncode != 0 and f"{var}=yes" in r.stderr


# the unpack beside the multiply (set_tile_overlap, on by default): ranges of one tile, one pair, a pair and a
# lone tile, many pairs; one and several row-group pairs (the first one unpacks the next pair), K of one 64-k step
# and of many; with the weights read ahead or not, beside k-blocks and the streamed body (which it leaves alone);
# and "serial", the overlap off (each pair unpacked before its own multiply)
@pytest.mark.parametrize("variant", ["plain", "cold", "kblock", "stream", "serial"])
@pytest.mark.parametrize("n,k,m", [(16, 64, 3), (32, 200, 16), (48, 1000, 40), (19 * 16 - 5, 6912, 17),
                                   (45 * 16, 2560, 70), (100, 640, 33)])
def test_gemm_ternary_on_tiles_overlapped(tiles, variant, n, k, m):
    def on():
        _bodies(overlap=variant != "serial", warm=variant != "cold", kblock=192 if variant == "kblock" else 0,
                stream=variant == "stream")
        assert K.tile_overlap() == (variant != "serial")

    _variant_equals_vector_path(2 * n + k + m, n, k, m, on, _bodies)


@pytest.mark.parametrize("kblock", [64, 320])
def test_gemm_i8_head_on_tiles_in_k_blocks(tiles, kblock):
    n, k, m = 100, 1000, 35
    rng = np.random.default_rng(kblock)
    w_q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
    w, rowsum = layout.pack_i8(w_q), w_q.astype(np.int32).sum(axis=1).astype(np.int32)
    xq = np.zeros((m, layout.pad_to(k, 64)), np.int8)
    xq[:, :k] = rng.integers(-128, 128, size=(m, k))
    raw = np.empty((m, n), np.int32)
    _bodies(kblock=kblock)
    try:
        K.gemm_i8_i32(w, rowsum, xq, raw)
    finally:
        _bodies()
    assert np.array_equal(raw, (xq[:, :k].astype(np.int64) @ w_q.astype(np.int64).T).astype(np.int32))


def test_tile_kblock_setting():
    for k, got in ((0, 0), (-5, 0), (63, 0), (64, 64), (1000, 960), (4096, 4096)):
        K.set_tile_kblock(k)
        assert K.tile_kblock() == got
    _bodies()
    r = _child("from bitnet_cpu import simd; print(simd.tile_kblock())", BITNET_TILE_KBLOCK="1024")
    assert r.returncode == 0 and r.stdout.split() == ["1024"], r.stderr
    for bad in ("big", "100", "7"):   # not a multiple of 64 was rounded down to one, or to 0 (all of K), silently
        r = _child("from bitnet_cpu import simd; simd.tiles()", BITNET_TILE_KBLOCK=bad)
        assert r.returncode != 0 and f"BITNET_TILE_KBLOCK={bad}:" in r.stderr


@pytest.mark.parametrize("m", [2, 17, 40])
def test_gemm_b3_on_tiles_equals_tile16(tiles, m):
    n, k = 100, 640
    wt, w, rs, xq, s, sm = _ternary_case(m, n, k, m)
    wb3 = layout.pack_ternary_b3(wt)
    a, b = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    K.gemm_ternary_b3(wb3, rs, xq, s, sm, a)
    _vector(K.gemm_ternary, w, rs, xq, s, sm, b)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("n,k,m", [(37, 100, 9), (100, 256, 16), (250, 640, 33), (4000, 256, 40)])
def test_gemm_i8_head_on_tiles_equals_vector_path(tiles, n, k, m):
    rng = np.random.default_rng(n + m)
    w_q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
    w = layout.pack_i8(w_q)
    rs = rng.random(n, dtype=np.float32) + np.float32(0.5)
    rowsum = w_q.astype(np.int32).sum(axis=1).astype(np.int32)
    k_pad = layout.pad_to(k, 64)
    xq = np.zeros((m, k_pad), np.int8)
    xq[:, :k] = rng.integers(-128, 128, size=(m, k))
    xq[0, :k] = -128                                     # the extreme the vector bodies offset by 128
    s = rng.random(m, dtype=np.float32) + np.float32(0.1)
    raw = np.empty((m, n), np.int32)
    used = K._tile_products()
    K.gemm_i8_i32(w, rowsum, xq, raw)
    assert K._tile_products() > used
    assert np.array_equal(raw, (xq[:, :k].astype(np.int64) @ w_q.astype(np.int64).T).astype(np.int32))
    out, ref = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    K.gemm_i8(w, rs, rowsum, xq, s, out)
    _vector(K.gemm_i8, w, rs, rowsum, xq, s, ref)
    assert np.array_equal(out, ref)


def test_extremes_do_not_overflow_on_tiles(tiles):
    n, k, m = 32, 8640, 17
    for sign in (1, -1):
        for xval in (-128, 127):
            w = layout.pack_ternary(np.full((n, k), sign, np.int8))
            xq = np.zeros((m, layout.pad_to(k, 64)), np.int8)
            xq[:, :k] = xval
            raw = np.empty((m, n), np.int32)
            K.gemm_ternary_i32(w, xq, xq.astype(np.int32).sum(axis=1).astype(np.int32), raw)
            assert (raw == sign * xval * k).all()


def test_crossover_keeps_small_products_on_the_vector_path():
    # with the crossover above m the product is the vector body's: the same bits either way, and the raw
    # i32 path proves the call still works when the tiles decline it
    K.set_tiles("emu")
    try:
        K.set_tile_min_rows(64)
        assert K.tile_min_rows() == 64
        wt, w, rs, xq, s, sm = _ternary_case(3, 50, 300, 5)
        raw = np.empty((5, 50), np.int32)
        used = K._tile_products()
        K.gemm_ternary_i32(w, xq, sm, raw)
        assert K._tile_products() == used
        assert np.array_equal(raw, xq[:, :300].astype(np.int32) @ wt.astype(np.int32).T)
    finally:
        K.set_tile_min_rows(0)
        K.set_isa(None)


# ---------------------------------------------------------------- the emulated instructions themselves
@pytest.mark.parametrize("a_signed", [True, False])
@pytest.mark.parametrize("M,KK,N", [(16, 16, 16), (3, 5, 7), (1, 1, 1), (16, 2, 9)])
def test_emulated_tdp_is_intels_dot_product(a_signed, M, KK, N):
    rng = np.random.default_rng(M * 100 + KK * 10 + N)
    a = rng.integers(-128, 128, size=(M, 4 * KK)).astype(np.int8 if a_signed else np.uint8) if a_signed else \
        rng.integers(0, 256, size=(M, 4 * KK)).astype(np.uint8)
    b = rng.integers(-128, 128, size=(KK, 4 * N)).astype(np.int8)
    c0 = rng.integers(-1000, 1000, size=(M, N)).astype(np.int32)
    c = c0.copy()
    K._tile_emu_dot(a, b, c, a_signed)
    # B in VNNI order: B[kk, 4n+q] is the element (k = 4kk+q, n)
    b_kn = b.reshape(KK, N, 4).transpose(0, 2, 1).reshape(4 * KK, N)
    assert np.array_equal(c, c0 + a.astype(np.int64) @ b_kn.astype(np.int64))


def test_emulated_tdp_wraps_in_32_bits():
    a = np.full((1, 64), -128, np.int8)
    b = np.full((16, 4), -128, np.int8)
    c = np.full((1, 1), 2**31 - 1, np.int32)
    K._tile_emu_dot(a, b, c, True)
    assert int(c[0, 0]) == ((2**31 - 1 + 64 * 128 * 128 + 2**31) % 2**32) - 2**31


# ---------------------------------------------------------------- the switch: API, environment, bitnet info
def test_tile_modes_and_refusals():
    assert K.tiles() in ("off", "amx")
    with pytest.raises(KernelError, match="unknown tile mode"):
        K.set_tiles("bogus")
    if not HW:
        with pytest.raises(KernelError, match="AMX"):
            K.set_tiles("amx")
        with pytest.raises(KernelError, match="cannot run the 'amx'"):
            K.set_isa("amx")
        assert K.tiles() == "off"
    K.set_tiles("emu")
    assert K.tiles() == "emu"
    K.set_isa(VECTOR_ISAS[-1])       # an explicit path turns the tiles off (BITNET_ISA=avx512 for A/B runs)
    assert K.tiles() == "off"
    K.set_isa(None)
    assert K.tiles() == ("amx" if HW else "off")
    assert K.active() == ("amx" if HW else VECTOR_ISAS[-1]) or not HW


def test_reason_names_what_is_missing():
    why = K.tiles_reason()
    if HW:
        assert "granted" in why
    elif not CPU_HAS_AMX:
        assert "no AMX" in why or "build" in why


def _child(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=120)


def test_bitnet_tiles_env():
    r = _child("from bitnet_cpu import simd; print(simd.tiles(), simd.tile_min_rows())", BITNET_TILES="emu",
               BITNET_TILE_MIN_ROWS="4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["emu", "4"]
    r = _child("from bitnet_cpu import simd; simd.tiles()", BITNET_TILES="sideways")
    assert r.returncode != 0 and "BITNET_TILES=sideways" in r.stderr
    r = _child("from bitnet_cpu import simd; print(simd.tiles())", BITNET_ISA="avx512" if "avx512" in VECTOR_ISAS
               else VECTOR_ISAS[-1])
    assert r.returncode == 0 and r.stdout.split() == ["off"]


def test_bitnet_info_names_the_tiles():
    # `python -m bitnet_cpu` is the `bitnet` command, and runs where the package is importable but not installed
    # (a leased AMX machine runs these tests from the checkout: the entry point is not there)
    bitnet = [sys.executable, "-m", "bitnet_cpu"]
    r = subprocess.run([*bitnet, "info"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, BITNET_TILES="emu", BITNET_TILE_STREAM="0", BITNET_TILE_KBLOCK="512"))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("matrix tiles"))
    assert "emu" in line and K.tiles_reason() in line
    # the bodies' settings in force, as the environment set them (for A/B runs)
    assert "k-block 512" in line and "streamed small-M off" in line and "unpack beside the multiply on" in line
    r = subprocess.run([*bitnet, "info", "--json"], capture_output=True, text=True, timeout=120)
    f = json.loads(r.stdout)
    assert f["tiles"] == ("amx" if HW else "off") and f["tiles_reason"] == K.tiles_reason()


# ---------------------------------------------------------------- a whole model on the tiles
def test_model_prefill_and_batch_on_tiles_give_the_same_tokens():
    """The bundled model: a prompt's greedy continuation and its logits with every multi-row product on the
    (emulated) tiles equal those of the vector path, bit for bit."""
    code = ("import numpy as np; from bitnet_cpu.engine.api import load_model, SamplingParams; "
            "llm = load_model(None, threads=2); "
            "p = 'The quick brown fox jumps over the lazy dog. ' * 4; "
            "print(repr(''.join(c.text for c in llm.generate(p, SamplingParams(temperature=0), max_tokens=12)))); "
            "from bitnet_cpu.simd import _kernels as K; print(K._tile_products())")
    emu = _child(code, BITNET_TILES="emu")
    off = _child(code, BITNET_ISA="avx512" if "avx512" in VECTOR_ISAS else VECTOR_ISAS[-1])
    assert emu.returncode == 0 and off.returncode == 0, emu.stderr + off.stderr
    text_emu, used_emu = emu.stdout.strip().rsplit("\n", 1)
    text_off, used_off = off.stdout.strip().rsplit("\n", 1)
    assert int(used_emu) > 0 and int(used_off) == 0      # the prefill's products went through the tiles
    assert text_emu == text_off and len(text_emu) > 2


# ---------------------------------------------------------------- the benchmark stays runnable
def test_bench_tiles_runs_on_the_emulation(tmp_path):
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_tiles.py")
    out = tmp_path / "tiles.json"
    r = subprocess.run([sys.executable, bench, "--emu", "--quick", "--threads", "1", "--ms", "4,16", "--json",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["emulated"] and [g["m"] for g in res["gemm"]] == [4, 16]
    assert all(g["us_on"] > 0 and g["us_off"] > 0 for g in res["gemm"])
    assert [r["m"] for r in res["stream"]] == [8, 16, 24, 32] and all(r["speedup"] > 0 for r in res["stream"])
    assert [r["m"] for r in res["warm"]] == [16, 32, 128] and all(r["gmacs_warm"] > 0 for r in res["warm"])
    if not HW:   # without --emu a machine with no tiles gets the reason and exit 0
        r = subprocess.run([sys.executable, bench], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and K.tiles_reason() in r.stdout


# ---------------------------------------------------------------- aarch64: the emulated tiles under NEON
AARCH64_HARNESS = r"""
#include "tiles.h"

/* every aarch64 path with the emulated tiles on top against the same path without them: ternary GEMM (tile16
 * and base-3) and the int8 head, M around the 16-row groups, N not a multiple of 32, threads 1 and 3 */
int main(void) {
    static const int PATHS[4] = {BK_ISA_SCALAR, BK_ISA_NEON, BK_ISA_DOTPROD, BK_ISA_I8MM};
    static const int MS[6] = {1, 3, 16, 17, 33, 40};
    const int n = 37 * 16 - 3, k_pad = 320, n_pad = 37 * 16;
    uint8_t *wt = malloc((size_t)n_pad * k_pad / 4);
    int8_t *wi = malloc((size_t)n_pad * k_pad), *xq = malloc(40 * (size_t)k_pad);
    int32_t *rowsum = calloc(n_pad, 4), act_sum[40];
    float *row_scale = malloc(4 * (size_t)n_pad), act_scale[40];
    for (size_t i = 0; i < (size_t)n_pad * k_pad / 4; i++) /* four valid codes (0, 1, 2) per byte */
        wt[i] = (uint8_t)(rnd() % 3 | (rnd() % 3) << 2 | (rnd() % 3) << 4 | (rnd() % 3) << 6);
    for (size_t i = 0; i < (size_t)n_pad * k_pad; i++) wi[i] = (int8_t)(rnd() % 255 - 127);
    for (int i = 0; i < n_pad; i++) row_scale[i] = 0.5f + (rnd() % 1000) / 1000.0f;
    for (int r = 0; r < 40; r++) {
        act_sum[r] = 0;
        act_scale[r] = 0.25f + (rnd() % 1000) / 500.0f;
        for (int c = 0; c < k_pad; c++) act_sum[r] += (xq[(size_t)r * k_pad + c] = (int8_t)(rnd() % 256 - 128));
    }
    float *a = malloc(4 * 40 * (size_t)n), *b = malloc(4 * 40 * (size_t)n);
    for (int p = 0; p < 4; p++)
        for (int th = 1; th <= 3; th += 2)
            for (int i = 0; i < 6; i++) {
                int m = MS[i];
                CHECK(bk_set_isa(PATHS[p]) == 0, "path %d", PATHS[p]);
                bk_set_num_threads(th);
                bk_gemm_ternary(wt, row_scale, xq, m, k_pad, act_scale, act_sum, a, NULL, n);
                CHECK(bk_set_tiles(BK_TILES_EMU) == 0, "emu tiles");
                uint64_t used = bk_tiles_products();
                bk_gemm_ternary(wt, row_scale, xq, m, k_pad, act_scale, act_sum, b, NULL, n);
                CHECK(bk_tiles_products() > used, "tiles not taken path %d m %d", PATHS[p], m);
                CHECK(!memcmp(a, b, 4 * (size_t)m * n), "gemm_ternary tiles path %d m %d threads %d", PATHS[p], m, th);
                bk_set_tiles(BK_TILES_OFF);
                CHECK(bk_gemm_i8(wi, row_scale, rowsum, xq, m, k_pad, act_scale, a, NULL, n) == 0, "gemm_i8");
                bk_set_tiles(BK_TILES_EMU);
                CHECK(bk_gemm_i8(wi, row_scale, rowsum, xq, m, k_pad, act_scale, b, NULL, n) == 0, "gemm_i8 tiles");
                CHECK(!memcmp(a, b, 4 * (size_t)m * n), "gemm_i8 tiles path %d m %d threads %d", PATHS[p], m, th);
            }
    return REPORT(); /* "ALL OK" only when every check passed */
}
"""


def test_emulated_tiles_under_every_aarch64_path(tmp_path):
    cross_c = pytest.importorskip("cross_c")
    if not (cross_c.CC_AARCH64 and cross_c.QEMU_AARCH64):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    cross_c.run_harness(tmp_path, AARCH64_HARNESS, name="tiles_aarch64")


def test_batched_steps_on_tiles_give_the_vector_paths_tokens():
    """The batching engine's mixed steps (decode rows of some sequences beside prefill chunks of others, the int8
    or q4 head over many rows) on the emulated tiles: every sequence's greedy tokens equal the vector path's."""
    from bitnet_cpu.engine.api import SamplingParams, load_engine

    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "A tiny robot " * 6]

    def run():
        eng = load_engine(None, threads=2, parallel=4, ctx=256, progress=False)
        try:
            ids = [eng.tokenizer.encode(p) for p in prompts]
            streams = [eng.submit(i, SamplingParams(temperature=0), max_tokens=10) for i in ids]
            return [[c.token for c in s if c.token is not None] for s in streams]
        finally:
            eng.close()

    try:
        K.set_isa(VECTOR_ISAS[-1])
        want = run()
        K.set_tiles("emu")
        used = K._tile_products()
        got = run()
        assert K._tile_products() > used
    finally:
        K.set_isa(None)
    assert got == want and all(len(t) > 0 for t in want)
