/* Ternary GEMV (one token) on the tile16 layout (simd/layout.py):
 *   dot[n] = sum_k (u[n,k] - 1) * xq[k] = sum_k u[n,k] * xq[k] - act_sum,   u = 2-bit code in {0,1,2}
 *   out[n] = ((float)dot[n] / act_scale) * row_scale[n]
 * A 64-byte block holds 16 rows x 16 columns; (block >> 2i) & 3 is 16 rows x 4 columns (4i..4i+3), one
 * dword per row: exactly the operand of vpdpbusd (u8 codes x s8 activations broadcast to every lane).
 * Decode is memory-bound: the bodies read one tile at a time (a single sequential stream) with enough
 * independent accumulators to keep the loads flowing; unpacking costs well under the DRAM time
 * (AVX-512: ~52 GB/s from L2 on one core vs ~33 GB/s streaming from DRAM).
 */
#include "kernels.h"

#include <string.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include "ternary_neon.h"
#endif

/* sum_k u[16t + r, k] * xq[k] for the 16 rows of one tile (the scalar reference of every body). */
static void tile_code_dots_scalar(const uint8_t *tile, const int8_t *xq, int kb, int32_t *dots) {
    for (int r = 0; r < 16; r++) dots[r] = 0;
    for (int b = 0; b < kb; b++) {
        const uint8_t *blk = tile + (size_t)b * 64;
        const int8_t *xb = xq + 16 * b;
        for (int r = 0; r < 16; r++) {
            int32_t s = 0;
            for (int j = 0; j < 4; j++) {
                unsigned byte = blk[r * 4 + j];
                for (int i = 0; i < 4; i++) s += (int32_t)((byte >> (2 * i)) & 3) * xb[4 * i + j];
            }
            dots[r] += s;
        }
    }
}

static void gemv_ternary_scalar(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                                float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                                int tile_begin, int tile_end) {
    int kb = k_pad / 16;
    int32_t dots[16];
    for (int t = tile_begin; t < tile_end; t++) {
        tile_code_dots_scalar(w + (size_t)t * kb * 64, xq, kb, dots);
        for (int r = 0; r < 16; r++) dots[r] -= act_sum;
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}

#if defined(__x86_64__)
/* ---------------- AVX-512 VNNI ---------------- */
/* Shift-free unpacking: (v & (3 << 2i)) = u_i << 2i is still a valid u8 operand (<= 128), so each of the 4
 * column groups gets its own accumulator holding 4^i times its dot, and the shifts move to the end of the
 * row (exact: every accumulator is a multiple of its 4^i). 4 and + 4 vpdpbusd per 64 bytes instead of
 * 3 shift + 4 and + 4 vpdpbusd. Bound: |acc_3| <= 64 * 256 * K_pad/4 < 2^31 for K_pad <= 2^18 (checked at
 * the boundary). */
#define TERNARY_STEP_AVX512(c0, c1, c2, c3, ptr)                                 \
    do {                                                                     \
        __m512i v_ = _mm512_loadu_si512(ptr);                                \
        c0 = dpbusd512(c0, _mm512_and_si512(v_, m0), x0);          \
        c1 = dpbusd512(c1, _mm512_and_si512(v_, m1), x1);          \
        c2 = dpbusd512(c2, _mm512_and_si512(v_, m2), x2);          \
        c3 = dpbusd512(c3, _mm512_and_si512(v_, m3), x3);          \
    } while (0)

AVX512_TARGET static inline __m512i combine_scaled_avx512(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
    return _mm512_add_epi32(_mm512_add_epi32(c0, _mm512_srai_epi32(c1, 2)),
                            _mm512_add_epi32(_mm512_srai_epi32(c2, 4), _mm512_srai_epi32(c3, 6)));
}

/* Intel's loop (bk_table.gemv_one_block, kernels.h): one block per step, 4 accumulators, one load and one
 * prefetch a step; otherwise the same tile order, products and epilogue as the two-block loop below. */
AVX512_TARGET static void gemv_ternary_avx512_one_block(const uint8_t *w, const float *row_scale,
                                                        const int8_t *xq, int k_pad, float act_scale,
                                                        int32_t act_sum, float *out, int32_t *out_i32, int n,
                                                        int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    const size_t tile_bytes = (size_t)kb * 64;
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0c), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xc0);
    const size_t pf = (size_t)bk_table.gemv_prefetch;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int b = 0; b < kb; b++) {
            const int8_t *xb = xq + 16 * b;
            bk_prefetch_ahead(p + (size_t)b * 64, pf);
            __m512i x0 = _mm512_set1_epi32(load_i32(xb)), x1 = _mm512_set1_epi32(load_i32(xb + 4));
            __m512i x2 = _mm512_set1_epi32(load_i32(xb + 8)), x3 = _mm512_set1_epi32(load_i32(xb + 12));
            TERNARY_STEP_AVX512(a0, a1, a2, a3, p + (size_t)b * 64);
        }
        finish_tile_avx512(combine_scaled_avx512(a0, a1, a2, a3), act_sum, t * 16, n, row_scale, act_scale, out,
                           out_i32);
    }
}

/* One tile at a time, two blocks per iteration (8 accumulators), so the weights are read as a single
 * sequential stream: interleaving 4 tiles (4 streams 10 KB apart, more accumulator chains) read DRAM at
 * 17 GB/s on one Zen 4 core where this reads 26 GB/s (the hardware prefetchers follow one stream best).
 * Plus a software prefetch of every line bk_table.gemv_prefetch bytes ahead (kernels.h: +14% on Zen 5).
 * Intel cores take the one-block loop above (bk_table.gemv_one_block). */
AVX512_TARGET static void gemv_ternary_avx512(const uint8_t *w, const float *row_scale, const int8_t *xq,
                                                  int k_pad, float act_scale, int32_t act_sum, float *out,
                                                  int32_t *out_i32, int n, int tile_begin, int tile_end) {
    if (bk_table.gemv_one_block) {
        gemv_ternary_avx512_one_block(w, row_scale, xq, k_pad, act_scale, act_sum, out, out_i32, n, tile_begin,
                                      tile_end);
        return;
    }
    const int kb = k_pad / 16;
    const size_t tile_bytes = (size_t)kb * 64;
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0c), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xc0);
    const size_t pf = (size_t)bk_table.gemv_prefetch;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        __m512i z = _mm512_setzero_si512();
        __m512i a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
        for (int b = 0; b < kb; b += 2) { /* kb = K_pad/16 is a multiple of 4 */
            const int8_t *xb = xq + 16 * b;
            bk_prefetch_ahead(p + (size_t)b * 64, pf);
            bk_prefetch_ahead(p + (size_t)b * 64 + 64, pf);
            {
                __m512i x0 = _mm512_set1_epi32(load_i32(xb)), x1 = _mm512_set1_epi32(load_i32(xb + 4));
                __m512i x2 = _mm512_set1_epi32(load_i32(xb + 8)), x3 = _mm512_set1_epi32(load_i32(xb + 12));
                TERNARY_STEP_AVX512(a0, a1, a2, a3, p + (size_t)b * 64);
            }
            {
                __m512i x0 = _mm512_set1_epi32(load_i32(xb + 16)), x1 = _mm512_set1_epi32(load_i32(xb + 20));
                __m512i x2 = _mm512_set1_epi32(load_i32(xb + 24)), x3 = _mm512_set1_epi32(load_i32(xb + 28));
                TERNARY_STEP_AVX512(b0, b1, b2, b3, p + (size_t)b * 64 + 64);
            }
        }
        finish_tile_avx512(combine_scaled_avx512(_mm512_add_epi32(a0, b0), _mm512_add_epi32(a1, b1),
                                                 _mm512_add_epi32(a2, b2), _mm512_add_epi32(a3, b3)),
                           act_sum, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}

/* ---------------- AVX2 (pmaddubsw, int16 partial sums) ---------------- */
/* TERNARY_HALF_AVX2 (x86_common.h): one 32-byte half block into a pair of int16 accumulators. */

/* The AVX2 body prefetches too (bk_table.gemv_prefetch, kernels.h): the hardware prefetchers alone left one Zen
 * core's GEMV at ~60% of its streaming rate (compute and DRAM latency did not overlap). A fixed 2 KB first
 * (Zen 4, 13824 x 2560 out of cache: mean 11.5 -> 15.0 GB/s); on Zen 5, one thread: none 71%, 2 KB 74%,
 * 4 KB 82%, 8 KB 87% of the stream rate (2026-11-28): the runtime setting now, 8 KB by default on this path. */

/* One tile at a time: a single sequential read stream (see the AVX-512 body). */
AVX2_TARGET static void gemv_ternary_avx2(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                                          float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                                          int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    const size_t tile_bytes = (size_t)kb * 64;
    const __m256i m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12), ones = _mm256_set1_epi16(1);
    const size_t pf = (size_t)bk_table.gemv_prefetch;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0;
        for (int b0 = 0; b0 < kb; b0 += AVX2_FLUSH_BLOCKS) {
            int b1 = b0 + AVX2_FLUSH_BLOCKS < kb ? b0 + AVX2_FLUSH_BLOCKS : kb;
            __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0;
            for (int b = b0; b < b1; b++) {
                const int8_t *xb = xq + 16 * b;
                __m256i x0 = _mm256_set1_epi32(load_i32(xb)), x1 = _mm256_set1_epi32(load_i32(xb + 4));
                __m256i x2 = _mm256_set1_epi32(load_i32(xb + 8)), x3 = _mm256_set1_epi32(load_i32(xb + 12));
                bk_prefetch_ahead(p + (size_t)b * 64, pf);
                TERNARY_HALF_AVX2(l0, l1, p + (size_t)b * 64);
                TERNARY_HALF_AVX2(h0, h1, p + (size_t)b * 64 + 32);
            }
            lo0 = _mm256_add_epi32(lo0, TERNARY_WIDEN_AVX2(l0, l1, ones));
            hi0 = _mm256_add_epi32(hi0, TERNARY_WIDEN_AVX2(h0, h1, ones));
        }
        finish_half_avx2(lo0, act_sum, t * 16, n, row_scale, act_scale, out, out_i32);
        finish_half_avx2(hi0, act_sum, t * 16 + 8, n, row_scale, act_scale, out, out_i32);
    }
}
#endif

#if defined(__aarch64__)
/* ---------------- NEON (sdot: codes {0,1,2} are valid s8) ---------------- */
__attribute__((target("arch=armv8.2-a+dotprod")))
static void gemv_ternary_neon(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                              float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                              int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * kb * 64;
        int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int b = 0; b < kb; b++) {
            int8x16_t xv = vld1q_s8(xq + 16 * b);
            for (int q = 0; q < 4; q++) { /* 16 bytes = rows 4q..4q+3 */
                acc[q] = ternary_sdot_neon(acc[q], vld1q_u8(p + (size_t)b * 64 + 16 * q), xv, m3);
            }
        }
        int32_t dots[16];
        for (int q = 0; q < 4; q++) vst1q_s32(dots + 4 * q, vsubq_s32(acc[q], vdupq_n_s32(act_sum)));
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}
#endif

#if defined(__aarch64__)
/* ---------------- plain NEON (no sdot: Cortex-A72 class, the Raspberry Pi 4) ----------------
 * The same products by widening multiply-accumulate: plane c of 4 rows x 4 bytes times activation dword c
 * repeated per row (smlal into int16 lanes, one lane per row and byte), folded into int32 (sadalp) every
 * 16 blocks: a lane gains at most 4 * 2 * 128 per block, 16 blocks < 2^15. Exact integers: the scalar dots. */
#define TERNARY_NEON_FOLD 16
static void gemv_ternary_neon_plain(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                                    float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                                    int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * kb * 64;
        int32x4_t acc[8]; /* vector q, half h: rows 4q + 2h, 4q + 2h + 1 (byte pairs) */
        for (int v = 0; v < 8; v++) acc[v] = vdupq_n_s32(0);
        for (int b0 = 0; b0 < kb; b0 += TERNARY_NEON_FOLD) {
            const int b1 = b0 + TERNARY_NEON_FOLD < kb ? b0 + TERNARY_NEON_FOLD : kb;
            int16x8_t s[8];
            for (int v = 0; v < 8; v++) s[v] = vdupq_n_s16(0);
            for (int b = b0; b < b1; b++) {
                int8x8_t x[4];
                ternary_dwords_neon(xq + 16 * b, x);
                for (int q = 0; q < 4; q++)
                    ternary_smlal_neon(&s[2 * q], &s[2 * q + 1], vld1q_u8(p + (size_t)b * 64 + 16 * q), x, m3);
            }
            for (int v = 0; v < 8; v++) acc[v] = vpadalq_s16(acc[v], s[v]);
        }
        int32_t dots[16];
        for (int q = 0; q < 4; q++) /* [r0 j01, r0 j23, r1 .., r1 ..] [r2 .., r3 ..] -> [r0, r1, r2, r3] */
            vst1q_s32(dots + 4 * q, vsubq_s32(vpaddq_s32(acc[2 * q], acc[2 * q + 1]), vdupq_n_s32(act_sum)));
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}
#endif

const bk_gemv_ternary_fn bk_gemv_ternary_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemv_ternary_scalar) BK_X86_BODY(AVX2, gemv_ternary_avx2) BK_X86_BODY(AVX512, gemv_ternary_avx512)
    BK_ARM_BODY(NEON, gemv_ternary_neon_plain) BK_ARM_BODY(DOTPROD, gemv_ternary_neon)
};

#define GEMV_TERNARY_ARGS(X) X(const uint8_t *, w) X(const float *, row_scale) X(const int8_t *, xq) X(int, k_pad) \
    X(float, act_scale) X(int32_t, act_sum) X(float *, out) X(int32_t *, out_i32) X(int, n)
BK_TILE_JOB(gemv_ternary_job, bk_gemv_ternary_fn, GEMV_TERNARY_ARGS)

void bk_gemv_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                     int32_t act_sum, float *out, int32_t *out_i32, int n) {
    /* tiny matrices: a thread hand-off costs more than the work */
    BK_RUN_TILE_JOB(gemv_ternary_job, bk_table.gemv_ternary, GEMV_TERNARY_ARGS, n, k_pad, 16 * 4096);
}
