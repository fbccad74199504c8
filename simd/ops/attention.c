/* RoPE + KV-cache write + causal grouped-query attention, for one decode row or a prefill chunk.
 *
 * Math as transformers' BitNetAttention (FORMATS.md §1): half-split RoPE (rope_kv.c, with the f16 cache write)
 *   q'[i] = q[i]*cos[i] - q[i+h]*sin[i],  q'[i+h] = q[i+h]*cos[i] + q[i]*sin[i]   (h = head_dim/2),
 * scores = q.k / sqrt(head_dim), softmax in f32 (exp(s - max) / sum), out = sum_t p_t v_t.
 * KV head j serves query heads j*g .. j*g+g-1 (g = n_heads / n_kv).
 *
 * The cache of one layer: keys in transposed blocks [n_kv, n_ctx/32, head_dim, 32] (a block of positions
 * fills vector registers, so scores need no horizontal sums), values [n_kv, n_ctx, head_dim].
 * Work items (a KV head and the query heads it serves, split finer only when
 * threads would idle) go to the kernels' worker pool one at a time. scratch holds MAXQ score rows per thread.
 */
#include "ops.h"
#include "attention_q8.h"
#include "attention_neon.h"
#include "attention_bf16.h"
#include "attn_common.h" /* AVX2_FN / AVX512_FN, exp polynomial, lane masks */

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------- per-ISA kernels: scores of one head, weighted sum of values ---------- */

/* kv_blocks, BLK (how positions are addressed): attn_common.h */

typedef struct {
    void (*scores)(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n, int hd, float scale,
                   float *const *sc);
    void (*wsum)(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out);
    void (*wsum2)(const float *p0, const float *p1, const void *vc, kv_blocks bl, int f16, int n, int hd, float *o0,
                  float *o1);
    /* scores of four rows over an f16 cache (a prefill chunk's, or a KV head's four query heads decoding), 64
     * positions a pass (NULL: scores serves them); vc / pf: a decode item's prefetch (scores4_f16_avx512) */
    void (*scores4_f16)(const float *const *q, const void *kt, kv_blocks bl, int n, int hd, float scale,
                        float *const *sc, const void *vc, att_pf *pf);
    /* four queries over an f16 cache, hd a multiple of 16 (NULL: none for this path) */
    void (*wsum4_f16)(const float *const *p, const void *vc, kv_blocks bl, int n, int hd, float *const *out,
                      att_pf *pf);
    /* a decode item prefetches the next one's keys and values (att_pf) in scores4_f16 and wsum4_f16, whose steps
     * each cover item_pf positions (scores) or value columns (weighted sum); 0: no such prefetch */
    int item_pf;
    float (*row_max)(const float *x, int n); /* the largest of x[0..n-1] that is not NaN; -inf if none */
    /* softmax's last step over one score row: sc[t] *= inv for t < n, a subnormal weight becoming 0 (see
     * attention_items), and sc[t] = 0 for n <= t < n_end */
    void (*normalize)(float *sc, int n, float inv, int n_end);
} att_kernels;
/* softmax's exp is the int8 cache's (att_q8_kernels.exp_sum: one polynomial, 16 fixed lanes, the same bits on every
 * path), for every cache type: with libm's expf in the scalar reference no vector body could match it, and NEON
 * ran expf per position (2.2x the AVX2 body's instructions per byte of f16 attention) */

static float row_max_scalar(const float *x, int n) {
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

/* the widest head the four-query value pass takes (its accumulators live on the stack); the dispatcher
 * tests it on every architecture, so it stays outside the x86 block */
#define WS4_MAX_HD 256

static void normalize_scalar(float *sc, int n, float inv, int n_end) {
    for (int t = 0; t < n; t++) {
        const float w = sc[t] * inv;
        sc[t] = w < FLT_MIN ? 0.0f : w;
    }
    for (int t = n; t < n_end; t++) sc[t] = 0.0f;
}

#if defined(__x86_64__)
/* normalize_scalar 16 lanes at a time (the scalar loop, auto-vectorized to 4 lanes, was 3% of a 4,096-token
 * prefill): the same product and the same test per lane (a NaN is not below FLT_MIN and stays), so the same
 * floats. */
AVX512_FN static void normalize_avx512(float *sc, int n, float inv, int n_end) {
    const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(FLT_MIN);
    int t = 0;
    for (; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + t), vi);
        _mm512_mask_storeu_ps(sc + t, k, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, lo, _CMP_NLT_UQ), w));
    }
    for (t = n; t < n_end; t++) sc[t] = 0.0f;
}

/* A score row's max, 8 lanes at a time: the scalar loop is one dependent maxss per position (6% of a q8 decode
 * layer's samples at 4096 positions). vmaxps(x, m) is x > m ? x : m per lane, the scalar rule, so a NaN score is
 * skipped alike and the same number comes out whatever the order; only a -0 / +0 tie may give the other zero, and
 * exp(s - max) and the piece fold give the same floats for either. The AVX-512 path uses it too. */
AVX2_FN static float row_max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + t), m);
    float l[8], mx = -INFINITY;
    _mm256_storeu_ps(l, m);
    for (int i = 0; i < 8; i++) mx = l[i] > mx ? l[i] : mx;
    for (; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}
#endif

/* wsum: out = sum_t p_t v_t over the value cache rows (f16 rows converted in registers), keeping a block
 * of the output in registers across all t (no store/reload chain through memory). */
#define KROW16(base, t, hd) ((const uint16_t *)(base) + (int64_t)(t) * (hd))
#define KROW32(base, t, hd) ((const float *)(base) + (int64_t)(t) * (hd))

/* scores: S_j[t] = scale * q_j . k_t for R <= MAXQ query vectors and t < n, over the key cache in
 * transposed blocks [n_ctx / KT_BLOCK][head_dim][KT_BLOCK]: a block of positions sits in vector registers,
 * so the dot products need no horizontal sums, each key block is loaded once for all R queries, and a
 * block's keys are one contiguous 4-8 KB run (prefetcher friendly).
 * The reference fuses each multiply-add (fmaf), i in order from 0 for a score and t in order for a weighted
 * sum's column, then one multiply by scale: exactly what every vector body does in each lane (one position per
 * lane of a key block, one column per lane of a value row), so the AVX2, AVX-512 and NEON bodies give its bytes
 * (tests/test_attention_paths.py; under qemu, tests/test_attention_neon.py). Unfused, no body could match it
 * with fused FMAs, and NEON needed an fmul and an fadd where one fmla does. */
#define MAXQ OPS_ATT_SCRATCH_ROWS
#define KT_BLOCK OPS_KT_BLOCK
static void scores_scalar(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n, int hd,
                          float scale, float *const *sc) {
    for (int j = 0; j < R; j++)
        for (int t = 0; t < n; t++) {
            float d = 0.0f;
            const int64_t base = BLK(bl, t / KT_BLOCK) + t % KT_BLOCK;
            for (int i = 0; i < hd; i++) {
                const int64_t at = base + (int64_t)i * KT_BLOCK;
                d = fmaf(q[j][i], f16 ? ops_half_to_float(((const uint16_t *)kt)[at]) : ((const float *)kt)[at], d);
            }
            sc[j][t] = d * scale;
        }
}
static void wsum_scalar(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out) {
    memset(out, 0, sizeof(float) * hd);
    for (int t = 0; t < n; t++) {
        const int64_t row = BLK(bl, t / KT_BLOCK) / hd + t % KT_BLOCK;
        if (f16) {
            const uint16_t *v = KROW16(vc, row, hd);
            for (int i = 0; i < hd; i++) out[i] = fmaf(p[t], ops_half_to_float(v[i]), out[i]);
        } else {
            const float *v = KROW32(vc, row, hd);
            for (int i = 0; i < hd; i++) out[i] = fmaf(p[t], v[i], out[i]);
        }
    }
}

#if defined(__x86_64__)
AVX2_FN static inline __m256 load8(const void *base, int f16, int64_t off, int valid) {
    if (valid >= 8)
        return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)))
                   : _mm256_loadu_ps((const float *)base + off);
    float tmp[8] = {0};
    for (int i = 0; i < valid; i++) tmp[i] = f16 ? ops_half_to_float(((const uint16_t *)base)[off + i]) : ((const float *)base)[off + i];
    return _mm256_loadu_ps(tmp);
}
/* a0..d1 (8 accumulators in the caller's scope) += broadcast(r0..r3[i]) * k0 | k1: four rows (queries, or
 * their weights) against 16 values; scores4_f16_avx2 and wsum4_f16_avx2 share it, so both keep the FMA order. */
#define FMA4X2(r0, r1, r2, r3, i, k0, k1)                                                        \
    do {                                                                                         \
        __m256 x_ = _mm256_broadcast_ss((r0) + (i));                                             \
        a0 = _mm256_fmadd_ps(x_, k0, a0), a1 = _mm256_fmadd_ps(x_, k1, a1);                      \
        x_ = _mm256_broadcast_ss((r1) + (i));                                                    \
        b0 = _mm256_fmadd_ps(x_, k0, b0), b1 = _mm256_fmadd_ps(x_, k1, b1);                      \
        x_ = _mm256_broadcast_ss((r2) + (i));                                                    \
        c0 = _mm256_fmadd_ps(x_, k0, c0), c1 = _mm256_fmadd_ps(x_, k1, c1);                      \
        x_ = _mm256_broadcast_ss((r3) + (i));                                                    \
        d0 = _mm256_fmadd_ps(x_, k0, d0), d1 = _mm256_fmadd_ps(x_, k1, d1);                      \
    } while (0)

/* The common case, four queries (a KV head's group) over a full block of 16 f16 keys: every accumulator in a
 * register (the general body below keeps acc[][] in memory: a store-reload chain per FMA, measured 3x
 * slower). Same operations in the same order: the same floats. */
AVX2_FN static inline void scores4_f16_avx2(const float *const *q, const uint16_t *kt, int64_t base, int hd,
                                            __m256 vs, float *const *sc, int t0, const char *next, int s0,
                                            att_pf *pf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    const float *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
    for (int i = 0; i < hd; i++) {
        att_pf_step(pf);
        pf_lines(next, s0 + i, 1, hd); /* a block of f16 keys: 32 x hd x 2 bytes, hd lines */
        const uint16_t *kp = kt + base + (int64_t)i * KT_BLOCK;
        __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)kp));
        __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kp + 8)));
        FMA4X2(q0, q1, q2, q3, i, k0, k1);
    }
    _mm256_storeu_ps(sc[0] + t0, _mm256_mul_ps(a0, vs)), _mm256_storeu_ps(sc[0] + t0 + 8, _mm256_mul_ps(a1, vs));
    _mm256_storeu_ps(sc[1] + t0, _mm256_mul_ps(b0, vs)), _mm256_storeu_ps(sc[1] + t0 + 8, _mm256_mul_ps(b1, vs));
    _mm256_storeu_ps(sc[2] + t0, _mm256_mul_ps(c0, vs)), _mm256_storeu_ps(sc[2] + t0 + 8, _mm256_mul_ps(c1, vs));
    _mm256_storeu_ps(sc[3] + t0, _mm256_mul_ps(d0, vs)), _mm256_storeu_ps(sc[3] + t0 + 8, _mm256_mul_ps(d1, vs));
}

/* scores4_f16_avx2 over all n positions (a KV head's four query heads decoding, or four prefill rows): pf, a decode
 * item's stream of the next item's keys and values (att_pf), a step per dimension of each 16 positions; vc unused
 * (wsum4_f16_avx2 prefetches the values it reads) */
AVX2_FN static void scores4_f16_run_avx2(const float *const *q, const void *kt, kv_blocks bl, int n, int hd,
                                         float scale, float *const *sc, const void *vc, att_pf *pf) {
    (void)vc;
    const __m256 vs = _mm256_set1_ps(scale);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int valid = n - t0;
        const int64_t base = BLK(bl, t0 / KT_BLOCK) + t0 % KT_BLOCK;
        const char *next = pf_block(kt, bl, t0 / KT_BLOCK + 1, n, 2);
        const int s0 = (t0 % KT_BLOCK / 16) * hd; /* steps of this half-run in its block */
        /* A last, partial run of positions is computed on all 16 lanes and only its valid scores are kept: t0 is
         * a multiple of 16, so the 16 lanes stay inside their allocated KT_BLOCK block (whatever a lane past n
         * holds only reaches that lane's own discarded score). The per-element masked loads this replaces cost
         * ~10 us per layer of a decode step (2B-4T, one tail per KV head) at any context length. */
        if (valid >= 16) {
            scores4_f16_avx2(q, (const uint16_t *)kt, base, hd, vs, sc, t0, next, s0, pf);
        } else {
            float tmp[4][16], *tp[4] = {tmp[0], tmp[1], tmp[2], tmp[3]};
            scores4_f16_avx2(q, (const uint16_t *)kt, base, hd, vs, tp, 0, next, s0, pf);
            for (int j = 0; j < 4; j++) memcpy(sc[j] + t0, tmp[j], sizeof(float) * (size_t)valid);
        }
    }
}

AVX2_FN static void scores_avx2(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n, int hd,
                                float scale, float *const *sc) {
    if (R == 4 && f16) {
        scores4_f16_run_avx2(q, kt, bl, n, hd, scale, sc, NULL, NULL);
        return;
    }
    const __m256 vs = _mm256_set1_ps(scale);
    const int64_t esize = f16 ? 2 : 4;
    const int lines = (int)(hd * esize / 2), per = f16 ? 1 : 2; /* a block: 32 x hd values */
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int valid = n - t0;
        const int64_t base = BLK(bl, t0 / KT_BLOCK) + t0 % KT_BLOCK;
        const char *next = pf_block(kt, bl, t0 / KT_BLOCK + 1, n, esize);
        const int s0 = (t0 % KT_BLOCK / 16) * hd; /* steps of this half-run in its block */
        /* a last, partial run on all 16 lanes, its valid scores kept (see scores4_f16_run_avx2) */
        __m256 acc[MAXQ][2];
        for (int j = 0; j < MAXQ; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i++) {
            pf_lines(next, s0 + i, per, lines);
            const int64_t off = base + (int64_t)i * KT_BLOCK;
            __m256 k0 = load8(kt, f16, off, 8), k1 = load8(kt, f16, off + 8, 8);
            for (int j = 0; j < R; j++) {
                __m256 b = _mm256_broadcast_ss(q[j] + i);
                acc[j][0] = _mm256_fmadd_ps(b, k0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(b, k1, acc[j][1]);
            }
        }
        for (int j = 0; j < R; j++) {
            float tmp[16];
            _mm256_storeu_ps(tmp, _mm256_mul_ps(acc[j][0], vs));
            _mm256_storeu_ps(tmp + 8, _mm256_mul_ps(acc[j][1], vs));
            memcpy(sc[j] + t0, tmp, sizeof(float) * (size_t)(valid < 16 ? valid : 16));
        }
    }
}
AVX2_FN static void wsum_avx2(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out) {
    int c0 = 0;
    if (f16) /* full 64-column blocks of an f16 cache with the 8 accumulators in registers (see scores4_f16_avx2) */
        for (; c0 + 64 <= hd; c0 += 64) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int t = 0; t < n; t++) {
                const __m256 w = _mm256_set1_ps(p[t]);
                const uint16_t *v = (const uint16_t *)vc + BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
#define WS_STEP(a, j) a = _mm256_fmadd_ps(w, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8 * (j)))), a)
                WS_STEP(a0, 0), WS_STEP(a1, 1), WS_STEP(a2, 2), WS_STEP(a3, 3);
                WS_STEP(a4, 4), WS_STEP(a5, 5), WS_STEP(a6, 6), WS_STEP(a7, 7);
#undef WS_STEP
            }
            float *o = out + c0;
            _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
            _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
            _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
        }
    for (; c0 < hd; c0 += 64) { /* 8 ymm accumulators = 64 output columns */
        __m256 acc[8];
        int nb = (hd - c0 + 7) / 8 < 8 ? (hd - c0 + 7) / 8 : 8;
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            __m256 w = _mm256_set1_ps(p[t]);
            const int64_t o = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
            for (int j = 0; j < nb; j++) acc[j] = _mm256_fmadd_ps(w, load8(vc, f16, o + 8 * j, hd - c0 - 8 * j), acc[j]);
        }
        for (int j = 0; j < nb; j++) {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[j]);
            for (int i = 0; i < 8 && c0 + 8 * j + i < hd; i++) out[c0 + 8 * j + i] = tmp[i];
        }
    }
}

/* The weighted sum of values for the four query heads of a KV head's group (decode, GQA 4) over an f16 cache in
 * one pass: each value row is converted once for all four instead of once per query (wsum_avx2 converts it four
 * times). Positions go in blocks of WS4_BLOCK (16 KB of values at head_dim 128, in L1) and, inside a block, 16
 * columns at a time with 8 accumulators, 4 weights and 2 value vectors in registers; between blocks the
 * accumulators wait in acc[][] (a column pass over a whole long context re-read the values from L3 8 times:
 * measured 2x the time of the scores). Per output element the same FMAs in the same order as wsum_avx2: the
 * same floats. hd a multiple of 16, <= WS4_MAX_HD. */
#define WS4_BLOCK 64 /* a multiple of KT_BLOCK */
AVX2_FN static void wsum4_f16_avx2(const float *const *p, const void *vc, kv_blocks bl, int n, int hd,
                                   float *const *out, att_pf *pf) {
    const float *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    float acc[4][WS4_MAX_HD]; /* between blocks; the first block starts from zero, the last writes out */
    if (n <= 0)
        for (int j = 0; j < 4; j++)
            for (int c = 0; c < hd; c++) out[j][c] = 0.0f;
    for (int tb = 0; tb < n; tb += WS4_BLOCK) {
        const int te = tb + WS4_BLOCK < n ? tb + WS4_BLOCK : n;
        float *dst[4] = {acc[0], acc[1], acc[2], acc[3]};
        if (te == n) dst[0] = out[0], dst[1] = out[1], dst[2] = out[2], dst[3] = out[3];
        for (int col = 0; col < hd; col += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            if (tb) {
                a0 = _mm256_loadu_ps(acc[0] + col), a1 = _mm256_loadu_ps(acc[0] + col + 8);
                b0 = _mm256_loadu_ps(acc[1] + col), b1 = _mm256_loadu_ps(acc[1] + col + 8);
                c0 = _mm256_loadu_ps(acc[2] + col), c1 = _mm256_loadu_ps(acc[2] + col + 8);
                d0 = _mm256_loadu_ps(acc[3] + col), d1 = _mm256_loadu_ps(acc[3] + col + 8);
            }
            for (int ts = tb; ts < te; ts += KT_BLOCK) { /* runs inside one KT_BLOCK: rows hd apart */
                const int tn = ts + KT_BLOCK < te ? ts + KT_BLOCK : te;
                const uint16_t *v = (const uint16_t *)vc + BLK(bl, ts / KT_BLOCK) + (int64_t)(ts % KT_BLOCK) * hd + col;
                /* the same block of the next tile (hd lines: 32 x hd f16 values), 16 lines before each column
                 * pass's loop: a prefetch per step, behind a test, cost more than it hid (and it reached only
                 * the first half of the block) */
                pf_lines(pf_block(vc, bl, ts / KT_BLOCK + WS4_BLOCK / KT_BLOCK, n, 2), col / 16, 16, hd);
                for (int t = ts; t < tn; t++, v += hd) {
                    att_pf_step(pf);
                    const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v));
                    const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8)));
                    FMA4X2(p0, p1, p2, p3, t, v0, v1);
                }
            }
            _mm256_storeu_ps(dst[0] + col, a0), _mm256_storeu_ps(dst[0] + col + 8, a1);
            _mm256_storeu_ps(dst[1] + col, b0), _mm256_storeu_ps(dst[1] + col + 8, b1);
            _mm256_storeu_ps(dst[2] + col, c0), _mm256_storeu_ps(dst[2] + col + 8, c1);
            _mm256_storeu_ps(dst[3] + col, d0), _mm256_storeu_ps(dst[3] + col + 8, d1);
        }
    }
}

AVX512_FN static inline __m512 load16(const void *base, int f16, int64_t off, __mmask16 k) {
    return f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)base + off))
               : _mm512_maskz_loadu_ps(k, (const float *)base + off);
}
static inline __mmask16 mask16(int valid) { return valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1); }

/* The 4 x 4 step of the four-query bodies: a[j][v] += w_j * x[v] for four rows j (queries or softmax rows) and
 * four vectors v (keys of 64 positions, or 64 value columns), one broadcast per row. */
AVX512_FN __attribute__((always_inline)) static inline void fma4x4_avx512(__m512 a[4][4], const __m512 x[4], float w0,
                                                                         float w1, float w2, float w3) {
    const __m512 b0 = _mm512_set1_ps(w0), b1 = _mm512_set1_ps(w1), b2 = _mm512_set1_ps(w2), b3 = _mm512_set1_ps(w3);
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        a[0][v] = _mm512_fmadd_ps(b0, x[v], a[0][v]);
        a[1][v] = _mm512_fmadd_ps(b1, x[v], a[1][v]);
        a[2][v] = _mm512_fmadd_ps(b2, x[v], a[2][v]);
        a[3][v] = _mm512_fmadd_ps(b3, x[v], a[3][v]);
    }
}

/* scores_avx512 for four queries over an f16 cache: 64 positions (two KT_BLOCK blocks) per pass, 16 accumulators,
 * so each converted key vector feeds four FMAs and each broadcast four. The generic body's two vectors per pass (with
 * its R and f16 tests and prefetch loop in every step) kept the FMAs at 55% of this Zen 5 core's peak, 48% of a
 * 4,096-token prefill's attention (now 82%, the attention +20%). Decode items (a KV head's four query heads) take it
 * too, with their prefetch: vc (an item nobody prefetched: its own values, block by block, as its keys are read, so
 * the weighted sum finds them in L2) and pf (the next item's keys and values, att_pf). Without them a decode item
 * in this body lost 10% to the two unprefetched blocks at its start. Per score the same FMAs in the same order,
 * then the same scaling: the same floats. */
AVX512_FN static void scores4_f16_avx512(const float *const *q, const void *kv, kv_blocks bl, int n, int hd,
                                         float scale, float *const *sc, const void *vc, att_pf *pf) {
    const uint16_t *kt = (const uint16_t *)kv;
    const __m512 vs = _mm512_set1_ps(scale);
    const float *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
    const int own = !pf || vc; /* an item whose lines nobody requested yet (pf NULL: prefill) */
    for (int t0 = 0; t0 < n; t0 += 2 * KT_BLOCK) {
        __mmask16 m[4];
        for (int v = 0; v < 4; v++) m[v] = mask16(n - t0 - 16 * v);
        const int b = t0 / KT_BLOCK;
        const uint16_t *k0 = kt + BLK(bl, b);
        const uint16_t *k1 = t0 + KT_BLOCK < n ? kt + BLK(bl, b + 1) : k0; /* its lanes are masked off past n */
        /* the next pass's two blocks (hd lines each), a line of each per step; past n: this block, harmlessly */
        const char *nx0 = pf_block(kt, bl, b + 2, n, 2), *nx1 = pf_block(kt, bl, b + 3, n, 2);
        if (!nx0) nx0 = (const char *)k0;
        if (!nx1) nx1 = (const char *)k0;
        const char *v0 = vc ? (const char *)vc + BLK(bl, b) * 2 : NULL;
        const char *v1 = vc && t0 + KT_BLOCK < n ? (const char *)vc + BLK(bl, b + 1) * 2 : v0;
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) a[j][v] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i++) {
            att_pf_step(pf);
            if (own) __builtin_prefetch(nx0 + (int64_t)i * 64, 0, 3), __builtin_prefetch(nx1 + (int64_t)i * 64, 0, 3);
            if (v0) __builtin_prefetch(v0 + (int64_t)i * 64, 0, 3), __builtin_prefetch(v1 + (int64_t)i * 64, 0, 3);
            const int64_t off = (int64_t)i * KT_BLOCK;
            __m512 x[4];
            x[0] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[0], k0 + off));
            x[1] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[1], k0 + off + 16));
            x[2] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[2], k1 + off));
            x[3] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[3], k1 + off + 16));
            fma4x4_avx512(a, x, q0[i], q1[i], q2[i], q3[i]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(sc[j] + t0 + 16 * v, m[v], _mm512_mul_ps(a[j][v], vs));
    }
}
AVX512_FN static void scores_avx512(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n,
                                    int hd, float scale, float *const *sc) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < n; t0 += 32) {
        const __mmask16 m0 = mask16(n - t0), m1 = mask16(n - t0 - 16);
        __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        const int64_t base = BLK(bl, t0 / KT_BLOCK);
        const char *next = pf_block(kt, bl, t0 / KT_BLOCK + 1, n, f16 ? 2 : 4);
        for (int i = 0; i < hd; i++) {
            pf_lines(next, i, f16 ? 1 : 2, f16 ? hd : 2 * hd); /* a block: 32 x hd values, hd (f16) or 2 hd lines */
            const int64_t off = base + (int64_t)i * KT_BLOCK;
            const __m512 k0 = load16(kt, f16, off, m0), k1 = load16(kt, f16, off + 16, m1);
            __m512 b = _mm512_set1_ps(q[0][i]);
            a00 = _mm512_fmadd_ps(b, k0, a00), a01 = _mm512_fmadd_ps(b, k1, a01);
            if (R > 1) {
                b = _mm512_set1_ps(q[1][i]);
                a10 = _mm512_fmadd_ps(b, k0, a10), a11 = _mm512_fmadd_ps(b, k1, a11);
            }
            if (R > 2) {
                b = _mm512_set1_ps(q[2][i]);
                a20 = _mm512_fmadd_ps(b, k0, a20), a21 = _mm512_fmadd_ps(b, k1, a21);
            }
            if (R > 3) {
                b = _mm512_set1_ps(q[3][i]);
                a30 = _mm512_fmadd_ps(b, k0, a30), a31 = _mm512_fmadd_ps(b, k1, a31);
            }
        }
        _mm512_mask_storeu_ps(sc[0] + t0, m0, _mm512_mul_ps(a00, vs)), _mm512_mask_storeu_ps(sc[0] + t0 + 16, m1, _mm512_mul_ps(a01, vs));
        if (R > 1) _mm512_mask_storeu_ps(sc[1] + t0, m0, _mm512_mul_ps(a10, vs)), _mm512_mask_storeu_ps(sc[1] + t0 + 16, m1, _mm512_mul_ps(a11, vs));
        if (R > 2) _mm512_mask_storeu_ps(sc[2] + t0, m0, _mm512_mul_ps(a20, vs)), _mm512_mask_storeu_ps(sc[2] + t0 + 16, m1, _mm512_mul_ps(a21, vs));
        if (R > 3) _mm512_mask_storeu_ps(sc[3] + t0, m0, _mm512_mul_ps(a30, vs)), _mm512_mask_storeu_ps(sc[3] + t0 + 16, m1, _mm512_mul_ps(a31, vs));
    }
}
AVX512_FN static void wsum_avx512(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out) {
    for (int c0 = 0; c0 < hd; c0 += 128) { /* 8 zmm accumulators = 128 output columns */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const int r = hd - c0;
        const __mmask16 k0 = mask16(r), k1 = mask16(r - 16), k2 = mask16(r - 32), k3 = mask16(r - 48);
        const __mmask16 k4 = mask16(r - 64), k5 = mask16(r - 80), k6 = mask16(r - 96), k7 = mask16(r - 112);
        for (int t = 0; t < n; t++) {
            const __m512 w = _mm512_set1_ps(p[t]);
            const int64_t o = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
            a0 = _mm512_fmadd_ps(w, load16(vc, f16, o, k0), a0);
            a1 = _mm512_fmadd_ps(w, load16(vc, f16, o + 16, k1), a1);
            a2 = _mm512_fmadd_ps(w, load16(vc, f16, o + 32, k2), a2);
            a3 = _mm512_fmadd_ps(w, load16(vc, f16, o + 48, k3), a3);
            if (k4) {
                a4 = _mm512_fmadd_ps(w, load16(vc, f16, o + 64, k4), a4);
                a5 = _mm512_fmadd_ps(w, load16(vc, f16, o + 80, k5), a5);
                a6 = _mm512_fmadd_ps(w, load16(vc, f16, o + 96, k6), a6);
                a7 = _mm512_fmadd_ps(w, load16(vc, f16, o + 112, k7), a7);
            }
        }
        _mm512_mask_storeu_ps(out + c0, k0, a0), _mm512_mask_storeu_ps(out + c0 + 16, k1, a1);
        _mm512_mask_storeu_ps(out + c0 + 32, k2, a2), _mm512_mask_storeu_ps(out + c0 + 48, k3, a3);
        _mm512_mask_storeu_ps(out + c0 + 64, k4, a4), _mm512_mask_storeu_ps(out + c0 + 80, k5, a5);
        _mm512_mask_storeu_ps(out + c0 + 96, k6, a6), _mm512_mask_storeu_ps(out + c0 + 112, k7, a7);
    }
}
/* two queries over the same values: each value row is loaded (and converted) once for both */
AVX512_FN static void wsum2_avx512(const float *p0, const float *p1, const void *vc, kv_blocks bl, int f16, int n,
                                   int hd, float *out0, float *out1) {
    for (int c0 = 0; c0 < hd; c0 += 128) {
        __m512 a[8], b[8];
        __mmask16 k[8];
        for (int j = 0; j < 8; j++) a[j] = b[j] = _mm512_setzero_ps(), k[j] = mask16(hd - c0 - 16 * j);
        for (int t = 0; t < n; t++) {
            const __m512 w0 = _mm512_set1_ps(p0[t]), w1 = _mm512_set1_ps(p1[t]);
            const int64_t o = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
            if (c0 == 0) /* this row of the next block: hd x esize bytes */
                pf_lines(pf_block(vc, bl, t / KT_BLOCK + 1, n, f16 ? 2 : 4), t % KT_BLOCK, hd * (f16 ? 2 : 4) / 64,
                         hd * (f16 ? 2 : 4) / 2);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                if (!k[j]) break;
                const __m512 v = load16(vc, f16, o + 16 * j, k[j]);
                a[j] = _mm512_fmadd_ps(w0, v, a[j]);
                b[j] = _mm512_fmadd_ps(w1, v, b[j]);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_mask_storeu_ps(out0 + c0 + 16 * j, k[j], a[j]);
            _mm512_mask_storeu_ps(out1 + c0 + 16 * j, k[j], b[j]);
        }
    }
}

/* The four-query value pass of wsum4_f16_avx2 on 512-bit registers: a KV head's four query heads (decode, GQA 4)
 * or four rows of one head (a prefill chunk) over an f16 cache, each value vector converted once for the four
 * (wsum2_avx512 converted every value vector twice per four queries: with the scores, 40% of a 4,096-token
 * prefill on this Zen 5). 64 columns at a time over all n positions: 16 accumulators, 4 value vectors and a weight
 * in registers, written to out once. (Blocks of positions with the accumulators kept in a stack array cost a
 * scalar zeroing and copy-out of 4 x hd floats per call, a fifth of this kernel's time at 256 positions.) A column
 * pass reads whole lines (64 f16 columns are two), so the passes together read each value line once. The first
 * pass prefetches whole rows of the next block: prefetching only its own columns left the second pass to miss
 * on every row of a decode piece coming from memory (decode attention at 3,000 positions, 30 layers, 2 threads:
 * 6.8-7.5 -> 6.1-6.4 ms a token; whole-model decode there +8-12%). Per output element the same FMAs in the same
 * order as wsum_avx512: the same floats. hd a multiple of 16. */
AVX512_FN static void wsum4_f16_avx512(const float *const *p, const void *vc, kv_blocks bl, int n, int hd,
                                       float *const *out, att_pf *pf) {
    const float *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    for (int col = 0; col < hd; col += 64) {
        const int nv = hd - col >= 64 ? 4 : (hd - col) / 16; /* value vectors of this column pass */
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) a[j][v] = _mm512_setzero_ps();
        for (int ts = 0; ts < n; ts += KT_BLOCK) { /* one KT_BLOCK: rows hd apart */
            const int tn = ts + KT_BLOCK < n ? ts + KT_BLOCK : n;
            const uint16_t *vp = (const uint16_t *)vc + BLK(bl, ts / KT_BLOCK) + col;
            /* the first column pass prefetches whole rows of the next block, a row per step (past n: this
             * block, harmlessly); the later passes find their lines in L2 */
            const char *nx = pf_block(vc, bl, ts / KT_BLOCK + 1, n, 2);
            nx = nx ? nx : (const char *)vp;
            const int pf_lines_row = col == 0 && !pf ? (hd * 2 + 63) / 64 : 0;
            if (nv == 4) {
                for (int t = ts; t < tn; t++, vp += hd, nx += (int64_t)hd * 2) {
                    att_pf_step(pf);
                    if (pf_lines_row) {
                        __builtin_prefetch(nx, 0, 3), __builtin_prefetch(nx + 64, 0, 3); /* hd >= 64 here */
                        for (int l = 2; l < pf_lines_row; l++) __builtin_prefetch(nx + 64 * l, 0, 3);
                    }
                    __m512 x[4];
#pragma GCC unroll 4
                    for (int v = 0; v < 4; v++) x[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vp + 16 * v)));
                    fma4x4_avx512(a, x, p0[t], p1[t], p2[t], p3[t]);
                }
            } else {
                for (int t = ts; t < tn; t++, vp += hd)
                    for (int v = 0; v < nv; v++) {
                        const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vp + 16 * v)));
                        a[0][v] = _mm512_fmadd_ps(_mm512_set1_ps(p0[t]), x, a[0][v]);
                        a[1][v] = _mm512_fmadd_ps(_mm512_set1_ps(p1[t]), x, a[1][v]);
                        a[2][v] = _mm512_fmadd_ps(_mm512_set1_ps(p2[t]), x, a[2][v]);
                        a[3][v] = _mm512_fmadd_ps(_mm512_set1_ps(p3[t]), x, a[3][v]);
                    }
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                if (v < nv) _mm512_storeu_ps(out[j] + col + 16 * v, a[j][v]);
    }
}
#endif

static att_kernels kernels_for(int isa) {
    att_kernels k = {scores_scalar, wsum_scalar, NULL, NULL, NULL, 0, row_max_scalar, normalize_scalar};
#if defined(__x86_64__)
    if (isa >= OPS_ISA_AVX512) {
        k.scores = scores_avx512, k.scores4_f16 = scores4_f16_avx512, k.wsum = wsum_avx512, k.wsum2 = wsum2_avx512;
        k.wsum4_f16 = wsum4_f16_avx512, k.item_pf = 64;
        k.row_max = row_max_avx2, k.normalize = normalize_avx512;
    } else if (isa >= OPS_ISA_AVX2) {
        k.scores = scores_avx2, k.wsum = wsum_avx2, k.row_max = row_max_avx2;
        k.scores4_f16 = scores4_f16_run_avx2, k.wsum4_f16 = wsum4_f16_avx2, k.item_pf = 16;
    }
#endif
#if defined(__aarch64__) /* attention_neon.c */
    if (ops_neon())
        k.scores = att_scores_neon, k.wsum = att_wsum_neon, k.wsum4_f16 = att_wsum4_f16_neon, k.row_max = att_row_max_neon;
#endif
    return k;
}

/* One run of consecutive rows of one sequence: rows row0 .. row0+m-1 of qkv / out at positions pos0 ..,
 * its blocks addressed through `pages` (NULL: block b is at b * stride). */
typedef struct {
    int row0, m, pos0;
    const int32_t *pages;
} att_seg;

/* Long contexts in pieces. A row that sees more than PIECE positions has them split at multiples of PIECE; each
 * piece gets its own softmax (max m_k, sum l_k, normalized weighted sum o_k) and the pieces are folded in order
 * into a running weighted mean (acc starts as o_0, L as l_0, M as m_0):
 *   M' = max(M, m_k), a = exp(M - M') L, b = exp(m_k - M') l_k,  acc = (acc a + o_k b) / (a + b),  L = a + b,
 * out = acc (fold_piece / fold_finish, the same code for every path). A decode row's pieces are separate work
 * items, so both threads of a 2-core machine stream the KV cache of every head (a KV head per item left one
 * thread idle for 2 of 5 heads and halved the cache reads in flight; 3000 positions: 23 ms per token on 2 threads
 * vs 27 on 1); a prefill row folds its pieces inside its item. The split depends on positions only, never on the
 * thread count, and a row within one piece is computed exactly as before. PIECE_MAX_HD bounds the per-thread
 * temporaries; wider heads are never split. */
#define PIECE 256
#define PIECE_MAX_HD 512
_Static_assert(PIECE == ATT_BF16_PIECE, "the bf16 bodies convert one piece at a time");

/* prefill attention in bf16 products (attention_bf16.h): off unless asked for (ops_set_attention_bf16) */
static int att_bf16_on;
void ops_set_attention_bf16(int on) { att_bf16_on = on != 0; }
int ops_get_attention_bf16(void) { return att_bf16_on; }
int ops_attention_bf16_vector(void) { return att_bf16_vector(); }
static inline int n_pieces(int n, int hd) { return hd > PIECE_MAX_HD || n <= PIECE ? 1 : (n + PIECE - 1) / PIECE; }
/* positions of a decode row of n positions in its piece k (a row in one piece: all n) */
static inline int piece_len(int n, int k, int hd) {
    return n_pieces(n, hd) == 1 ? n : n - k * PIECE < PIECE ? n - k * PIECE : PIECE;
}

/* state[0] = M, state[1] = L, state[2..] = acc: initialised from the first piece, then folded */
static void fold_piece(float *state, int first, float m_k, float l_k, const float *o_k, int hd) {
    if (first) {
        state[0] = m_k, state[1] = l_k;
        memcpy(state + 2, o_k, sizeof(float) * (size_t)hd);
        return;
    }
    const float M = state[0], L = state[1], M2 = m_k > M ? m_k : M;
    const float a = expf(M - M2) * L, b = expf(m_k - M2) * l_k, inv = 1.0f / (a + b);
    float *acc = state + 2;
    for (int i = 0; i < hd; i++) acc[i] = (acc[i] * a + o_k[i] * b) * inv;
    state[0] = M2, state[1] = a + b;
}
static void fold_finish(const float *state, int hd, float *out) { memcpy(out, state + 2, sizeof(float) * (size_t)hd); }

/* Work item: (segment, part of a KV head's query heads, piece); piece -1: all pieces of a prefill segment. */
typedef struct {
    int seg, it, piece;
} att_item;

/* Step 2 of attention_core over work items [item_begin, item_end) (one chunk of the pool). */
typedef struct {
    att_kernels K;
    att_q8_kernels Q; /* int8 cache (q8 set); its exp_sum is softmax's for every cache type */
    int q8;
    const att_seg *segs;
    const att_item *items;
    const int64_t *ws_off; /* per segment: its first state / partial in ws (units of hd + 2 floats), or -1 */
    int n_sub, group, sub, kv_f16, head_dim, row_stride, q_dim, n_heads, scratch_len;
    int64_t stride, k_head, v_head;
    size_t esize;
    const void *k_cache, *v_cache;
    const float *qkv;
    float *out, *scratch, *ws;
    const int8_t *qq; /* int8 cache: every row's query heads quantized, [row][n_heads][head_dim] */
    const float *qc;  /* their scales times the softmax scale, [row][n_heads] */
    float scale;
    char *bws; /* bf16 prefill passes: one workspace per thread slot (att_bf16_ws_bytes), NULL: f32 passes */
    size_t bws_bytes;
    int tiles16; /* bf16 prefill passes of 16 rows on the matrix tiles (att_bf16_tiles; head_dim a multiple of 32) */
} att_job;

/* block addressing from position p0 on (p0 a multiple of KT_BLOCK): the pages table or the base pointer moves */
static inline kv_blocks shift_blocks(kv_blocks bl, int p0, const char **base, size_t esize) {
    if (bl.pages) return (kv_blocks){bl.pages + p0 / KT_BLOCK, bl.stride};
    *base += (size_t)(p0 / KT_BLOCK) * (size_t)bl.stride * esize;
    return bl;
}

/* A prefill item's passes of 16 rows of one head over piece `tile` (already converted into bw) on the matrix tiles:
 * bf16 opt-in with att_bf16_tiles. The same softmax, pieces and fold as the 4-row passes of attention_items. */
static void prefill_tile_passes(const att_job *J, void *bw, att_seg S, int h0, int tile,
                                int64_t wso) {
    const int hd = J->head_dim, sw = hd + 2;
    float *sc = att_bf16_score_rows(bw, hd), *ot = att_bf16_temp_rows(bw, hd);
    att_bf16_tiles_begin();
    for (int h = h0; h < h0 + J->sub; h++)
        for (int r0 = 0; r0 < S.m; r0 += 16) {
            const int R = S.m - r0 < 16 ? S.m - r0 : 16;
            const float *qs[16];
            float *os[16], *st[16], *po[16], mxs[16], sums[16], invs[16];
            int ns[16], live[16], nk_max = 0;
            for (int j = 0; j < R; j++) {
                const int64_t row = S.row0 + r0 + j;
                qs[j] = J->qkv + row * J->row_stride + h * hd, os[j] = J->out + row * J->q_dim + h * hd;
                ns[j] = S.pos0 + r0 + j + 1;
                st[j] = wso < 0 ? NULL : J->ws + (wso + (int64_t)(r0 + j) * J->n_heads + h) * sw; /* fold state */
            }
            const int n_max = ns[R - 1], np_all = n_pieces(n_max, hd);
            if (tile >= np_all) continue; /* these rows end before this piece */
            { /* the next pass's query rows (16 rows of the head, a line per 16 floats) while this one computes */
                const int nr0 = r0 + 16 < S.m ? r0 + 16 : 0, nh = r0 + 16 < S.m ? h : h + 1;
                for (int j = 0; j < 16 && nh < h0 + J->sub && nr0 + j < S.m; j++)
                    for (int l = 0; l < hd; l += 16)
                        __builtin_prefetch(J->qkv + (int64_t)(S.row0 + nr0 + j) * J->row_stride + nh * hd + l, 0, 3);
            }
            const int p0 = tile * PIECE, p1 = np_all == 1 ? n_max : (p0 + PIECE < n_max ? p0 + PIECE : n_max);
            for (int j = 0; j < R; j++) {
                const int end = ns[j] < p1 ? ns[j] : p1;
                live[j] = end > p0 ? end - p0 : 0;
                nk_max = live[j] > nk_max ? live[j] : nk_max;
            }
            att_bf16_scores16(bw, qs, R, live, nk_max, hd, J->scale, mxs);
            float *rows[16];
            for (int j = 0; j < 16; j++) rows[j] = sc + (size_t)j * PIECE;
            att_bf16_softmax(bw, hd, rows, J->scale, 16, R, live, mxs, sums);
            for (int j = 0; j < R; j++) {
                invs[j] = live[j] ? 1.0f / sums[j] : 0.0f;
                po[j] = live[j] && n_pieces(ns[j], hd) == 1 ? os[j] : ot + (size_t)j * hd;
            }
            att_bf16_wsum16(bw, R, live, hd, invs, po);
            for (int j = 0; j < R; j++) {
                if (po[j] == os[j] || !live[j]) continue;
                fold_piece(st[j], tile == 0, mxs[j], sums[j], po[j], hd);
                if (tile == n_pieces(ns[j], hd) - 1) fold_finish(st[j], hd, os[j]);
            }
        }
    att_bf16_tiles_end();
}

static void attention_items(void *ctx, int item_begin, int item_end) {
    const att_job *J = ctx;
    const att_kernels K = J->K;
    const int n_sub = J->n_sub, group = J->group, sub = J->sub, kv_f16 = J->kv_f16, n_heads = J->n_heads;
    const int head_dim = J->head_dim, row_stride = J->row_stride, q_dim = J->q_dim, scratch_len = J->scratch_len;
    const int64_t stride = J->stride, k_head = J->k_head, v_head = J->v_head, sw = head_dim + 2;
    const size_t esize = J->esize;
    float *my_scratch = J->scratch + (int64_t)bk_thread_slot() * MAXQ * scratch_len;
    float tmp_o[MAXQ][PIECE_MAX_HD];
    void *bw = J->bws ? J->bws + (size_t)bk_thread_slot() * J->bws_bytes : NULL;
    int pf_next_item = 0;
    for (int item = item_begin; item < item_end; item++) {
        const att_item I = J->items[item];
        const att_seg S = J->segs[I.seg];
        const int kvh = I.it / n_sub, h0 = kvh * group + (I.it % n_sub) * sub, m = S.m;
        const char *kb0 = (const char *)J->k_cache + (size_t)kvh * k_head * esize;
        const char *vb0 = (const char *)J->v_cache + (size_t)kvh * v_head * esize;
        const int64_t wso = J->ws_off[I.seg];
        const float *qs[MAXQ];
        const int8_t *q8s[MAXQ]; /* int8 cache: the quantized queries and their scales */
        float *ss[MAXQ], *os[MAXQ], *st[MAXQ], qcs[MAXQ];
        int ns[MAXQ];
        /* a decode item of this run of items: the next item's keys and values stream in while this one computes
         * (att_pf); this one's were requested by the item before it (warm), or else it prefetches its own as it
         * goes. The four query heads in one pass (sub == MAXQ: scores4_f16 and wsum4_f16 step pf) */
        att_pf pf, *pfp = NULL;
        const int warm = pf_next_item; /* the item before requested this one's lines */
        pf_next_item = 0;
        const int pf_q8 = J->q8 && J->Q.pf_spos; /* the int8 kernels step it too */
        if (m == 1 && ((K.item_pf && kv_f16 && sub == MAXQ) || pf_q8) && item + 1 < item_end) {
            const att_item N = J->items[item + 1];
            const att_seg S2 = J->segs[N.seg];
            if (S2.m == 1) {
                /* this item's steps (scores4: a step per dimension and W positions; wsum4: a step per position
                 * and W columns; the int8 kernels: per pf_spos positions and 4 dimensions, per block and
                 * pf_wcols columns) carry the next item's 2 x nb blocks of `lines` lines */
                const int here = piece_len(S.pos0 + 1, I.piece, head_dim), W = K.item_pf;
                const int wc = J->Q.pf_wcols, sp = J->Q.pf_spos;
                const int steps = J->q8 ? (here + sp - 1) / sp * (head_dim / 4) + (here + KT_BLOCK - 1) / KT_BLOCK
                                                                                       * ((head_dim + wc - 1) / wc)
                                        : (here + W - 1) / W * head_dim + (head_dim + W - 1) / W * here;
                const int nb = (piece_len(S2.pos0 + 1, N.piece, head_dim) + KT_BLOCK - 1) / KT_BLOCK;
                const int lines = J->q8 ? Q8_LINES(head_dim) : head_dim;
                pf = (att_pf){(const char *)J->k_cache + (size_t)(N.it / n_sub) * k_head * esize,
                              (const char *)J->v_cache + (size_t)(N.it / n_sub) * v_head * esize,
                              {S2.pages, stride}, (int64_t)esize, N.piece * PIECE / KT_BLOCK, nb, lines,
                              (2 * nb * lines + steps - 1) / (steps > 0 ? steps : 1), 0, 0, NULL};
                att_pf_block(&pf);
                pfp = &pf;
                pf_next_item = 1;
            }
        }
        /* passes: (head block, one row) when decoding, (one head, row block) in a prefill chunk. A prefill chunk
         * goes piece by piece (outer loop), every pass of the item inside it: the piece's keys and values (PIECE
         * positions, 128 KB f16 at head_dim 128) are read from memory once and stay in L2 for all the chunk's
         * query rows of this KV head, where the pass-major order reread the whole cache of the head (2 MB at
         * 4096 positions, from L3 or memory) for every 4 rows. Each row still folds its pieces in order, with
         * the same operations: the same floats as before. */
        const int n_pass = m == 1 ? (sub + MAXQ - 1) / MAXQ : sub * ((m + MAXQ - 1) / MAXQ);
        const int n_tiles = m == 1 ? 1 : n_pieces(S.pos0 + m, head_dim);
        const int bf = bw && m > 1; /* bf16 passes: prefill rows only */
        for (int tile = 0; tile < n_tiles; tile++) {
        if (bf) { /* this piece's keys and values in bf16 pairs, once for every pass below */
            const int p0 = tile * PIECE, end = S.pos0 + m, p1 = n_tiles == 1 ? end : p0 + PIECE < end ? p0 + PIECE : end;
            const char *kb = kb0, *vb = vb0;
            const kv_blocks bl0 = {S.pages, stride};
            const kv_blocks kbl = shift_blocks(bl0, p0, &kb, esize), vbl = shift_blocks(bl0, p0, &vb, esize);
            att_bf16_piece(bw, kb, kbl, vb, vbl, kv_f16, p1 - p0, head_dim);
            if (J->tiles16 && m >= 16) { /* 16 rows a pass on the tiles */
                prefill_tile_passes(J, bw, S, h0, tile, wso);
                continue;
            }
        }
        for (int ps = 0; ps < n_pass; ps++) {
            int R = 0, n_max = 0;
            if (m == 1) {
                const float *qrow = J->qkv + (int64_t)S.row0 * row_stride;
                float *orow = J->out + (int64_t)S.row0 * q_dim;
                for (int h = h0 + ps * MAXQ; h < h0 + sub && R < MAXQ; h++, R++) {
                    qs[R] = qrow + h * head_dim, os[R] = orow + h * head_dim, ns[R] = S.pos0 + 1;
                    if (J->q8) q8s[R] = J->qq + ((int64_t)S.row0 * n_heads + h) * head_dim, qcs[R] = J->qc[(int64_t)S.row0 * n_heads + h];
                    st[R] = wso < 0 ? NULL : J->ws + (wso + (int64_t)I.piece * n_heads + h) * sw; /* partial k */
                }
            } else {
                const int nb = (m + MAXQ - 1) / MAXQ, h = h0 + ps / nb, r0 = (ps % nb) * MAXQ;
                for (int r = r0; r < m && R < MAXQ; r++, R++) {
                    qs[R] = J->qkv + (int64_t)(S.row0 + r) * row_stride + h * head_dim;
                    if (J->q8)
                        q8s[R] = J->qq + ((int64_t)(S.row0 + r) * n_heads + h) * head_dim,
                        qcs[R] = J->qc[(int64_t)(S.row0 + r) * n_heads + h];
                    os[R] = J->out + (int64_t)(S.row0 + r) * q_dim + h * head_dim;
                    ns[R] = S.pos0 + r + 1;
                    st[R] = wso < 0 ? NULL : J->ws + (wso + (int64_t)r * n_heads + h) * sw;   /* fold state */
                }
            }
            for (int j = 0; j < MAXQ; j++) ss[j] = my_scratch + (int64_t)j * scratch_len; /* bf16: all four */
            for (int j = 0; j < R; j++) n_max = ns[j] > n_max ? ns[j] : n_max;
            /* the piece of this pass: the item's (decode), or this tile if the longest row reaches it (prefill) */
            const int np_all = n_pieces(n_max, head_dim);
            const int k_lo = I.piece >= 0 ? I.piece : tile, k_hi = I.piece >= 0 ? I.piece + 1 : tile < np_all ? tile + 1 : tile;
            for (int k = k_lo; k < k_hi; k++) {
                const int p0 = k * PIECE, p1 = np_all == 1 ? n_max : (p0 + PIECE < n_max ? p0 + PIECE : n_max);
                const char *kb = kb0, *vb = vb0;
                const kv_blocks bl0 = {S.pages, stride};
                const kv_blocks kbl = shift_blocks(bl0, p0, &kb, esize), vbl = shift_blocks(bl0, p0, &vb, esize);
                float *po[MAXQ], mxs[MAXQ], sums[MAXQ], invs[MAXQ];
                int live[MAXQ], nk_max = 0;
                for (int j = 0; j < R; j++) {
                    const int end = ns[j] < p1 ? ns[j] : p1;
                    live[j] = end > p0 ? end - p0 : 0; /* this row's positions in the piece */
                    nk_max = live[j] > nk_max ? live[j] : nk_max;
                }
                if (bf) /* and each row's max */
                    att_bf16_scores(bw, qs, R, live, nk_max, head_dim, J->scale, ss, mxs);
                else if (J->q8)
                    J->Q.scores(q8s, qcs, R, (const int8_t *)kb, kbl, nk_max, head_dim, ss, pfp);
                else if (K.scores4_f16 && kv_f16 && R == 4)
                    K.scores4_f16(qs, kb, kbl, nk_max, head_dim, J->scale, ss, m == 1 && !warm ? vb : NULL, pfp);
                else
                    K.scores(qs, R, kb, kbl, kv_f16, nk_max, head_dim, J->scale, ss);
                if (bf) /* exp(s - max) straight into bf16 weight rows, and their sums */
                    att_bf16_softmax(bw, head_dim, ss, 1.0f, MAXQ, R, live, mxs, sums);
                for (int j = 0; j < R; j++) {
                    float *sc = ss[j];
                    const int n = live[j];
                    const float mx = bf ? mxs[j] : K.row_max(sc, n);
                    float sum = bf ? sums[j] : n ? J->Q.exp_sum(sc, n, mx) : 0.0f, inv = n ? 1.0f / sum : 0.0f;
                    /* a subnormal weight is 0, for every cache type (see q8_weight): on the lent Xeon f16 decode
                     * attention with all but two weights subnormal ran 2.3-4.8x slower without this, 1.0x with it.
                     * bf16: the weighted sum takes the unnormalized weights and multiplies by inv at its end (the
                     * bf16 rows flush subnormals), saving this pass over the row */
                    if (bf)
                        invs[j] = inv;
                    else
                        K.normalize(sc, n, inv, nk_max); /* positions after this row's own: no weight */
                    mxs[j] = mx, sums[j] = sum;
                    /* a row in one piece writes its output; a longer one its piece's into the partial / temp;
                     * a row that ended before this piece (prefill) only lends its lanes: output thrown away */
                    po[j] = !n ? tmp_o[j] : n_pieces(ns[j], head_dim) == 1 ? os[j] : m == 1 ? st[j] + 2 : tmp_o[j];
                }
                int j = 0;
                if (bf) { /* each row over its own positions; rows past R write into spare temporaries */
                    float *o4[MAXQ];
                    for (int r = 0; r < MAXQ; r++) o4[r] = r < R ? po[r] : tmp_o[r];
                    att_bf16_wsum(bw, R, live, head_dim, invs, o4);
                    j = R;
                } else if (J->q8) { /* positions after a row's own have weight 0: nk_max serves all R */
                    J->Q.wsum((const float *const *)ss, R, (const int8_t *)vb, vbl, nk_max, head_dim, po, pfp);
                    j = R;
                } else if (K.wsum4_f16 && kv_f16 && R == 4 && head_dim % 16 == 0 && head_dim <= WS4_MAX_HD) {
                    /* positions past a row's own have weight 0 (above): nk_max serves all four */
                    K.wsum4_f16((const float *const *)ss, vb, vbl, nk_max, head_dim, po, pfp);
                    j = 4;
                }
                if (K.wsum2 && !J->q8 && !bf)
                    for (; j + 2 <= R; j += 2) K.wsum2(ss[j], ss[j + 1], vb, vbl, kv_f16, live[j + 1], head_dim, po[j], po[j + 1]);
                for (; j < R; j++) K.wsum(ss[j], vb, vbl, kv_f16, live[j], head_dim, po[j]);
                for (j = 0; j < R; j++) {
                    if (po[j] == os[j] || !live[j]) continue;
                    if (m == 1) {
                        st[j][0] = mxs[j], st[j][1] = sums[j]; /* partial k, folded by the caller */
                    } else {
                        fold_piece(st[j], k == 0, mxs[j], sums[j], tmp_o[j], head_dim);
                        if (k == n_pieces(ns[j], head_dim) - 1) fold_finish(st[j], head_dim, os[j]);
                    }
                }
            }
        }
        } /* tile */
    }
}

/* The plan of attention's items for `threads` threads: *sub (query heads per item: a KV head's group is split while
 * there would be too few items for the threads; each part rereads the head's cache, the floats do not depend on
 * it), and the segments the items run over, written to out (NULL: only counted; returns their count). A prefill
 * chunk's items are long (a KV head's whole group over all rows): 5 KV heads on 2 threads run as 3 + 2, one
 * thread idle for a third of the step, so they are split until each thread has at least 4 items (not timed on its
 * own); with piece-major passes each part rereads its head's keys and values once per chunk, a small share of its
 * arithmetic. Where the query heads are split as far as they go and the items are still fewer than 4 per thread (16
 * threads on 5 KV heads x 4 query heads: 20 items, the second round keeping 4 of 16 threads busy, 62%), a
 * prefill segment also goes in blocks of its rows: they start a multiple of 16 rows from its start and hold at
 * least 16 (the last takes the rest), so every pass (4 rows, or 16 on the tiles) groups the rows it groups
 * unsplit: the same floats. A block rereads its KV head's positions up to its last row; the last rows, the
 * longest, come first (items are handed out in order). */
static int att_plan(const att_seg *segs, int n_segs, int n_kv, int group, int head_dim, int threads, int *sub_out,
                    att_seg *out) {
    int64_t base_items = 0;
    int prefill = 0;
    for (int sg = 0; sg < n_segs; sg++) {
        base_items += (int64_t)n_kv * (segs[sg].m == 1 ? n_pieces(segs[sg].pos0 + 1, head_dim) : 1);
        prefill |= segs[sg].m > 1;
    }
    const int64_t enough = (int64_t)(prefill ? 4 : 2) * threads;
    int sub = group;
    while (sub % 2 == 0 && base_items * (group / sub) < enough) sub /= 2;
    *sub_out = sub;
    const int64_t items = base_items * (group / sub);
    const int want = prefill && items < enough ? (int)((enough + items - 1) / items) : 1;
    int n = 0;
    for (int sg = 0; sg < n_segs; sg++) {
        const att_seg S = segs[sg];
        int rows = S.m, nb = 1;
        if (want > 1 && S.m >= 32) {
            rows = (S.m + want - 1) / want / 16 * 16;
            if (rows < 16) rows = 16;
            nb = S.m / rows;
        }
        for (int b = nb - 1; b >= 0; b--, n++)
            if (out) {
                const int r0 = b * rows;
                out[n] = (att_seg){S.row0 + r0, b == nb - 1 ? S.m - r0 : rows, S.pos0 + r0, S.pages};
            }
    }
    return n;
}

int ops_attention_plan(const int32_t *ms, const int32_t *pos0s, int n_segs, int n_heads, int n_kv, int head_dim,
                       int threads, int32_t *out, int max_out) {
    att_seg stack_segs[64];
    att_seg *segs = n_segs <= 64 ? stack_segs : malloc(sizeof(att_seg) * (size_t)n_segs);
    if (!segs) return -1;
    int row0 = 0, sub = 0;
    for (int i = 0; i < n_segs; row0 += ms[i], i++) segs[i] = (att_seg){row0, ms[i], pos0s[i], NULL};
    int n = att_plan(segs, n_segs, n_kv, n_heads / n_kv, head_dim, threads, &sub, NULL);
    att_seg *planned = malloc(sizeof(att_seg) * (size_t)(n > 0 ? n : 1));
    if (!planned || n > max_out) {
        free(planned);
        if (segs != stack_segs) free(segs);
        return planned ? -2 : -1;
    }
    att_plan(segs, n_segs, n_kv, n_heads / n_kv, head_dim, threads, &sub, planned);
    for (int i = 0; i < n; i++) {
        out[3 * i] = planned[i].row0, out[3 * i + 1] = planned[i].m, out[3 * i + 2] = planned[i].pos0;
    }
    out[3 * n] = sub;
    free(planned);
    if (segs != stack_segs) free(segs);
    return n;
}

/* The shared body of ops_attention (one segment, contiguous cache) and ops_attention_paged (one segment per
 * sequence of a batched step, caches in the page pool). k/v_head: elements between KV heads; stride:
 * elements between blocks. scratch: [scratch_rows, scratch_len] f32, OPS_ATT_SCRATCH_ROWS rows per thread.
 * Returns 0, or -1 when the workspace cannot be allocated. */
static int attention_core(float *qkv, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                          const float *rope_sin, const att_seg *segs, int n_segs, void *k_cache, void *v_cache,
                          int kv_type, int64_t k_head, int64_t v_head, int64_t stride, float *out, float *scratch,
                          int scratch_rows, int scratch_len) {
    const int isa = ops_isa();
    const int q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim, row_stride = q_dim + 2 * kv_dim;
    const int half = head_dim / 2, group = n_heads / n_kv;
    const float scale = 1.0f / sqrtf((float)head_dim);
    const int kv_f16 = kv_type == OPS_KV_F16, q8 = kv_type == OPS_KV_Q8;
    const size_t esize = q8 ? 1 : kv_f16 ? sizeof(uint16_t) : sizeof(float);

    /* 1. rotate q and k of every row, append k (into its transposed block) and v to the cache */
    int64_t work = 0;
    for (int sg = 0; sg < n_segs; sg++) {
        const att_seg S = segs[sg];
        const kv_blocks bl = {S.pages, stride};
        work += (int64_t)S.m * (S.pos0 + S.m);
        for (int r = 0; r < S.m; r++) {
            float *row = qkv + (int64_t)(S.row0 + r) * row_stride;
            const int pos = S.pos0 + r;
            const float *c = rope_cos + (int64_t)pos * half, *s = rope_sin + (int64_t)pos * half;
            ops_rope_heads(row, n_heads, head_dim, c, s); /* rope_kv.c */
            ops_rope_heads(row + q_dim, n_kv, head_dim, c, s);
            const int64_t blk = BLK(bl, pos / KT_BLOCK);
            for (int j = 0; j < n_kv; j++) {
                const int64_t vat = j * v_head + blk + (int64_t)(pos % KT_BLOCK) * head_dim;
                const int64_t kat = j * k_head + blk + pos % KT_BLOCK;
                const float *kr = row + q_dim + j * head_dim, *vr = row + q_dim + kv_dim + j * head_dim;
                if (q8) { /* a block's 32 scales follow its int8 values (attention_q8.h) */
                    att_q8_store_key(kr, head_dim, (int8_t *)k_cache + j * k_head + blk, pos % KT_BLOCK);
                    att_q8_store_value(vr, head_dim, (int8_t *)v_cache + j * v_head + blk, pos % KT_BLOCK);
                } else if (kv_f16) { /* rope_kv.c */
                    ops_kv_store_f16(kr, vr, head_dim, (uint16_t *)k_cache + kat, (uint16_t *)v_cache + vat);
                } else {
                    float *kc = (float *)k_cache + kat;
                    memcpy((float *)v_cache + vat, vr, sizeof(float) * head_dim);
                    for (int i = 0; i < head_dim; i++) kc[(int64_t)i * KT_BLOCK] = kr[i];
                }
            }
        }
    }

    /* 2. causal attention: scores of up to MAXQ query vectors per pass over the keys (the query heads
     * sharing a KV head when decoding, consecutive rows of one head in a prefill chunk), then per
     * query softmax and the weighted sum of values. Items: (segment, KV head, part of its query heads, and for a
     * long decode row, piece of its positions); a prefill segment may run as blocks of its rows (att_plan). */
    const att_kernels K = kernels_for(isa);
    int threads = bk_get_num_threads();
    if (threads > scratch_rows / MAXQ) threads = scratch_rows / MAXQ; /* scratch rows are per thread */
    if (threads < 1) threads = 1;
    int sub = group, n_bsegs = 0;
    att_seg stack_bsegs[64];
    const int n_max_bsegs = att_plan(segs, n_segs, n_kv, group, head_dim, threads, &sub, NULL);
    att_seg *bsegs = n_max_bsegs <= 64 ? stack_bsegs : malloc(sizeof(att_seg) * (size_t)n_max_bsegs);
    if (!bsegs) return -1;
    n_bsegs = att_plan(segs, n_segs, n_kv, group, head_dim, threads, &sub, bsegs);
    int prefill = 0;
    for (int sg = 0; sg < n_segs; sg++) prefill |= segs[sg].m > 1;
    const int n_sub = group / sub, per_seg = n_kv * n_sub;
    segs = bsegs, n_segs = n_bsegs; /* steps 2 and 3 run over the planned segments */
    /* items and workspace: a decode segment's pieces each hold n_heads partials, a long prefill segment's rows
     * each n_heads fold states (hd + 2 floats apiece) */
    int64_t n_items = 0, n_states = 0;
    for (int sg = 0; sg < n_segs; sg++) {
        const int np = n_pieces(segs[sg].pos0 + segs[sg].m, head_dim);
        n_items += (int64_t)per_seg * (segs[sg].m == 1 ? np : 1);
        if (np > 1) n_states += (int64_t)n_heads * (segs[sg].m == 1 ? np : segs[sg].m);
    }
    /* items are 12 bytes: the int64 offsets after them start on the next multiple of 8 (UBSan: misaligned) */
    const size_t items_bytes = (sizeof(att_item) * (size_t)n_items + 7) & ~(size_t)7;
    const size_t off_bytes = sizeof(int64_t) * (size_t)n_segs;
    const size_t head_bytes = (items_bytes + off_bytes + 63) & ~(size_t)63;
    /* per call: after the first free of a large block glibc raises its mmap threshold, so later calls reuse heap
     * memory without page faults */
    int64_t n_rows = 0; /* int8 cache: rows whose query heads are quantized (rows are numbered from 0) */
    for (int sg = 0; sg < n_segs && q8; sg++)
        n_rows = segs[sg].row0 + segs[sg].m > n_rows ? segs[sg].row0 + segs[sg].m : n_rows;
    const size_t ws_bytes = sizeof(float) * (size_t)n_states * (size_t)(head_dim + 2);
    const size_t qc_bytes = sizeof(float) * (size_t)(n_rows * n_heads);
    char *w = malloc(head_bytes + ws_bytes + qc_bytes + (size_t)(n_rows * n_heads) * (size_t)head_dim);
    if (!w) {
        if (bsegs != stack_bsegs) free(bsegs);
        return -1;
    }
    att_item *items = (att_item *)w;
    int64_t *ws_off = (int64_t *)(w + items_bytes);
    float *ws = (float *)(w + head_bytes);
    float *qc = (float *)(w + head_bytes + ws_bytes);
    int8_t *qq = (int8_t *)(w + head_bytes + ws_bytes + qc_bytes);
    for (int sg = 0; sg < n_segs && q8; sg++) /* rows already rotated (step 1) */
        for (int r = segs[sg].row0; r < segs[sg].row0 + segs[sg].m; r++)
            for (int h = 0; h < n_heads; h++)
                qc[(int64_t)r * n_heads + h] = att_q8_quantize_query(qkv + (int64_t)r * row_stride + h * head_dim, head_dim,
                                                                     scale, qq + ((int64_t)r * n_heads + h) * head_dim);
    int64_t ni = 0, off = 0;
    for (int sg = 0; sg < n_segs; sg++) {
        const att_seg S = segs[sg];
        const int np = n_pieces(S.pos0 + S.m, head_dim);
        ws_off[sg] = np > 1 ? off : -1;
        if (np > 1) off += (int64_t)n_heads * (S.m == 1 ? np : S.m);
        for (int it = 0; it < per_seg; it++) {
            if (S.m == 1)
                for (int k = 0; k < np; k++) items[ni++] = (att_item){sg, it, k};
            else
                items[ni++] = (att_item){sg, it, -1};
        }
    }
    /* threads only pay off with enough work: a hand-off costs microseconds, a short-context decode
     * step of one layer is tens of microseconds (2B-4T shape, avx2, 2 threads vs 1, median us per layer:
     * 64 positions 17-23 vs 22-30, 128: 33 vs 34-49, 256: 38-52 vs 56-75, 400: 53-57 vs 81-111; so from
     * ~100 positions, 1 << 18). A batched step uses the same bound: it once stayed serial up to 1 << 24 (for the
     * wait on a busy machine), which left the other thread spinning through 12% of a 16-sequence step; threaded,
     * 16 sequences of 32 + 128 tokens ran 194-201 -> 205-218 tok/s and 8 176-185 -> 190-195 (2-core Zen 5,
     * alternating builds), and with a burner on one core 117-120 either way */
    const int64_t min_work = (int64_t)1 << 18;
    att_q8_kernels Q = att_q8_kernels_for(isa);
#if defined(__aarch64__) /* attention_neon.c: sdot where the CPU has it */
    if (ops_neon()) Q = att_q8_neon_kernels(bk_get_isa() != BK_ISA_NEON);
#endif
    /* bf16 prefill passes (opt-in): a piece's keys and values per thread, 64-byte aligned */
    const int bf16 = att_bf16_on && prefill && !q8 && head_dim % 16 == 0 && head_dim <= PIECE_MAX_HD;
    const size_t bws_bytes = bf16 ? (att_bf16_ws_bytes(head_dim) + 63) & ~(size_t)63 : 0;
    char *bws = bf16 ? aligned_alloc(64, bws_bytes * (size_t)threads) : NULL;
    if (bf16 && !bws) {
        free(w);
        if (bsegs != stack_bsegs) free(bsegs);
        return -1;
    }
    const att_job job = {K, Q, q8, segs, items, ws_off, n_sub, group, sub, kv_f16, head_dim, row_stride, q_dim, n_heads,
                         scratch_len, stride, k_head, v_head, esize, k_cache, v_cache, qkv, out, scratch, ws, qq, qc, scale,
                         bws, bws_bytes, bf16 && head_dim % 32 == 0 && att_bf16_tiles()};
    /* grain 1: items are whole heads (or pieces), handed out one chunk at a time; slot < threads indexes the scratch */
    if (n_items > 1 && threads > 1 && work * n_heads * head_dim > min_work)
        bk_parallel_for((int)n_items, 1, threads, attention_items, (void *)&job);
    else
        attention_items((void *)&job, 0, (int)n_items);

    /* 3. a long decode row: its heads' pieces folded in order */
    for (int sg = 0; sg < n_segs; sg++) {
        const att_seg S = segs[sg];
        const int np = n_pieces(S.pos0 + S.m, head_dim);
        if (S.m != 1 || np == 1) continue;
        float *o = out + (int64_t)S.row0 * q_dim;
        for (int h = 0; h < n_heads; h++) {
            float *first = ws + (ws_off[sg] + h) * (head_dim + 2);
            for (int k = 1; k < np; k++) {
                const float *pk = ws + (ws_off[sg] + (int64_t)k * n_heads + h) * (head_dim + 2);
                fold_piece(first, 0, pk[0], pk[1], pk + 2, head_dim);
            }
            fold_finish(first, head_dim, o + h * head_dim);
        }
    }
    free(bws);
    free(w);
    if (bsegs != stack_bsegs) free(bsegs);
    return 0;
}

int ops_attention(float *qkv, int m, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                  const float *rope_sin, int pos0, void *k_cache, void *v_cache, int kv_type, int n_ctx,
                  float *out, float *scratch, int scratch_rows) {
    const att_seg seg = {0, m, pos0, NULL};
    const int64_t nblk = (n_ctx + KT_BLOCK - 1) / KT_BLOCK;
    const int64_t blk = kv_type == OPS_KV_Q8 ? OPS_Q8_BLOCK_BYTES(head_dim) : (int64_t)KT_BLOCK * head_dim;
    const int64_t k_head = nblk * blk, v_head = kv_type == OPS_KV_Q8 ? nblk * blk : (int64_t)n_ctx * head_dim;
    return attention_core(qkv, n_heads, n_kv, head_dim, rope_cos, rope_sin, &seg, 1, k_cache, v_cache, kv_type, k_head,
                          v_head, blk, out, scratch, scratch_rows, n_ctx);
}

int ops_attention_paged(float *qkv, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                         const float *rope_sin, int n_seqs, const int32_t *seq_rows, const int32_t *seq_pos0,
                         const int32_t *page_table, int max_pages, void *k_pool, void *v_pool, int kv_type,
                         float *out, float *scratch, int scratch_rows, int scratch_len) {
    att_seg stack_segs[64];
    att_seg *segs = n_seqs <= 64 ? stack_segs : malloc(sizeof(att_seg) * (size_t)n_seqs);
    if (!segs) return -1;
    int n = 0;
    for (int i = 0; i < n_seqs; i++) {
        const int m = seq_rows[i + 1] - seq_rows[i];
        if (m <= 0) continue;
        segs[n++] = (att_seg){seq_rows[i], m, seq_pos0[i], page_table + (int64_t)i * max_pages};
    }
    const int64_t blk = kv_type == OPS_KV_Q8 ? OPS_Q8_BLOCK_BYTES(head_dim) : (int64_t)KT_BLOCK * head_dim;
    const int rc = attention_core(qkv, n_heads, n_kv, head_dim, rope_cos, rope_sin, segs, n, k_pool, v_pool, kv_type,
                                  blk, blk, blk * n_kv, out, scratch, scratch_rows, scratch_len);
    if (segs != stack_segs) free(segs);
    return rc;
}
