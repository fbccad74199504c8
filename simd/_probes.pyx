# cython: language_level=3
"""simd._probes: machine-limit probes for the benchmarks (bench/bench_kernels.py, bench/limits.py), C in
simd/probes/bench_probes.c. Not used at run time, so not part of simd._kernels: the path and the thread
count are read from simd._kernels and passed in.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint64_t

from bitnet_cpu.simd import _kernels
from bitnet_cpu.simd.errors import KernelError

cnp.import_array()

cdef extern from "kernels.h" nogil:
    pass

cdef extern from *:
    """
    uint64_t bk_stream_read(const uint8_t *buf, size_t nbytes, int isa, int nt);
    int64_t bk_peak_dot(long iters, int isa, int vex, int nt);
    int64_t bk_peak_dot_macs_per_iter(int isa);
    int64_t bk_peak_tile(long iters, int nt);
    int64_t bk_peak_fma(long iters, int isa, int nt);
    """
    uint64_t bk_stream_read(const uint8_t *buf, size_t nbytes, int isa, int nt) nogil
    int64_t bk_peak_dot(long iters, int isa, int vex, int nt) nogil
    int64_t bk_peak_dot_macs_per_iter(int isa) nogil
    int64_t bk_peak_tile(long iters, int nt) nogil
    int64_t bk_peak_fma(long iters, int isa, int nt) nogil


cdef int _isa():
    # the vector path under the tiles: "amx" is avx512 with tiles on top
    return _kernels.ISA_NAMES.index("avx512" if _kernels.active() == "amx" else _kernels.active())


def stream_read(buf):
    """Read every byte of a C-contiguous uint8 buffer with vector loads of the active path, split over
    simd._kernels.get_num_threads() threads running at once (bandwidth probe). Returns a checksum."""
    if not isinstance(buf, cnp.ndarray) or cnp.PyArray_TYPE(<cnp.ndarray>buf) != cnp.NPY_UINT8 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>buf):
        raise KernelError("stream_read: buf must be a C-contiguous uint8 numpy array")
    cdef cnp.ndarray ab = <cnp.ndarray>buf
    cdef const uint8_t *p = <const uint8_t *>cnp.PyArray_DATA(ab)
    cdef size_t nbytes = <size_t>cnp.PyArray_SIZE(ab)
    cdef int isa = _isa(), nt = _kernels.get_num_threads()
    cdef uint64_t s
    with nogil:
        s = bk_stream_read(p, nbytes, isa, nt)
    return s


def peak_dot(long iters):
    """Run the register-only int8 dot-product loop of the active path on every kernel thread at once.
    Returns the number of int8 multiply-adds done (0 if the path has no probe)."""
    cdef int isa = _isa(), nt = _kernels.get_num_threads()
    cdef int vex = 1 if _kernels.features()["avxvnni"] else 0
    cdef int64_t r
    with nogil:
        r = bk_peak_dot(iters, isa, vex, nt)
    return int(bk_peak_dot_macs_per_iter(isa) * iters * nt) + 0 * r


def peak_fma(long iters):
    """Run the register-only f32 FMA loop of the active path (12 chains of vfmadd231ps, zmm or ymm) on every
    kernel thread at once. Returns the f32 multiply-adds done (0 if the path has no probe: scalar, NEON)."""
    cdef int isa = _isa(), nt = _kernels.get_num_threads()
    cdef int64_t r
    with nogil:
        r = bk_peak_fma(iters, isa, nt)
    return int(r)


def peak_tile(long iters):
    """The AMX int8 peak: a register-only loop of tdpbssd on every kernel thread at once. Returns the
    multiply-adds done; KernelError where the hardware tiles are not usable (simd._kernels.tiles_reason())."""
    if "amx" not in _kernels.supported_isas():
        raise KernelError(f"peak_tile: no hardware tiles here ({_kernels.tiles_reason()})")
    cdef int nt = _kernels.get_num_threads()
    cdef int64_t r
    with nogil:
        r = bk_peak_tile(iters, nt)
    return int(r)
