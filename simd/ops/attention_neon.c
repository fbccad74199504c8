/* NEON bodies of attention (aarch64): scores and the weighted sum of values over the f16 / f32 cache
 * (attention.c), and scores, softmax's exp and the weighted sum over the int8 cache (attention_q8.c).
 *
 * Bit-identical to the scalar bodies, which fixes how each is written:
 * - f16 / f32 cache: the scalar reference fuses `d = fmaf(q, k, d)`, one position per lane of the transposed key
 *   block, i in order; the weighted sum is `out[c] = fmaf(p[t], v[c], out[c])`, t in order. So these bodies use
 *   one fmla per 4 lanes (it was fmul + fadd while the reference was unfused) in the same order per lane.
 *   Softmax's exp is the int8 cache's (q8_exp_sum below) for every cache type.
 *   f16 -> f32 is fcvtl (baseline Armv8 AdvSIMD, exact like bk_half_to_float).
 * - int8 cache: integer dot products (exact: sdot with dotprod, smull/smlal + sadalp without), then the scalar
 *   body's float epilogue in its order; the weighted sum in fused fmla, the order of the scalar fmaf; exp on
 *   attention_q8.c's polynomial over 16 fixed lanes with its reduction order.
 * Every stream of keys or values prefetches its next block as the x86 bodies do (pf_block / pf_lines,
 * attn_common.h): a few lines per step of the block being read. No float changes.
 * tests/test_attention_neon.py runs every cache type on every path under qemu and compares bytes.
 */
#include "attention_neon.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "attn_common.h" /* sum16 */
#include "exp_neon.h"   /* the exp polynomial in NEON registers */
#include "ops.h"

#define KT_BLOCK OPS_KT_BLOCK
#define Q8_MAX_HD OPS_Q8_MAX_HD
#define DOT_FN __attribute__((target("arch=armv8.2-a+dotprod")))
#define INLINE static inline __attribute__((always_inline))

/* How many of a loop's steps s0, s0 + 1, .. (at most steps of them) prefetch anything under pf_lines(next, s, per,
 * lines): the loop then calls pf_first(next, s, per) for those alone, without pf_lines' checks at every step (gcc
 * splits such a loop in two at -O3). A decode step over the f16 cache under qemu, instructions per byte: 1.679
 * without prefetch, 1.846 with pf_lines in every step, 1.724 so. Where lines % per != 0 (int8 blocks) the last
 * step touches a line or so past the block: a hint, which never faults. */
INLINE int pf_steps(const char *next, int s0, int per, int lines, int steps) {
    const int m = next ? (lines + per - 1) / per - s0 : 0;
    return m < 0 ? 0 : m < steps ? m : steps;
}
INLINE void pf_first(const char *next, int s, int per) {
    for (int l = 0; l < per; l++) __builtin_prefetch(next + ((int64_t)s * per + l) * 64, 0, 3);
}
/* the lines of four steps s .. s + 3 at once (an unrolled loop's group): where pf_m is not a multiple of four, the
 * last group touches up to three steps' lines past the block, hints that never fault */
INLINE void pf_four(const char *next, int s, int per) {
    const char *a = next + (int64_t)s * per * 64;
    for (int l = 0; l < 4 * per; l++) __builtin_prefetch(a + l * 64, 0, 3);
}

/* A score row's max, 8 lanes at a time (it was the scalar loop: one dependent compare per position, 12 k of a
 * decode step's 291 k instructions under qemu). x > m ? x : m per lane is the scalar rule (a NaN score is skipped,
 * a -0 / +0 tie keeps the first), so the result is the scalar one up to that tie, as row_max_avx2's; exp(s - max)
 * and the piece fold give the same floats for either zero. */
float att_row_max_neon(const float *x, int n) {
    float32x4_t m0 = vdupq_n_f32(-INFINITY), m1 = m0;
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const float32x4_t a = vld1q_f32(x + t), b = vld1q_f32(x + t + 4);
        m0 = vbslq_f32(vcgtq_f32(a, m0), a, m0), m1 = vbslq_f32(vcgtq_f32(b, m1), b, m1);
    }
    float l[8], mx = -INFINITY;
    vst1q_f32(l, m0), vst1q_f32(l + 4, m1);
    for (int i = 0; i < 8; i++) mx = l[i] > mx ? l[i] : mx;
    for (; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

/* ---------------- f16 / f32 cache ---------------- */

/* 16 consecutive values (keys of 16 positions, or 16 columns of a value row) as four f32 vectors */
INLINE void load16(const void *base, const int f16, int64_t off, float32x4_t *k) {
    if (f16) {
        const float16x8_t a = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *)base + off));
        const float16x8_t b = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *)base + off + 8));
        k[0] = vcvt_f32_f16(vget_low_f16(a)), k[1] = vcvt_high_f32_f16(a);
        k[2] = vcvt_f32_f16(vget_low_f16(b)), k[3] = vcvt_high_f32_f16(b);
    } else {
        const float *p = (const float *)base + off;
        k[0] = vld1q_f32(p), k[1] = vld1q_f32(p + 4), k[2] = vld1q_f32(p + 8), k[3] = vld1q_f32(p + 12);
    }
}
INLINE float32x4_t load4(const void *base, const int f16, int64_t off) {
    return f16 ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)base + off)))
               : vld1q_f32((const float *)base + off);
}

/* 16 positions (a half key block) at a time, R x 4 accumulators in registers; a last partial run is computed
 * on all 16 lanes (they stay inside the allocated block) and only its valid scores are kept */
INLINE void scores_body(const float *const *q, const int R, const void *kt, kv_blocks bl, const int f16, int n,
                        int hd, float scale, float *const *sc) {
    const float32x4_t vs = vdupq_n_f32(scale);
    const int64_t esize = f16 ? 2 : 4;
    const int lines = (int)(hd * esize / 2), per = f16 ? 1 : 2; /* a block: 32 x hd values */
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int64_t base = BLK(bl, t0 / KT_BLOCK) + t0 % KT_BLOCK;
        const char *next = pf_block(kt, bl, t0 / KT_BLOCK + 1, n, esize);
        const int s0 = (t0 % KT_BLOCK / 16) * hd; /* steps of this half-run in its block */
        const int pf_m = pf_steps(next, s0, per, lines, hd);
        float32x4_t acc[4][4];
        for (int j = 0; j < R; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = vdupq_n_f32(0.0f);
        /* four steps of i at a time: each query's q[i..i+3] in one register and fmla by lane (a load per query
         * per step, and the loop's own count, were a third of the instructions); per lane still i in order */
        int i = 0;
        for (; i + 4 <= hd; i += 4) {
            float32x4_t qv[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
            for (int j = 0; j < R; j++) qv[j] = vld1q_f32(q[j] + i);
            if (i < pf_m) pf_four(next, s0 + i, per); /* one test per four steps */
#define SC_STEP(l)                                                                                  \
    do {                                                                                            \
        float32x4_t k[4];                                                                           \
        load16(kt, f16, base + (int64_t)(i + (l)) * KT_BLOCK, k);                                   \
        for (int j = 0; j < R; j++)                                                                 \
            for (int x = 0; x < 4; x++) acc[j][x] = vfmaq_laneq_f32(acc[j][x], k[x], qv[j], (l));   \
    } while (0)
            SC_STEP(0); SC_STEP(1); SC_STEP(2); SC_STEP(3);
#undef SC_STEP
        }
        for (; i < hd; i++) {
            if (i < pf_m) pf_first(next, s0 + i, per);
            float32x4_t k[4];
            load16(kt, f16, base + (int64_t)i * KT_BLOCK, k);
            for (int j = 0; j < R; j++)
                for (int x = 0; x < 4; x++) acc[j][x] = vfmaq_n_f32(acc[j][x], k[x], q[j][i]);
        }
        const int valid = n - t0 < 16 ? n - t0 : 16;
        for (int j = 0; j < R; j++) {
            float tmp[16], *dst = valid == 16 ? sc[j] + t0 : tmp;
            for (int x = 0; x < 4; x++) vst1q_f32(dst + 4 * x, vmulq_f32(acc[j][x], vs));
            if (dst == tmp) memcpy(sc[j] + t0, tmp, sizeof(float) * (size_t)valid);
        }
    }
}

void att_scores_neon(const float *const *q, int R, const void *kt, kv_blocks bl, int f16, int n, int hd, float scale,
                     float *const *sc) {
    /* R = 4 (a KV head's four query heads, the common GQA group) and the cache type as constants: the
     * accumulators stay in registers and the loads carry no branch */
    if (f16) {
        if (R == 4) scores_body(q, 4, kt, bl, 1, n, hd, scale, sc);
        else scores_body(q, R, kt, bl, 1, n, hd, scale, sc);
    } else {
        if (R == 4) scores_body(q, 4, kt, bl, 0, n, hd, scale, sc);
        else scores_body(q, R, kt, bl, 0, n, hd, scale, sc);
    }
}

/* the first column pass over the values prefetches the next block, row t % 32 of it at position t (wsum2_avx512's
 * addressing): next is that block (pf_block), taken at each block's first position */
INLINE const char *wsum_prefetch(const char *next, const void *vc, kv_blocks bl, int t, int n, int64_t esize, int hd) {
    if (t % KT_BLOCK == 0) next = pf_block(vc, bl, t / KT_BLOCK + 1, n, esize);
    const int row = (int)((hd * esize + 63) / 64);
    pf_lines(next, t % KT_BLOCK, row, KT_BLOCK * row);
    return next;
}

/* out[c] = sum_t p[t] * v[t][c]: 32 columns at a time in 8 accumulators across all t, then 4 at a time, then
 * single columns (a head_dim not a multiple of 4) */
INLINE void wsum_body(const float *p, const void *vc, kv_blocks bl, const int f16, int n, int hd, float *out) {
    const int64_t esize = f16 ? 2 : 4;
    const char *next = NULL;
    int c0 = 0;
    for (; c0 + 32 <= hd; c0 += 32) {
        float32x4_t a[8];
        for (int x = 0; x < 8; x++) a[x] = vdupq_n_f32(0.0f);
        int t = 0;
        /* four positions at a time, their weights in one register, fmla by lane (as the scores); a run of four
         * never crosses a block (KT_BLOCK is a multiple of 4) */
        for (; t + 4 <= n; t += 4) {
            const float32x4_t w = vld1q_f32(p + t);
            const int64_t o0 = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
#define WS_STEP(l)                                                                                  \
    do {                                                                                            \
        if (c0 == 0) next = wsum_prefetch(next, vc, bl, t + (l), n, esize, hd);                     \
        float32x4_t v[8];                                                                           \
        load16(vc, f16, o0 + (int64_t)(l) * hd, v), load16(vc, f16, o0 + (int64_t)(l) * hd + 16, v + 4); \
        for (int x = 0; x < 8; x++) a[x] = vfmaq_laneq_f32(a[x], v[x], w, (l));                     \
    } while (0)
            WS_STEP(0); WS_STEP(1); WS_STEP(2); WS_STEP(3);
#undef WS_STEP
        }
        for (; t < n; t++) {
            if (c0 == 0) next = wsum_prefetch(next, vc, bl, t, n, esize, hd);
            const int64_t o = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
            float32x4_t v[8];
            load16(vc, f16, o, v), load16(vc, f16, o + 16, v + 4);
            for (int x = 0; x < 8; x++) a[x] = vfmaq_n_f32(a[x], v[x], p[t]);
        }
        for (int x = 0; x < 8; x++) vst1q_f32(out + c0 + 4 * x, a[x]);
    }
    for (; c0 + 4 <= hd; c0 += 4) {
        float32x4_t a = vdupq_n_f32(0.0f);
        for (int t = 0; t < n; t++) {
            if (c0 == 0) next = wsum_prefetch(next, vc, bl, t, n, esize, hd); /* hd < 32: no pass above */
            a = vfmaq_n_f32(a, load4(vc, f16, BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0), p[t]);
        }
        vst1q_f32(out + c0, a);
    }
    for (; c0 < hd; c0++) {
        float a = 0.0f;
        for (int t = 0; t < n; t++) {
            const int64_t o = BLK(bl, t / KT_BLOCK) + (int64_t)(t % KT_BLOCK) * hd + c0;
            a = fmaf(p[t], f16 ? ops_half_to_float(((const uint16_t *)vc)[o]) : ((const float *)vc)[o], a);
        }
        out[c0] = a;
    }
}

void att_wsum_neon(const float *p, const void *vc, kv_blocks bl, int f16, int n, int hd, float *out) {
    if (f16) wsum_body(p, vc, bl, 1, n, hd, out);
    else wsum_body(p, vc, bl, 0, n, hd, out);
}

/* The four query heads of a KV head over an f16 cache (hd a multiple of 16): each value row converted once for
 * all four. Positions in runs of one key block (32 rows, in L1), 16 columns at a time with 16 accumulators in
 * registers; between runs the sums wait in acc[][] (attention.c's wsum4_f16_avx2 scheme). */
void att_wsum4_f16_neon(const float *const *p, const void *vc, kv_blocks bl, int n, int hd, float *const *out,
                        att_pf *pf) {
    (void)pf; /* item_pf is 0 on this path: never given one */
    if (hd > Q8_MAX_HD || hd % 16) {
        for (int j = 0; j < 4; j++) att_wsum_neon(p[j], vc, bl, 1, n, hd, out[j]);
        return;
    }
    float acc[4][Q8_MAX_HD];
    for (int j = 0; j < 4; j++) memset(acc[j], 0, sizeof(float) * (size_t)hd);
    for (int ts = 0; ts < n; ts += KT_BLOCK) {
        const int tn = ts + KT_BLOCK < n ? KT_BLOCK : n - ts;
        const uint16_t *v0 = (const uint16_t *)vc + BLK(bl, ts / KT_BLOCK);
        /* the next block, hd lines (32 rows of hd halves), one per step over the columns' passes */
        const char *next = pf_block(vc, bl, ts / KT_BLOCK + 1, n, 2);
        for (int col = 0; col < hd; col += 16) {
            float32x4_t a[4][4];
            for (int j = 0; j < 4; j++)
                for (int x = 0; x < 4; x++) a[j][x] = vld1q_f32(acc[j] + col + 4 * x);
            const uint16_t *v = v0 + col;
            const int pf_m = pf_steps(next, col / 16 * KT_BLOCK, 1, hd, tn);
            /* four positions at a time, each query's four weights in one register, fmla by lane (as the
             * scores); per column still t in order */
            int t = 0;
            for (; t + 4 <= tn; t += 4) {
                float32x4_t w[4];
                for (int j = 0; j < 4; j++) w[j] = vld1q_f32(p[j] + ts + t);
                if (t < pf_m) pf_four(next, col / 16 * KT_BLOCK + t, 1); /* as the scores */
#define WS4_STEP(l)                                                                                 \
    do {                                                                                            \
        float32x4_t x4[4];                                                                          \
        load16(v + (int64_t)(t + (l)) * hd, 1, 0, x4);                                              \
        for (int j = 0; j < 4; j++)                                                                 \
            for (int x = 0; x < 4; x++) a[j][x] = vfmaq_laneq_f32(a[j][x], x4[x], w[j], (l));       \
    } while (0)
                WS4_STEP(0); WS4_STEP(1); WS4_STEP(2); WS4_STEP(3);
#undef WS4_STEP
            }
            for (; t < tn; t++) {
                if (t < pf_m) pf_first(next, col / 16 * KT_BLOCK + t, 1);
                float32x4_t x4[4];
                load16(v + (int64_t)t * hd, 1, 0, x4);
                for (int j = 0; j < 4; j++)
                    for (int x = 0; x < 4; x++) a[j][x] = vfmaq_n_f32(a[j][x], x4[x], p[j][ts + t]);
            }
            for (int j = 0; j < 4; j++)
                for (int x = 0; x < 4; x++) vst1q_f32(acc[j] + col + 4 * x, a[j][x]);
        }
    }
    for (int j = 0; j < 4; j++) memcpy(out[j], acc[j], sizeof(float) * (size_t)hd);
}

/* ---------------- int8 cache (layout: attention_q8.h; kernels table: attn_common.h) ---------------- */

#define KB OPS_KT_BLOCK
#define KSCALES Q8_SCALES

/* sc[j][t0 .. t0+valid) = ((float)dot * kscale) * c[j], the scalar body's order */
INLINE void store_scores(const int32x4_t *acc, const float *ks, float c, int valid, float *dst) {
    float tmp[16], *o = valid == 16 ? dst : tmp;
    const float32x4_t cj = vdupq_n_f32(c);
    for (int x = 0; x < 4; x++) vst1q_f32(o + 4 * x, vmulq_f32(vmulq_f32(vcvtq_f32_s32(acc[x]), vld1q_f32(ks + 4 * x)), cj));
    if (o == tmp) memcpy(dst, tmp, sizeof(float) * (size_t)valid);
}

/* dotprod: 16 positions (4 lanes of 4 key bytes per vector) x R queries, one sdot per vector and query */
DOT_FN INLINE void q8_scores_dot_body(const int8_t *const *q8, const float *c, const int R, const int8_t *kt,
                                     kv_blocks bl, int n, int hd, float *const *sc, att_pf *pf) {
    (void)pf; /* no next-item prefetch here (pf_spos 0) */
    const int lines = Q8_LINES(hd), per = (lines + hd / 2 - 1) / (hd / 2); /* hd / 2 steps a block */
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int64_t blk = BLK(bl, t0 / KB);
        const int8_t *k = kt + blk + (t0 % KB) * 4;
        const char *next = pf_block(kt, bl, t0 / KB + 1, n, 1);
        const int s0 = (t0 % KB / 16) * (hd / 4), pf_m = pf_steps(next, s0, per, lines, hd / 4);
        int32x4_t acc[4][4];
        for (int j = 0; j < R; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = vdupq_n_s32(0);
        for (int i4 = 0; i4 < hd / 4; i4++) {
            if (i4 < pf_m) pf_first(next, s0 + i4, per);
            const int8_t *kp = k + (int64_t)i4 * 4 * KB;
            const int8x16_t k0 = vld1q_s8(kp), k1 = vld1q_s8(kp + 16), k2 = vld1q_s8(kp + 32), k3 = vld1q_s8(kp + 48);
            for (int j = 0; j < R; j++) {
                const int8x16_t qs = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(q8[j] + 4 * i4)));
                acc[j][0] = vdotq_s32(acc[j][0], k0, qs), acc[j][1] = vdotq_s32(acc[j][1], k1, qs);
                acc[j][2] = vdotq_s32(acc[j][2], k2, qs), acc[j][3] = vdotq_s32(acc[j][3], k3, qs);
            }
        }
        const int valid = n - t0 < 16 ? n - t0 : 16;
        for (int j = 0; j < R; j++) store_scores(acc[j], KSCALES(kt, blk, hd) + t0 % KB, c[j], valid, sc[j] + t0);
    }
}

/* plain NEON: 8 positions x R queries; smull + smlal of two key groups (4 bytes each) into int16 lanes (at most
 * 2 x 127 x 127 = 32258: no overflow), sadalp into int32 pairs, one pairwise add per position at the end */
INLINE void q8_scores_plain_body(const int8_t *const *q8, const float *c, const int R, const int8_t *kt,
                                 kv_blocks bl, int n, int hd, float *const *sc, att_pf *pf) {
    (void)pf; /* no next-item prefetch here (pf_spos 0) */
    const int g = hd / 4, pairs = (g + 1) / 2; /* steps of a half (8 positions): pairs of key groups */
    const int lines = Q8_LINES(hd), per = (lines + 4 * pairs - 1) / (4 * pairs); /* 4 halves a block */
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int64_t blk = BLK(bl, t0 / KB);
        const char *next = pf_block(kt, bl, t0 / KB + 1, n, 1);
        int32x4_t res[4][4];
        for (int h = 0; h < 2; h++) { /* positions t0 + 8h .. t0 + 8h + 7 */
            const int s0 = ((t0 % KB / 16) * 2 + h) * pairs; /* steps of this half in its block */
            const int pf_m = pf_steps(next, s0, per, lines, pairs);
            const int8_t *k = kt + blk + (t0 % KB + 8 * h) * 4;
            int32x4_t acc[4][4]; /* [query][pair of positions], lanes: (p, bytes 0-1), (p, bytes 2-3), (p+1, ..) */
            for (int j = 0; j < R; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = vdupq_n_s32(0);
            int i4 = 0;
            for (; i4 + 2 <= g; i4 += 2) {
                if (i4 / 2 < pf_m) pf_first(next, s0 + i4 / 2, per);
                const int8_t *kp = k + (int64_t)i4 * 4 * KB;
                const int8x16_t a0 = vld1q_s8(kp), a1 = vld1q_s8(kp + 16);                   /* group i4 */
                const int8x16_t b0 = vld1q_s8(kp + 4 * KB), b1 = vld1q_s8(kp + 4 * KB + 16); /* group i4 + 1 */
                for (int j = 0; j < R; j++) {
                    const int8x16_t qa = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(q8[j] + 4 * i4)));
                    const int8x16_t qb = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(q8[j] + 4 * i4 + 4)));
                    acc[j][0] = vpadalq_s16(acc[j][0], vmlal_s8(vmull_s8(vget_low_s8(a0), vget_low_s8(qa)), vget_low_s8(b0), vget_low_s8(qb)));
                    acc[j][1] = vpadalq_s16(acc[j][1], vmlal_high_s8(vmull_high_s8(a0, qa), b0, qb));
                    acc[j][2] = vpadalq_s16(acc[j][2], vmlal_s8(vmull_s8(vget_low_s8(a1), vget_low_s8(qa)), vget_low_s8(b1), vget_low_s8(qb)));
                    acc[j][3] = vpadalq_s16(acc[j][3], vmlal_high_s8(vmull_high_s8(a1, qa), b1, qb));
                }
            }
            if (i4 < g) { /* an odd number of groups: the last alone */
                if (i4 / 2 < pf_m) pf_first(next, s0 + i4 / 2, per);
                const int8_t *kp = k + (int64_t)i4 * 4 * KB;
                const int8x16_t a0 = vld1q_s8(kp), a1 = vld1q_s8(kp + 16);
                for (int j = 0; j < R; j++) {
                    const int8x16_t qa = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(q8[j] + 4 * i4)));
                    acc[j][0] = vpadalq_s16(acc[j][0], vmull_s8(vget_low_s8(a0), vget_low_s8(qa)));
                    acc[j][1] = vpadalq_s16(acc[j][1], vmull_high_s8(a0, qa));
                    acc[j][2] = vpadalq_s16(acc[j][2], vmull_s8(vget_low_s8(a1), vget_low_s8(qa)));
                    acc[j][3] = vpadalq_s16(acc[j][3], vmull_high_s8(a1, qa));
                }
            }
            for (int j = 0; j < R; j++) {
                res[j][2 * h] = vpaddq_s32(acc[j][0], acc[j][1]);
                res[j][2 * h + 1] = vpaddq_s32(acc[j][2], acc[j][3]);
            }
        }
        const int valid = n - t0 < 16 ? n - t0 : 16;
        for (int j = 0; j < R; j++) store_scores(res[j], KSCALES(kt, blk, hd) + t0 % KB, c[j], valid, sc[j] + t0);
    }
}

/* the queries come quantized (att_q8_quantize_query, once per row and head in attention.c) */
Q8_SCORES_ENTRY(DOT_FN, q8_scores_dot, q8_scores_dot_body)
Q8_SCORES_ENTRY(, q8_scores_plain, q8_scores_plain_body)

/* int8 x 16 -> four f32 vectors (exact) */
INLINE void cvt16_s8(int8x16_t b, float32x4_t *x) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
    x[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), x[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    x[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), x[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

/* out[j][c] = fmaf(p[j][t] * vscale[t], v[t][c], out[j][c]) for t in order: attention_q8.c's wsum_avx2 scheme
 * (runs of one block, 16 columns x R queries in registers), then 4 columns at a time (hd is a multiple of 4) */
INLINE void q8_wsum_body(const float *const *p, const int R, const int8_t *vc, kv_blocks bl, int n, int hd,
                         float (*acc)[Q8_MAX_HD]) {
    const int h16 = hd & ~15;
    for (int ts = 0; ts < n; ts += KB) {
        q8_run_t r;
        q8_run(&r, p, R, vc, bl, ts, n, hd);
        for (int col = 0; col < h16; col += 16) {
            float32x4_t a[4][4];
            for (int j = 0; j < R; j++)
                for (int x = 0; x < 4; x++) a[j][x] = vld1q_f32(acc[j] + col + 4 * x);
            const int8_t *v = r.v0 + col;
            const int pf_m = pf_steps(r.next, col / 16 * KB, 1, Q8_LINES(hd), r.tn);
            for (int t = 0; t < r.tn; t++, v += hd) {
                if (t < pf_m) pf_first(r.next, col / 16 * KB + t, 1);
                float32x4_t x4[4];
                cvt16_s8(vld1q_s8(v), x4);
                for (int j = 0; j < R; j++) {
                    const float wj = r.w[j][t];
                    for (int x = 0; x < 4; x++) a[j][x] = vfmaq_n_f32(a[j][x], x4[x], wj);
                }
            }
            for (int j = 0; j < R; j++)
                for (int x = 0; x < 4; x++) vst1q_f32(acc[j] + col + 4 * x, a[j][x]);
        }
        for (int col = h16; col < hd; col += 4) {
            float32x4_t a[4];
            for (int j = 0; j < R; j++) a[j] = vld1q_f32(acc[j] + col);
            const int8_t *v = r.v0 + col;
            for (int t = 0; t < r.tn; t++, v += hd) {
                int32_t four;
                memcpy(&four, v, 4);
                const float32x4_t x = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four))))));
                for (int j = 0; j < R; j++) a[j] = vfmaq_n_f32(a[j], x, r.w[j][t]);
            }
            for (int j = 0; j < R; j++) vst1q_f32(acc[j] + col, a[j]);
        }
    }
}

static void q8_wsum(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd, float *const *out,
                    att_pf *pf) {
    (void)pf; /* no next-item prefetch here (pf_spos 0) */
    float acc[4][Q8_MAX_HD];
    for (int j = 0; j < R; j++) memset(acc[j], 0, sizeof(float) * (size_t)hd);
    if (R == 4) q8_wsum_body(p, 4, vc, bl, n, hd, acc);
    else q8_wsum_body(p, R, vc, bl, n, hd, acc);
    for (int j = 0; j < R; j++) memcpy(out[j], acc[j], sizeof(float) * (size_t)hd);
}

/* lane l of the 16 sums x[i] for i % 16 == l; a last partial vector: exp of 0 in the spare lanes, then zeroed.
 * Whole groups of 16 in a loop of their own, with the sums in four named registers: with a test per vector and
 * the sums in an array (the partial group's path in the same loop), gcc kept the sums on the stack and reloaded
 * exp's ten constants for every vector, 46 instructions per 4 exps against AVX2's 31 per 8. */
static float q8_exp_sum(float *x, int n, float mx) {
    const float32x4_t vm = vdupq_n_f32(mx);
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const float32x4_t e0 = ops_exp_neon(vsubq_f32(vld1q_f32(x + i), vm));
        const float32x4_t e1 = ops_exp_neon(vsubq_f32(vld1q_f32(x + i + 4), vm));
        const float32x4_t e2 = ops_exp_neon(vsubq_f32(vld1q_f32(x + i + 8), vm));
        const float32x4_t e3 = ops_exp_neon(vsubq_f32(vld1q_f32(x + i + 12), vm));
        vst1q_f32(x + i, e0), vst1q_f32(x + i + 4, e1), vst1q_f32(x + i + 8, e2), vst1q_f32(x + i + 12, e3);
        a0 = vaddq_f32(a0, e0), a1 = vaddq_f32(a1, e1), a2 = vaddq_f32(a2, e2), a3 = vaddq_f32(a3, e3);
    }
    float32x4_t acc[4] = {a0, a1, a2, a3};
    if (i < n) { /* the last, partial group: the same lanes; spare ones hold mx (exp of 0), then are zeroed */
        const int left = n - i;
        const uint32x4_t lane = {0, 1, 2, 3};
        float tmp[16];
        for (int l = 0; l < 16; l++) tmp[l] = l < left ? x[i + l] : mx;
        for (int v = 0; v < 4 && 4 * v < left; v++) {
            const uint32x4_t keep = vcltq_u32(lane, vdupq_n_u32((uint32_t)(left - 4 * v)));
            const float32x4_t e = vreinterpretq_f32_u32(
                vandq_u32(vreinterpretq_u32_f32(ops_exp_neon(vsubq_f32(vld1q_f32(tmp + 4 * v), vm))), keep));
            vst1q_f32(tmp + 4 * v, e);
            acc[v] = vaddq_f32(acc[v], e);
        }
        memcpy(x + i, tmp, sizeof(float) * (size_t)left);
    }
    float s[16];
    for (int v = 0; v < 4; v++) vst1q_f32(s + 4 * v, acc[v]);
    return sum16(s);
}

att_q8_kernels att_q8_neon_kernels(int dotprod) {
    return (att_q8_kernels){dotprod ? q8_scores_dot : q8_scores_plain, q8_wsum, q8_exp_sum, 0, 0};
}

#else
typedef int att_neon_empty_unit; /* x86: nothing here (ISO C wants a declaration in every file) */
#endif
