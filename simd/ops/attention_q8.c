/* Attention over the int8 KV cache (kv q8): scores, softmax's exp and the weighted sum of values, read straight
 * from the int8 blocks (layout in attention_q8.h); attention.c does the rest (RoPE, pieces, threads).
 *
 * Scores are integer dot products: each query head is quantized like the cache (int8, one scale; shared scalar
 * code), keys sit in [head_dim/4][32][4] blocks so four of a position's values are one 32-bit lane, and
 * |q| x sign(k, q) goes through vpmaddubsw + vpmaddwd (no saturation: |q|, |k| <= 127); the int32 sum is exact,
 * so every path agrees by construction, then (float)dot * kscale * (qscale / sqrt(head_dim)) in one order.
 * Measured against int8 -> f32 in registers + FMA (the f16 path's scheme), one KV head's 4 queries over 4096
 * positions (L2-resident keys, one thread, AVX2): 66 us vs 33 us.
 * The weighted sum keeps f32 weights (softmax outputs in int8 would cost accuracy): value rows are turned into
 * f32 in registers and FMA'd in the same order per output element as the scalar body's fmaf.
 *
 * Softmax's exp: one polynomial (Cephes expf, as attention.c's vector bodies) written out in fmaf for the scalar
 * body, sums over 16 lanes (lane = i % 16) reduced in one fixed order, so all paths give the same bits. */
#include "attention_q8.h"

#include <math.h>
#include <string.h>

#include "attn_common.h" /* AVX2_FN / AVX512_FN, exp polynomial (vector and one lane), sum16, lane masks */
#include "ops.h"

#define KB OPS_KT_BLOCK
#define Q8_MAX_HD OPS_Q8_MAX_HD
/* element i of position `at` in a key block: [head_dim/4][32][4] */
#define KIDX(i, at) ((int64_t)((i) >> 2) * (4 * KB) + (at) * 4 + ((i) & 3))
#define KSCALES Q8_SCALES /* a block's 32 scales */

static float quantize_row_scalar(const float *x, int hd, int8_t *q) { /* q[i] = round(x[i] * 127 / max|x|); the scale */
    float amax = 0.0f;
    for (int i = 0; i < hd; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    /* round half to even as lrintf does (in the default rounding mode), without its libm call per value: adding
     * and removing 1.5 * 2^23 leaves an integer for any |t| < 2^22 (here |t| <= 127 up to one rounding). NaN (a
     * NaN or inf in x) gives -127, as lrintf's LONG_MIN clamped did. */
    for (int i = 0; i < hd; i++) {
        const float t = x[i] * inv, r = (t + 12582912.0f) - 12582912.0f;
        q[i] = (int8_t)(r >= 127.0f ? 127 : r > -127.0f ? (int)r : -127);
    }
    return amax / 127.0f;
}

#if defined(__x86_64__)
/* quantize_row_scalar 16 / 8 lanes at a time, giving its bytes: the same max (a NaN never wins it: max_ps returns
 * its second operand, the running max, when either is NaN; the scalar compare is false for NaN too), the same
 * multiply, rounding adds and clamps (NaN: -127), each a separate IEEE operation (the build does not contract).
 * The scalar loops were ~15% of a 16-sequence decode step's attention over an int8 cache (the queries and the new
 * keys and values, quantized on the calling thread): 2-core Zen 5, 2 threads, alternating in one process, that
 * attention at 96 positions 7.5 -> 6.0 ms a step (1,024: 1.05x), the whole step +2.4%. hd a multiple of 4 (the
 * cache's rule). */
AVX512_FN static float quantize_row_avx512(const float *x, int hd, int8_t *q) {
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 16) {
        const __mmask16 k = hd - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - i)) - 1);
        mx = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + i)), mx);
    }
    const float amax = _mm512_reduce_max_ps(mx); /* lanes hold no NaN */
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv), c = _mm512_set1_ps(12582912.0f);
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int i = 0; i < hd; i += 16) {
        const __mmask16 k = hd - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - i)) - 1);
        const __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vinv);
        const __m512 r = _mm512_sub_ps(_mm512_add_ps(t, c), c);
        __m512 v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, lo, _CMP_GT_OQ), lo, r); /* NaN: -127 */
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, hi, _CMP_GE_OQ), v, hi);
        _mm512_mask_cvtepi32_storeu_epi8(q + i, k, _mm512_cvttps_epi32(v));
    }
    return amax / 127.0f;
}

AVX2_FN static float quantize_row_avx2(const float *x, int hd, int8_t *q) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= hd; i += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), absm), mx);
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float amax = 0.0f;
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; i < hd; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv), c = _mm256_set1_ps(12582912.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (i = 0; i + 8 <= hd; i += 8) {
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
        const __m256 r = _mm256_sub_ps(_mm256_add_ps(t, c), c);
        __m256 v = _mm256_blendv_ps(lo, r, _mm256_cmp_ps(r, lo, _CMP_GT_OQ)); /* NaN: -127 */
        v = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(r, hi, _CMP_GE_OQ));
        const __m256i n = _mm256_cvttps_epi32(v);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w, w));
    }
    for (; i < hd; i++) {
        const float t = x[i] * inv, r = (t + 12582912.0f) - 12582912.0f;
        q[i] = (int8_t)(r >= 127.0f ? 127 : r > -127.0f ? (int)r : -127);
    }
    return amax / 127.0f;
}
#endif

static float quantize_row(const float *x, int hd, int8_t *q) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX512) return quantize_row_avx512(x, hd, q);
    if (ops_isa() >= OPS_ISA_AVX2) return quantize_row_avx2(x, hd, q);
#endif
    return quantize_row_scalar(x, hd, q);
}

void att_q8_store_key(const float *x, int hd, int8_t *block, int at) {
    int8_t q[Q8_MAX_HD];
    ((float *)(block + (int64_t)KB * hd))[at] = quantize_row(x, hd, q);
    for (int i = 0; i < hd; i += 4) memcpy(block + KIDX(i, at), q + i, 4); /* KIDX: 4 consecutive i, one lane */
}

void att_q8_store_value(const float *x, int hd, int8_t *block, int at) {
    ((float *)(block + (int64_t)KB * hd))[at] = quantize_row(x, hd, block + (int64_t)at * hd);
}

float att_q8_quantize_query(const float *x, int hd, float scale, int8_t *q) { return quantize_row(x, hd, q) * scale; }

/* ---------- exp with 16 fixed lanes (lane = i % 16, reduced by sum16) ---------- */
static float exp_sum_scalar(float *x, int n, float mx) {
    float lanes[16] = {0};
    for (int i = 0; i < n; i++) {
        x[i] = exp_poly(x[i] - mx);
        lanes[i % 16] += x[i];
    }
    return sum16(lanes);
}

static void scores_scalar(const int8_t *const *q8, const float *c, int R, const int8_t *kt, kv_blocks bl, int n, int hd,
                          float *const *sc, att_pf *pf) {
    (void)pf; /* pf_spos 0 */
    for (int t = 0; t < n; t++) {
        const int64_t blk = BLK(bl, t / KB);
        const float ks = KSCALES(kt, blk, hd)[t % KB];
        for (int j = 0; j < R; j++) {
            int32_t d = 0;
            for (int i = 0; i < hd; i++) d += (int32_t)q8[j][i] * kt[blk + KIDX(i, t % KB)];
            sc[j][t] = (float)d * ks * c[j];
        }
    }
}

static void wsum_scalar(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd,
                        float *const *out, att_pf *pf) {
    (void)pf;
    for (int j = 0; j < R; j++) memset(out[j], 0, sizeof(float) * (size_t)hd);
    for (int t = 0; t < n; t++) {
        const int64_t blk = BLK(bl, t / KB);
        const int8_t *v = vc + blk + (int64_t)(t % KB) * hd;
        const float vs = KSCALES(vc, blk, hd)[t % KB];
        for (int j = 0; j < R; j++) {
            const float w = q8_weight(p[j][t], vs);
            for (int c = 0; c < hd; c++) out[j][c] = fmaf(w, (float)v[c], out[j][c]);
        }
    }
}

#if defined(__x86_64__)
/* ---------- AVX2 ---------- */
AVX2_FN static float exp_sum_avx2(float *x, int n, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 lo = _mm256_setzero_ps(), hi = lo; /* lanes 0-7 and 8-15 of the 16 */
    for (int i = 0; i < n; i += 16) {
        for (int h = 0; h < 2; h++) {
            const int left = n - i - 8 * h;
            if (left <= 0) break;
            float *px = x + i + 8 * h;
            __m256 e;
            if (left >= 8) {
                e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(px), vm));
                _mm256_storeu_ps(px, e);
            } else { /* masked lanes: exp of 0, then dropped */
                const __m256i k = lanes_below(left);
                e = exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(px, k), _mm256_and_ps(vm, _mm256_castsi256_ps(k))));
                e = _mm256_and_ps(e, _mm256_castsi256_ps(k));
                _mm256_maskstore_ps(px, k, e);
            }
            if (h) hi = _mm256_add_ps(hi, e);
            else lo = _mm256_add_ps(lo, e);
        }
    }
    float s[16];
    _mm256_storeu_ps(s, lo), _mm256_storeu_ps(s + 8, hi);
    return sum16(s);
}

AVX2_FN static inline __m256 cvt8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* 16 positions (half a key block) at a time, four values of a position per 32-bit lane, R x 2 int32 accumulators
 * (inlined with R = 4, a KV head's query group, so they stay in registers) */
AVX2_FN static inline __attribute__((always_inline)) void scores_avx2_body(const int8_t *const *q8, const float *c,
                                                                           int R, const int8_t *kt, kv_blocks bl, int n,
                                                                           int hd, float *const *sc, att_pf *pf) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int lines = Q8_LINES(hd), per = (lines + hd / 2 - 1) / (hd / 2);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int64_t blk = BLK(bl, t0 / KB);
        const int8_t *k = kt + blk + (t0 % KB) * 4;
        const float *ks = KSCALES(kt, blk, hd) + t0 % KB;
        const char *next = pf_block(kt, bl, t0 / KB + 1, n, 1);
        __m256i acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
        for (int i4 = 0; i4 < hd / 4; i4++) {
            pf_lines(next, (t0 % KB / 16) * (hd / 4) + i4, per, lines);
            att_pf_step(pf);
            const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k + (int64_t)i4 * 4 * KB));
            const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k + (int64_t)i4 * 4 * KB + 32));
            for (int j = 0; j < R; j++) {
                int32_t w;
                memcpy(&w, q8[j] + 4 * i4, 4);
                const __m256i qs = _mm256_set1_epi32(w), qa = _mm256_abs_epi8(qs);
                acc[j][0] = _mm256_add_epi32(acc[j][0], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(k0, qs)), ones));
                acc[j][1] = _mm256_add_epi32(acc[j][1], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(k1, qs)), ones));
            }
        }
        /* a last partial run: all 16 lanes stay inside the block; only the valid scores are kept */
        const int valid = n - t0 < 16 ? n - t0 : 16;
        const __m256 s0 = _mm256_loadu_ps(ks), s1 = _mm256_loadu_ps(ks + 8);
        for (int j = 0; j < R; j++) {
            float tmp[16];
            const __m256 cj = _mm256_set1_ps(c[j]);
            _mm256_storeu_ps(tmp, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[j][0]), s0), cj));
            _mm256_storeu_ps(tmp + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[j][1]), s1), cj));
            memcpy(sc[j] + t0, tmp, sizeof(float) * (size_t)valid);
        }
    }
}
Q8_SCORES_ENTRY(AVX2_FN, scores_avx2, scores_avx2_body)

/* Positions in runs of up to one block (32, whose rows stay in L1), 16 columns at a time with R x 2 accumulators
 * in registers; between runs the sums wait in acc[][] (the f16 wsum4's scheme, attention.c). Columns past the
 * last multiple of 16 in fmaf, in the same order. The inner loop is 8 FMAs, 4 weight broadcasts and 2 vpmovsxbd
 * straight from memory (an xmm load + shift + 2 conversions before) per position; the next block's prefetches go
 * before each column pass rather than behind a test per position (one layer's decode at 4096 positions, one
 * thread: the weighted sum 15-18% faster). */
AVX2_FN static void wsum_avx2(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd,
                              float *const *out, att_pf *pf) {
    float acc[4][Q8_MAX_HD];
    const int h16 = hd & ~15;
    const int lines = Q8_LINES(hd), per = h16 ? (lines + h16 / 16 - 1) / (h16 / 16) : 0;
    for (int j = 0; j < R; j++) memset(acc[j], 0, sizeof(float) * (size_t)hd);
    for (int ts = 0; ts < n; ts += KB) {
        q8_run_t r;
        q8_run(&r, p, R, vc, bl, ts, n, hd);
        for (int col = 0; col < h16; col += 16) {
            pf_lines(r.next, col / 16, per, lines); /* this column pass's share of the next block, before its loop */
            att_pf_step(pf);
            __m256 a0 = _mm256_loadu_ps(acc[0] + col), a1 = _mm256_loadu_ps(acc[0] + col + 8), b0 = a0, b1 = a1, c0 = a0,
                   c1 = a1, d0 = a0, d1 = a1;
            if (R > 1) b0 = _mm256_loadu_ps(acc[1] + col), b1 = _mm256_loadu_ps(acc[1] + col + 8);
            if (R > 2) c0 = _mm256_loadu_ps(acc[2] + col), c1 = _mm256_loadu_ps(acc[2] + col + 8);
            if (R > 3) d0 = _mm256_loadu_ps(acc[3] + col), d1 = _mm256_loadu_ps(acc[3] + col + 8);
            const int8_t *v = r.v0 + col;
#pragma GCC unroll 2
            for (int t = 0; t < r.tn; t++, v += hd) {
                const __m256 x0 = cvt8(_mm_loadl_epi64((const __m128i *)v)), x1 = cvt8(_mm_loadl_epi64((const __m128i *)(v + 8)));
                __m256 x = _mm256_broadcast_ss(r.w[0] + t);
                a0 = _mm256_fmadd_ps(x, x0, a0), a1 = _mm256_fmadd_ps(x, x1, a1);
                if (R > 1) x = _mm256_broadcast_ss(r.w[1] + t), b0 = _mm256_fmadd_ps(x, x0, b0), b1 = _mm256_fmadd_ps(x, x1, b1);
                if (R > 2) x = _mm256_broadcast_ss(r.w[2] + t), c0 = _mm256_fmadd_ps(x, x0, c0), c1 = _mm256_fmadd_ps(x, x1, c1);
                if (R > 3) x = _mm256_broadcast_ss(r.w[3] + t), d0 = _mm256_fmadd_ps(x, x0, d0), d1 = _mm256_fmadd_ps(x, x1, d1);
            }
            _mm256_storeu_ps(acc[0] + col, a0), _mm256_storeu_ps(acc[0] + col + 8, a1);
            if (R > 1) _mm256_storeu_ps(acc[1] + col, b0), _mm256_storeu_ps(acc[1] + col + 8, b1);
            if (R > 2) _mm256_storeu_ps(acc[2] + col, c0), _mm256_storeu_ps(acc[2] + col + 8, c1);
            if (R > 3) _mm256_storeu_ps(acc[3] + col, d0), _mm256_storeu_ps(acc[3] + col + 8, d1);
        }
        for (int j = 0; j < R; j++)
            for (int t = 0; t < r.tn; t++)
                for (int c = h16; c < hd; c++) acc[j][c] = fmaf(r.w[j][t], (float)r.v0[(int64_t)t * hd + c], acc[j][c]);
    }
    for (int j = 0; j < R; j++) memcpy(out[j], acc[j], sizeof(float) * (size_t)hd);
}

/* ---------- AVX-512 ---------- */
AVX512_FN static float exp_sum_avx512(float *x, int n, float mx) {
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 ex = _mm512_maskz_mov_ps(k, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm)));
        _mm512_mask_storeu_ps(x + i, k, ex);
        acc = _mm512_add_ps(acc, ex);
    }
    float s[16];
    _mm512_storeu_ps(s, acc);
    return sum16(s);
}

AVX512_FN static inline __m512 cvt16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }

/* A whole key block (32 positions) at a time on VNNI's vpdpbusd (the avx512 path implies AVX512-VNNI:
 * simd/kernels/dispatch.c): it takes unsigned bytes times signed ones, so the keys go in as k + 128 (k ^ 0x80)
 * and the queries as they are:
 * sum_i (k_i + 128) q_i = k.q + 128 sum_i q_i, the second term taken off once per query. Exact in int32 (|sum| <=
 * 255 * 127 * hd), so the same dot products as the other bodies: 2 vpdpbusd a query and 32 positions where AVX-512's
 * vpmaddubsw body (it has no vpsignb: k negated under the mask of q's sign bits) took 8 instructions. One thread,
 * 16 sequences, 5 KV heads, 30 layers' pools cycled, thread CPU time alternating in one process, with the next
 * item's prefetch (attention.c): 0.437 -> 0.419 ms a call at 96 positions, 1.79 -> 1.76 at 512. */
#define AVX512VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
AVX512VNNI_FN static inline __attribute__((always_inline)) void scores_avx512_body(const int8_t *const *q8,
                                                                                 const float *c, int R,
                                                                                 const int8_t *kt, kv_blocks bl,
                                                                                 int n, int hd, float *const *sc,
                                                                                 att_pf *pf) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int lines = Q8_LINES(hd), per = (lines + hd / 4 - 1) / (hd / 4);
    int32_t qsum[4] = {0, 0, 0, 0};
    for (int j = 0; j < R; j++)
        for (int i = 0; i < hd; i++) qsum[j] += q8[j][i];
    for (int t0 = 0; t0 < n; t0 += KB) {
        const int64_t blk = BLK(bl, t0 / KB);
        const int8_t *k = kt + blk;
        const float *ks = KSCALES(kt, blk, hd);
        const char *next = pf_block(kt, bl, t0 / KB + 1, n, 1);
        __m512i acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm512_set1_epi32(-128 * qsum[j]);
        for (int i4 = 0; i4 < hd / 4; i4++) {
            pf_lines(next, i4, per, lines);
            att_pf_step(pf);
            const int8_t *ki = k + (int64_t)i4 * 4 * KB;
            const __m512i k0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)ki), flip);
            const __m512i k1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(ki + 64)), flip);
            for (int j = 0; j < R; j++) {
                int32_t w;
                memcpy(&w, q8[j] + 4 * i4, 4);
                const __m512i qs = _mm512_set1_epi32(w);
                acc[j][0] = _mm512_dpbusd_epi32(acc[j][0], k0, qs);
                acc[j][1] = _mm512_dpbusd_epi32(acc[j][1], k1, qs);
            }
        }
        const int valid = n - t0;
        const __mmask16 m0 = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
        const __mmask16 m1 = valid >= 32 ? (__mmask16)0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
        const __m512 s0 = _mm512_loadu_ps(ks), s1 = _mm512_loadu_ps(ks + 16);
        for (int j = 0; j < R; j++) {
            const __m512 cj = _mm512_set1_ps(c[j]);
            const __m512 d0 = _mm512_cvtepi32_ps(acc[j][0]), d1 = _mm512_cvtepi32_ps(acc[j][1]);
            _mm512_mask_storeu_ps(sc[j] + t0, m0, _mm512_mul_ps(_mm512_mul_ps(d0, s0), cj));
            _mm512_mask_storeu_ps(sc[j] + t0 + 16, m1, _mm512_mul_ps(_mm512_mul_ps(d1, s1), cj));
        }
    }
}
Q8_SCORES_ENTRY(AVX512VNNI_FN, scores_avx512, scores_avx512_body)

/* as wsum_avx2, 32 columns at a time (columns past the last multiple of 16 masked); hd <= Q8_MAX_HD (checked at the boundary) */
AVX512_FN static void wsum_avx512(const float *const *p, int R, const int8_t *vc, kv_blocks bl, int n, int hd,
                                  float *const *out, att_pf *pf) {
    float acc[4][Q8_MAX_HD];
    const int passes = (hd + 31) / 32, lines = Q8_LINES(hd), per = (lines + passes - 1) / passes;
    for (int j = 0; j < R; j++) memset(acc[j], 0, sizeof(float) * (size_t)hd);
    for (int ts = 0; ts < n; ts += KB) {
        q8_run_t r;
        q8_run(&r, p, R, vc, bl, ts, n, hd);
        for (int col = 0; col < hd; col += 32) {
            pf_lines(r.next, col / 32, per, lines); /* as wsum_avx2: this pass's share, before its loop */
            att_pf_step(pf);
            const int left = hd - col;
            const __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? (__mmask16)0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            __m512 a0 = _mm512_maskz_loadu_ps(m0, acc[0] + col), a1 = _mm512_maskz_loadu_ps(m1, acc[0] + col + 16);
            __m512 b0 = a0, b1 = a1, c0 = a0, c1 = a1, d0 = a0, d1 = a1;
            if (R > 1) b0 = _mm512_maskz_loadu_ps(m0, acc[1] + col), b1 = _mm512_maskz_loadu_ps(m1, acc[1] + col + 16);
            if (R > 2) c0 = _mm512_maskz_loadu_ps(m0, acc[2] + col), c1 = _mm512_maskz_loadu_ps(m1, acc[2] + col + 16);
            if (R > 3) d0 = _mm512_maskz_loadu_ps(m0, acc[3] + col), d1 = _mm512_maskz_loadu_ps(m1, acc[3] + col + 16);
            const int8_t *v = r.v0 + col;
            for (int t = 0; t < r.tn; t++, v += hd) {
                const __m512 x0 = cvt16(_mm_maskz_loadu_epi8(m0, v)), x1 = cvt16(_mm_maskz_loadu_epi8(m1, v + 16));
                __m512 x = _mm512_set1_ps(r.w[0][t]);
                a0 = _mm512_fmadd_ps(x, x0, a0), a1 = _mm512_fmadd_ps(x, x1, a1);
                if (R > 1) x = _mm512_set1_ps(r.w[1][t]), b0 = _mm512_fmadd_ps(x, x0, b0), b1 = _mm512_fmadd_ps(x, x1, b1);
                if (R > 2) x = _mm512_set1_ps(r.w[2][t]), c0 = _mm512_fmadd_ps(x, x0, c0), c1 = _mm512_fmadd_ps(x, x1, c1);
                if (R > 3) x = _mm512_set1_ps(r.w[3][t]), d0 = _mm512_fmadd_ps(x, x0, d0), d1 = _mm512_fmadd_ps(x, x1, d1);
            }
            _mm512_mask_storeu_ps(acc[0] + col, m0, a0), _mm512_mask_storeu_ps(acc[0] + col + 16, m1, a1);
            if (R > 1) _mm512_mask_storeu_ps(acc[1] + col, m0, b0), _mm512_mask_storeu_ps(acc[1] + col + 16, m1, b1);
            if (R > 2) _mm512_mask_storeu_ps(acc[2] + col, m0, c0), _mm512_mask_storeu_ps(acc[2] + col + 16, m1, c1);
            if (R > 3) _mm512_mask_storeu_ps(acc[3] + col, m0, d0), _mm512_mask_storeu_ps(acc[3] + col + 16, m1, d1);
        }
    }
    for (int j = 0; j < R; j++) memcpy(out[j], acc[j], sizeof(float) * (size_t)hd);
}
#endif

att_q8_kernels att_q8_kernels_for(int isa) {
    att_q8_kernels k = {scores_scalar, wsum_scalar, exp_sum_scalar, 0, 0};
#if defined(__x86_64__)
    if (isa >= OPS_ISA_AVX512) k = (att_q8_kernels){scores_avx512, wsum_avx512, exp_sum_avx512, KB, 32};
    else if (isa >= OPS_ISA_AVX2) k = (att_q8_kernels){scores_avx2, wsum_avx2, exp_sum_avx2, 16, 16};
#endif
    return k;
}
