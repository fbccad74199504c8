/* int8 GEMV for the LM head ("i8_tile16", simd/layout.py): W_q int8 in [-127, 127], per-row f32 scale.
 *   dot[n] = sum_k W_q[n,k] * xq[k];   out[n] = ((float)dot[n] / act_scale) * row_scale[n]
 * A 64-byte group is 16 rows x 4 columns (one dword per row).
 *   AVX-512 VNNI: vpdpbusd needs an unsigned operand, so the activations are offset to u8 = xq + 128 (xq ^ 0x80)
 *     and the weights stay signed: sum (xq+128)*W = dot + 128 * w_rowsum[n]; w_rowsum comes with the head.
 *   AVX2: pmaddubsw(|xq| as u8, sign(W, xq)); |xq| <= 128 and |W| <= 127, so a pair sum <= 32512: no
 *     saturation. (|W| x sign(xq, W) would break on xq = -128, whose negation does not fit in int8.)
 * aux holds xq ^ 0x80 (first k_pad bytes) and |xq| (next k_pad bytes), computed once per call.
 * bk_gemm_i8: the same for M activation rows (the batched engine's logits): each weight tile is read once
 * for all rows (AVX-512: up to 8 rows share each 64-byte weight load; other paths: the GEMV body per row over
 * a cache-sized run of tiles). Per row the int32 dots and the f32 epilogue are those of bk_gemv_i8.
 */
#include "kernels.h"
#include "tiles.h"

#include <stdlib.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

static void gemv_i8_scalar(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                           const uint8_t *aux, int k_pad, float act_scale, float *out, int32_t *out_i32, int n,
                           int tile_begin, int tile_end) {
    (void)w_rowsum;
    (void)aux;
    const int groups = k_pad / 4;
    int32_t dots[16];
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *tile = w + (size_t)t * groups * 64;
        for (int r = 0; r < 16; r++) dots[r] = 0;
        for (int g = 0; g < groups; g++)
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 4; j++) dots[r] += (int32_t)tile[(size_t)g * 64 + r * 4 + j] * xq[4 * g + j];
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}

#if defined(__x86_64__)
AVX512_TARGET static inline __m512i rowsum_correction_avx512(const int32_t *w_rowsum, int row0, int n) {
    __mmask16 mk = n - row0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - row0)) - 1);
    return _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mk, w_rowsum + row0), 7);
}

/* One tile at a time (a single sequential read stream, see gemv_ternary.c), 4 groups per iteration into 4
 * accumulators to cover the vpdpbusd latency. */
AVX512_TARGET static void gemv_i8_avx512(const int8_t *w, const float *row_scale, const int32_t *w_rowsum,
                                         const int8_t *xq, const uint8_t *aux, int k_pad, float act_scale,
                                         float *out, int32_t *out_i32, int n, int tile_begin, int tile_end) {
    (void)xq;
    const int groups = k_pad / 4; /* a multiple of 16 */
    const size_t tile_bytes = (size_t)groups * 64;
    const uint8_t *xu = aux; /* xq + 128 */
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *p = w + (size_t)t * tile_bytes;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int g = 0; g < groups; g += 4) {
            const int8_t *q = p + (size_t)g * 64;
            a0 = dpbusd512(a0, _mm512_set1_epi32(load_i32(xu + 4 * g)), _mm512_loadu_si512(q));
            a1 = dpbusd512(a1, _mm512_set1_epi32(load_i32(xu + 4 * g + 4)), _mm512_loadu_si512(q + 64));
            a2 = dpbusd512(a2, _mm512_set1_epi32(load_i32(xu + 4 * g + 8)), _mm512_loadu_si512(q + 128));
            a3 = dpbusd512(a3, _mm512_set1_epi32(load_i32(xu + 4 * g + 12)), _mm512_loadu_si512(q + 192));
        }
        __m512i acc = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
        int row0 = t * 16;
        finish_tile_avx512(_mm512_sub_epi32(acc, rowsum_correction_avx512(w_rowsum, row0, n)), 0, row0, n, row_scale,
                           act_scale, out, out_i32);
    }
}

/* acc += |x| * sign(W, x), widened to int32 each step (a pair sum can reach 32512: no room to add two) */
#define I8_HALF_AVX2(acc, ptr)                                                                              \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(                                    \
                                    xa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(ptr)), xs)), \
                                ones))

/* One tile at a time: a single sequential read stream. */
AVX2_TARGET static void gemv_i8_avx2(const int8_t *w, const float *row_scale, const int32_t *w_rowsum,
                                     const int8_t *xq, const uint8_t *aux, int k_pad, float act_scale, float *out,
                                     int32_t *out_i32, int n, int tile_begin, int tile_end) {
    (void)w_rowsum;
    const int groups = k_pad / 4;
    const size_t tile_bytes = (size_t)groups * 64;
    const uint8_t *xabs = aux + k_pad;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *p = w + (size_t)t * tile_bytes;
        __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0;
        for (int g = 0; g < groups; g++) {
            __m256i xa = _mm256_set1_epi32(load_i32(xabs + 4 * g)), xs = _mm256_set1_epi32(load_i32(xq + 4 * g));
            I8_HALF_AVX2(lo0, p + (size_t)g * 64);
            I8_HALF_AVX2(hi0, p + (size_t)g * 64 + 32);
        }
        finish_half_avx2(lo0, 0, t * 16, n, row_scale, act_scale, out, out_i32);
        finish_half_avx2(hi0, 0, t * 16 + 8, n, row_scale, act_scale, out, out_i32);
    }
#undef I8_HALF_AVX2
}
#endif

#if defined(__x86_64__)
/* rows r0 .. r0+R-1 (R <= 8) of xu [m, 2*k_pad] against tiles [tile_begin, tile_end). The weights arrive ahead
 * of the first row group, as in the ternary GEMM: the range's first tile is read at streaming speed
 * (bk_stream_warm), and the first row group over tile t prefetches tile t + 1 into L2 (40 KB at K = 2560), one
 * line per line it reads; that group alone, 8 vpdpbusd per 64 weight bytes, kept too few lines in flight.
 * Head 128256 x 2560, 2 threads, ms per call, best of 3 rounds alternating (2026-11-28, Zen 5): M = 2 4.31 ->
 * 4.21, 4 5.39 -> 4.49, 8 7.93 -> 4.16, 16 12.05 -> 8.10 (two tiles ahead: the same). */
AVX512_TARGET static void gemm_i8_avx512(const int8_t *w, const float *row_scale, const int32_t *w_rowsum,
                                         const uint8_t *aux, int m, int k_pad, const float *act_scale, float *out,
                                         int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const int groups = k_pad / 4;
    const size_t tile_bytes = (size_t)groups * 64, astride = 2 * (size_t)k_pad;
    if (tile_begin < tile_end) bk_stream_warm((const uint8_t *)w + (size_t)tile_begin * tile_bytes, tile_bytes);
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *p = w + (size_t)t * tile_bytes;
        const int row0 = t * 16;
        const __m512i corr = rowsum_correction_avx512(w_rowsum, row0, n);
        for (int r0 = 0; r0 < m; r0 += 8) {
            const int R = m - r0 < 8 ? m - r0 : 8;
            const uint8_t *x0 = aux + (size_t)r0 * astride;
            const int8_t *ahead = r0 == 0 && t + 1 < tile_end ? w + (size_t)(t + 1) * tile_bytes : NULL;
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            if (R == 8) {
                for (int g = 0; g < groups; g++) {
                    if (ahead) __builtin_prefetch(ahead + (size_t)g * 64, 0, 2);
                    const __m512i wv = _mm512_loadu_si512(p + (size_t)g * 64);
                    const uint8_t *x = x0 + 4 * g;
                    a0 = dpbusd512(a0, _mm512_set1_epi32(load_i32(x)), wv);
                    a1 = dpbusd512(a1, _mm512_set1_epi32(load_i32(x + astride)), wv);
                    a2 = dpbusd512(a2, _mm512_set1_epi32(load_i32(x + 2 * astride)), wv);
                    a3 = dpbusd512(a3, _mm512_set1_epi32(load_i32(x + 3 * astride)), wv);
                    a4 = dpbusd512(a4, _mm512_set1_epi32(load_i32(x + 4 * astride)), wv);
                    a5 = dpbusd512(a5, _mm512_set1_epi32(load_i32(x + 5 * astride)), wv);
                    a6 = dpbusd512(a6, _mm512_set1_epi32(load_i32(x + 6 * astride)), wv);
                    a7 = dpbusd512(a7, _mm512_set1_epi32(load_i32(x + 7 * astride)), wv);
                }
            } else {
                for (int g = 0; g < groups; g++) {
                    if (ahead) __builtin_prefetch(ahead + (size_t)g * 64, 0, 2);
                    const __m512i wv = _mm512_loadu_si512(p + (size_t)g * 64);
                    const uint8_t *x = x0 + 4 * g;
                    a0 = dpbusd512(a0, _mm512_set1_epi32(load_i32(x)), wv);
                    if (R > 1) a1 = dpbusd512(a1, _mm512_set1_epi32(load_i32(x + astride)), wv);
                    if (R > 2) a2 = dpbusd512(a2, _mm512_set1_epi32(load_i32(x + 2 * astride)), wv);
                    if (R > 3) a3 = dpbusd512(a3, _mm512_set1_epi32(load_i32(x + 3 * astride)), wv);
                    if (R > 4) a4 = dpbusd512(a4, _mm512_set1_epi32(load_i32(x + 4 * astride)), wv);
                    if (R > 5) a5 = dpbusd512(a5, _mm512_set1_epi32(load_i32(x + 5 * astride)), wv);
                    if (R > 6) a6 = dpbusd512(a6, _mm512_set1_epi32(load_i32(x + 6 * astride)), wv);
                }
            }
            const __m512i acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int j = 0; j < R; j++) {
                const int r = r0 + j;
                finish_tile_avx512(_mm512_sub_epi32(acc[j], corr), 0, row0, n, row_scale, act_scale[r],
                                   out ? out + (size_t)r * n : NULL, out_i32 ? out_i32 + (size_t)r * n : NULL);
            }
        }
    }
}
#endif

#if defined(__aarch64__)
/* plain NEON (no sdot): smull + smlal of two groups into int16 lanes (|W| <= 127, |xq| <= 128: a pair sum
 * <= 32512, no overflow), sadalp into int32 pairs, one pairwise add per row at the end. Per 128 weight bytes:
 * 8 smull + 8 smlal + 8 sadalp + 8 loads + 2 broadcasts. */
static void gemv_i8_neon_plain(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                               const uint8_t *aux, int k_pad, float act_scale, float *out, int32_t *out_i32, int n,
                               int tile_begin, int tile_end) {
    (void)w_rowsum;
    (void)aux;
    const int groups = k_pad / 4; /* a multiple of 16 */
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *p = w + (size_t)t * groups * 64;
        int32x4_t acc[8]; /* acc[2q]: rows 4q, 4q+1; acc[2q+1]: rows 4q+2, 4q+3 (lanes: a row's k 0-1, k 2-3) */
        for (int i = 0; i < 8; i++) acc[i] = vdupq_n_s32(0);
        for (int g = 0; g < groups; g += 2) {
            const int8x16_t xa = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(xq + 4 * g)));
            const int8x16_t xb = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(xq + 4 * g + 4)));
            for (int q = 0; q < 4; q++) {
                const int8x16_t a = vld1q_s8(p + (size_t)g * 64 + 16 * q), b = vld1q_s8(p + (size_t)g * 64 + 64 + 16 * q);
                acc[2 * q] = vpadalq_s16(acc[2 * q], vmlal_s8(vmull_s8(vget_low_s8(a), vget_low_s8(xa)), vget_low_s8(b), vget_low_s8(xb)));
                acc[2 * q + 1] = vpadalq_s16(acc[2 * q + 1], vmlal_high_s8(vmull_high_s8(a, xa), b, xb));
            }
        }
        int32_t dots[16];
        for (int q = 0; q < 4; q++) vst1q_s32(dots + 4 * q, vpaddq_s32(acc[2 * q], acc[2 * q + 1]));
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}

__attribute__((target("arch=armv8.2-a+dotprod")))
static void gemv_i8_neon(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq,
                         const uint8_t *aux, int k_pad, float act_scale, float *out, int32_t *out_i32, int n,
                         int tile_begin, int tile_end) {
    (void)w_rowsum;
    (void)aux;
    const int groups = k_pad / 4;
    for (int t = tile_begin; t < tile_end; t++) {
        const int8_t *p = w + (size_t)t * groups * 64;
        int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int g = 0; g < groups; g += 4) { /* 4 groups share one 16-byte activation load */
            int8x16_t xv = vld1q_s8(xq + 4 * g);
            for (int q = 0; q < 4; q++) {
                const int8_t *blk = p + (size_t)g * 64 + 16 * q;
                acc[q] = vdotq_laneq_s32(acc[q], vld1q_s8(blk), xv, 0);
                acc[q] = vdotq_laneq_s32(acc[q], vld1q_s8(blk + 64), xv, 1);
                acc[q] = vdotq_laneq_s32(acc[q], vld1q_s8(blk + 128), xv, 2);
                acc[q] = vdotq_laneq_s32(acc[q], vld1q_s8(blk + 192), xv, 3);
            }
        }
        int32_t dots[16];
        for (int q = 0; q < 4; q++) vst1q_s32(dots + 4 * q, acc[q]);
        bk_store_tile(dots, t * 16, n, row_scale, act_scale, out, out_i32);
    }
}
#endif

const bk_gemv_i8_fn bk_gemv_i8_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, gemv_i8_scalar) BK_X86_BODY(AVX2, gemv_i8_avx2) BK_X86_BODY(AVX512, gemv_i8_avx512)
    BK_ARM_BODY(NEON, gemv_i8_neon_plain) BK_ARM_BODY(DOTPROD, gemv_i8_neon)
};

#define GEMV_I8_ARGS(X) X(const int8_t *, w) X(const float *, row_scale) X(const int32_t *, w_rowsum) \
    X(const int8_t *, xq) X(const uint8_t *, aux) X(int, k_pad) X(float, act_scale) X(float *, out)  \
    X(int32_t *, out_i32) X(int, n)
BK_TILE_JOB(gemv_i8_job, bk_gemv_i8_fn, GEMV_I8_ARGS)

int bk_gemv_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int k_pad,
               float act_scale, float *out, int32_t *out_i32, int n) {
    uint8_t stack_aux[2 * 8192];
    uint8_t *aux = 2 * (size_t)k_pad <= sizeof stack_aux ? stack_aux : malloc(2 * (size_t)k_pad);
    if (!aux) return -1;
    for (int k = 0; k < k_pad; k++) {
        aux[k] = (uint8_t)(xq[k] ^ 0x80);
        aux[k_pad + k] = (uint8_t)(xq[k] < 0 ? -xq[k] : xq[k]); /* -(-128) = 128 fits in u8 */
    }
    BK_RUN_TILE_JOB(gemv_i8_job, bk_table.gemv_i8, GEMV_I8_ARGS, n, k_pad, 16 * 4096);
    if (aux != stack_aux) free(aux);
    return 0;
}

/* M rows of the GEMV body per run of tiles (or the AVX-512 GEMM body): its own range function */
#define GEMM_I8_ARGS(X) X(const int8_t *, w) X(const float *, row_scale) X(const int32_t *, w_rowsum) \
    X(const int8_t *, xq) X(const uint8_t *, aux) X(int, m) X(int, k_pad) X(const float *, act_scale) \
    X(float *, out) X(int32_t *, out_i32) X(int, n)
BK_JOB_STRUCT(gemm_i8_job, bk_gemv_i8_fn, GEMM_I8_ARGS);

static void gemm_i8_range(void *ctx, int b, int e) {
    gemm_i8_job *j = ctx;
#if defined(__x86_64__)
    if (j->fn == gemv_i8_avx512) {
        gemm_i8_avx512(j->w, j->row_scale, j->w_rowsum, j->aux, j->m, j->k_pad, j->act_scale, j->out, j->out_i32,
                       j->n, b, e);
        return;
    }
#endif
    const int run = 8; /* tiles per run: 8 * 16 rows * k_pad bytes stay in L2 while every row passes */
    for (int t0 = b; t0 < e; t0 += run) {
        const int t1 = t0 + run < e ? t0 + run : e;
        for (int r = 0; r < j->m; r++)
            j->fn(j->w, j->row_scale, j->w_rowsum, j->xq + (size_t)r * j->k_pad, j->aux + (size_t)r * 2 * j->k_pad,
                  j->k_pad, j->act_scale[r], j->out ? j->out + (size_t)r * j->n : NULL,
                  j->out_i32 ? j->out_i32 + (size_t)r * j->n : NULL, j->n, t0, t1);
    }
}

int bk_gemm_i8(const int8_t *w, const float *row_scale, const int32_t *w_rowsum, const int8_t *xq, int m, int k_pad,
               const float *act_scale, float *out, int32_t *out_i32, int n) {
    if (bk_gemm_i8_tiles(w, row_scale, xq, m, k_pad, act_scale, out, out_i32, n)) return 0; /* gemm_tiles.c */
    uint8_t *aux = malloc(2 * (size_t)k_pad * m);
    if (!aux) return -1;
    for (int r = 0; r < m; r++) {
        const int8_t *x = xq + (size_t)r * k_pad;
        uint8_t *a = aux + (size_t)r * 2 * k_pad;
        for (int k = 0; k < k_pad; k++) {
            a[k] = (uint8_t)(x[k] ^ 0x80);
            a[k_pad + k] = (uint8_t)(x[k] < 0 ? -x[k] : x[k]);
        }
    }
    gemm_i8_job job = BK_JOB_INIT(bk_table.gemv_i8, GEMM_I8_ARGS);
    int n_tiles = (n + 15) / 16;
    bk_run_tiles(n_tiles, (size_t)n_tiles * k_pad * m, 16 * 4096, gemm_i8_range, &job);
    free(aux);
    return 0;
}
