/* Exact logits for the best candidates of an approximate LM head (the q4 group head, engine/runtime/model.py).
 *
 * The q4 head reads half the bytes of the int8 head but ranks tokens less precisely; its top k rows are then
 * recomputed from the f16 rows of the head (for a tied head: the embedding table, already in the store), so
 * the tokens a sampler can pick carry the f16 head's logits. Each recomputed logit is the f16 head's exact
 * float (simd/kernels/gemv_f16.c): out = fma(w[d-1], x[d-1], ... fma(w[0], x[0], 0)), one in-order chain per
 * row, in every path. Reads k * d halves per row of logits: ~0.3 MB for k = 64, d = 2560, against ~170 MB for
 * the q4 head itself.
 */
#include "ops.h"

#include <math.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

static void dots_scalar(const uint16_t *table, int d, const int32_t *ids, int n, const float *x, float *out) {
    for (int j = 0; j < n; j++) {
        const uint16_t *w = table + (int64_t)ids[j] * d;
        float acc = 0.0f;
        for (int c = 0; c < d; c++) acc = fmaf(ops_half_to_float(w[c]), x[c], acc);
        out[j] = acc;
    }
}

/* The end of a vector body's rows: lane j's chain a[j] continues over the last columns [c, d) in column order,
 * as dots_scalar's does (HALF converts one f16; exact either way), into out[j] for j < LANES. */
#define DOTS_TAIL(LANES, HALF)                                                       \
    for (int j = 0; j < (LANES); j++) {                                              \
        float s_ = a[j];                                                             \
        for (int cc = c; cc < d; cc++) s_ = fmaf(HALF(w[j][cc]), x[cc], s_);         \
        out[j] = s_;                                                                 \
    }

#if defined(__x86_64__)
/* Eight rows at once, one per lane: 8 columns of each row are converted, transposed to 8 vectors of one
 * column each, and fed to the lane chains in column order. */
__attribute__((target("avx2,fma,f16c"))) static void dots8_avx2(const uint16_t *table, int d, const int32_t *ids,
                                                                 const int32_t *next, const float *x, float *out) {
    const uint16_t *w[8], *nw[8];
    for (int j = 0; j < 8; j++) w[j] = table + (int64_t)ids[j] * d;
    for (int j = 0; j < 8; j++) nw[j] = next ? table + (int64_t)next[j] * d : w[j];
    __m256 acc = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= d; c += 8) {
        /* the rows are random rows of a large table (cold in cache): while this group's chains run, fetch the next
         * group's rows at the pace they are consumed (a 64-byte line of each row every 4 steps) */
        if ((c & 31) == 0)
            for (int j = 0; j < 8; j++) _mm_prefetch((const char *)(nw[j] + c), _MM_HINT_T0);
        __m256 r0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[0] + c)));
        __m256 r1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[1] + c)));
        __m256 r2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[2] + c)));
        __m256 r3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[3] + c)));
        __m256 r4 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[4] + c)));
        __m256 r5 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[5] + c)));
        __m256 r6 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[6] + c)));
        __m256 r7 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[7] + c)));
        /* 8x8 transpose: t_i holds column c+i of rows 0..7 */
        __m256 a0 = _mm256_unpacklo_ps(r0, r1), a1 = _mm256_unpackhi_ps(r0, r1);
        __m256 a2 = _mm256_unpacklo_ps(r2, r3), a3 = _mm256_unpackhi_ps(r2, r3);
        __m256 a4 = _mm256_unpacklo_ps(r4, r5), a5 = _mm256_unpackhi_ps(r4, r5);
        __m256 a6 = _mm256_unpacklo_ps(r6, r7), a7 = _mm256_unpackhi_ps(r6, r7);
        __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
        __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
        __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
        __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
        __m256 t0 = _mm256_permute2f128_ps(b0, b4, 0x20), t4 = _mm256_permute2f128_ps(b0, b4, 0x31);
        __m256 t1 = _mm256_permute2f128_ps(b1, b5, 0x20), t5 = _mm256_permute2f128_ps(b1, b5, 0x31);
        __m256 t2 = _mm256_permute2f128_ps(b2, b6, 0x20), t6 = _mm256_permute2f128_ps(b2, b6, 0x31);
        __m256 t3 = _mm256_permute2f128_ps(b3, b7, 0x20), t7 = _mm256_permute2f128_ps(b3, b7, 0x31);
        acc = _mm256_fmadd_ps(t0, _mm256_set1_ps(x[c + 0]), acc);
        acc = _mm256_fmadd_ps(t1, _mm256_set1_ps(x[c + 1]), acc);
        acc = _mm256_fmadd_ps(t2, _mm256_set1_ps(x[c + 2]), acc);
        acc = _mm256_fmadd_ps(t3, _mm256_set1_ps(x[c + 3]), acc);
        acc = _mm256_fmadd_ps(t4, _mm256_set1_ps(x[c + 4]), acc);
        acc = _mm256_fmadd_ps(t5, _mm256_set1_ps(x[c + 5]), acc);
        acc = _mm256_fmadd_ps(t6, _mm256_set1_ps(x[c + 6]), acc);
        acc = _mm256_fmadd_ps(t7, _mm256_set1_ps(x[c + 7]), acc);
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    DOTS_TAIL(8, _cvtsh_ss);
}
#endif

#if defined(__aarch64__)
/* Four rows at once, one per lane, as dots8_avx2: 4 columns of each row converted (f16 -> f32 is exact),
 * transposed, and fed to the lane chains in column order with fused multiply-adds (fmla = fmaf). */
static void dots4_neon(const uint16_t *table, int d, const int32_t *ids, const float *x, float *out) {
    const uint16_t *w[4];
    for (int j = 0; j < 4; j++) w[j] = table + (int64_t)ids[j] * d;
    float32x4_t acc = vdupq_n_f32(0.0f);
    int c = 0;
    for (; c + 4 <= d; c += 4) {
        float32x4_t r0 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w[0] + c)));
        float32x4_t r1 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w[1] + c)));
        float32x4_t r2 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w[2] + c)));
        float32x4_t r3 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w[3] + c)));
        /* 4x4 transpose: t_i holds column c+i of rows 0..3 */
        float32x4_t a0 = vtrn1q_f32(r0, r1), a1 = vtrn2q_f32(r0, r1);
        float32x4_t a2 = vtrn1q_f32(r2, r3), a3 = vtrn2q_f32(r2, r3);
        float32x4_t t0 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a0), vreinterpretq_f64_f32(a2)));
        float32x4_t t1 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a1), vreinterpretq_f64_f32(a3)));
        float32x4_t t2 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a0), vreinterpretq_f64_f32(a2)));
        float32x4_t t3 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a1), vreinterpretq_f64_f32(a3)));
        acc = vfmaq_n_f32(acc, t0, x[c + 0]);
        acc = vfmaq_n_f32(acc, t1, x[c + 1]);
        acc = vfmaq_n_f32(acc, t2, x[c + 2]);
        acc = vfmaq_n_f32(acc, t3, x[c + 3]);
    }
    float a[4];
    vst1q_f32(a, acc);
    DOTS_TAIL(4, ops_half_to_float);
}
#endif

/* Exact logits of candidates ids[0..n) (n <= 8) into out; next: the following group's ids (prefetch) or NULL. */
static void dots_group(const uint16_t *table, int d, const int32_t *ids, int n, const int32_t *next,
                       const float *x, float *out) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) {
        if (n == 8) {
            dots8_avx2(table, d, ids, next, x, out);
            return;
        }
        int32_t pad[8]; /* a short group: pad with its last row, keep the first n results */
        float tmp[8];
        for (int q = 0; q < 8; q++) pad[q] = ids[q < n ? q : n - 1];
        dots8_avx2(table, d, pad, NULL, x, tmp);
        for (int q = 0; q < n; q++) out[q] = tmp[q];
        return;
    }
#endif
#if defined(__aarch64__)
    if (ops_neon()) {
        for (int q0 = 0; q0 < n; q0 += 4) {
            int32_t pad[4]; /* a short group: pad with its last row, keep the first n results */
            float tmp[4];
            for (int q = 0; q < 4; q++) pad[q] = ids[q0 + q < n ? q0 + q : n - 1];
            dots4_neon(table, d, pad, x, tmp);
            for (int q = 0; q < 4 && q0 + q < n; q++) out[q0 + q] = tmp[q];
        }
        return;
    }
#endif
    (void)next;
    dots_scalar(table, d, ids, n, x, out);
}

typedef struct {
    const uint16_t *table;
    int d, vocab, k, groups; /* groups = ceil(k / 8) per row */
    const float *x;
    float *logits, *heap_vals;
    int32_t *idx;
} rescore_job;

/* phase 1, rows b..e: top k of each row into idx (-1 past the number found) */
static void topk_rows(void *ctx, int b, int e) {
    const rescore_job *j = ctx;
    for (int r = b; r < e; r++) {
        float *hv = j->heap_vals + (int64_t)r * j->k;
        int32_t *ir = j->idx + (int64_t)r * j->k;
        int got = ops_topk(j->logits + (int64_t)r * j->vocab, j->vocab, j->k, hv, ir);
        for (int q = got; q < j->k; q++) ir[q] = -1;
    }
}

/* phase 2, items b..e = (row, group of 8 candidates): exact logits written over the approximate ones (the
 * heap is free again: it holds the exact values) */
static void dot_items(void *ctx, int b, int e) {
    const rescore_job *j = ctx;
    for (int it = b; it < e; it++) {
        const int r = it / j->groups, q0 = (it % j->groups) * 8;
        const int32_t *ir = j->idx + (int64_t)r * j->k + q0;
        int n = 0;
        while (n < 8 && q0 + n < j->k && ir[n] >= 0) n++;
        if (n == 0) continue;
        const int32_t *next = NULL; /* the next item's first 8 ids, when it is a full group of this range */
        if (it + 1 < e) {
            const int r1 = (it + 1) / j->groups, q1 = ((it + 1) % j->groups) * 8;
            const int32_t *i1 = j->idx + (int64_t)r1 * j->k + q1;
            if (q1 + 8 <= j->k && i1[7] >= 0) next = i1;
        }
        float *hv = j->heap_vals + (int64_t)r * j->k + q0, *lr = j->logits + (int64_t)r * j->vocab;
        dots_group(j->table, j->d, ir, n, next, j->x + (int64_t)r * j->d, hv);
        for (int q = 0; q < n; q++) lr[ir[q]] = hv[q];
    }
}

void ops_head_rescore(const uint16_t *table, int d, const float *x, int m, float *logits, int vocab, int k,
                      float *heap_vals, int32_t *idx) {
    rescore_job job = {table, d, vocab, k, (k + 7) / 8, x, logits, heap_vals, idx};
    const int nt = bk_get_num_threads();
    /* top-k: one row (decode) stays on the caller, ~40 us. The exact rows are latency-bound reads of random
     * table rows (cold in cache), so their groups of 8 go to the pool even for one row, each group fetching the
     * next one's rows ahead: 64 rows of the 2B-4T embedding inside a 2-thread decode, 1.2 -> 0.31 ms per token
     * (per-op timers over 48 tokens of a random model, whose candidates change every token). */
    if (m >= 2)
        bk_parallel_for(m, 1, nt, topk_rows, &job);
    else
        topk_rows(&job, 0, m);
    const int items = m * job.groups;
    if (items >= 2 && nt > 1)
        bk_parallel_for(items, 1, nt, dot_items, &job);
    else
        dot_items(&job, 0, items);
}
