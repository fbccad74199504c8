/* Group-quantized LM head ("q4g_tile16", simd/layout.py): int4 codes, a 6-bit integer scale per row and
 * group of 32 columns, one f32 scale per row, for M rows (M = 1: decode; more: the verify pass of speculative
 * decoding, batched steps): up to 64 per pass of the vector bodies, all in one pass on the matrix tiles from
 * their crossover up (gemm_tiles_q4_body.h). All integer until the last step, so every path gives the same bits:
 *   dot[n] = sum_g s[n,g] * (sum_{k in g} u[n,k] * xq[k] - 8 * sum_{k in g} xq[k]),   u = q + 8 in 0..15
 *   out[n] = ((float)dot[n] / act_scale) * d[n]
 * |inner| <= 32 * 8 * 128 = 2^15, times s <= 63 and K/32 <= 256 groups: |dot| < 2^29 (K_pad <= 8192, checked
 * at the boundary). Reads 0.53 bytes per weight instead of the int8 head's 1.0.
 * AVX-512 VNNI: a quarter (64 bytes, 16 rows x 8 columns) gives two vpdpbusd operands (low / high nibbles,
 * codes as the unsigned side, the activations broadcast from memory as the signed side); per group one
 * vpmulld by the 16 rows' group scales. AVX2: pmaddubsw, int16 sums of one group (<= 8 x 3840 < 2^15).
 */
#include "kernels.h"
#include "q4g.h"
#include "rows.h"
#include "tiles.h"

#include <stdlib.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef void (*q4g_fn)(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                       const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out, int32_t *out_i32,
                       int n, int tile_begin, int tile_end);

static void q4g_scalar(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                       const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out, int32_t *out_i32,
                       int n, int tile_begin, int tile_end) {
    (void)xs8;
    const int groups = k_pad / 32;
    int32_t dots[16];
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            for (int r = 0; r < 16; r++) {
                int32_t dot = 0;
                for (int g = 0; g < groups; g++) {
                    const uint8_t *q = codes + ((size_t)t * groups + g) * 256;
                    int32_t inner = 0;
                    for (int j = 0; j < 4; j++)
                        for (int c = 0; c < 4; c++) {
                            unsigned b = q[j * 64 + r * 4 + c];
                            inner += ((int32_t)(b & 15) - 8) * x[32 * g + 8 * j + c] +
                                     ((int32_t)(b >> 4) - 8) * x[32 * g + 8 * j + 4 + c];
                        }
                    dot += (int32_t)gscale[((size_t)t * groups + g) * 16 + r] * inner;
                }
                dots[r] = dot;
            }
            bk_store_tile(dots, t * 16, n, d, act_scale[i], out ? out + (size_t)i * n : NULL,
                          out_i32 ? out_i32 + (size_t)i * n : NULL);
        }
}

#if defined(__x86_64__)
AVX512_TARGET static inline __m512i q4g_dpbusd_bcast(__m512i acc, __m512i a_u8, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a_u8), "m"(*(const int32_t *)p));
    return acc;
}

AVX512_TARGET __attribute__((always_inline)) static inline void q4g_tile_avx512(
    const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, const int32_t *xs8, int m0,
    const int MR, int k_pad, const float *act_scale, float *out, int32_t *out_i32, int n, int t,
    const uint8_t *ahead) {
    const int groups = k_pad / 32;
    const __m512i lowmask = _mm512_set1_epi8(0x0f);
    __m512i tot[8];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) tot[i] = _mm512_setzero_si512();
    const size_t pf = (size_t)bk_table.gemv_prefetch;
    for (int g = 0; g < groups; g++) {
        const uint8_t *q = codes + ((size_t)t * groups + g) * 256;
        /* the codes' and the group scales' streams, gemv_prefetch bytes of codes ahead (kernels.h) */
        bk_prefetch_ahead(q, pf), bk_prefetch_ahead(q + 64, pf), bk_prefetch_ahead(q + 128, pf);
        bk_prefetch_ahead(q + 192, pf), bk_prefetch_ahead(gscale + ((size_t)t * groups + g) * 16, pf / 16);
        if (ahead) /* a later tile's group g, into L2 (q4g_avx512) */
            for (int l = 0; l < 256; l += 64) __builtin_prefetch(ahead + (size_t)g * 256 + l, 0, 2);
        __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
        __m512i v2 = _mm512_loadu_si512(q + 128), v3 = _mm512_loadu_si512(q + 192);
        __m512i l0 = _mm512_and_si512(v0, lowmask), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lowmask);
        __m512i l1 = _mm512_and_si512(v1, lowmask), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lowmask);
        __m512i l2 = _mm512_and_si512(v2, lowmask), h2 = _mm512_and_si512(_mm512_srli_epi16(v2, 4), lowmask);
        __m512i l3 = _mm512_and_si512(v3, lowmask), h3 = _mm512_and_si512(_mm512_srli_epi16(v3, 4), lowmask);
        __m512i sv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gscale + ((size_t)t * groups + g) * 16)));
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int8_t *xb = xq + (size_t)(m0 + i) * k_pad + 32 * g;
            __m512i a = _mm512_setzero_si512(), b = a;
            a = q4g_dpbusd_bcast(a, l0, xb);
            b = q4g_dpbusd_bcast(b, h0, xb + 4);
            a = q4g_dpbusd_bcast(a, l1, xb + 8);
            b = q4g_dpbusd_bcast(b, h1, xb + 12);
            a = q4g_dpbusd_bcast(a, l2, xb + 16);
            b = q4g_dpbusd_bcast(b, h2, xb + 20);
            a = q4g_dpbusd_bcast(a, l3, xb + 24);
            b = q4g_dpbusd_bcast(b, h3, xb + 28);
            __m512i inner = _mm512_sub_epi32(_mm512_add_epi32(a, b), _mm512_set1_epi32(xs8[(size_t)(m0 + i) * groups + g]));
            tot[i] = _mm512_add_epi32(tot[i], _mm512_mullo_epi32(inner, sv));
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        finish_tile_avx512(tot[i], 0, t * 16, n, d, act_scale[m0 + i], out ? out + (size_t)(m0 + i) * n : NULL,
                           out_i32 ? out_i32 + (size_t)(m0 + i) * n : NULL);
}

/* From Q4G_AHEAD_ROWS rows on, the codes arrive ahead of the row groups, as in the ternary GEMM: the first
 * group over a tile, 32 vpdpbusd per 256 code bytes, keeps too few lines in flight to read DRAM fast itself. A
 * thread range's first Q4G_AHEAD_TILES tiles are read at streaming speed (bk_stream_warm), and the first row
 * group over tile t prefetches tile t + Q4G_AHEAD_TILES into L2. Head 128256 x 2560, 2 threads, ms per call:
 * with none of it M = 8 9.4-9.6, 16 14.1-14.4, 32 22.7; warming every 8 tiles first 6.3-7.1, 11.1-11.9, 19.9-20.3
 * (2026-11-28); on a quieter run of the same machine, warming every 8 tiles first against this: M = 4 4.2-4.4
 * -> 3.7, 8 5.9-6.1 -> 4.6-4.7, 16 9.6-9.7 -> 7.8, 32 16.8-17.0 -> 15.6 (prefetching 4 or 8 tiles ahead, or from 2
 * rows, within noise of it). */
#define Q4G_AHEAD_ROWS 4
#define Q4G_AHEAD_TILES 2
/* rows per pass over a tile's codes: each group's codes are unpacked once for up to 8 rows (8 totals, 8 code
 * vectors, a scale vector and two sums: 19 of 32 registers). 4 rows a pass unpacked them twice as often: head
 * 128256 x 2560, 2 threads, ms per call (2026-11-28, Zen 5): M = 8 5.85-5.91 -> 5.38-5.49, 16 9.72-9.97 ->
 * 8.69-8.74, 32 16.3-16.8 -> 15.2 */
#define Q4G_MR 8

AVX512_TARGET static void q4g_avx512(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                                     const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out,
                                     int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const size_t tile_bytes = (size_t)k_pad / 32 * 256;
    const int early = m >= Q4G_AHEAD_ROWS;
    if (early && tile_begin < tile_end) {
        const int te = tile_begin + Q4G_AHEAD_TILES < tile_end ? tile_begin + Q4G_AHEAD_TILES : tile_end;
        bk_stream_warm(codes + (size_t)tile_begin * tile_bytes, (size_t)(te - tile_begin) * tile_bytes);
    }
    for (int t = tile_begin; t < tile_end; t++) {
        const int ta = t + Q4G_AHEAD_TILES;
        const uint8_t *ahead = early && ta < tile_end ? codes + (size_t)ta * tile_bytes : NULL;
        for (int m0 = 0; m0 < m; m0 += Q4G_MR) {
            int mr = m - m0 < Q4G_MR ? m - m0 : Q4G_MR;
#define Q4G_CALL(R) \
    q4g_tile_avx512(codes, gscale, d, xq, xs8, m0, R, k_pad, act_scale, out, out_i32, n, t, m0 ? NULL : ahead)
            switch (mr) {
            case 1: Q4G_CALL(1); break;
            case 2: Q4G_CALL(2); break;
            case 3: Q4G_CALL(3); break;
            case 4: Q4G_CALL(4); break;
            case 5: Q4G_CALL(5); break;
            case 6: Q4G_CALL(6); break;
            case 7: Q4G_CALL(7); break;
            default: Q4G_CALL(8); break;
            }
#undef Q4G_CALL
        }
    }
}

/* Several rows (a verify pass, a batched step): each group's codes are unpacked once for up to 4 rows (R, a
 * compile-time constant so the accumulators stay in registers), one half tile (8 rows of weights) at a time.
 * Integer sums in another order: the same int32 dots, so the same floats as the one-row body. */
AVX2_TARGET __attribute__((always_inline)) static inline void q4g_rows_avx2(
    const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, const int32_t *xs8, int i0,
    const int R, int k_pad, const float *act_scale, float *out, int32_t *out_i32, int n, int t) {
    const int groups = k_pad / 32;
    const __m256i lowmask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i tot[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) {
            const uint8_t *q = codes + ((size_t)t * groups + g) * 256 + 32 * h;
            __m256i s16[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
                __m256i lo = _mm256_and_si256(v, lowmask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lowmask);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + (size_t)(i0 + r) * k_pad + 32 * g + 8 * j;
                    s16[r] = addw_acc256(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x))));
                    s16[r] = addw_acc256(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x + 4))));
                }
            }
            __m256i sv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gscale + ((size_t)t * groups + g) * 16 + 8 * h)));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256i inner = _mm256_sub_epi32(_mm256_madd_epi16(s16[r], ones),
                                                 _mm256_set1_epi32(xs8[(size_t)(i0 + r) * groups + g]));
                tot[r] = _mm256_add_epi32(tot[r], _mm256_mullo_epi32(inner, sv));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            finish_half_avx2(tot[r], 0, t * 16 + 8 * h, n, d, act_scale[i0 + r],
                             out ? out + (size_t)(i0 + r) * n : NULL, out_i32 ? out_i32 + (size_t)(i0 + r) * n : NULL);
    }
}

AVX2_TARGET static void q4g_avx2(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                                 const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out,
                                 int32_t *out_i32, int n, int tile_begin, int tile_end) {
    if (m > 1) {
        for (int t = tile_begin; t < tile_end; t++)
            for (int i0 = 0; i0 < m; i0 += 4) {
#define Q4G_ROWS(R) q4g_rows_avx2(codes, gscale, d, xq, xs8, i0, R, k_pad, act_scale, out, out_i32, n, t)
                switch (m - i0 < 4 ? m - i0 : 4) {
                case 1: Q4G_ROWS(1); break;
                case 2: Q4G_ROWS(2); break;
                case 3: Q4G_ROWS(3); break;
                default: Q4G_ROWS(4); break;
                }
#undef Q4G_ROWS
            }
        return;
    }
    const int groups = k_pad / 32;
    const __m256i lowmask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            __m256i tot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = codes + ((size_t)t * groups + g) * 256;
                const uint8_t *sp = gscale + ((size_t)t * groups + g) * 16;
                __m256i xs = _mm256_set1_epi32(xs8[(size_t)i * groups + g]);
                /* software prefetch 2 KB ahead, as gemv_ternary's AVX2 body (hints: never fault) */
                _mm_prefetch((const char *)q + 2048, _MM_HINT_T0), _mm_prefetch((const char *)q + 2048 + 64, _MM_HINT_T0);
                _mm_prefetch((const char *)q + 2048 + 128, _MM_HINT_T0), _mm_prefetch((const char *)q + 2048 + 192, _MM_HINT_T0);
                _mm_prefetch((const char *)sp + 256, _MM_HINT_T0);
                for (int h = 0; h < 2; h++) {
                    __m256i s16 = _mm256_setzero_si256();
                    for (int j = 0; j < 4; j++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32 * h));
                        __m256i lo = _mm256_and_si256(v, lowmask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lowmask);
                        s16 = _mm256_add_epi16(s16, _mm256_add_epi16(
                                  _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x + 32 * g + 8 * j))),
                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x + 32 * g + 8 * j + 4)))));
                    }
                    __m256i inner = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), xs);
                    __m256i sv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sp + 8 * h)));
                    tot[h] = _mm256_add_epi32(tot[h], _mm256_mullo_epi32(inner, sv));
                }
            }
            float *o = out ? out + (size_t)i * n : NULL;
            int32_t *oi = out_i32 ? out_i32 + (size_t)i * n : NULL;
            finish_half_avx2(tot[0], 0, t * 16, n, d, act_scale[i], o, oi);
            finish_half_avx2(tot[1], 0, t * 16 + 8, n, d, act_scale[i], o, oi);
        }
}
#endif

#if defined(__aarch64__)
/* NEON: a quarter of a group is 4 vectors of 4 rows x 4 code bytes, the layout of sdot's "by element" form
 * (lane i += the 4 bytes of row i . 4 activation bytes): codes 0..15 are valid s8, so
 * inner = sum u*x - 8*sum x with no widening, as the x86 bodies. The plain-NEON body does the same products
 * with widening multiply-accumulates (smlal, int16 lanes: 8 products <= 15 * 128 each, < 2^15) and pairwise
 * adds. Integer sums either way: the scalar body's dots exactly. */
#define Q4G_NEON_GROUP_HEAD                                                                                  \
    const uint8_t *q = codes + ((size_t)t * groups + g) * 256;                                              \
    const uint8_t *sp = gscale + ((size_t)t * groups + g) * 16;                                             \
    const int8_t *xg = x + 32 * g;                                                                          \
    uint8x16_t s8 = vld1q_u8(sp);                                                                           \
    uint16x8_t s16l = vmovl_u8(vget_low_u8(s8)), s16h = vmovl_u8(vget_high_u8(s8));                        \
    int32x4_t sv[4] = {vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(s16l))),                               \
                       vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(s16l))),                              \
                       vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(s16h))),                               \
                       vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(s16h)))};                             \
    const int32x4_t xs = vdupq_n_s32(xs8[(size_t)i * groups + g]);

#define Q4G_NEON_GROUP_TAIL                                                                                  \
    for (int v = 0; v < 4; v++) tot[v] = vaddq_s32(tot[v], vmulq_s32(vsubq_s32(inner[v], xs), sv[v]));

#define Q4G_NEON_TILE_END                                                                                    \
    int32_t dots[16];                                                                                        \
    for (int v = 0; v < 4; v++) vst1q_s32(dots + 4 * v, tot[v]);                                            \
    bk_store_tile(dots, t * 16, n, d, act_scale[i], out ? out + (size_t)i * n : NULL,                      \
                  out_i32 ? out_i32 + (size_t)i * n : NULL);

__attribute__((target("arch=armv8.2-a+dotprod")))
static void q4g_dotprod(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                        const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out, int32_t *out_i32,
                        int n, int tile_begin, int tile_end) {
    const int groups = k_pad / 32;
    const uint8x16_t lowmask = vdupq_n_u8(0x0f);
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            int32x4_t tot[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int g = 0; g < groups; g++) {
                Q4G_NEON_GROUP_HEAD
                const int8x16_t x0 = vld1q_s8(xg), x1 = vld1q_s8(xg + 16);
                int32x4_t inner[4];
                for (int v = 0; v < 4; v++) {
                    /* quarter j, rows 4v..4v+3: low nibbles take x[8j..8j+3], high ones x[8j+4..8j+7] */
                    uint8x16_t c0 = vld1q_u8(q + 16 * v), c1 = vld1q_u8(q + 64 + 16 * v);
                    uint8x16_t c2 = vld1q_u8(q + 128 + 16 * v), c3 = vld1q_u8(q + 192 + 16 * v);
                    int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
                    a = vdotq_laneq_s32(a, vreinterpretq_s8_u8(vandq_u8(c0, lowmask)), x0, 0);
                    b = vdotq_laneq_s32(b, vreinterpretq_s8_u8(vshrq_n_u8(c0, 4)), x0, 1);
                    a = vdotq_laneq_s32(a, vreinterpretq_s8_u8(vandq_u8(c1, lowmask)), x0, 2);
                    b = vdotq_laneq_s32(b, vreinterpretq_s8_u8(vshrq_n_u8(c1, 4)), x0, 3);
                    a = vdotq_laneq_s32(a, vreinterpretq_s8_u8(vandq_u8(c2, lowmask)), x1, 0);
                    b = vdotq_laneq_s32(b, vreinterpretq_s8_u8(vshrq_n_u8(c2, 4)), x1, 1);
                    a = vdotq_laneq_s32(a, vreinterpretq_s8_u8(vandq_u8(c3, lowmask)), x1, 2);
                    b = vdotq_laneq_s32(b, vreinterpretq_s8_u8(vshrq_n_u8(c3, 4)), x1, 3);
                    inner[v] = vaddq_s32(a, b);
                }
                Q4G_NEON_GROUP_TAIL
            }
            Q4G_NEON_TILE_END
        }
}

/* 4 activation bytes repeated over 8 lanes (the 2 rows x 4 codes of half a vector) */
static inline int8x8_t q4g_rep4(const int8_t *p) { return vreinterpret_s8_s32(vdup_n_s32(load_i32(p))); }

static void q4g_neon(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq,
                     const int32_t *xs8, int m, int k_pad, const float *act_scale, float *out, int32_t *out_i32,
                     int n, int tile_begin, int tile_end) {
    const int groups = k_pad / 32;
    const uint8x16_t lowmask = vdupq_n_u8(0x0f);
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            int32x4_t tot[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int g = 0; g < groups; g++) {
                Q4G_NEON_GROUP_HEAD
                int32x4_t inner[4];
                for (int v = 0; v < 4; v++) {
                    int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0); /* rows 4v, 4v+1 | rows 4v+2, 4v+3 */
                    for (int j = 0; j < 4; j++) {
                        uint8x16_t c = vld1q_u8(q + 64 * j + 16 * v);
                        int8x16_t l = vreinterpretq_s8_u8(vandq_u8(c, lowmask)), h = vreinterpretq_s8_u8(vshrq_n_u8(c, 4));
                        int8x8_t xl = q4g_rep4(xg + 8 * j), xh = q4g_rep4(xg + 8 * j + 4);
                        lo = vmlal_s8(lo, vget_low_s8(l), xl);
                        hi = vmlal_s8(hi, vget_high_s8(l), xl);
                        lo = vmlal_s8(lo, vget_low_s8(h), xh);
                        hi = vmlal_s8(hi, vget_high_s8(h), xh);
                    }
                    /* [r0 c0..3, r1 c0..3] [r2 .., r3 ..] -> pairs -> [r0, r1, r2, r3] */
                    inner[v] = vpaddlq_s16(vpaddq_s16(lo, hi));
                }
                Q4G_NEON_GROUP_TAIL
            }
            Q4G_NEON_TILE_END
        }
}
#endif

static const q4g_fn q4g_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, q4g_scalar) BK_X86_BODY(AVX2, q4g_avx2) BK_X86_BODY(AVX512, q4g_avx512) BK_ARM_BODY(NEON, q4g_neon)
    BK_ARM_BODY(DOTPROD, q4g_dotprod)
};

#define Q4G_ARGS(X) X(const uint8_t *, codes) X(const uint8_t *, gscale) X(const float *, d) X(const int8_t *, xq) \
    X(const int32_t *, xs8) X(int, m) X(int, k_pad) X(const float *, act_scale) X(float *, out)                 \
    X(int32_t *, out_i32) X(int, n)
BK_TILE_JOB(q4g_job, q4g_fn, Q4G_ARGS)

/* Rows per pass of the vector bodies over the head: each weight tile's nibbles are unpacked once for all of
 * them (4 rows per register block) and the head is read once per pass. Measured (128256 x 2560, this AVX-512
 * machine, ms at M = 16 / 32 / 64): 8 rows per pass 18.0 / 36.0 / 72.4 on 2 threads, 35.8 / 70.8 / 141 on 1;
 * 64: 13.9 / 22.3 / 40.9 and 27.5 / 44.7 / 80.1; avx2 2 threads 35.0 / 70.9 / 140 -> 30.2 / 56.1 / 110.
 * Same integer dots either way, so the same bits. */
#define Q4G_ROWS_PASS 64

/* One pass: xs8 (8 * group sums) on the stack up to 2048 (8 rows at K_pad = 8192), else allocated. */
static int q4g_rows(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m, int k_pad,
                    const float *act_scale, float *out, int32_t *out_i32, int n) {
    const int groups = k_pad / 32;
    int32_t stack_xs[BK_ROWS_MAX * BK_Q4G_MAX_K / 32];
    const size_t nxs = (size_t)m * groups;
    int32_t *xs8 = nxs <= sizeof stack_xs / sizeof *stack_xs ? stack_xs : malloc(nxs * sizeof(int32_t));
    if (!xs8) return -1;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < groups; g++) {
            int32_t s = 0;
            for (int k = 0; k < 32; k++) s += xq[(size_t)i * k_pad + 32 * g + k];
            xs8[(size_t)i * groups + g] = 8 * s;
        }
    BK_RUN_TILE_JOB(q4g_job, BK_PICK(q4g_bodies, bk_get_isa()), Q4G_ARGS, n, (size_t)k_pad * m, 16 * 8192);
    if (xs8 != stack_xs) free(xs8);
    return 0;
}

/* Any m: on the tiles in one pass from the crossover up (gemm_tiles.c), else Q4G_ROWS_PASS rows per pass of the
 * vector bodies over the head. */
int bk_gemv_q4g(const uint8_t *codes, const uint8_t *gscale, const float *d, const int8_t *xq, int m, int k_pad,
                const float *act_scale, float *out, int32_t *out_i32, int n) {
    if (bk_gemm_q4g_tiles(codes, gscale, d, xq, m, k_pad, act_scale, out, out_i32, n)) return 0;
    for (int r0 = 0; r0 < m; r0 += Q4G_ROWS_PASS) {
        const int mr = m - r0 < Q4G_ROWS_PASS ? m - r0 : Q4G_ROWS_PASS;
        if (q4g_rows(codes, gscale, d, xq + (size_t)r0 * k_pad, mr, k_pad, act_scale + r0,
                     out ? out + (size_t)r0 * n : NULL, out_i32 ? out_i32 + (size_t)r0 * n : NULL, n))
            return -1;
    }
    return 0;
}
