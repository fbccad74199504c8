/* Ternary GEMM (M tokens, prefill) on the tile16 layout:
 *   out[m, n] = ((float)(sum_k u[n,k] * xq[m,k] - act_sum[m]) / act_scale[m]) * row_scale[n]
 * Prefill is compute-bound, so the unpacked codes of a block (4 shift+and per 64 bytes) are reused for a
 * group of tokens held in registers: AVX-512 keeps 2 tiles x 8 tokens = 16 accumulators + 8 unpacked
 * operands in the 32 zmm registers, and each activation broadcast feeds both tiles (about 97% of the
 * vpdpbusd peak on one Zen 4 core, M >= 32). Loop order: see gemm_ternary_avx512 and gemm_chunk_tiles.
 */
#include "kernels.h"
#include "tiles.h"

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include "ternary_neon.h"
#endif

/* The scalar reference: the GEMV reference body once per token. */
static void gemm_ternary_scalar(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32,
                                int n, int tile_begin, int tile_end) {
    bk_gemv_ternary_fn gemv = bk_gemv_ternary_bodies[BK_ISA_SCALAR];
    for (int i = 0; i < m; i++)
        gemv(w, row_scale, xq + (size_t)i * k_pad, k_pad, act_scale[i], act_sum[i], out ? out + (size_t)i * n : NULL,
             out_i32 ? out_i32 + (size_t)i * n : NULL, n, tile_begin, tile_end);
}

#if defined(__x86_64__)
/* ---------------- AVX-512 VNNI ---------------- */
/* TG tiles (1..2) starting at tile t, MG tokens (1..8) starting at m0; TG and MG are constants after
 * inlining, so the accumulator arrays live in registers. pf0 / pf1 (or NULL): tiles to prefetch into L2 beside
 * the pass, the line at the same offset per line read. */
AVX512_TARGET __attribute__((always_inline)) static inline void gemm_group_avx512(
    const uint8_t *w, size_t tile_bytes, int t, const int TG, const int8_t *xq, int m0, const int MG, int k_pad,
    const float *row_scale, const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n,
    const uint8_t *pf0, const uint8_t *pf1) {
    const int kb = k_pad / 16;
    const __m512i m3 = _mm512_set1_epi8(3);
    __m512i acc[2][8];
#pragma GCC unroll 2
    for (int j = 0; j < TG; j++)
#pragma GCC unroll 8
        for (int i = 0; i < MG; i++) acc[j][i] = _mm512_setzero_si512();
    const uint8_t *p = w + (size_t)t * tile_bytes;
    const int8_t *x = xq + (size_t)m0 * k_pad;
    for (int b = 0; b < kb; b++) {
        if (pf0) __builtin_prefetch(pf0 + (size_t)b * 64, 0, 2);
        if (pf1) __builtin_prefetch(pf1 + (size_t)b * 64, 0, 2);
        __m512i u[2][4];
#pragma GCC unroll 2
        for (int j = 0; j < TG; j++) {
            __m512i v = _mm512_loadu_si512(p + j * tile_bytes + (size_t)b * 64);
            u[j][0] = _mm512_and_si512(v, m3);
            u[j][1] = _mm512_and_si512(_mm512_srli_epi16(v, 2), m3);
            u[j][2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m3);
            u[j][3] = _mm512_and_si512(_mm512_srli_epi16(v, 6), m3);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MG; i++) {
            const int8_t *xb = x + (size_t)i * k_pad + 16 * b;
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                __m512i xs = _mm512_set1_epi32(load_i32(xb + 4 * s));
#pragma GCC unroll 2
                for (int j = 0; j < TG; j++) acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], u[j][s], xs);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MG; i++) {
        size_t off = (size_t)(m0 + i) * n;
#pragma GCC unroll 2
        for (int j = 0; j < TG; j++)
            finish_tile_avx512(acc[j][i], act_sum[m0 + i], (t + j) * 16, n, row_scale, act_scale[m0 + i],
                               out ? out + off : NULL, out_i32 ? out_i32 + off : NULL);
    }
}

/* The AVX2 body's loop order: a chunk of tiles small enough to stay in L2 (~256 KB of weights), then token
 * groups, then tiles: each group's activations stay in L1 while the chunk's weights stream from L2, and every
 * weight byte comes from DRAM once per call. That body is bound by its arithmetic at every M (~300 GMAC/s on 2
 * threads): reading each chunk at streaming speed first lost 5-18% there at M = 4..16, so it does not. */
static inline int gemm_chunk_tiles(size_t tile_bytes) {
    size_t c = ((size_t)256 << 10) / tile_bytes;
    return c < 2 ? 2 : (int)(c & ~(size_t)1);
}

/* One token group of MG tokens from m0 over the chunk's tiles [tc, tce) in pairs, also prefetching the next
 * chunk's tile at the same offset (tiles below nce) when pf. One function per MG (not inlined into the caller:
 * with the eight sizes in one body, GCC's registers for the 8-token loop got worse, 13824 x 2560 at M = 8 ran
 * 10-15% slower). */
#define GEMM_PASS(MG)                                                                                       \
    AVX512_TARGET __attribute__((noinline)) static void gemm_pass##MG##_avx512(                              \
        const uint8_t *w, size_t tile_bytes, int tc, int tce, int nce, int pf, const int8_t *xq, int m0,      \
        int k_pad, const float *row_scale, const float *act_scale, const int32_t *act_sum, float *out,       \
        int32_t *out_i32, int n) {                                                                          \
        for (int t = tc; t < tce; t += 2) {                                                                 \
            const int u = t + (tce - tc);                                                                   \
            const uint8_t *p0 = pf && u < nce ? w + (size_t)u * tile_bytes : NULL;                          \
            const uint8_t *p1 = pf && u + 1 < nce ? w + (size_t)(u + 1) * tile_bytes : NULL;                \
            if (tce - t >= 2)                                                                               \
                gemm_group_avx512(w, tile_bytes, t, 2, xq, m0, MG, k_pad, row_scale, act_scale, act_sum, out, \
                                  out_i32, n, p0, p1);                                                      \
            else                                                                                            \
                gemm_group_avx512(w, tile_bytes, t, 1, xq, m0, MG, k_pad, row_scale, act_scale, act_sum, out, \
                                  out_i32, n, p0, p1);                                                      \
        }                                                                                                   \
    }
GEMM_PASS(1)
GEMM_PASS(2)
GEMM_PASS(3)
GEMM_PASS(4)
GEMM_PASS(5)
GEMM_PASS(6)
GEMM_PASS(7)
GEMM_PASS(8)
#undef GEMM_PASS
typedef void (*gemm_pass_fn)(const uint8_t *w, size_t tile_bytes, int tc, int tce, int nce, int pf, const int8_t *xq,
                             int m0, int k_pad, const float *row_scale, const float *act_scale, const int32_t *act_sum,
                             float *out, int32_t *out_i32, int n);
static const gemm_pass_fn gemm_passes[9] = {NULL,                gemm_pass1_avx512, gemm_pass2_avx512,
                                            gemm_pass3_avx512,   gemm_pass4_avx512, gemm_pass5_avx512,
                                            gemm_pass6_avx512,   gemm_pass7_avx512, gemm_pass8_avx512};

/* Loop order: a chunk of tiles, then token groups of 8 (the last 1-7 tokens in one group: one unpack of the
 * codes for all of them, where 4 + 2 + 1 unpacked them three times: M = 7 4.2-4.4 -> 3.1-3.2 GEMVs' time),
 * then tile pairs: each group's activations (8 x K_pad bytes) stay in L1 while the chunk's weights come from
 * L1 / L2, and every weight byte comes from DRAM once per call. The first group over a chunk, 64 vpdpbusd per
 * 128 weight bytes, keeps too few lines in flight to read DRAM fast itself (one Zen 5 core, 13824 x 2560: 291
 * GMAC/s at M = 8, 525 with the weights in cache), so the weights arrive ahead of it: the range's first chunk is
 * read at streaming speed (bk_stream_warm), and every later chunk is prefetched into L2 by the first group over
 * the chunk before it, which overlaps the read with the arithmetic where warming every chunk first (the loop
 * until 2026-11-28) put it in front of it.
 * Chunks: at M <= 32 one pair of tiles (the threads' ranges hold ~8-30 tiles, and only their first chunk is read
 * before the arithmetic), ~256 KB above (tiles outer, tokens inner lost 2-8% on 13824 x 2560 at M = 128: the
 * 8-token group and the tile pair evict each other from L1). 2 threads, weights from DRAM, GOP/s at M = 8 / 16,
 * warmed chunks against prefetched pairs, alternating builds: 13824 x 2560 1,406 -> 1,881 / 1,697 -> 1,885;
 * 3840 x 2560 1,386 -> 1,630 / 1,663 -> 1,822; 2560 x 6912 1,395 -> 1,694 / 1,696 -> 1,861 (one thread, M = 16:
 * 899 -> 1,036, the rate of M = 128). Chunks of 6 tiles at M = 16 left 3840 x 2560 5% behind pairs. */
AVX512_TARGET static void gemm_ternary_avx512(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                              int k_pad, const float *act_scale, const int32_t *act_sum,
                                              float *out, int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const size_t tile_bytes = (size_t)(k_pad / 16) * 64;
    const int chunk = m <= 32 ? 2 : gemm_chunk_tiles(tile_bytes);
    for (int tc = tile_begin; tc < tile_end; tc += chunk) {
        const int tce = tc + chunk < tile_end ? tc + chunk : tile_end;
        const int nce = tce + chunk < tile_end ? tce + chunk : tile_end;
        if (tc == tile_begin) bk_stream_warm(w + (size_t)tc * tile_bytes, (size_t)(tce - tc) * tile_bytes);
        for (int m0 = 0, pf = 1; m0 < m; m0 += 8, pf = 0) {
            const int mg = m - m0 < 8 ? m - m0 : 8;
            gemm_passes[mg](w, tile_bytes, tc, tce, nce, pf, xq, m0, k_pad, row_scale, act_scale, act_sum, out,
                            out_i32, n);
        }
    }
}

/* ---------------- AVX2 (pmaddubsw into int16, widened every 16 blocks) ---------------- */
/* Plane by plane: for code plane s (columns 4s..4s+3 of each row) the two halves of a block are unpacked and
 * every token's activation dword is broadcast once and feeds both halves. Live: 2 x MG int16 accumulators, the
 * two unpacked halves, one broadcast and a product: 13 of the 16 ymm registers at MG = 4. (Unpacking all four
 * planes of a half first, then 4 tokens x 2 halves, needed ~20: GCC kept the 16 broadcasts on the stack and
 * the loop took 33.5 cycles per block of 4 tokens in llvm-mca's Zen 3 model (~31 int8 MACs per cycle), bound
 * by the stack traffic; this one 25, bound by the four vector pipes: 1.3-1.4x in GMAC/s measured, M >= 4.)
 * An int16 lane gains at most 4 planes x 2 products x 2 x 127 = 2032 per block, or -2048 at activations of -128:
 * 16 blocks stay within [-2^15, 2^15 - 1] (test_ternary_extremes_do_not_overflow), then madd with ones widens
 * into int32. */
AVX2_TARGET __attribute__((always_inline)) static inline void gemm_group_avx2(
    const uint8_t *w, size_t tile_bytes, int t, const int8_t *xq, int m0, const int MG, int k_pad,
    const float *row_scale, const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n) {
    const int kb = k_pad / 16;
    const __m256i m3 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i acc32[2][4];
#pragma GCC unroll 4
    for (int i = 0; i < MG; i++) acc32[0][i] = acc32[1][i] = _mm256_setzero_si256();
    const uint8_t *p = w + (size_t)t * tile_bytes;
    const int8_t *x = xq + (size_t)m0 * k_pad;
    for (int b0 = 0; b0 < kb; b0 += 16) {
        int b1 = b0 + 16 < kb ? b0 + 16 : kb;
        __m256i acc16[2][4];
#pragma GCC unroll 4
        for (int i = 0; i < MG; i++) acc16[0][i] = acc16[1][i] = _mm256_setzero_si256();
        for (int b = b0; b < b1; b++) {
            const __m256i *blk = (const __m256i *)(p + (size_t)b * 64);
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                __m256i v0 = _mm256_loadu_si256(blk), v1 = _mm256_loadu_si256(blk + 1);
                __m256i u0 = _mm256_and_si256(_mm256_srli_epi16(v0, 2 * s), m3);
                __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(v1, 2 * s), m3);
#pragma GCC unroll 4
                for (int i = 0; i < MG; i++) {
                    __m256i xs = _mm256_set1_epi32(load_i32(x + (size_t)i * k_pad + 16 * b + 4 * s));
                    acc16[0][i] = addw_acc256(acc16[0][i], _mm256_maddubs_epi16(u0, xs));
                    acc16[1][i] = addw_acc256(acc16[1][i], _mm256_maddubs_epi16(u1, xs));
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < MG; i++) {
            acc32[0][i] = _mm256_add_epi32(acc32[0][i], _mm256_madd_epi16(acc16[0][i], ones));
            acc32[1][i] = _mm256_add_epi32(acc32[1][i], _mm256_madd_epi16(acc16[1][i], ones));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MG; i++) {
        size_t off = (size_t)(m0 + i) * n;
        float *o = out ? out + off : NULL;
        int32_t *oi = out_i32 ? out_i32 + off : NULL;
        finish_half_avx2(acc32[0][i], act_sum[m0 + i], t * 16, n, row_scale, act_scale[m0 + i], o, oi);
        finish_half_avx2(acc32[1][i], act_sum[m0 + i], t * 16 + 8, n, row_scale, act_scale[m0 + i], o, oi);
    }
}

AVX2_TARGET static void gemm_ternary_avx2(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                          int k_pad, const float *act_scale, const int32_t *act_sum, float *out,
                                          int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const size_t tile_bytes = (size_t)(k_pad / 16) * 64;
    const int chunk = gemm_chunk_tiles(tile_bytes);
    for (int tc = tile_begin; tc < tile_end; tc += chunk) {
        int tce = tc + chunk < tile_end ? tc + chunk : tile_end;
        int m0 = 0;
        for (; m0 + 4 <= m; m0 += 4)
            for (int t = tc; t < tce; t++)
                gemm_group_avx2(w, tile_bytes, t, xq, m0, 4, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
        if (m0 + 2 <= m) {
            for (int t = tc; t < tce; t++)
                gemm_group_avx2(w, tile_bytes, t, xq, m0, 2, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
            m0 += 2;
        }
        if (m0 < m)
            for (int t = tc; t < tce; t++)
                gemm_group_avx2(w, tile_bytes, t, xq, m0, 1, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
    }
}
#endif

#if defined(__aarch64__)
/* ---------------- plain NEON: that path's GEMV body per token, tile by tile (the tile stays in cache for the
 * other tokens); the same dots by construction ---------------- */
static void gemm_ternary_neon_plain(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                                    const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32,
                                    int n, int tile_begin, int tile_end) {
    bk_gemv_ternary_fn gemv = bk_gemv_ternary_bodies[BK_ISA_NEON];
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++)
            gemv(w, row_scale, xq + (size_t)i * k_pad, k_pad, act_scale[i], act_sum[i],
                 out ? out + (size_t)i * n : NULL, out_i32 ? out_i32 + (size_t)i * n : NULL, n, t, t + 1);
}

/* ---------------- NEON (sdot): a block's unpacked codes (16 vectors) shared by 2 tokens ----------------
 * Per 64 weight bytes and 2 tokens: 4 loads + 28 unpack + 2 x (1 + 16 sdot), against 2 x 49 when each token
 * unpacked the block itself (instructions per weight byte and token under qemu, 512 x 2560, 8 tokens: 0.743 -> 0.557;
 * AVX2 0.500). */
__attribute__((target("arch=armv8.2-a+dotprod"))) __attribute__((always_inline)) static inline void
gemm_group_dot(const uint8_t *p, int kb, const int8_t *x, int k_pad, const int TT, int32x4_t (*acc)[4]) {
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int i = 0; i < TT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = vdupq_n_s32(0);
    for (int b = 0; b < kb; b++) {
        int8x16_t u[4][4];
        for (int q = 0; q < 4; q++) {
            const uint8x16_t v = vld1q_u8(p + (size_t)b * 64 + 16 * q);
            u[q][0] = vreinterpretq_s8_u8(vandq_u8(v, m3));
            u[q][1] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 2), m3));
            u[q][2] = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(v, 4), m3));
            u[q][3] = vreinterpretq_s8_u8(vshrq_n_u8(v, 6));
        }
        for (int i = 0; i < TT; i++) {
            const int8x16_t xv = vld1q_s8(x + (size_t)i * k_pad + 16 * b);
            for (int q = 0; q < 4; q++) {
                acc[i][q] = vdotq_laneq_s32(acc[i][q], u[q][0], xv, 0);
                acc[i][q] = vdotq_laneq_s32(acc[i][q], u[q][1], xv, 1);
                acc[i][q] = vdotq_laneq_s32(acc[i][q], u[q][2], xv, 2);
                acc[i][q] = vdotq_laneq_s32(acc[i][q], u[q][3], xv, 3);
            }
        }
    }
}

__attribute__((target("arch=armv8.2-a+dotprod")))
static void gemm_ternary_neon(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                              const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n,
                              int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * kb * 64; /* the tile stays in cache for every token */
        for (int i = 0; i < m; i += 2) {
            const int g = m - i >= 2 ? 2 : 1;
            int32x4_t acc[2][4];
            if (g == 2) gemm_group_dot(p, kb, xq + (size_t)i * k_pad, k_pad, 2, acc);
            else gemm_group_dot(p, kb, xq + (size_t)i * k_pad, k_pad, 1, acc);
            for (int j = 0; j < g; j++) {
                int32_t dots[16];
                for (int q = 0; q < 4; q++) vst1q_s32(dots + 4 * q, vsubq_s32(acc[j][q], vdupq_n_s32(act_sum[i + j])));
                bk_store_tile(dots, t * 16, n, row_scale, act_scale[i + j], out ? out + (size_t)(i + j) * n : NULL,
                              out_i32 ? out_i32 + (size_t)(i + j) * n : NULL);
            }
        }
    }
}

/* ---------------- i8mm (smmla): 16 rows x 4 tokens per pass over a tile ----------------
 * smmla multiplies a 2 x 8 int8 matrix by the transpose of another into a 2 x 2 int32 block: 2 weight rows x
 * 2 tokens x 8 k per instruction, twice sdot's 16 multiplies. The tile16 codes give it its operand without a
 * table: after the usual shift+and, a 32-bit lane holds 4 codes (4 consecutive k) of one row, so zip1/zip2 of
 * the unpacks for k 0-3 and k 4-7 are two rows x 8 k each; the tokens' 8-byte halves zip into the other
 * operand. Per 64 weight bytes and 4 tokens: 32 smmla + 16 zip + 28 unpack (+ 8 for the tokens), against
 * 4 x 16 sdot + 4 x 28 unpack on the dotprod body. Integer sums: the same dots, so the same floats. */
__attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) __attribute__((always_inline)) static inline void
gemm_group_i8mm(const uint8_t *p, int kb, const int8_t *x, int k_pad, const int TP, int32_t (*dots)[16]) {
    const uint8x16_t m3 = vdupq_n_u8(3);
    int32x4_t acc[8][2]; /* [row pair: rows 2r, 2r+1][token pair], lanes (row a, tok 0) (row a, tok 1) (row b, ..) */
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = vdupq_n_s32(0);
    for (int b = 0; b < kb; b++) {
        int8x16_t lo[2], hi[2]; /* tokens 2P, 2P+1: k 0-7 and k 8-15 of this block */
        for (int P = 0; P < TP; P++) {
            const int64x2_t x0 = vreinterpretq_s64_s8(vld1q_s8(x + (size_t)(2 * P) * k_pad + 16 * b));
            const int64x2_t x1 = vreinterpretq_s64_s8(vld1q_s8(x + (size_t)(2 * P + 1) * k_pad + 16 * b));
            lo[P] = vreinterpretq_s8_s64(vzip1q_s64(x0, x1)), hi[P] = vreinterpretq_s8_s64(vzip2q_s64(x0, x1));
        }
        for (int q = 0; q < 4; q++) { /* rows 4q .. 4q+3 */
            const uint8x16_t v = vld1q_u8(p + (size_t)b * 64 + 16 * q);
            const int32x4_t u0 = vreinterpretq_s32_u8(vandq_u8(v, m3));
            const int32x4_t u1 = vreinterpretq_s32_u8(vandq_u8(vshrq_n_u8(v, 2), m3));
            const int32x4_t u2 = vreinterpretq_s32_u8(vandq_u8(vshrq_n_u8(v, 4), m3));
            const int32x4_t u3 = vreinterpretq_s32_u8(vshrq_n_u8(v, 6));
            const int8x16_t a01_lo = vreinterpretq_s8_s32(vzip1q_s32(u0, u1)), a23_lo = vreinterpretq_s8_s32(vzip2q_s32(u0, u1));
            const int8x16_t a01_hi = vreinterpretq_s8_s32(vzip1q_s32(u2, u3)), a23_hi = vreinterpretq_s8_s32(vzip2q_s32(u2, u3));
            for (int P = 0; P < TP; P++) {
                acc[2 * q][P] = vmmlaq_s32(vmmlaq_s32(acc[2 * q][P], a01_lo, lo[P]), a01_hi, hi[P]);
                acc[2 * q + 1][P] = vmmlaq_s32(vmmlaq_s32(acc[2 * q + 1][P], a23_lo, lo[P]), a23_hi, hi[P]);
            }
        }
    }
    for (int P = 0; P < TP; P++)
        for (int q = 0; q < 4; q++) { /* even lanes: token 2P, odd lanes: token 2P+1 */
            vst1q_s32(dots[2 * P] + 4 * q, vuzp1q_s32(acc[2 * q][P], acc[2 * q + 1][P]));
            vst1q_s32(dots[2 * P + 1] + 4 * q, vuzp2q_s32(acc[2 * q][P], acc[2 * q + 1][P]));
        }
}

__attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
static void gemm_ternary_i8mm(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                              const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n,
                              int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * kb * 64; /* one tile (k_pad * 4 bytes) stays in cache for every token */
        int i = 0;
        for (; i + 2 <= m; i += (m - i >= 4 ? 4 : 2)) {
            int32_t dots[4][16];
            const int g = m - i >= 4 ? 4 : 2;
            if (g == 4) gemm_group_i8mm(p, kb, xq + (size_t)i * k_pad, k_pad, 2, dots);
            else gemm_group_i8mm(p, kb, xq + (size_t)i * k_pad, k_pad, 1, dots);
            for (int j = 0; j < g; j++) {
                for (int r = 0; r < 16; r++) dots[j][r] -= act_sum[i + j];
                bk_store_tile(dots[j], t * 16, n, row_scale, act_scale[i + j], out ? out + (size_t)(i + j) * n : NULL,
                              out_i32 ? out_i32 + (size_t)(i + j) * n : NULL);
            }
        }
        if (i < m) /* an odd last token: the sdot body */
            gemm_ternary_neon(w, row_scale, xq + (size_t)i * k_pad, 1, k_pad, act_scale + i, act_sum + i,
                              out ? out + (size_t)i * n : NULL, out_i32 ? out_i32 + (size_t)i * n : NULL, n, t, t + 1);
    }
}
#endif

const bk_gemm_ternary_fn bk_gemm_ternary_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemm_ternary_scalar) BK_X86_BODY(AVX2, gemm_ternary_avx2) BK_X86_BODY(AVX512, gemm_ternary_avx512)
    BK_ARM_BODY(NEON, gemm_ternary_neon_plain) BK_ARM_BODY(DOTPROD, gemm_ternary_neon)
    BK_ARM_BODY(I8MM, gemm_ternary_i8mm)
};

#define GEMM_TERNARY_ARGS(X) X(const uint8_t *, w) X(const float *, row_scale) X(const int8_t *, xq) X(int, m) \
    X(int, k_pad) X(const float *, act_scale) X(const int32_t *, act_sum) X(float *, out) X(int32_t *, out_i32) \
    X(int, n)
BK_TILE_JOB(gemm_ternary_job, bk_gemm_ternary_fn, GEMM_TERNARY_ARGS)

void bk_gemm_ternary(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                     const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n) {
    if (bk_gemm_ternary_tiles(w, row_scale, xq, m, k_pad, act_scale, act_sum, out, out_i32, n)) return;
    BK_RUN_TILE_JOB(gemm_ternary_job, bk_table.gemm_ternary, GEMM_TERNARY_ARGS, n, (size_t)k_pad * m, 16 * 4096);
}
