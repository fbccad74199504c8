/* f16 GEMV for the LM head ("f16_tile16", simd/layout.py): tile t, column k -> 16 halves of rows 16t..16t+15.
 *   out[n] = fma(W[n,K-1], x[K-1], ... fma(W[n,1], x[1], fma(W[n,0], x[0], 0)))
 * Each row is accumulated strictly in order k = 0..K-1 with a fused multiply-add, one lane per row, in every
 * path, so all paths give identical floats. The sequential chain per row means FMA latency, not throughput,
 * bounds one tile: the bodies interleave several tiles to keep enough independent chains in flight.
 */
#include "kernels.h"
#include "half.h"

#include <math.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

static void gemv_f16_scalar(const uint16_t *w, const float *x, int k, float *out, int n, int tile_begin, int tile_end) {
    for (int t = tile_begin; t < tile_end; t++) {
        const uint16_t *tile = w + (size_t)t * k * 16;
        float acc[16] = {0};
        for (int c = 0; c < k; c++)
            for (int r = 0; r < 16; r++) acc[r] = fmaf(bk_half_to_float(tile[(size_t)c * 16 + r]), x[c], acc[r]);
        for (int r = 0; r < 16 && t * 16 + r < n; r++) out[t * 16 + r] = acc[r];
    }
}

#if defined(__x86_64__)
AVX512_TARGET static inline void store_rows_avx512(__m512 acc, int row0, int n, float *out) {
    __mmask16 mk = n - row0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - row0)) - 1);
    _mm512_mask_storeu_ps(out + row0, mk, acc);
}

#define F16_STEP_AVX512(acc, ptr) acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ptr))), xc, acc)

AVX512_TARGET static void gemv_f16_avx512(const uint16_t *w, const float *x, int k, float *out, int n,
                                          int tile_begin, int tile_end) {
    const size_t tile_halves = (size_t)k * 16;
    int t = tile_begin;
/* F16_TILES tiles at once: that many independent FMA chains (latency 4 x 2 FMA/cycle). 1, 2 and 8 all read
 * DRAM at ~85% of stream_read on one core (measured), so the chain count is not the limit there. */
#define F16_TILES 8
    for (; t + F16_TILES <= tile_end; t += F16_TILES) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        __m512 a[F16_TILES];
        for (int j = 0; j < F16_TILES; j++) a[j] = _mm512_setzero_ps();
        for (int c = 0; c < k; c++) {
            __m512 xc = _mm512_set1_ps(x[c]);
#pragma GCC unroll 8
            for (int j = 0; j < F16_TILES; j++) F16_STEP_AVX512(a[j], p + j * tile_halves + (size_t)c * 16);
        }
        for (int j = 0; j < F16_TILES; j++) store_rows_avx512(a[j], (t + j) * 16, n, out);
    }
    for (; t < tile_end; t++) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        __m512 a0 = _mm512_setzero_ps();
        for (int c = 0; c < k; c++) {
            __m512 xc = _mm512_set1_ps(x[c]);
            F16_STEP_AVX512(a0, p + (size_t)c * 16);
        }
        store_rows_avx512(a0, t * 16, n, out);
    }
}

AVX2_TARGET static inline void store_rows_avx2(__m256 lo, __m256 hi, int row0, int n, float *out) {
    if (row0 + 16 <= n) {
        _mm256_storeu_ps(out + row0, lo);
        _mm256_storeu_ps(out + row0 + 8, hi);
    } else {
        float tmp[16];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        for (int r = 0; r < 16 && row0 + r < n; r++) out[row0 + r] = tmp[r];
    }
}

#define F16_STEP_AVX2(acc, ptr) acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ptr))), xc, acc)

AVX2_TARGET static void gemv_f16_avx2(const uint16_t *w, const float *x, int k, float *out, int n, int tile_begin,
                                      int tile_end) {
    const size_t tile_halves = (size_t)k * 16;
    int t = tile_begin;
    for (; t + 4 <= tile_end; t += 4) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int c = 0; c < k; c++) {
            __m256 xc = _mm256_set1_ps(x[c]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                F16_STEP_AVX2(a[2 * j], p + j * tile_halves + (size_t)c * 16);
                F16_STEP_AVX2(a[2 * j + 1], p + j * tile_halves + (size_t)c * 16 + 8);
            }
        }
        for (int j = 0; j < 4; j++) store_rows_avx2(a[2 * j], a[2 * j + 1], (t + j) * 16, n, out);
    }
    for (; t < tile_end; t++) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        __m256 lo = _mm256_setzero_ps(), hi = lo;
        for (int c = 0; c < k; c++) {
            __m256 xc = _mm256_set1_ps(x[c]);
            F16_STEP_AVX2(lo, p + (size_t)c * 16);
            F16_STEP_AVX2(hi, p + (size_t)c * 16 + 8);
        }
        store_rows_avx2(lo, hi, t * 16, n, out);
    }
}
#endif

#if defined(__aarch64__)
static void gemv_f16_neon(const uint16_t *w, const float *x, int k, float *out, int n, int tile_begin, int tile_end) {
    for (int t = tile_begin; t < tile_end; t++) {
        const uint16_t *p = w + (size_t)t * k * 16;
        float32x4_t a[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int c = 0; c < k; c++) {
            float32x4_t xc = vdupq_n_f32(x[c]);
            for (int q = 0; q < 4; q++) /* vfmaq: fused, same as fmaf */
                a[q] = vfmaq_f32(a[q], vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + (size_t)c * 16 + 4 * q))), xc);
        }
        float tmp[16];
        for (int q = 0; q < 4; q++) vst1q_f32(tmp + 4 * q, a[q]);
        for (int r = 0; r < 16 && t * 16 + r < n; r++) out[t * 16 + r] = tmp[r];
    }
}
#endif

const bk_gemv_f16_fn bk_gemv_f16_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemv_f16_scalar) BK_X86_BODY(AVX2, gemv_f16_avx2) BK_X86_BODY(AVX512, gemv_f16_avx512)
    BK_ARM_BODY(NEON, gemv_f16_neon)
};

#define GEMV_F16_ARGS(X) X(const uint16_t *, w) X(const float *, x) X(int, k) X(float *, out) X(int, n)
BK_TILE_JOB(gemv_f16_job, bk_gemv_f16_fn, GEMV_F16_ARGS)

void bk_gemv_f16(const uint16_t *w, const float *x, int k, float *out, int n) {
    BK_RUN_TILE_JOB(gemv_f16_job, bk_table.gemv_f16, GEMV_F16_ARGS, n, k, 16 * 1024);
}

/* M rows at once (the batched engine's logits, prompt rows scored for perplexity or echo): a body per path that
 * keeps R rows x 4 tiles of accumulators in registers, so each weight vector loaded (and converted) once feeds R
 * rows and R x 4 independent chains hide the FMA latency that bounds the GEMV body run once per row. Every
 * accumulator is still its row's sequential chain in k (fma(W[n,c], x[c], acc) for c = 0..K-1, from 0), so row
 * r of out equals bk_gemv_f16 of x[r] bit for bit on every path. Paths without a blocked body (scalar, NEON) run
 * the path's GEMV body per row over runs of 4 tiles: each run's weights (4 x 16 rows x k halves, ~320 KB at
 * k = 2560) come from memory once and from L2 for the other rows. */
static void gemm_f16_rows(const uint16_t *w, const float *x, int m, int k, float *out, int n, int tile_begin,
                          int tile_end) {
    for (int t0 = tile_begin; t0 < tile_end; t0 += 4) {
        const int t1 = t0 + 4 < tile_end ? t0 + 4 : tile_end;
        for (int r = 0; r < m; r++) bk_table.gemv_f16(w, x + (size_t)r * k, k, out + (size_t)r * n, n, t0, t1);
    }
}

#if defined(__x86_64__)
/* R rows (1..4, a constant after inlining) x 4 tiles: 16 zmm chains at R = 4 (2 FMA ports x latency 4 need 8) */
AVX512_TARGET static inline __attribute__((always_inline)) void
gemm_f16_block_avx512(const uint16_t *p, size_t tile_halves, const float *x, int k, float *out, int n, int row0,
                      const int R) {
    __m512 a[4][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    for (int c = 0; c < k; c++) {
        __m512 wv[4];
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + j * tile_halves + (size_t)c * 16)));
        for (int i = 0; i < R; i++) {
            const __m512 xc = _mm512_set1_ps(x[(size_t)i * k + c]);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(wv[j], xc, a[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) store_rows_avx512(a[i][j], row0 + j * 16, n, out + (size_t)i * n);
}

AVX512_TARGET static void gemm_f16_avx512(const uint16_t *w, const float *x, int m, int k, float *out, int n,
                                          int tile_begin, int tile_end) {
    const size_t tile_halves = (size_t)k * 16;
    int t = tile_begin;
    for (; t + 4 <= tile_end; t += 4) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        int r = 0;
        for (; r + 4 <= m; r += 4) gemm_f16_block_avx512(p, tile_halves, x + (size_t)r * k, k, out + (size_t)r * n, n, t * 16, 4);
        const float *xr = x + (size_t)r * k;
        float *orow = out + (size_t)r * n;
        switch (m - r) {
        case 3: gemm_f16_block_avx512(p, tile_halves, xr, k, orow, n, t * 16, 3); break;
        case 2: gemm_f16_block_avx512(p, tile_halves, xr, k, orow, n, t * 16, 2); break;
        case 1: gemm_f16_block_avx512(p, tile_halves, xr, k, orow, n, t * 16, 1); break;
        default: break;
        }
    }
    if (t < tile_end)   /* the last 1-3 tiles of the range: the GEMV body per row (the same chains) */
        for (int r = 0; r < m; r++) gemv_f16_avx512(w, x + (size_t)r * k, k, out + (size_t)r * n, n, t, tile_end);
}

/* R rows (1..4) x 1 tile as two 8-lane halves: 8 ymm chains at R = 4, within AVX2's 16 registers */
AVX2_TARGET static inline __attribute__((always_inline)) void
gemm_f16_block_avx2(const uint16_t *p, const float *x, int k, float *out, int n, int row0, const int R) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int c = 0; c < k; c++) {
        const __m256 wl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + (size_t)c * 16)));
        const __m256 wh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + (size_t)c * 16 + 8)));
        for (int i = 0; i < R; i++) {
            const __m256 xc = _mm256_set1_ps(x[(size_t)i * k + c]);
            lo[i] = _mm256_fmadd_ps(wl, xc, lo[i]);
            hi[i] = _mm256_fmadd_ps(wh, xc, hi[i]);
        }
    }
    for (int i = 0; i < R; i++) store_rows_avx2(lo[i], hi[i], row0, n, out + (size_t)i * n);
}

AVX2_TARGET static void gemm_f16_avx2(const uint16_t *w, const float *x, int m, int k, float *out, int n,
                                      int tile_begin, int tile_end) {
    const size_t tile_halves = (size_t)k * 16;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint16_t *p = w + (size_t)t * tile_halves;
        int r = 0;
        for (; r + 4 <= m; r += 4) gemm_f16_block_avx2(p, x + (size_t)r * k, k, out + (size_t)r * n, n, t * 16, 4);
        const float *xr = x + (size_t)r * k;
        float *orow = out + (size_t)r * n;
        switch (m - r) {
        case 3: gemm_f16_block_avx2(p, xr, k, orow, n, t * 16, 3); break;
        case 2: gemm_f16_block_avx2(p, xr, k, orow, n, t * 16, 2); break;
        case 1: gemm_f16_block_avx2(p, xr, k, orow, n, t * 16, 1); break;
        default: break;
        }
    }
}
#endif

const bk_gemm_f16_fn bk_gemm_f16_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemm_f16_rows) BK_X86_BODY(AVX2, gemm_f16_avx2) BK_X86_BODY(AVX512, gemm_f16_avx512)
};

#define GEMM_F16_ARGS(X) X(const uint16_t *, w) X(const float *, x) X(int, m) X(int, k) X(float *, out) X(int, n)
BK_TILE_JOB(gemm_f16_job, bk_gemm_f16_fn, GEMM_F16_ARGS)

void bk_gemm_f16(const uint16_t *w, const float *x, int m, int k, float *out, int n) {
    BK_RUN_TILE_JOB(gemm_f16_job, bk_table.gemm_f16, GEMM_F16_ARGS, n, (size_t)k * m, 16 * 1024);
}
