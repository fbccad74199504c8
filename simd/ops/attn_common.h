/* Shared by attention.c (f16 / f32 cache) and attention_q8.c (int8 cache): the x86 bodies' target attributes,
 * softmax's exp (Cephes' expf polynomial, ~1 ulp, like the vectorized exp torch uses) in one scalar lane and in
 * AVX2 / AVX-512 registers, the one reduction order of 16 lane sums, and lane masks. One copy, so bodies that must
 * give the same bits use the very same operations.
 *
 * exp is only ever taken of x <= 0 (a score minus the row's max): arguments below EXP_LO give 0 (their true value
 * underflows anyway), so 2^n is always a normal float (n >= -126) and is built from its exponent bits. */
#ifndef BITNET_ATTN_COMMON_H
#define BITNET_ATTN_COMMON_H

#include <float.h> /* FLT_MIN */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ops.h" /* OPS_KT_BLOCK */

#if defined(__x86_64__)
#include <immintrin.h>
/* the AVX2 level of the dispatcher implies FMA and F16C (simd/kernels/dispatch.c) */
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#endif

/* Positions live in blocks of OPS_KT_BLOCK: block b of one KV head starts at element (pages ? pages[b] : b) * stride
 * of that head's base (a contiguous cache: pages NULL; the paged pool: the sequence's page table). Elements are
 * bytes for the int8 cache (layout: attention_q8.h). */
typedef struct {
    const int32_t *pages;
    int64_t stride;
} kv_blocks;
#define BLK(bl, b) ((int64_t)((bl).pages ? (bl).pages[(b)] : (b)) * (bl).stride)


/* Software prefetch of the next block of a stream (keys in the scores, values in the weighted sum). A decode
 * piece streams 64 KB of f16 keys then 64 KB of values, cut at every 4 KB page where the hardware's streamer stops
 * and waits for new misses; this keeps one block (4-16 KB) in flight ahead of the reads. A kernel reading block b
 * calls pf_lines(next, s, per, lines) at its step s there: lines s*per .. s*per+per-1 of block b + 1 (next:
 * pf_block, NULL past the last of the n positions, so a page table is never read beyond them). No float changes. */
static inline const char *pf_block(const void *base, kv_blocks bl, int b, int n, int64_t esize) {
    return (int64_t)b * OPS_KT_BLOCK < n ? (const char *)base + BLK(bl, b) * esize : NULL;
}
static inline void pf_lines(const char *next, int s, int per, int lines) {
    if (!next) return;
    for (int l = s * per; l < s * per + per && l < lines; l++) __builtin_prefetch(next + (int64_t)l * 64, 0, 3);
}

/* Software prefetch of the next work item's keys and values while this one computes. A decode item (a KV head's
 * query group over <= 256 positions) computes little on each line it reads, and a block ahead covers a fraction
 * of the memory latency at 3-8 blocks an item: its loads stalled on lines nobody had requested (batched decode at
 * 96 positions: the items' time from memory was the sum of their time from L3 and the memory reads, no overlap).
 * So a thread's run of items streams the next item's lines (keys first, then values), `per` a step, spread over
 * the current item's steps. Measured on 2-core Zen 5 (with the values prefetched beside the keys, see
 * scores4_f16_avx512), whole batched / decode steps, alternating in one process: 16 sequences at 1,024 positions
 * +3% (2 threads) / +9% (1 thread), one sequence at 4,096 +6% / +18%, 16 at 96 +-0 / +5%. No float changes. */
typedef struct {
    const char *k, *v; /* the next item's KV head bases */
    kv_blocks bl;
    int64_t esize;
    int b0, nb, lines; /* its first block, its blocks, lines per block */
    int per, blk, l;   /* lines a step; the next line to request: block blk (0 .. 2 nb - 1: keys, then values), line l */
    const char *at;    /* block blk's first line */
} att_pf;
static inline void att_pf_block(att_pf *p) {
    const int b = p->blk < p->nb ? p->blk : p->blk - p->nb;
    p->at = p->blk < 2 * p->nb ? (p->blk < p->nb ? p->k : p->v) + BLK(p->bl, p->b0 + b) * p->esize : NULL;
}
static inline void att_pf_step(att_pf *p) {
    if (!p || !p->at) return;
    for (int c = 0; c < p->per; c++) {
        __builtin_prefetch(p->at + (int64_t)p->l * 64, 0, 3);
        if (++p->l == p->lines) {
            p->l = 0, p->blk++;
            att_pf_block(p);
            if (!p->at) return;
        }
    }
}
/* The int8 cache's kernels for one ISA (attention_q8.c: scalar, AVX2, AVX-512; attention_neon.c: NEON). Every
 * ISA's body gives the same bits as the scalar one: f32 FMAs in the same order per output element (fmaf in the
 * scalar code), exp on one polynomial, sums over 16 fixed lanes. */
typedef struct {
    /* sc[j][t] = (sum_i q8[j][i] * k[i][t]) * kscale[t] * c[j], q8[j] / c[j]: query j quantized like the cache by
     * att_q8_quantize_query (c[j] = its scale * the softmax scale); j < R <= 4, t < n */
    void (*scores)(const int8_t *const *q8, const float *c, int R, const int8_t *kt, kv_blocks bl, int n, int hd,
                   float *const *sc, att_pf *pf);
    /* out[j][c] = sum_t (p[j][t] * vscale[t]) * v[t][c], j < R <= 4, t < n (in order); hd <= OPS_Q8_MAX_HD */
    void (*wsum)(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd, float *const *out,
                 att_pf *pf);
    /* x[i] = exp(x[i] - mx); returns the sum. Softmax's exp for every cache type (attention.c calls it for the
     * f16 / f32 cache too) */
    float (*exp_sum)(float *x, int n, float mx);
    /* a decode item prefetches the next one's keys and values (att_pf, pf non-NULL) one step at a time: the scores
     * a step per pf_spos positions and 4 dimensions, the weighted sum a step per block and pf_wcols columns;
     * 0: no such prefetch (pf is ignored) */
    int pf_spos, pf_wcols;
} att_q8_kernels;

/* a scores entry point that inlines its body with R = 4 (a KV head's query group: the accumulators stay in
 * registers) and otherwise with R as given */
#define Q8_SCORES_ENTRY(ATTR, name, body)                                                                      \
    ATTR static void name(const int8_t *const *q8, const float *c, int R, const int8_t *kt, kv_blocks bl, int n, \
                          int hd, float *const *sc, att_pf *pf) {                                              \
        if (R == 4) body(q8, c, 4, kt, bl, n, hd, sc, pf);                                                     \
        else body(q8, c, R, kt, bl, n, hd, sc, pf);                                                            \
    }

/* an int8 block's 32 f32 scales follow its OPS_KT_BLOCK x hd int8 values */
#define Q8_SCALES(base, blk, hd) ((const float *)((base) + (blk) + (int64_t)OPS_KT_BLOCK * (hd)))

/* a position's weight in the int8 weighted sum, p x its value scale; a subnormal one is 0 (every path, the scalar
 * body too, so all give the same bits): it moves an output by under 1e-35, while Intel cores take a microcode assist
 * on each FMA a subnormal operand enters. On the lent 16-core Xeon (AVX-512) a decode at 4,096 positions whose
 * weights were all subnormal (a benchmark's cache of tiny scales) ran at 1.9 tok/s against 15.4 with f16 K/V. */
static inline float q8_weight(float p, float vscale) {
    const float w = p * vscale;
    return fabsf(w) < FLT_MIN ? 0.0f : w;
}

/* one run of the int8 weighted sum from position ts (a multiple of OPS_KT_BLOCK: one block, at most its 32
 * positions, tn of them): w[j][t] = q8_weight(p[j][ts + t], vscale[t]), v0 its first value row, next the block to
 * prefetch meanwhile (pf_block; Q8_LINES(hd) lines) */
#define Q8_LINES(hd) ((int)((OPS_Q8_BLOCK_BYTES(hd) + 63) / 64))
typedef struct {
    float w[4][OPS_KT_BLOCK];
    const int8_t *v0;
    const char *next;
    int tn;
} q8_run_t;
static inline void q8_run(q8_run_t *r, const float *const *p, int R, const int8_t *vc, kv_blocks bl, int ts, int n,
                          int hd) {
    const int64_t blk = BLK(bl, ts / OPS_KT_BLOCK);
    const float *vs = Q8_SCALES(vc, blk, hd);
    r->tn = ts + OPS_KT_BLOCK < n ? OPS_KT_BLOCK : n - ts;
    for (int j = 0; j < R; j++)
        for (int t = 0; t < r->tn; t++) r->w[j][t] = q8_weight(p[j][ts + t], vs[t]);
    r->v0 = vc + blk;
    r->next = pf_block(vc, bl, ts / OPS_KT_BLOCK + 1, n, 1);
}

#define EXP_LO (-87.3f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_C0 1.9875691500E-4f
#define EXP_C1 1.3981999507E-3f
#define EXP_C2 8.3334519073E-3f
#define EXP_C3 4.1665795894E-2f
#define EXP_C4 1.6666665459E-1f
#define EXP_C5 5.0000001201E-1f

static inline float sum16(const float *s) { /* the one reduction order of 16 lane sums */
    float t[16];
    memcpy(t, s, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}

static inline float exp_poly(float x) { /* the vector bodies' operations, one lane (fmaf where they fuse) */
    x = x > EXP_LO ? x : EXP_LO;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = EXP_C0;
    p = fmaf(p, r, EXP_C1);
    p = fmaf(p, r, EXP_C2);
    p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C4);
    p = fmaf(p, r, EXP_C5);
    const float y = fmaf(p * r, r, r) + 1.0f;
    const uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return y * two_n;
}

#if defined(__x86_64__)
/* exp(x) on the polynomial in registers, one body for both widths: P the intrinsics' prefix, V the vector type,
 * ROUND its round-to-nearest, CAST its int -> float bit cast */
#define EXP_VEC_BODY(P, V, ROUND, CAST)                                                                   \
    x = P##_max_ps(x, P##_set1_ps(EXP_LO));                                                               \
    V n = ROUND(P##_mul_ps(x, P##_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);    \
    V r = P##_fnmadd_ps(n, P##_set1_ps(EXP_LN2_HI), x);                                                   \
    r = P##_fnmadd_ps(n, P##_set1_ps(EXP_LN2_LO), r);                                                     \
    V p = P##_set1_ps(EXP_C0);                                                                            \
    p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C1));                                                          \
    p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C2));                                                          \
    p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C3));                                                          \
    p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C4));                                                          \
    p = P##_fmadd_ps(p, r, P##_set1_ps(EXP_C5));                                                          \
    V y = P##_add_ps(P##_fmadd_ps(P##_mul_ps(p, r), r, r), P##_set1_ps(1.0f));                            \
    return P##_mul_ps(y, CAST(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23)))

AVX2_FN static inline __m256 exp_avx2(__m256 x) { EXP_VEC_BODY(_mm256, __m256, _mm256_round_ps, _mm256_castsi256_ps); }
AVX512_FN static inline __m512 exp_avx512(__m512 x) {
    EXP_VEC_BODY(_mm512, __m512, _mm512_roundscale_ps, _mm512_castsi512_ps);
}
AVX2_FN static inline __m256i lanes_below(int k) { /* lanes 0..k-1 set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

#endif
