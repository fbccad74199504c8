/* Multi-row GEMV: M <= BK_ROWS_MAX tokens through one pass over the weights (ternary tile16 and the int8 head),
 * for the verification step of speculative decoding (engine/speculative.py). Results are bit-identical to M
 * single-token GEMVs: the same exact int32 dots and the same f32 epilogue (finish_tile_avx512 / bk_store_tile).
 *
 * Why not gemm_ternary: it is built for prefill (compute-bound, M >= 32): two tiles per step (two read streams)
 * and an L2 chunk loop. Measured on 24 matrices of 13824 x 2560 (out of cache, 2 threads, busy machine):
 * gemm M=1 1.64x a gemv, M=2 2.00x, M=4 1.91x. Here one tile at a time is read as a single sequential stream
 * (like the GEMV) and its unpacked codes feed all M rows.
 *
 * AVX-512 VNNI: dedicated bodies (one unpack, M x 4 vpdpbusd per 64 bytes; two accumulator sets so each chain
 * has half the latency). Other paths: the single-token body of that path run per row on the same tile, so the
 * tile comes from DRAM once and from L1/L2 for the other rows (identical results by construction).
 */
#include "kernels.h"
#include "rows.h"

#include <stdlib.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif

typedef void (*rows_ternary_fn)(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                const float *act_scale, const int32_t *act_sum, float *out, int n, int tile_begin,
                                int tile_end);
typedef void (*rows_i8_fn)(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                           const uint8_t *aux, const int32_t *xsum, int m, int k_pad, const float *act_scale,
                           float *out, int n, int tile_begin, int tile_end);

/* ---------------- generic: the path's own GEMV body, tile by tile, once per row ---------------- */
static void ternary_rows_by_tile(bk_gemv_ternary_fn gemv, const uint8_t *w, const float *row_scale,
                                 const int8_t *xq, int m, int k_pad, const float *act_scale, const int32_t *act_sum,
                                 float *out, int n, int tile_begin, int tile_end) {
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++)
            gemv(w, row_scale, xq + (size_t)i * k_pad, k_pad, act_scale[i], act_sum[i], out + (size_t)i * n, NULL, n,
                 t, t + 1);
}

/* The GEMV body the dispatcher chose for this path (AVX2, AVX-VNNI, NEON, or on the scalar path the reference). */
static void ternary_rows_generic(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                 const float *act_scale, const int32_t *act_sum, float *out, int n, int tile_begin,
                                 int tile_end) {
    ternary_rows_by_tile(bk_table.gemv_ternary, w, row_scale, xq, m, k_pad, act_scale, act_sum, out, n, tile_begin,
                         tile_end);
}

static void i8_rows_by_tile(bk_gemv_i8_fn gemv, const int8_t *w, const float *row_scale, const int32_t *w_rowsum,
                            const int8_t *xq, const uint8_t *aux, int m, int k_pad, const float *act_scale, float *out,
                            int n, int tile_begin, int tile_end) {
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++)
            gemv(w, row_scale, w_rowsum, xq + (size_t)i * k_pad, aux + (size_t)i * 2 * k_pad, k_pad, act_scale[i],
                 out + (size_t)i * n, NULL, n, t, t + 1);
}

static void i8_rows_generic(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                            const uint8_t *aux, const int32_t *xsum, int m, int k_pad, const float *act_scale, float *out, int n,
                            int tile_begin, int tile_end) {
    (void)xsum;
    i8_rows_by_tile(bk_table.gemv_i8, w, row_scale, w_rowsum, xq, aux, m, k_pad, act_scale, out, n, tile_begin,
                    tile_end);
}

#if defined(__x86_64__)
/* ---------------- AVX-512 VNNI ---------------- */
/* acc += dot(u8 a, s8 [4 bytes at p] broadcast): the broadcast is folded into vpdpbusd as a {1to16} memory
 * operand (a separate vpbroadcastd per vpdpbusd halved the rate at M >= 3). */
AVX512_TARGET static inline __m512i dpbusd512_bcast(__m512i acc, __m512i a_u8, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a_u8), "m"(*(const int32_t *)p));
    return acc;
}

/* MR (1..8) rows of one tile; MR is a constant after inlining so the 2 x MR accumulators stay in registers
 * (16 + 8 unpacked operands + mask + broadcast <= 32 zmm). */
AVX512_TARGET __attribute__((always_inline)) static inline void ternary_tile_rows_avx512(
    const uint8_t *p, int t, const int MR, const int8_t *xq, int m0, int k_pad, const float *row_scale,
    const float *act_scale, const int32_t *act_sum, float *out, int n) {
    const int kb = k_pad / 16; /* a multiple of 4 */
    const __m512i m3 = _mm512_set1_epi8(3);
    __m512i a[8], b[8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) a[i] = b[i] = _mm512_setzero_si512();
    const size_t pf = (size_t)bk_table.gemv_prefetch; /* kernels.h: BK_GEMV_PREFETCH_DEFAULT */
    for (int blk = 0; blk < kb; blk += 2) {
        bk_prefetch_ahead(p + (size_t)blk * 64, pf);
        bk_prefetch_ahead(p + (size_t)blk * 64 + 64, pf);
        __m512i v = _mm512_loadu_si512(p + (size_t)blk * 64), v2 = _mm512_loadu_si512(p + (size_t)blk * 64 + 64);
        __m512i u0 = _mm512_and_si512(v, m3), u1 = _mm512_and_si512(_mm512_srli_epi16(v, 2), m3);
        __m512i u2 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m3), u3 = _mm512_and_si512(_mm512_srli_epi16(v, 6), m3);
        __m512i s0 = _mm512_and_si512(v2, m3), s1 = _mm512_and_si512(_mm512_srli_epi16(v2, 2), m3);
        __m512i s2 = _mm512_and_si512(_mm512_srli_epi16(v2, 4), m3), s3 = _mm512_and_si512(_mm512_srli_epi16(v2, 6), m3);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int8_t *xb = xq + (size_t)(m0 + i) * k_pad + 16 * blk;
            a[i] = dpbusd512_bcast(a[i], u0, xb);
            b[i] = dpbusd512_bcast(b[i], s0, xb + 16);
            a[i] = dpbusd512_bcast(a[i], u1, xb + 4);
            b[i] = dpbusd512_bcast(b[i], s1, xb + 20);
            a[i] = dpbusd512_bcast(a[i], u2, xb + 8);
            b[i] = dpbusd512_bcast(b[i], s2, xb + 24);
            a[i] = dpbusd512_bcast(a[i], u3, xb + 12);
            b[i] = dpbusd512_bcast(b[i], s3, xb + 28);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        finish_tile_avx512(_mm512_add_epi32(a[i], b[i]), act_sum[m0 + i], t * 16, n, row_scale, act_scale[m0 + i],
                           out + (size_t)(m0 + i) * n, NULL);
}

/* Every tile of [tile_begin, tile_end) (p: its first byte, tile_bytes apart), its m rows in groups of up to
 * 8: CALL(R) with R a constant, so the tile-rows body is inlined once per group size. */
#define ROWS_TILES(T, tile_bytes, CALL)                         \
    for (int t = tile_begin; t < tile_end; t++) {              \
        const T *p = w + (size_t)t * (tile_bytes);              \
        for (int m0 = 0; m0 < m; m0 += 8) {                     \
            switch (m - m0 < 8 ? m - m0 : 8) {                  \
            case 1: CALL(1); break;                             \
            case 2: CALL(2); break;                             \
            case 3: CALL(3); break;                             \
            case 4: CALL(4); break;                             \
            case 5: CALL(5); break;                             \
            case 6: CALL(6); break;                             \
            case 7: CALL(7); break;                             \
            default: CALL(8); break;                            \
            }                                                   \
        }                                                       \
    }

AVX512_TARGET static void ternary_rows_avx512(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                              int k_pad, const float *act_scale, const int32_t *act_sum, float *out,
                                              int n, int tile_begin, int tile_end) {
#define TERNARY_CALL(R) ternary_tile_rows_avx512(p, t, R, xq, m0, k_pad, row_scale, act_scale, act_sum, out, n)
    ROWS_TILES(uint8_t, (size_t)(k_pad / 16) * 64, TERNARY_CALL)
#undef TERNARY_CALL
}

/* int8 head with the operands swapped against gemv_i8.c: the weights become the unsigned side (W_q ^ 0x80 =
 * W_q + 128, one xor per 64 bytes shared by all rows) so the activations (s8) can be broadcast from memory
 * inside vpdpbusd: sum (W_q + 128) * xq = dot + 128 * sum(xq). (The u8-activation form needs a separate
 * broadcast per row and group: 4-row head passes took 1.9x a 1-row GEMV that way.) Int32 wrap-around in the
 * accumulator cancels exactly, as in gemv_i8.c. */
AVX512_TARGET __attribute__((always_inline)) static inline void i8_tile_rows_avx512(
    const int8_t *p, int t, const int MR, const int8_t *xq, const int32_t *xsum, int m0, int k_pad,
    const float *row_scale, const float *act_scale, float *out, int n) {
    const int groups = k_pad / 4; /* a multiple of 16 */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a[8], b[8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) a[i] = b[i] = _mm512_setzero_si512();
    for (int g = 0; g < groups; g += 2) {
        __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(p + (size_t)g * 64), flip);
        __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(p + (size_t)g * 64 + 64), flip);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int8_t *xb = xq + (size_t)(m0 + i) * k_pad + 4 * g;
            a[i] = dpbusd512_bcast(a[i], w0, xb);
            b[i] = dpbusd512_bcast(b[i], w1, xb + 4);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        finish_tile_avx512(_mm512_add_epi32(a[i], b[i]), (int32_t)((uint32_t)xsum[m0 + i] << 7), t * 16, n,
                           row_scale, act_scale[m0 + i], out + (size_t)(m0 + i) * n, NULL);
}

AVX512_TARGET static void i8_rows_avx512(const int8_t *w, const float *row_scale, const int32_t *w_rowsum,
                                         const int8_t *xq, const uint8_t *aux, const int32_t *xsum, int m,
                                         int k_pad, const float *act_scale, float *out, int n, int tile_begin,
                                         int tile_end) {
    (void)w_rowsum;
    (void)aux;
#define I8_CALL(R) i8_tile_rows_avx512(p, t, R, xq, xsum, m0, k_pad, row_scale, act_scale, out, n)
    ROWS_TILES(int8_t, (size_t)(k_pad / 4) * 64, I8_CALL)
#undef I8_CALL
}
#endif

/* Paths with no multi-row body of their own (every one but avx512) fall to the scalar entry: the path's GEMV
 * body per row, tile by tile. */
static const rows_ternary_fn ternary_rows_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, ternary_rows_generic) BK_X86_BODY(AVX512, ternary_rows_avx512)
};
static const rows_i8_fn i8_rows_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, i8_rows_generic) BK_X86_BODY(AVX512, i8_rows_avx512)
};

/* The multi-row body of the active path over tiles [tile_begin, tile_end), on the calling thread (gemv_b3.c runs
 * it on tiles it decoded into tile16). */
void bk_gemv_rows_ternary_tiles(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                const float *act_scale, const int32_t *act_sum, float *out, int n, int tile_begin,
                                int tile_end) {
    rows_ternary_fn fn = BK_PICK(ternary_rows_bodies, bk_get_isa());
    fn(w, row_scale, xq, m, k_pad, act_scale, act_sum, out, n, tile_begin, tile_end);
}

/* ---------------- threaded drivers ---------------- */
#define TERNARY_ROWS_ARGS(X) X(const uint8_t *, w) X(const float *, row_scale) X(const int8_t *, xq) X(int, m) \
    X(int, k_pad) X(const float *, act_scale) X(const int32_t *, act_sum) X(float *, out) X(int, n)
BK_TILE_JOB(ternary_rows_job, rows_ternary_fn, TERNARY_ROWS_ARGS)

void bk_gemv_rows_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                          const float *act_scale, const int32_t *act_sum, float *out, int n) {
    BK_RUN_TILE_JOB(ternary_rows_job, BK_PICK(ternary_rows_bodies, bk_get_isa()), TERNARY_ROWS_ARGS, n, k_pad,
                    16 * 4096);
}

#define I8_ROWS_ARGS(X) X(const int8_t *, w) X(const float *, row_scale) X(const int32_t *, w_rowsum)     \
    X(const int8_t *, xq) X(const uint8_t *, aux) X(const int32_t *, xsum) X(int, m) X(int, k_pad) \
    X(const float *, act_scale) X(float *, out) X(int, n)
BK_TILE_JOB(i8_rows_job, rows_i8_fn, I8_ROWS_ARGS)

int bk_gemv_rows_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m,
                    int k_pad, const float *act_scale, float *out, int n) {
    /* per row: xq ^ 0x80 (k_pad bytes) then |xq| (k_pad bytes), as gemv_i8.c's aux */
    uint8_t *aux = malloc((size_t)m * 2 * k_pad);
    int32_t xsum[BK_ROWS_MAX];
    if (!aux) return -1;
    for (int i = 0; i < m; i++) {
        const int8_t *x = xq + (size_t)i * k_pad;
        uint8_t *a = aux + (size_t)i * 2 * k_pad;
        int32_t sx = 0;
        for (int k = 0; k < k_pad; k++) {
            a[k] = (uint8_t)(x[k] ^ 0x80);
            a[k_pad + k] = (uint8_t)(x[k] < 0 ? -x[k] : x[k]);
            sx += x[k];
        }
        xsum[i] = sx;
    }
    BK_RUN_TILE_JOB(i8_rows_job, BK_PICK(i8_rows_bodies, bk_get_isa()), I8_ROWS_ARGS, n, k_pad, 16 * 4096);
    free(aux);
    return 0;
}
