# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin Python boundary of the C kernels in simd/kernels/ (contract: engine/INTERFACES.md, layouts:
simd/layout.py, numpy oracle: simd/reference.py), and of the runtime helpers in simd/ops/ (simd/_ops.pxi,
included at the end; Python imports them as simd._ops). One extension, so one ISA choice and one worker
pool govern both.

Every precondition (type, dtype, byte order, C-contiguity, writability, shapes, K_pad % 64 == 0, packed
sizes, scale lengths, M consistency) is checked here once and raises engine.errors.KernelError (a
ValueError) naming the kernel and the argument; the C loops trust them. Arrays are read through the numpy
C API (no memoryview acquisition: a few hundred ns per call matter at ~120 GEMVs per token), and the GIL is
released around every kernel. No alignment is required: the kernels use unaligned vector loads, which cost
nothing extra on aligned data (store tensors are 64-byte aligned anyway).
"""
import os

cimport numpy as cnp
from libc.string cimport memset
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint64_t

import numpy as np

from bitnet_cpu.simd.errors import IsaChoiceError, KernelError

cnp.import_array()

cdef extern from "kernels.h" nogil:
    ctypedef struct bk_features_t:
        int sse41, avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512vnni, avx512bf16, avxvnni, neon, dotprod, i8mm
        int amx_tile, amx_int8, amx_bf16
    const bk_features_t *bk_get_features()
    int bk_isa_supported(int isa)
    int bk_set_isa(int isa)
    int bk_get_isa()
    int bk_best_isa()
    void bk_set_num_threads(int n)
    int bk_get_num_threads()
    void bk_init()
    void bk_set_gemv_prefetch(int nbytes)
    int bk_get_gemv_prefetch()
    void bk_set_gemv_one_block(int on)
    int bk_get_gemv_one_block()
    int BK_GEMV_PREFETCH_DEFAULT, BK_GEMV_PREFETCH_DEFAULT_256, BK_GEMV_PREFETCH_MAX
    void bk_pool_stats(uint64_t *jobs, uint64_t *worker_chunks, uint64_t *caller_sleeps)
    void bk_quantize_act(const float *x, int m, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum)
    void bk_gemv_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                         int32_t act_sum, float *out, int32_t *out_i32, int n)
    void bk_gemm_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                         const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n)
    int bk_gemv_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int k_pad,
                   float act_scale, float *out, int32_t *out_i32, int n)
    int bk_gemm_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m,
                   int k_pad, const float *act_scale, float *out, int32_t *out_i32, int n)
    void bk_gemv_f16(const uint16_t *w, const float *x, int k, float *out, int n)
    void bk_gemm_f16(const uint16_t *w, const float *x, int m, int k, float *out, int n)


cdef extern from "tiles.h" nogil:
    int BK_TILES_OFF, BK_TILES_AMX, BK_TILES_EMU, BK_TILES_NULL
    int bk_set_tiles_timing_only(int on)
    int bk_tiles_supported()
    const char *bk_tiles_reason()
    int bk_set_tiles(int mode)
    int bk_get_tiles()
    void bk_set_tile_min_rows(int m)
    void bk_set_tile_kblock(int k)
    int bk_get_tile_kblock()
    void bk_set_tile_stream(int on)
    int bk_get_tile_stream()
    void bk_set_tile_warm(int on)
    int bk_get_tile_warm()
    void bk_set_tile_overlap(int on)
    int bk_get_tile_overlap()
    int bk_get_tile_min_rows()
    uint64_t bk_tiles_products()
    ctypedef struct bk_tilecfg_t:
        uint8_t palette_id
        uint16_t colsb[16]
        uint8_t rows[16]
    void bk_emu_tile_config(const bk_tilecfg_t *cfg)
    void bk_emu_tile_release()
    void bk_emu_tile_load(int t, const void *base, size_t stride)
    void bk_emu_tile_store(int t, void *base, size_t stride)
    void bk_emu_tile_dpbssd(int c, int a, int b)
    void bk_emu_tile_dpbusd(int c, int a, int b)


cdef extern from "rows.h" nogil:
    int BK_ROWS_MAX
    void bk_gemv_rows_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                              const float *act_scale, const int32_t *act_sum, float *out, int n)
    int bk_gemv_rows_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m,
                        int k_pad, const float *act_scale, float *out, int n)

cdef extern from "b3.h" nogil:
    size_t bk_b3_tile_bytes(int k_pad)
    int bk_gemv_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                   int32_t act_sum, float *out, int32_t *out_i32, int n)
    int bk_gemm_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                   const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n)
    int bk_gemv_rows_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                        const float *act_scale, const int32_t *act_sum, float *out, int n)
    void bk_b3_to_tile16(const uint8_t *w, int n, int k_pad, uint8_t *dst)

cdef extern from "q4g.h" nogil:
    int BK_Q4G_MAX_K
    int bk_gemv_q4g(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m, int k_pad,
                    const float *act_scale, float *out, int32_t *out_i32, int n)

cdef extern from "tg.h" nogil:
    int BK_TG_GROUP
    int BK_TG_GROUP_BYTES
    void bk_quantize_act_g128(const float *x, int m, int k, int ldx, int k_pad, int8_t *xq, float *xd, int32_t *xsum)
    void bk_gemv_tg(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                    float *out, int n)

ISA_NAMES = ("scalar", "avx2", "avx512", "neon", "avxvnni", "dotprod", "i8mm")
# the matrix-tile modes (simd/kernels/tiles.h): "off", "amx" (the hardware), "emu" (the portable emulation)
TILE_MODES = ("off", "amx", "emu")
cdef Py_ssize_t MAX_DIM = 1 << 30
# int32 accumulators of the AVX-512 ternary GEMV hold 64x a partial dot: exact up to K_pad = 2^18
MAX_K_PAD = 1 << 18


# ---------------------------------------------------------------- dispatch
def features():
    """CPU features the dispatcher sees (cpuid AND the OS saving the register state, via xgetbv)."""
    cdef const bk_features_t *f = bk_get_features()
    return {
        "sse4.1": bool(f.sse41), "avx2": bool(f.avx2), "fma": bool(f.fma), "f16c": bool(f.f16c),
        "avx512f": bool(f.avx512f), "avx512bw": bool(f.avx512bw), "avx512vl": bool(f.avx512vl),
        "avx512vnni": bool(f.avx512vnni), "avx512bf16": bool(f.avx512bf16), "avxvnni": bool(f.avxvnni),
        "neon": bool(f.neon), "dotprod": bool(f.dotprod), "i8mm": bool(f.i8mm),
        "amx-tile": bool(f.amx_tile), "amx-int8": bool(f.amx_int8), "amx-bf16": bool(f.amx_bf16),
    }


def supported_isas():
    """The paths this CPU can run, worst to best ("amx": the avx512 path with the AMX tiles for multi-row
    products, where the CPU has them and Linux grants them)."""
    return [name for i, name in enumerate(ISA_NAMES) if bk_isa_supported(i)] + (["amx"] if bk_tiles_supported() else [])


def active():
    """The path in use: "amx" (avx512 + the AMX tiles) | "avx512" | "avxvnni" | "avx2" | "scalar" | "neon" |
    "dotprod" | "i8mm". The emulated tiles (tiles() == "emu") keep the vector path's name."""
    if bk_get_tiles() == BK_TILES_AMX:
        return "amx"
    return ISA_NAMES[bk_get_isa()]


def set_isa(name=None):
    """Force a path by name (None or "auto": the best this CPU runs, with the AMX tiles where usable).
    An explicit path turns the tiles off ("avx512": vpdpbusd only); "amx" is avx512 with the hardware tiles.
    Raises KernelError if the CPU cannot."""
    if name is None or name == "" or name == "auto":
        bk_set_isa(-1)
        return active()
    if name == "amx":
        if not bk_tiles_supported() or bk_set_isa(ISA_NAMES.index("avx512")) != 0:
            raise IsaChoiceError(f"this CPU cannot run the 'amx' kernels: {tiles_reason()}",
                                 hint=f"it supports: {', '.join(supported_isas())}")
        bk_set_tiles(BK_TILES_AMX)
        return active()
    if name not in ISA_NAMES:
        # "amx" and "auto" are names set_isa takes besides ISA_NAMES (the hint listed only those)
        raise IsaChoiceError(f"unknown ISA {name!r}", hint=f"use one of {', '.join(ISA_NAMES + ('amx', 'auto'))}")
    if bk_set_isa(ISA_NAMES.index(name)) != 0:
        raise IsaChoiceError(f"this CPU cannot run the {name!r} kernels",
                          hint=f"it supports: {', '.join(supported_isas())}")
    return active()


def tiles():
    """The matrix-tile mode in force: "amx" (multi-row products on the AMX tiles), "emu" (on their portable C
    emulation: tests), or "off" ("timing-only" while _set_tiles_timing_only is on)."""
    mode = bk_get_tiles()
    return "timing-only" if mode == BK_TILES_NULL else TILE_MODES[mode]


def _set_tiles_timing_only(bint on):
    """Benchmarks only (bench_tiles.py --vector-side): the tile bodies without their tile instructions, on any
    machine, to time what they do beside the tile unit (unpack, epilogue, loops). Every multi-row product then
    gives WRONG results until this is turned off (which leaves the tiles off; set_isa(None) restores the
    default)."""
    bk_set_tiles_timing_only(1 if on else 0)


def tiles_reason():
    """One line: why the hardware tiles are (not) usable in this process (CPU, OS state, Linux's grant)."""
    return bk_tiles_reason().decode()


def set_tiles(mode):
    """"off", "amx" (the hardware: KernelError where it is not usable or the path is not avx512) or "emu"
    (the emulation, on any path). Governs gemm_ternary(_b3), gemm_i8 and gemv_q4g from tile_min_rows() rows up."""
    if mode not in TILE_MODES:
        raise IsaChoiceError(f"unknown tile mode {mode!r}", hint=f"use one of {', '.join(TILE_MODES)}")
    if bk_set_tiles(TILE_MODES.index(mode)) != 0:
        raise IsaChoiceError(f"the AMX tiles cannot run here: {tiles_reason()}"
                             if not bk_tiles_supported() else "the AMX tiles run with the avx512 path only",
                             hint="BITNET_TILES=emu runs their emulation on any CPU")
    return tiles()


def set_tile_min_rows(int m):
    """Products of fewer rows than m keep the vector bodies (m <= 0: the mode's default: 1 emulated, the
    measured crossover on the hardware)."""
    bk_set_tile_min_rows(m)


def set_tile_kblock(int k):
    """K-blocking of the tile bodies: k per block (rounded down to a multiple of 64; < 64: the whole K in one
    block, the default). Results never change; bench_tiles.py --kblocks measures the speed."""
    bk_set_tile_kblock(k)


def tile_kblock():
    """The k-block in force (0: the whole K)."""
    return bk_get_tile_kblock()


def set_tile_stream(bint on):
    """The tile bodies at M <= 32 (the ternary GEMM and the q4 head): unpack the weights one 64-k step at a time
    beside the tile multiply (on, the default: 1.2-1.8x at 16-32 rows on Emerald Rapids) or the whole K first
    (off). Results never change; bench_tiles.py --stream-ms measures the speed on an AMX machine."""
    bk_set_tile_stream(1 if on else 0)


def tile_stream():
    """Whether the streamed small-M tile body is on (set_tile_stream)."""
    return bool(bk_get_tile_stream())


def set_tile_warm(bint on):
    """The tile bodies' weights arrive ahead of their use (on, the default: two tiles ahead, prefetched beside
    the work on the tiles before) or as the unpack and the tile loads reach them (off). Results never change;
    bench_tiles.py --warm-ms measures the speed on an AMX machine."""
    bk_set_tile_warm(1 if on else 0)


def tile_warm():
    """Whether the tile bodies read their weights ahead (set_tile_warm)."""
    return bool(bk_get_tile_warm())


def set_tile_overlap(bint on):
    """The tile GEMM (and the q4 head) unpacks the next weight tiles beside the tile multiply of the ones before
    (on, the default: 1.0-1.6x at 128-512 rows on Emerald Rapids) or before their own multiply (off). Results
    never change; bench_tiles.py --overlap-ms measures the speed on an AMX machine."""
    bk_set_tile_overlap(1 if on else 0)


def tile_overlap():
    """Whether the tile GEMM's unpack runs beside the multiply (set_tile_overlap)."""
    return bool(bk_get_tile_overlap())


def tile_min_rows():
    """The crossover in force (0: the mode's default)."""
    return bk_get_tile_min_rows()


def set_gemv_prefetch(nbytes):
    """How far ahead of the weights they read the x86 GEMV bodies prefetch, in bytes (0: not at all; None: the
    path's default, GEMV_PREFETCH_DEFAULT on AVX-512, GEMV_PREFETCH_DEFAULT_256 on AVX2 / AVX-VNNI). A hint:
    results never change, only the read rate (bench_kernels.py --prefetch sweeps it)."""
    if nbytes is None:
        nbytes = -1
    elif not isinstance(nbytes, int) or not 0 <= nbytes <= BK_GEMV_PREFETCH_MAX:
        raise KernelError(f"prefetch distance must be 0..{BK_GEMV_PREFETCH_MAX} bytes, got {nbytes!r}")
    bk_set_gemv_prefetch(nbytes)


def gemv_prefetch():
    """The prefetch distance in force, in bytes (0: none)."""
    return bk_get_gemv_prefetch()


def set_gemv_one_block(on):
    """The AVX-512 tile16 GEMV's loop: one 64-byte block per step (True; the default on Intel cores) or two
    (False; the default elsewhere); None: the CPU's default (simd/kernels/kernels.h). Results never change."""
    if on is not None and not isinstance(on, bool):
        raise KernelError(f"set_gemv_one_block takes True, False or None, got {on!r}")
    bk_set_gemv_one_block(-1 if on is None else int(on))


def gemv_one_block():
    """Whether the AVX-512 tile16 GEMV reads one block per loop step (set_gemv_one_block)."""
    return bool(bk_get_gemv_one_block())


GEMV_PREFETCH_DEFAULT = BK_GEMV_PREFETCH_DEFAULT
GEMV_PREFETCH_DEFAULT_256 = BK_GEMV_PREFETCH_DEFAULT_256


def _tile_products():
    """How many kernel calls (one per thread's tile range) ran on the tiles since the process started."""
    return int(bk_tiles_products())


def _tile_emu_dot(a, b, c, bint a_signed):
    """One emulated tdpbssd (a_signed) or tdpbusd on tiles shaped as the operands: c (int32 [M, N]) += a
    (int8 or uint8 [M, 4*KK]) . b (int8 [KK, 4*N], VNNI order), M, KK <= 16, N <= 16 (tests of tiles_emu.c)."""
    cdef str fn = "_tile_emu_dot"
    cdef cnp.ndarray aa = _arr(fn, "a", a, cnp.NPY_INT8 if a_signed else cnp.NPY_UINT8, 2, False)
    cdef cnp.ndarray ab = _arr(fn, "b", b, cnp.NPY_INT8, 2, False)
    cdef cnp.ndarray ac = _arr(fn, "c", c, cnp.NPY_INT32, 2, True)
    cdef int M = cnp.PyArray_DIM(aa, 0), KB = cnp.PyArray_DIM(aa, 1), KK = cnp.PyArray_DIM(ab, 0)
    cdef int NB = cnp.PyArray_DIM(ab, 1)
    if not (0 < M <= 16 and 0 < KK <= 16 and KB == 4 * KK and 0 < NB <= 64 and NB % 4 == 0
            and cnp.PyArray_DIM(ac, 0) == M and cnp.PyArray_DIM(ac, 1) * 4 == NB):
        raise KernelError(f"{fn}: shapes a {a.shape}, b {b.shape}, c {c.shape} are not one tile product")
    cdef bk_tilecfg_t cfg
    memset(&cfg, 0, sizeof(cfg))
    cfg.palette_id = 1
    cfg.rows[0], cfg.colsb[0] = M, NB       # C
    cfg.rows[1], cfg.colsb[1] = M, KB       # A
    cfg.rows[2], cfg.colsb[2] = KK, NB      # B
    with nogil:
        bk_emu_tile_config(&cfg)
        bk_emu_tile_load(0, cnp.PyArray_DATA(ac), NB)
        bk_emu_tile_load(1, cnp.PyArray_DATA(aa), KB)
        bk_emu_tile_load(2, cnp.PyArray_DATA(ab), NB)
        if a_signed:
            bk_emu_tile_dpbssd(0, 1, 2)
        else:
            bk_emu_tile_dpbusd(0, 1, 2)
        bk_emu_tile_store(0, cnp.PyArray_DATA(ac), NB)
        bk_emu_tile_release()


def set_num_threads(int n):
    """Threads used by every kernel and runtime helper called from THIS thread (n <= 0: back to the process
    default, which is OMP_NUM_THREADS when it is a positive count, else all available processors). Per
    calling thread, so sessions driven from different threads keep their own counts."""
    bk_set_num_threads(n)


def get_num_threads():
    return bk_get_num_threads()


def _pool_stats():
    """(jobs run on the worker pool, chunks the workers ran, times the caller slept waiting for a worker's
    chunk): how much the other threads took part, and how often one was not running when needed."""
    cdef uint64_t jobs, chunks, sleeps
    bk_pool_stats(&jobs, &chunks, &sleeps)
    return int(jobs), int(chunks), int(sleeps)


# ---------------------------------------------------------------- argument checks
cdef inline cnp.ndarray _arr(str fn, str name, object a, int typenum, int ndim, bint writable):
    if not isinstance(a, cnp.ndarray):
        raise KernelError(f"{fn}: {name} must be a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_ISNOTSWAPPED(arr):
        raise KernelError(f"{fn}: {name} has dtype {(<object>arr).dtype}, expected {_DTYPE_NAMES[typenum]} (native byte order)")
    if ndim > 0 and cnp.PyArray_NDIM(arr) != ndim:
        raise KernelError(f"{fn}: {name} must be {ndim}-D, got shape {(<object>arr).shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise KernelError(f"{fn}: {name} must be C-contiguous", hint="use np.ascontiguousarray")
    if writable and not cnp.PyArray_ISWRITEABLE(arr):
        raise KernelError(f"{fn}: {name} is read-only but is an output")
    return arr

_DTYPE_NAMES = {cnp.NPY_FLOAT32: "float32", cnp.NPY_INT8: "int8", cnp.NPY_UINT8: "uint8", cnp.NPY_INT32: "int32",
                cnp.NPY_UINT16: "uint16 or float16"}


cdef inline Py_ssize_t _k_pad_of(str fn, Py_ssize_t k_pad) except -1:
    if k_pad <= 0 or k_pad % 64 != 0 or k_pad > MAX_K_PAD:
        raise KernelError(f"{fn}: xq has {k_pad} columns; K_pad must be a positive multiple of 64, at most {MAX_K_PAD}",
                          hint="quantize_act into a buffer of layout.pad_to(K, 64) columns")
    return k_pad


cdef inline Py_ssize_t _n_of(str fn, Py_ssize_t n) except -1:
    if n <= 0 or n > MAX_DIM:
        raise KernelError(f"{fn}: out has {n} rows; N must be positive")
    return n


cdef inline void _check_size(str fn, str name, cnp.ndarray a, Py_ssize_t expected, str what) except *:
    if cnp.PyArray_SIZE(a) != expected:
        raise KernelError(f"{fn}: {name} has {cnp.PyArray_SIZE(a)} elements, expected {what} = {expected}")


cdef inline void _check_at_least(str fn, str name, cnp.ndarray a, Py_ssize_t n) except *:
    if cnp.PyArray_SIZE(a) < n:
        raise KernelError(f"{fn}: {name} has {cnp.PyArray_SIZE(a)} elements, needs at least N = {n}")


cdef inline Py_ssize_t _pad16(Py_ssize_t n):
    return (n + 15) // 16 * 16


# ---------------------------------------------------------------- kernels
cdef _quantize_call(str fn, x, xq, scale, sums, cols, bint g128):
    """x f32 [M, ldx] | [ldx] (its first cols columns, or all) -> xq int8 [M, K_pad] | [K_pad], with per row
    act_scale f32 [M] and act_sum int32 [M] (scale, sums), or (g128) per group of 128 columns xd f32 and xsum int32
    [M, K_pad/128] | [K_pad/128]."""
    cdef str sname = "xd" if g128 else "act_scale"
    cdef str mname = "xsum" if g128 else "act_sum"
    cdef cnp.ndarray ax = _arr(fn, "x", x, cnp.NPY_FLOAT32, 0, False)
    cdef cnp.ndarray aq = _arr(fn, "xq", xq, cnp.NPY_INT8, 0, True)
    cdef cnp.ndarray asc = _arr(fn, sname, scale, cnp.NPY_FLOAT32, 0, True)
    cdef cnp.ndarray asm = _arr(fn, mname, sums, cnp.NPY_INT32, 0, True)
    cdef int nd = cnp.PyArray_NDIM(ax)
    if nd not in (1, 2) or cnp.PyArray_NDIM(aq) != nd:
        raise KernelError(f"{fn}: x {(<object>ax).shape} and xq {(<object>aq).shape} must both be 1-D or both 2-D")
    cdef Py_ssize_t m = 1 if nd == 1 else cnp.PyArray_DIM(ax, 0)
    cdef Py_ssize_t ldx = cnp.PyArray_DIM(ax, nd - 1)
    cdef Py_ssize_t k = ldx if cols is None else cols
    if k > ldx:
        raise KernelError(f"{fn}: cols={k} is more than the {ldx} columns of x")
    cdef Py_ssize_t k_pad = _k_pad_of(fn, cnp.PyArray_DIM(aq, nd - 1))
    if g128 and k_pad % BK_TG_GROUP:
        raise KernelError(f"{fn}: xq has {k_pad} columns, not a multiple of {BK_TG_GROUP}")
    if nd == 2 and cnp.PyArray_DIM(aq, 0) != m:
        raise KernelError(f"{fn}: x has {m} rows but xq has {cnp.PyArray_DIM(aq, 0)}")
    if k <= 0 or k > k_pad:
        raise KernelError(f"{fn}: x has {k} columns, must be in 1..K_pad={k_pad} (xq's last dim)")
    cdef Py_ssize_t per_row = k_pad // BK_TG_GROUP if g128 else 1
    _check_size(fn, sname, asc, m * per_row, "M*K_pad/128" if g128 else "M")
    _check_size(fn, mname, asm, m * per_row, "M*K_pad/128" if g128 else "M")
    cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
    cdef int8_t *pq = <int8_t *>cnp.PyArray_DATA(aq)
    cdef float *ps = <float *>cnp.PyArray_DATA(asc)
    cdef int32_t *pm = <int32_t *>cnp.PyArray_DATA(asm)
    with nogil:
        if g128:
            bk_quantize_act_g128(px, <int>m, <int>k, <int>ldx, <int>k_pad, pq, ps, pm)
        else:
            bk_quantize_act(px, <int>m, <int>k, <int>k_pad, pq, ps, pm)


def quantize_act(x, xq, act_scale, act_sum):
    """x f32 [M, K] | [K] -> xq int8 [M, K_pad] | [K_pad] (0 in padding), act_scale f32 [M] = 127/max(max|x|, 1e-5),
    act_sum int32 [M] = sum(xq). Round half to even."""
    _quantize_call("quantize_act", x, xq, act_scale, act_sum, None, False)


cdef inline void _ternary_w(str fn, cnp.ndarray aw, Py_ssize_t n, Py_ssize_t k_pad) except *:
    _check_size(fn, "w", aw, _pad16(n) * k_pad // 4, f"N_pad*K_pad/4 (N={n}, K_pad={k_pad})")


cdef inline void _b3_w(str fn, cnp.ndarray aw, Py_ssize_t n, Py_ssize_t k_pad) except *:
    _check_size(fn, "w", aw, _pad16(n) // 16 * <Py_ssize_t>bk_b3_tile_bytes(<int>k_pad),
                f"tile16b3 bytes (N={n}, K_pad={k_pad})")


cdef inline _oom(str fn, int rc):
    if rc != 0:
        raise MemoryError(f"{fn}: no memory for the decode scratch")


cdef enum:
    ONE = 0    # one token: xq [K_pad] -> out [N]; act_scale (and act_sum) are numbers
    GEMM = 1   # M tokens: xq [M, K_pad] -> out [M, N]; act_scale [M] (and act_sum [M])
    ROWS = 2   # M <= ROWS_MAX tokens in one pass over the weights (speculative verification); no raw form


cdef _ternary_call(str fn, w, row_scale, xq, act_scale, act_sum, out, bint b3, int kind, bint raw):
    """Tokens against tile16 (b3 False) or tile16b3 weights, one (kind ONE) or M (GEMM, ROWS); raw (tile16 only for
    M tokens): exact int32 dots into out."""
    cdef int nd = 1 if kind == ONE else 2
    cdef cnp.ndarray aw = _arr(fn, "w", w, cnp.NPY_UINT8, 1, False)
    cdef cnp.ndarray ars = None if raw else _arr(fn, "row_scale", row_scale, cnp.NPY_FLOAT32, 1, False)
    cdef cnp.ndarray aq = _arr(fn, "xq", xq, cnp.NPY_INT8, nd, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_INT32 if raw else cnp.NPY_FLOAT32, nd, True)
    cdef Py_ssize_t k_pad = _k_pad_of(fn, cnp.PyArray_DIM(aq, nd - 1))
    cdef Py_ssize_t n = _n_of(fn, cnp.PyArray_DIM(ao, nd - 1))
    cdef cnp.ndarray asc = None
    cdef cnp.ndarray asm = None
    cdef Py_ssize_t m = 1
    if kind != ONE:
        asc = None if raw else _arr(fn, "act_scale", act_scale, cnp.NPY_FLOAT32, 1, False)
        asm = _arr(fn, "act_sum", act_sum, cnp.NPY_INT32, 1, False)
        if kind == ROWS:
            m = _rows_m(fn, aq, asc, ao)
            _check_size(fn, "act_sum", asm, m, "M")
        else:
            m = _gemm_m(fn, aq, asc, asm, ao)
        if raw:
            asc = np.ones(m, np.float32)  # unused by the raw path, but never NULL
    if b3:
        _b3_w(fn, aw, n, k_pad)
    else:
        _ternary_w(fn, aw, n, k_pad)
    if not raw:
        _check_at_least(fn, "row_scale", ars, n)
    cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
    cdef const int8_t *pq = <const int8_t *>cnp.PyArray_DATA(aq)
    cdef const float *prs = NULL
    cdef const float *ps = NULL
    cdef const int32_t *pm = NULL
    if not raw:
        prs = <const float *>cnp.PyArray_DATA(ars)
    if asc is not None:
        ps = <const float *>cnp.PyArray_DATA(asc)
    if asm is not None:
        pm = <const int32_t *>cnp.PyArray_DATA(asm)
    cdef float *po = NULL if raw else <float *>cnp.PyArray_DATA(ao)
    cdef int32_t *pi = <int32_t *>cnp.PyArray_DATA(ao) if raw else NULL
    cdef float one_scale = 1.0 if raw or kind != ONE else act_scale
    cdef int32_t one_sum = act_sum if kind == ONE else 0
    cdef int rc = 0
    with nogil:
        if kind == ONE and b3:
            rc = bk_gemv_b3(pw, prs, pq, <int>k_pad, one_scale, one_sum, po, pi, <int>n)
        elif kind == ONE:
            bk_gemv_ternary(pw, prs, pq, <int>k_pad, one_scale, one_sum, po, pi, <int>n)
        elif kind == ROWS and b3:
            rc = bk_gemv_rows_b3(pw, prs, pq, <int>m, <int>k_pad, ps, pm, po, <int>n)
        elif kind == ROWS:
            bk_gemv_rows_ternary(pw, prs, pq, <int>m, <int>k_pad, ps, pm, po, <int>n)
        elif b3:
            rc = bk_gemm_b3(pw, prs, pq, <int>m, <int>k_pad, ps, pm, po, NULL, <int>n)
        else:
            bk_gemm_ternary(pw, prs, pq, <int>m, <int>k_pad, ps, pm, po, pi, <int>n)
    _oom(fn, rc)


def gemv_ternary(w, row_scale, xq, float act_scale, int act_sum, out):
    """out[n] = ((float)(W_t[n] . xq) / act_scale) * row_scale[n]; w uint8 tile16 [N_pad*K_pad/4]."""
    _ternary_call("gemv_ternary", w, row_scale, xq, act_scale, act_sum, out, False, ONE, False)


def gemv_ternary_i32(w, xq, int act_sum, out):
    """Raw exact dots out[n] = W_t[n] . xq as int32 (tests; act_sum must be sum(xq))."""
    _ternary_call("gemv_ternary_i32", w, None, xq, None, act_sum, out, False, ONE, True)


cdef inline Py_ssize_t _gemm_m(str fn, cnp.ndarray aq, cnp.ndarray asc, cnp.ndarray asm, cnp.ndarray ao) except -1:
    cdef Py_ssize_t m = cnp.PyArray_DIM(aq, 0)
    if m <= 0 or cnp.PyArray_DIM(ao, 0) != m:
        raise KernelError(f"{fn}: xq has {m} rows but out has {cnp.PyArray_DIM(ao, 0)} (both are M, M >= 1)")
    if asc is not None:
        _check_size(fn, "act_scale", asc, m, "M")
    _check_size(fn, "act_sum", asm, m, "M")
    return m


def gemm_ternary(w, row_scale, xq, act_scale, act_sum, out):
    """out[m, n] = ((float)(W_t[n] . xq[m]) / act_scale[m]) * row_scale[n] for M tokens (prefill)."""
    _ternary_call("gemm_ternary", w, row_scale, xq, act_scale, act_sum, out, False, GEMM, False)


def gemm_ternary_i32(w, xq, act_sum, out):
    """Raw exact dots out[m, n] = W_t[n] . xq[m] as int32 (tests; act_sum[m] must be sum(xq[m]))."""
    _ternary_call("gemm_ternary_i32", w, None, xq, None, act_sum, out, False, GEMM, True)


# |w . xq| <= 128 * 127 * K_pad stays below 2^31 for K_pad <= 2^16 (no model's hidden size comes near it)
I8_MAX_K = 1 << 16


cdef _i8_call(str fn, w, row_scale, w_rowsum, xq, act_scale, out, int kind, bint raw):
    """The int8 head (i8_tile16) for one row or M rows; raw: exact int32 dots into out."""
    cdef int nd = 1 if kind == ONE else 2
    cdef cnp.ndarray aw = _arr(fn, "w", w, cnp.NPY_INT8, 1, False)
    cdef cnp.ndarray arw = _arr(fn, "w_rowsum", w_rowsum, cnp.NPY_INT32, 1, False)
    cdef cnp.ndarray aq = _arr(fn, "xq", xq, cnp.NPY_INT8, nd, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_INT32 if raw else cnp.NPY_FLOAT32, nd, True)
    cdef cnp.ndarray ars = None
    cdef cnp.ndarray asc = None
    cdef Py_ssize_t k_pad = _k_pad_of(fn, cnp.PyArray_DIM(aq, nd - 1))
    if k_pad > I8_MAX_K:
        raise KernelError(f"{fn}: K_pad {k_pad} > {I8_MAX_K} (the int32 dot bound of the int8 head)")
    cdef Py_ssize_t n = _n_of(fn, cnp.PyArray_DIM(ao, nd - 1))
    cdef Py_ssize_t m = 1
    if kind == ROWS:
        asc = _arr(fn, "act_scale", act_scale, cnp.NPY_FLOAT32, 1, False)
        m = _rows_m(fn, aq, asc, ao)
    elif kind == GEMM:
        m = cnp.PyArray_DIM(aq, 0)
        if m <= 0 or cnp.PyArray_DIM(ao, 0) != m:
            raise KernelError(f"{fn}: xq has {m} rows but out has {cnp.PyArray_DIM(ao, 0)} (both are M, M >= 1)")
        if raw:
            asc = np.ones(m, np.float32)
        else:
            asc = _arr(fn, "act_scale", act_scale, cnp.NPY_FLOAT32, 1, False)
            _check_size(fn, "act_scale", asc, m, "M")
    _check_size(fn, "w", aw, _pad16(n) * k_pad, f"N_pad*K_pad (N={n}, K_pad={k_pad})")
    _check_at_least(fn, "w_rowsum", arw, n)
    cdef const float *prs = NULL
    if not raw:
        ars = _arr(fn, "row_scale", row_scale, cnp.NPY_FLOAT32, 1, False)
        _check_at_least(fn, "row_scale", ars, n)
        prs = <const float *>cnp.PyArray_DATA(ars)
    cdef const float *ps = NULL
    if asc is not None:
        ps = <const float *>cnp.PyArray_DATA(asc)
    cdef float one_scale = 1.0 if raw or kind != ONE else act_scale
    cdef const int8_t *pw = <const int8_t *>cnp.PyArray_DATA(aw)
    cdef const int32_t *prw = <const int32_t *>cnp.PyArray_DATA(arw)
    cdef const int8_t *pq = <const int8_t *>cnp.PyArray_DATA(aq)
    cdef void *po = cnp.PyArray_DATA(ao)
    cdef float *pf = NULL if raw else <float *>po
    cdef int32_t *pi = <int32_t *>po if raw else NULL
    cdef int rc
    with nogil:
        if kind == ONE:
            rc = bk_gemv_i8(pw, prs, prw, pq, <int>k_pad, one_scale, pf, pi, <int>n)
        elif kind == GEMM:
            rc = bk_gemm_i8(pw, prs, prw, pq, <int>m, <int>k_pad, ps, pf, pi, <int>n)
        else:
            rc = bk_gemv_rows_i8(pw, prs, prw, pq, <int>m, <int>k_pad, ps, pf, <int>n)
    if rc != 0:
        raise MemoryError(f"{fn}: out of memory for {m} row(s) of {k_pad}-column activation buffers")


def gemv_i8(w, row_scale, w_rowsum, xq, float act_scale, out):
    """int8 LM head: out[n] = ((float)(W_q[n] . xq) / act_scale) * row_scale[n]; w int8 i8_tile16 [N_pad*K_pad],
    w_rowsum int32 [>= N] = sum_k W_q[n, k] (used by the AVX-512 u8 offset trick)."""
    _i8_call("gemv_i8", w, row_scale, w_rowsum, xq, act_scale, out, ONE, False)


def gemv_i8_i32(w, w_rowsum, xq, out):
    """Raw exact dots of the int8 head as int32 (tests)."""
    _i8_call("gemv_i8_i32", w, None, w_rowsum, xq, None, out, ONE, True)


def gemm_i8(w, row_scale, w_rowsum, xq, act_scale, out):
    """int8 LM head for M rows: out[m, n] = ((float)(W_q[n] . xq[m]) / act_scale[m]) * row_scale[n] (row m equals
    gemv_i8 of xq[m]); xq int8 [M, K_pad], act_scale f32 [M], out f32 [M, N]."""
    _i8_call("gemm_i8", w, row_scale, w_rowsum, xq, act_scale, out, GEMM, False)


def gemm_i8_i32(w, w_rowsum, xq, out):
    """Raw exact dots of the int8 head for M rows as int32 [M, N] (tests)."""
    _i8_call("gemm_i8_i32", w, None, w_rowsum, xq, None, out, GEMM, True)


cdef _f16_call(str fn, w, x, out, bint multi):
    """One row x [K] -> out [N], or (multi) M rows x [M, K] -> out [M, N]; w uint16|float16 f16_tile16 [N_pad*K]."""
    if isinstance(w, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>w) == cnp.NPY_FLOAT16:
        w = (<cnp.ndarray>w).view(np.uint16)
    cdef int nd = 2 if multi else 1
    cdef cnp.ndarray aw = _arr(fn, "w", w, cnp.NPY_UINT16, 1, False)
    cdef cnp.ndarray ax = _arr(fn, "x", x, cnp.NPY_FLOAT32, nd, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_FLOAT32, nd, True)
    cdef Py_ssize_t m = cnp.PyArray_DIM(ax, 0) if multi else 1
    cdef Py_ssize_t k = cnp.PyArray_DIM(ax, nd - 1)
    cdef Py_ssize_t n = _n_of(fn, cnp.PyArray_DIM(ao, nd - 1))
    if multi and (m <= 0 or cnp.PyArray_DIM(ao, 0) != m):
        raise KernelError(f"{fn}: x has {m} rows but out has {cnp.PyArray_DIM(ao, 0)} (both are M, M >= 1)")
    if k <= 0 or k > MAX_DIM:
        raise KernelError(f"{fn}: x has {k} {'columns' if multi else 'elements'}; K must be positive")
    _check_size(fn, "w", aw, _pad16(n) * k, f"N_pad*K (N={n}, K={k})")
    cdef const uint16_t *pw = <const uint16_t *>cnp.PyArray_DATA(aw)
    cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
    cdef float *po = <float *>cnp.PyArray_DATA(ao)
    with nogil:
        if multi:
            bk_gemm_f16(pw, px, <int>m, <int>k, po, <int>n)
        else:
            bk_gemv_f16(pw, px, <int>k, po, <int>n)


def gemv_f16(w, x, out):
    """f16 LM head: out[n] = sum_k W[n,k] * x[k], sequential-in-k fmaf per row; w uint16|float16 f16_tile16 [N_pad*K]."""
    _f16_call("gemv_f16", w, x, out, False)


def gemm_f16(w, x, out):
    """f16 LM head for M rows: out[m] = gemv_f16(w, x[m]) bit for bit; x f32 [M, K], out f32 [M, N]."""
    _f16_call("gemm_f16", w, x, out, True)


# ---------------------------------------------------------------- multi-row GEMV (speculative verification)
ROWS_MAX = BK_ROWS_MAX


cdef inline Py_ssize_t _rows_m(str fn, cnp.ndarray aq, cnp.ndarray asc, cnp.ndarray ao) except -1:
    cdef Py_ssize_t m = cnp.PyArray_DIM(aq, 0)
    if m <= 0 or m > BK_ROWS_MAX or cnp.PyArray_DIM(ao, 0) != m:
        raise KernelError(f"{fn}: xq has {m} rows and out {cnp.PyArray_DIM(ao, 0)}; both must be M, 1 <= M <= {BK_ROWS_MAX}",
                          hint="use gemm_ternary / one gemv_i8 per row for more rows")
    _check_size(fn, "act_scale", asc, m, "M")
    return m


def gemv_rows_ternary(w, row_scale, xq, act_scale, act_sum, out):
    """gemm_ternary for M <= ROWS_MAX tokens read as one weight stream (bit-identical to M gemv_ternary calls)."""
    _ternary_call("gemv_rows_ternary", w, row_scale, xq, act_scale, act_sum, out, False, ROWS, False)


# ---------------------------------------------------------------- base-3 ternary weights (tile16b3)
def gemv_ternary_b3(w, row_scale, xq, float act_scale, int act_sum, out):
    """gemv_ternary with w in the base-3 tile16b3 layout (simd/layout.py): the same floats."""
    _ternary_call("gemv_ternary_b3", w, row_scale, xq, act_scale, act_sum, out, True, ONE, False)


def gemv_ternary_b3_i32(w, xq, int act_sum, out):
    """Raw exact dots out[n] = W_t[n] . xq as int32 from a tile16b3 matrix (tests; act_sum must be sum(xq))."""
    _ternary_call("gemv_ternary_b3_i32", w, None, xq, None, act_sum, out, True, ONE, True)


def gemm_ternary_b3(w, row_scale, xq, act_scale, act_sum, out):
    """gemm_ternary with w in the tile16b3 layout (decoded a few tiles at a time): the same floats."""
    _ternary_call("gemm_ternary_b3", w, row_scale, xq, act_scale, act_sum, out, True, GEMM, False)


def gemv_rows_ternary_b3(w, row_scale, xq, act_scale, act_sum, out):
    """gemv_rows_ternary with w in the tile16b3 layout: the same floats."""
    _ternary_call("gemv_rows_ternary_b3", w, row_scale, xq, act_scale, act_sum, out, True, ROWS, False)


def b3_to_tile16(w, int n, int k_pad, out):
    """Decode a whole tile16b3 matrix into tile16 (out: uint8 [N_pad*K_pad/4]) with the active path's decoder."""
    cdef str fn = "b3_to_tile16"
    cdef cnp.ndarray aw = _arr(fn, "w", w, cnp.NPY_UINT8, 1, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_UINT8, 1, True)
    _k_pad_of(fn, k_pad)
    _n_of(fn, n)
    _b3_w(fn, aw, n, k_pad)
    _ternary_w(fn, ao, n, k_pad)
    cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
    cdef uint8_t *po = <uint8_t *>cnp.PyArray_DATA(ao)
    with nogil:
        bk_b3_to_tile16(pw, n, k_pad, po)


def gemv_rows_i8(w, row_scale, w_rowsum, xq, act_scale, out):
    """gemv_i8 for M <= ROWS_MAX rows xq [M, K_pad] with act_scale [M] -> out [M, N], one pass over the head."""
    _i8_call("gemv_rows_i8", w, row_scale, w_rowsum, xq, act_scale, out, ROWS, False)


# ---------------------------------------------------------------- group-quantized LM head (q4g_tile16)
Q4G_MAX_K = BK_Q4G_MAX_K


cdef _q4g_call(str fn, codes, gscale, d, xq, act_scale, out, bint raw):
    cdef cnp.ndarray ac = _arr(fn, "codes", codes, cnp.NPY_UINT8, 1, False)
    cdef cnp.ndarray ag = _arr(fn, "gscale", gscale, cnp.NPY_UINT8, 1, False)
    cdef cnp.ndarray aq = _arr(fn, "xq", xq, cnp.NPY_INT8, 2, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_INT32 if raw else cnp.NPY_FLOAT32, 2, True)
    cdef Py_ssize_t k_pad = _k_pad_of(fn, cnp.PyArray_DIM(aq, 1))
    if k_pad > BK_Q4G_MAX_K:
        raise KernelError(f"{fn}: K_pad {k_pad} > {BK_Q4G_MAX_K} (the int32 dot bound of the q4g head)",
                          hint="convert with --lm-head i8 for this model")
    cdef Py_ssize_t n = _n_of(fn, cnp.PyArray_DIM(ao, 1))
    cdef Py_ssize_t m = cnp.PyArray_DIM(aq, 0)
    if m <= 0 or cnp.PyArray_DIM(ao, 0) != m:
        raise KernelError(f"{fn}: xq has {m} rows but out has {cnp.PyArray_DIM(ao, 0)} (both are M, M >= 1)")
    _check_size(fn, "codes", ac, _pad16(n) * k_pad // 2, f"N_pad*K_pad/2 (N={n}, K_pad={k_pad})")
    _check_size(fn, "gscale", ag, _pad16(n) * k_pad // 32, f"N_pad*K_pad/32 (N={n}, K_pad={k_pad})")
    cdef cnp.ndarray ad = None
    cdef cnp.ndarray asc = None
    cdef const float *pd = NULL
    cdef const float *ps = NULL
    cdef cnp.ndarray unit = np.ones(m, np.float32)
    if raw:
        ps = <const float *>cnp.PyArray_DATA(unit)
    else:
        ad = _arr(fn, "d", d, cnp.NPY_FLOAT32, 1, False)
        _check_at_least(fn, "d", ad, n)
        asc = _arr(fn, "act_scale", act_scale, cnp.NPY_FLOAT32, 1, False)
        _check_size(fn, "act_scale", asc, m, "M")
        pd = <const float *>cnp.PyArray_DATA(ad)
        ps = <const float *>cnp.PyArray_DATA(asc)
    cdef const uint8_t *pc = <const uint8_t *>cnp.PyArray_DATA(ac)
    cdef const uint8_t *pg = <const uint8_t *>cnp.PyArray_DATA(ag)
    cdef const int8_t *pq = <const int8_t *>cnp.PyArray_DATA(aq)
    cdef void *po = cnp.PyArray_DATA(ao)
    cdef int rc
    with nogil:
        rc = bk_gemv_q4g(pc, pg, pd, pq, <int>m, <int>k_pad, ps, NULL if raw else <float *>po,
                         <int32_t *>po if raw else NULL, <int>n)
    if rc != 0:
        raise MemoryError(f"{fn}: out of memory")


def gemv_q4g(codes, gscale, d, xq, act_scale, out):
    """q4g head for M rows: out[m, n] = ((float)dot / act_scale[m]) * d[n] with
    dot = sum_g s[n,g] * sum_{k in g} q[n,k] xq[m,k] (layout.py "q4g_tile16"); K_pad <= Q4G_MAX_K. Any M: all rows
    in one pass on the matrix tiles from tile_min_rows() up, up to 64 rows per pass of the vector bodies."""
    _q4g_call("gemv_q4g", codes, gscale, d, xq, act_scale, out, False)


def gemv_q4g_i32(codes, gscale, xq, out):
    """Raw exact int32 dots of the q4g head (tests)."""
    _q4g_call("gemv_q4g_i32", codes, gscale, None, xq, None, out, True)


# ---------------------------------------------------------------- runtime helpers (simd._ops)

# ---------------------------------------------------------------- group-scaled ternary (tg128, Ternary Bonsai)
TG_GROUP = BK_TG_GROUP


cdef inline Py_ssize_t _tg_rows(str fn, cnp.ndarray a, int nd) except -1:
    return 1 if nd == 1 else cnp.PyArray_DIM(a, 0)


def quantize_act_g128(x, xq, xd, xsum, cols=None):
    """x f32 [M, K] | [K] -> xq int8 [M, K_pad] | [K_pad] (0 in padding), per group of 128 columns: xd f32 = amax/127,
    xsum int32 = sum of the group's xq ([M, K_pad/128] or [K_pad/128]); round half to even, clamp to +-127.
    cols: quantize only the first cols columns of each row of x (the gate half of [gate | up])."""
    _quantize_call("quantize_act_g128", x, xq, xd, xsum, cols, True)


def gemv_tg(w, xq, xd, xsum, out):
    """Group-scaled ternary weights (layout.py "tg128") for M rows: xq int8 [M, K] | [K] with xd / xsum from
    quantize_act_g128, out f32 [M, N] | [N]; K a multiple of 128; w uint8 [N_pad/16 * K/128 * 544]."""
    cdef str fn = "gemv_tg"
    cdef cnp.ndarray aw = _arr(fn, "w", w, cnp.NPY_UINT8, 1, False)
    cdef cnp.ndarray aq = _arr(fn, "xq", xq, cnp.NPY_INT8, 0, False)
    cdef cnp.ndarray ad = _arr(fn, "xd", xd, cnp.NPY_FLOAT32, 0, False)
    cdef cnp.ndarray asm = _arr(fn, "xsum", xsum, cnp.NPY_INT32, 0, False)
    cdef cnp.ndarray ao = _arr(fn, "out", out, cnp.NPY_FLOAT32, 0, True)
    cdef int nd = cnp.PyArray_NDIM(aq)
    if nd not in (1, 2) or cnp.PyArray_NDIM(ao) != nd:
        raise KernelError(f"{fn}: xq {(<object>aq).shape} and out {(<object>ao).shape} must both be 1-D or both 2-D")
    cdef Py_ssize_t m = _tg_rows(fn, aq, nd)
    if m <= 0 or (nd == 2 and cnp.PyArray_DIM(ao, 0) != m):
        raise KernelError(f"{fn}: xq has {m} rows but out has {cnp.PyArray_DIM(ao, 0)} (both are M, M >= 1)")
    cdef Py_ssize_t k_pad = _k_pad_of(fn, cnp.PyArray_DIM(aq, nd - 1))
    if k_pad % BK_TG_GROUP:
        raise KernelError(f"{fn}: xq has {k_pad} columns, not a multiple of {BK_TG_GROUP}")
    cdef Py_ssize_t n = _n_of(fn, cnp.PyArray_DIM(ao, nd - 1))
    cdef Py_ssize_t groups = k_pad // BK_TG_GROUP
    _check_size(fn, "w", aw, _pad16(n) // 16 * groups * BK_TG_GROUP_BYTES,
                f"N_pad/16*K/128*{BK_TG_GROUP_BYTES} (N={n}, K={k_pad})")
    _check_size(fn, "xd", ad, m * groups, "M*K/128")
    _check_size(fn, "xsum", asm, m * groups, "M*K/128")
    cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
    cdef const int8_t *pq = <const int8_t *>cnp.PyArray_DATA(aq)
    cdef const float *pd = <const float *>cnp.PyArray_DATA(ad)
    cdef const int32_t *pm = <const int32_t *>cnp.PyArray_DATA(asm)
    cdef float *po = <float *>cnp.PyArray_DATA(ao)
    with nogil:
        bk_gemv_tg(pw, pq, pd, pm, <int>m, <int>k_pad, po, <int>n)


include "_ops.pxi"


# ---------------------------------------------------------------- import-time choice
bk_init()
for _var, _choose in (("BITNET_ISA", set_isa), ("BITNET_TILES", set_tiles)):   # the path, then the tiles over it
    _forced = os.environ.get(_var, "").strip().lower()
    if _forced:
        try:
            _choose(_forced)
        except KernelError as _e:
            raise IsaChoiceError(f"{_var}={_forced}: {_e}") from None
_min_rows_forced = os.environ.get("BITNET_TILE_MIN_ROWS", "").strip()
if _min_rows_forced:
    if not _min_rows_forced.isdigit():
        raise IsaChoiceError(f"BITNET_TILE_MIN_ROWS={_min_rows_forced}: not a row count")
    set_tile_min_rows(int(_min_rows_forced))
_kblock_forced = os.environ.get("BITNET_TILE_KBLOCK", "").strip()
if _kblock_forced:
    if not _kblock_forced.isdigit() or int(_kblock_forced) % 64:   # 7 was all of K, 100 was 64: silently
        raise IsaChoiceError(f"BITNET_TILE_KBLOCK={_kblock_forced}: not a count of k (a multiple of 64; 0: all of K)")
    set_tile_kblock(int(_kblock_forced))
# the tile bodies' on / off switches: 0 or 1, anything else refused in one line naming the variable
for _var, _set in (("BITNET_TILE_STREAM", set_tile_stream), ("BITNET_TILE_WARM", set_tile_warm),
                   ("BITNET_TILE_OVERLAP", set_tile_overlap)):
    _forced = os.environ.get(_var, "").strip()
    if _forced:
        if _forced not in ("0", "1"):
            raise IsaChoiceError(f"{_var}={_forced}: 0 or 1")
        _set(_forced == "1")
_attention_forced = os.environ.get("BITNET_ATTENTION", "").strip()
if _attention_forced:
    if _attention_forced not in ATTENTION_PRECISIONS:
        raise IsaChoiceError(f"BITNET_ATTENTION={_attention_forced}: {' or '.join(ATTENTION_PRECISIONS)}")
    set_attention_precision(_attention_forced)
_prefetch_forced = os.environ.get("BITNET_PREFETCH", "").strip()
if _prefetch_forced:
    if not _prefetch_forced.isdigit() or int(_prefetch_forced) > BK_GEMV_PREFETCH_MAX:
        raise IsaChoiceError(f"BITNET_PREFETCH={_prefetch_forced}: not a distance in bytes (0..{BK_GEMV_PREFETCH_MAX})")
    set_gemv_prefetch(int(_prefetch_forced))
