/* Ternary weights in base 3 ("tile16b3", simd/layout.py): 1.6 bits per weight instead of tile16's 2.
 *
 * A tile (16 rows) is ns = kb / 5 superblocks of 256 bytes, each standing for 5 tile16 blocks (80 columns),
 * then the kb % 5 remaining blocks in the tile16 format. Superblock plane p (64 bytes, byte r*4 + j) holds for
 * row r the codes of columns 16*(5s+i) + 4p + j, i = 0..4, as q = ceil(v * 256 / 243), v = sum u_i 3^(4-i).
 *
 * No unpacking in the decode GEMV (AVX-512 VNNI): with m_0 = q and m_{i+1} = 3 m_i mod 256 (two byte adds),
 * u_i = (3 m_i - m_{i+1}) / 256 exactly, so per plane and trit two vpdpbusd give P_i += m_i . x_i and
 * Q_i += m_{i+1} . x_i, and the codes' dot is sum_i (3 P_i - Q_i) / 256 (every partial sum is a multiple of
 * 256). 10 vpdpbusd and 10 vpaddb per 64 bytes (320 weights) against tile16's 4 + 4 per 256 weights: ALU-bound
 * at ~22 GB/s of these bytes per Zen 4 core, so it pays where a core's share of the memory bandwidth is below
 * that (bench/probes/base3_unpack.c, README "Denser ternary layout").
 *
 * Every other path, and the multi-row and GEMM kernels on every path, decode a few tiles into tile16 (AVX-512,
 * AVX2 and NEON decoders: u = (m >= 86) + (m >= 171); scalar elsewhere) in a
 * per-thread scratch buffer and run the tile16 body of that path on it: identical integer dots by construction
 * (the tests demand equality with tile16 on every path). The drivers allocate the scratch (-1: no memory).
 */
#include "b3.h"

#include <stdlib.h>

#include "kernels.h"
#include "rows.h"

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define B3_GROUP_TILES 4 /* tiles decoded at a time for the multi-row / GEMM bodies (= bk_run_tiles' unit) */
#define B3_FLUSH_SUPERS 256 /* superblocks between folds of P, Q into the tile's dot (int32 bound, see below) */

size_t bk_b3_tile_bytes(int k_pad) {
    int kb = k_pad / 16;
    return (size_t)(kb / B3_SUPER_BLOCKS) * B3_SUPER_BYTES + (size_t)(kb % B3_SUPER_BLOCKS) * 64;
}

/* ---------------- decode one tile into tile16 ---------------- */
static void b3_decode_tile_scalar(const uint8_t *src, int kb, uint8_t *dst) {
    int ns = kb / B3_SUPER_BLOCKS;
    for (int s = 0; s < ns; s++) {
        uint8_t *d = dst + (size_t)s * B3_SUPER_BLOCKS * 64;
        memset(d, 0, B3_SUPER_BLOCKS * 64);
        for (int p = 0; p < 4; p++)
            for (int e = 0; e < 64; e++) {
                unsigned m = src[(size_t)s * B3_SUPER_BYTES + p * 64 + e];
                for (int i = 0; i < B3_SUPER_BLOCKS; i++) {
                    unsigned m3 = 3 * m;   /* u_i = (3 m - (3 m mod 256)) / 256 */
                    d[i * 64 + e] |= (uint8_t)((m3 >> 8) << (2 * p));
                    m = m3 & 255;
                }
            }
    }
    memcpy(dst + (size_t)ns * B3_SUPER_BLOCKS * 64, src + (size_t)ns * B3_SUPER_BYTES,
           (size_t)(kb % B3_SUPER_BLOCKS) * 64);
}

#if defined(__x86_64__)
/* u = floor(3m / 256) is (m >= 86) + (m >= 171): two unsigned compares, placed at bits 2p by a masked move. */
AVX512_TARGET static void b3_decode_tile_avx512(const uint8_t *src, int kb, uint8_t *dst) {
    int ns = kb / B3_SUPER_BLOCKS;
    const __m512i lo = _mm512_set1_epi8(86), hi = _mm512_set1_epi8((char)171);
    for (int s = 0; s < ns; s++) {
        __m512i acc[B3_SUPER_BLOCKS];
        for (int i = 0; i < B3_SUPER_BLOCKS; i++) acc[i] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i bit = _mm512_set1_epi8((char)(1 << (2 * p)));
            __m512i m = _mm512_loadu_si512(src + (size_t)s * B3_SUPER_BYTES + p * 64);
            for (int i = 0; i < B3_SUPER_BLOCKS; i++) {
                __mmask64 k1 = _mm512_cmpge_epu8_mask(m, lo), k2 = _mm512_cmpge_epu8_mask(m, hi);
                acc[i] = _mm512_add_epi8(acc[i], _mm512_add_epi8(_mm512_maskz_mov_epi8(k1, bit),
                                                                 _mm512_maskz_mov_epi8(k2, bit)));
                m = _mm512_add_epi8(_mm512_add_epi8(m, m), m);
            }
        }
        for (int i = 0; i < B3_SUPER_BLOCKS; i++)
            _mm512_storeu_si512(dst + ((size_t)s * B3_SUPER_BLOCKS + i) * 64, acc[i]);
    }
    memcpy(dst + (size_t)ns * B3_SUPER_BLOCKS * 64, src + (size_t)ns * B3_SUPER_BYTES,
           (size_t)(kb % B3_SUPER_BLOCKS) * 64);
}
#endif

#if defined(__x86_64__)
/* The same rule with AVX2 (no unsigned compare): (m >= 86) is (m -sat 85) != 0, (m >= 171) is (m -sat 170) != 0. */
AVX2_TARGET static void b3_decode_tile_avx2(const uint8_t *src, int kb, uint8_t *dst) {
    int ns = kb / B3_SUPER_BLOCKS;
    const __m256i c85 = _mm256_set1_epi8(85), c170 = _mm256_set1_epi8((char)170), z = _mm256_setzero_si256();
    for (int s = 0; s < ns; s++)
        for (int h = 0; h < 2; h++) {   /* 32-byte halves: rows 0-7, 8-15 */
            __m256i acc[B3_SUPER_BLOCKS];
            for (int i = 0; i < B3_SUPER_BLOCKS; i++) acc[i] = z;
            for (int p = 0; p < 4; p++) {
                const __m256i bit = _mm256_set1_epi8((char)(1 << (2 * p)));
                __m256i m = _mm256_loadu_si256((const __m256i *)(src + (size_t)s * B3_SUPER_BYTES + p * 64 + h * 32));
                for (int i = 0; i < B3_SUPER_BLOCKS; i++) {
                    __m256i b1 = _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_subs_epu8(m, c85), z), bit);
                    __m256i b2 = _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_subs_epu8(m, c170), z), bit);
                    acc[i] = _mm256_add_epi8(acc[i], _mm256_add_epi8(b1, b2));
                    m = _mm256_add_epi8(_mm256_add_epi8(m, m), m);
                }
            }
            for (int i = 0; i < B3_SUPER_BLOCKS; i++)
                _mm256_storeu_si256((__m256i *)(dst + ((size_t)s * B3_SUPER_BLOCKS + i) * 64 + h * 32), acc[i]);
        }
    memcpy(dst + (size_t)ns * B3_SUPER_BLOCKS * 64, src + (size_t)ns * B3_SUPER_BYTES,
           (size_t)(kb % B3_SUPER_BLOCKS) * 64);
}
#endif

#if defined(__aarch64__)
/* The same rule with NEON's unsigned compares (all ones where true), a 16-byte quarter of each plane at a time. */
static void b3_decode_tile_neon(const uint8_t *src, int kb, uint8_t *dst) {
    int ns = kb / B3_SUPER_BLOCKS;
    const uint8x16_t lo = vdupq_n_u8(86), hi = vdupq_n_u8(171);
    for (int s = 0; s < ns; s++)
        for (int h = 0; h < 4; h++) { /* rows 4h .. 4h+3 */
            uint8x16_t acc[B3_SUPER_BLOCKS];
            for (int i = 0; i < B3_SUPER_BLOCKS; i++) acc[i] = vdupq_n_u8(0);
            for (int p = 0; p < 4; p++) {
                const uint8x16_t bit = vdupq_n_u8((uint8_t)(1 << (2 * p)));
                uint8x16_t m = vld1q_u8(src + (size_t)s * B3_SUPER_BYTES + p * 64 + h * 16);
                for (int i = 0; i < B3_SUPER_BLOCKS; i++) {
                    uint8x16_t b1 = vandq_u8(vcgeq_u8(m, lo), bit), b2 = vandq_u8(vcgeq_u8(m, hi), bit);
                    acc[i] = vaddq_u8(acc[i], vaddq_u8(b1, b2));
                    m = vaddq_u8(vaddq_u8(m, m), m);
                }
            }
            for (int i = 0; i < B3_SUPER_BLOCKS; i++) vst1q_u8(dst + ((size_t)s * B3_SUPER_BLOCKS + i) * 64 + h * 16, acc[i]);
        }
    memcpy(dst + (size_t)ns * B3_SUPER_BLOCKS * 64, src + (size_t)ns * B3_SUPER_BYTES,
           (size_t)(kb % B3_SUPER_BLOCKS) * 64);
}
#endif

static void b3_decode_tile(const uint8_t *src, int kb, uint8_t *dst) {
#if defined(__x86_64__)
    int isa = bk_get_isa();
    if (isa == BK_ISA_AVX512) {
        b3_decode_tile_avx512(src, kb, dst);
        return;
    }
    if (isa == BK_ISA_AVX2 || isa == BK_ISA_AVXVNNI) {
        b3_decode_tile_avx2(src, kb, dst);
        return;
    }
#endif
#if defined(__aarch64__)
    const int isa_a = bk_get_isa();
    if (isa_a == BK_ISA_NEON || bk_isa_has_sdot(isa_a)) {
        b3_decode_tile_neon(src, kb, dst);
        return;
    }
#endif
    b3_decode_tile_scalar(src, kb, dst);
}

void bk_b3_to_tile16(const uint8_t *w, int n, int k_pad, uint8_t *dst) {
    int kb = k_pad / 16;
    size_t tb = bk_b3_tile_bytes(k_pad);
    for (int t = 0; t < (n + 15) / 16; t++) b3_decode_tile(w + (size_t)t * tb, kb, dst + (size_t)t * kb * 64);
}

/* ---------------- GEMV bodies ---------------- */
typedef void (*b3_gemv_fn)(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                           int32_t act_sum, float *out, int32_t *out_i32, int n, int tile_begin, int tile_end,
                           uint8_t *scratch);

/* The scalar reference: each trit read by the division-free rule, nothing else. */
static void gemv_b3_scalar(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
                           int32_t act_sum, float *out, int32_t *out_i32, int n, int tile_begin, int tile_end,
                           uint8_t *scratch) {
    (void)scratch;
    const int kb = k_pad / 16, ns = kb / B3_SUPER_BLOCKS;
    const size_t tb = bk_b3_tile_bytes(k_pad);
    int32_t dots[16];
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tb;
        for (int r = 0; r < 16; r++) dots[r] = 0;
        for (int s = 0; s < ns; s++)
            for (int pl = 0; pl < 4; pl++)
                for (int r = 0; r < 16; r++)
                    for (int j = 0; j < 4; j++) {
                        unsigned m = p[(size_t)s * B3_SUPER_BYTES + pl * 64 + r * 4 + j];
                        for (int i = 0; i < B3_SUPER_BLOCKS; i++) {
                            unsigned m3 = 3 * m;
                            dots[r] += (int32_t)(m3 >> 8) * xq[80 * s + 16 * i + 4 * pl + j];
                            m = m3 & 255;
                        }
                    }
        for (int b = ns * B3_SUPER_BLOCKS; b < kb; b++) {   /* tile16 blocks */
            const uint8_t *blk = p + (size_t)ns * B3_SUPER_BYTES + (size_t)(b - ns * B3_SUPER_BLOCKS) * 64;
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++)
                        dots[r] += (int32_t)((blk[r * 4 + j] >> (2 * i)) & 3) * xq[16 * b + 4 * i + j];
        }
        for (int r = 0; r < 16; r++) dots[r] -= act_sum;
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}

/* Any path: decode the tile into scratch (kb * 64 bytes), then the path's own tile16 GEMV body on it. The body
 * addresses tile t at w + t * tile16_bytes, so it gets a base that puts tile t at the scratch. */
static void gemv_b3_by_tile16(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                              float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n, int tile_begin,
                              int tile_end, uint8_t *scratch) {
    const int kb = k_pad / 16;
    const size_t tb = bk_b3_tile_bytes(k_pad), t16 = (size_t)kb * 64;
    for (int t = tile_begin; t < tile_end; t++) {
        b3_decode_tile(w + (size_t)t * tb, kb, scratch);
        bk_table.gemv_ternary((const uint8_t *)((uintptr_t)scratch - (uintptr_t)t * t16), row_scale, xq, k_pad,
                              act_scale, act_sum, out, out_i32, n, t, t + 1);
    }
}

#if defined(__x86_64__)
/* Bound: per plane and trit |m . x| <= 4 * 255 * 128 per lane, 4 planes per superblock, so after F superblocks
 * |3 P_i| <= 3 * 4 * 4 * 255 * 128 * F < 2^31 for F <= 1370; folded every B3_FLUSH_SUPERS = 256. */
AVX512_TARGET static void gemv_b3_avx512(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad,
                                         float act_scale, int32_t act_sum, float *out, int32_t *out_i32, int n,
                                         int tile_begin, int tile_end, uint8_t *scratch) {
    (void)scratch;
    const int kb = k_pad / 16, ns = kb / B3_SUPER_BLOCKS;
    const size_t tb = bk_b3_tile_bytes(k_pad), pf = (size_t)bk_table.gemv_prefetch;
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0c), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xc0);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tb;
        const __m512i z = _mm512_setzero_si512();
        __m512i dot = z;
        for (int s0 = 0; s0 < ns; s0 += B3_FLUSH_SUPERS) {
            const int s1 = s0 + B3_FLUSH_SUPERS < ns ? s0 + B3_FLUSH_SUPERS : ns;
            __m512i P0 = z, P1 = z, P2 = z, P3 = z, P4 = z, Q0 = z, Q1 = z, Q2 = z, Q3 = z, Q4 = z;
            for (int s = s0; s < s1; s++) {
                const uint8_t *q = p + (size_t)s * B3_SUPER_BYTES;
                const int8_t *xs = xq + 80 * s;
#pragma GCC unroll 4
                for (int pl = 0; pl < 4; pl++) {
                    bk_prefetch_ahead(q + 64 * pl, pf); /* kernels.h: BK_GEMV_PREFETCH_DEFAULT */
                    __m512i m = _mm512_loadu_si512(q + 64 * pl), x;
#define B3_TRIT(P, Q, i)                                                 \
    x = _mm512_set1_epi32(load_i32(xs + 16 * (i) + 4 * pl));             \
    P = dpbusd512(P, m, x);                                              \
    m = _mm512_add_epi8(_mm512_add_epi8(m, m), m);                       \
    Q = dpbusd512(Q, m, x)
                    B3_TRIT(P0, Q0, 0);
                    B3_TRIT(P1, Q1, 1);
                    B3_TRIT(P2, Q2, 2);
                    B3_TRIT(P3, Q3, 3);
                    B3_TRIT(P4, Q4, 4);
#undef B3_TRIT
                }
            }
#define B3_FOLD(P, Q) _mm512_srai_epi32(_mm512_sub_epi32(_mm512_add_epi32(P, _mm512_add_epi32(P, P)), Q), 8)
            dot = _mm512_add_epi32(dot, _mm512_add_epi32(_mm512_add_epi32(B3_FOLD(P0, Q0), B3_FOLD(P1, Q1)),
                                                         _mm512_add_epi32(_mm512_add_epi32(B3_FOLD(P2, Q2),
                                                                                           B3_FOLD(P3, Q3)),
                                                                          B3_FOLD(P4, Q4))));
#undef B3_FOLD
        }
        /* the tile16 blocks after the superblocks (at most 4): each plane in its own 4^i-scaled accumulator */
        __m512i c0 = z, c1 = z, c2 = z, c3 = z;
        const uint8_t *tail = p + (size_t)ns * B3_SUPER_BYTES;
        for (int b = ns * B3_SUPER_BLOCKS; b < kb; b++, tail += 64) {
            const __m512i v = _mm512_loadu_si512(tail);
            const int8_t *xb = xq + 16 * b;
            c0 = dpbusd512(c0, _mm512_and_si512(v, m0), _mm512_set1_epi32(load_i32(xb)));
            c1 = dpbusd512(c1, _mm512_and_si512(v, m1), _mm512_set1_epi32(load_i32(xb + 4)));
            c2 = dpbusd512(c2, _mm512_and_si512(v, m2), _mm512_set1_epi32(load_i32(xb + 8)));
            c3 = dpbusd512(c3, _mm512_and_si512(v, m3), _mm512_set1_epi32(load_i32(xb + 12)));
        }
        dot = _mm512_add_epi32(dot, _mm512_add_epi32(_mm512_add_epi32(c0, _mm512_srai_epi32(c1, 2)),
                                                     _mm512_add_epi32(_mm512_srai_epi32(c2, 4),
                                                                      _mm512_srai_epi32(c3, 6))));
        finish_tile_avx512(dot, act_sum, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}
#endif

/* Paths with no base-3 body of their own decode tiles into tile16 scratch and run that path's tile16 body. */
static const b3_gemv_fn gemv_b3_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemv_b3_scalar) BK_X86_BODY(AVX2, gemv_b3_by_tile16) BK_X86_BODY(AVX512, gemv_b3_avx512)
    BK_ARM_BODY(NEON, gemv_b3_by_tile16)
};

/* ---------------- threaded drivers ---------------- */
typedef struct {
    b3_gemv_fn gemv;
    const uint8_t *w;
    const float *row_scale;
    const int8_t *xq;
    int m, k_pad;
    float act_scale1;
    int32_t act_sum1;
    const float *act_scale;
    const int32_t *act_sum;
    float *out;
    int32_t *out_i32;
    int n;
    uint8_t *scratch;   /* per thread slot: slot_bytes each */
    size_t slot_bytes;
} b3_job;

/* scratch for every thread slot the pool may use in this call */
static int b3_alloc(b3_job *j, size_t slot_bytes) {
    j->slot_bytes = slot_bytes;
    j->scratch = malloc(slot_bytes * (size_t)(bk_get_num_threads() > 0 ? bk_get_num_threads() : 1));
    return j->scratch ? 0 : -1;
}

static void b3_gemv_range(void *ctx, int b, int e) {
    b3_job *j = ctx;
    uint8_t *s = j->scratch ? j->scratch + (size_t)bk_thread_slot() * j->slot_bytes : NULL;
    j->gemv(j->w, j->row_scale, j->xq, j->k_pad, j->act_scale1, j->act_sum1, j->out, j->out_i32, j->n, b, e, s);
}

int bk_gemv_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int k_pad, float act_scale,
               int32_t act_sum, float *out, int32_t *out_i32, int n) {
    int n_tiles = (n + 15) / 16;
    b3_job job = {BK_PICK(gemv_b3_bodies, bk_get_isa()), w, row_scale, xq, 1, k_pad, act_scale, act_sum, NULL, NULL,
                  out, out_i32, n, NULL, 0};
    if (job.gemv == gemv_b3_by_tile16 && b3_alloc(&job, (size_t)k_pad / 16 * 64) != 0) return -1;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad, 16 * 4096, b3_gemv_range, &job);
    free(job.scratch);
    return 0;
}

/* tiles [b, e) in groups of B3_GROUP_TILES: decoded into the slot's scratch, then the tile16 multi-row body
 * (rows != 0) or the path's tile16 GEMM body on them */
static void b3_multi_range(void *ctx, int b, int e, int rows) {
    b3_job *j = ctx;
    const int kb = j->k_pad / 16;
    const size_t tb = bk_b3_tile_bytes(j->k_pad), t16 = (size_t)kb * 64;
    uint8_t *s = j->scratch + (size_t)bk_thread_slot() * j->slot_bytes;
    for (int t0 = b; t0 < e; t0 += B3_GROUP_TILES) {
        int t1 = t0 + B3_GROUP_TILES < e ? t0 + B3_GROUP_TILES : e;
        for (int t = t0; t < t1; t++) b3_decode_tile(j->w + (size_t)t * tb, kb, s + (size_t)(t - t0) * t16);
        const uint8_t *base = (const uint8_t *)((uintptr_t)s - (uintptr_t)t0 * t16);   /* tile t0 at s */
        if (rows)
            bk_gemv_rows_ternary_tiles(base, j->row_scale, j->xq, j->m, j->k_pad, j->act_scale, j->act_sum, j->out,
                                       j->n, t0, t1);
        else
            bk_table.gemm_ternary(base, j->row_scale, j->xq, j->m, j->k_pad, j->act_scale, j->act_sum, j->out,
                                  j->out_i32, j->n, t0, t1);
    }
}

static void b3_gemm_range(void *ctx, int b, int e) { b3_multi_range(ctx, b, e, 0); }
static void b3_rows_range(void *ctx, int b, int e) { b3_multi_range(ctx, b, e, 1); }

int bk_gemm_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad, const float *act_scale,
               const int32_t *act_sum, float *out, int32_t *out_i32, int n) {
    int n_tiles = (n + 15) / 16;
    b3_job job = {NULL, w, row_scale, xq, m, k_pad, 0, 0, act_scale, act_sum, out, out_i32, n, NULL, 0};
    if (b3_alloc(&job, (size_t)B3_GROUP_TILES * (k_pad / 16) * 64) != 0) return -1;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad * m, 16 * 4096, b3_gemm_range, &job);
    free(job.scratch);
    return 0;
}

int bk_gemv_rows_b3(const uint8_t *w, const float *row_scale, const int8_t *xq, int m, int k_pad,
                    const float *act_scale, const int32_t *act_sum, float *out, int n) {
    int n_tiles = (n + 15) / 16;
    b3_job job = {NULL, w, row_scale, xq, m, k_pad, 0, 0, act_scale, act_sum, out, NULL, n, NULL, 0};
    if (b3_alloc(&job, (size_t)B3_GROUP_TILES * (k_pad / 16) * 64) != 0) return -1;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad, 16 * 4096, b3_rows_range, &job);
    free(job.scratch);
    return 0;
}
