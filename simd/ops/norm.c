/* RMSNorm (f32, no +1 offset, as transformers' BitNetRMSNorm: x * rsqrt(mean(x^2) + eps) * w) fused with
 * the residual add before it and the per-token int8 quantization after it (FORMATS.md §1), the gated MLP
 * activation (relu(g)^2 * u or silu(g) * u), and the f16 embedding lookup.
 *
 * Quantization is simd/kernels/quantize_act.c's own (bk_table.quantize_scaled, bk_act_scale), so it matches
 * simd._kernels.quantize_act bit for bit. Rows of a prefill chunk go to the kernels' worker pool.
 *
 * SiLU: silu(g) = g * sigmoid(g), taken as e = exp(-|g|), (g >= 0 ? g : g * e) / (1 + e), on attn_common.h's exp
 * polynomial (exp_poly; exp_avx2 and exp_neon.h are it in registers), with e = 0 where -|g| <= EXP_LO (exp is
 * below f32's normal range there; so silu(-huge) is -0, not g * exp(EXP_LO)). The exp's argument is never
 * positive, so nothing overflows, and every path (scalar, AVX2, NEON) gives the same bits: libm's expf, which the
 * scalar body called before, has no vector form with its bits (the AVX2 body then differed from it by an ulp here
 * and there, and at |g| > 88 by more).
 */
#include "ops.h"
#include "attn_common.h" /* exp_poly, exp_avx2, sum16 */

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#include "exp_neon.h"
#endif

/* ---------- scalar bodies ---------- */

static float sumsq_scalar(const float *x, int n) {
    /* 16 partial sums (lane l takes i % 16 == l; less rounding error than one running sum), reduced in sum16's
     * order, then the tail one by one: the order of the AVX2 body (two 8-lane sums) and of the NEON body (four
     * 4-lane sums), so every path gives the same float */
    float s[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) s[j] += x[i + j] * x[i + j];
    float t = sum16(s);
    for (; i < n; i++) t += x[i] * x[i];
    return t;
}

static float scale_mul_scalar(const float *x, float r, const float *w, int n, float *h) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float v = (x[i] * r) * w[i];
        h[i] = v;
        float a = fabsf(v);
        if (a > amax) amax = a;
    }
    return amax;
}

static void add_scalar(float *x, const float *d, int n) {
    for (int i = 0; i < n; i++) x[i] += d[i];
}

/* silu(g) * u, one element: the scalar body, and the tail of the vector ones */
static inline float silu_mul_one(float g, float u) {
    const float a = -fabsf(g), e = a > EXP_LO ? exp_poly(a) : 0.0f;
    return ((g >= 0.0f ? g : g * e) / (1.0f + e)) * u; /* a NaN gate: g * e, NaN */
}

/* ---------- AVX2 bodies ---------- */
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static float sumsq_avx2(const float *x, int n) {
    /* lanes 0-7 and 8-15 of the scalar body's 16; hsum256(a0 + a1) is sum16's order */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
    }
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

__attribute__((target("avx2,fma"))) static float scale_mul_avx2(const float *x, float r, const float *w, int n, float *h) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 vr = _mm256_set1_ps(r);
    __m256 vmax = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(h + i, v);
        vmax = _mm256_max_ps(_mm256_and_ps(v, abs_mask), vmax); /* a NaN lane keeps vmax, as the scalar `a > amax` */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; i < n; i++) {
        float v = (x[i] * r) * w[i];
        h[i] = v;
        if (fabsf(v) > amax) amax = fabsf(v);
    }
    return amax;
}

__attribute__((target("avx2,fma"))) static void relu2_mul_avx2(float *g, const float *u, int n) {
    const __m256 zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_max_ps(_mm256_loadu_ps(g + i), zero);
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(a, a), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) {
        float a = g[i] > 0.0f ? g[i] : 0.0f;
        g[i] = (a * a) * u[i];
    }
}

AVX2_FN static void silu_mul_avx2(float *g, const float *u, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), a = _mm256_or_ps(x, sign); /* -|g| */
        const __m256 e = _mm256_and_ps(exp_avx2(a), _mm256_cmp_ps(a, lo, _CMP_GT_OQ));
        const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = silu_mul_one(g[i], u[i]);
}

__attribute__((target("avx2,fma"))) static void add_avx2(float *x, const float *d, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(d + i)));
    for (; i < n; i++) x[i] += d[i];
}
#endif


/* ---------- NEON bodies: the scalar bodies' operations in the scalar bodies' order (the 16 partial sums
 * of sumsq are four vectors' lanes), so the same floats ---------- */
#if defined(__aarch64__)
static float sumsq_neon(const float *x, int n) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int v = 0; v < 4; v++) {
            const float32x4_t a = vld1q_f32(x + i + 4 * v);
            acc[v] = vaddq_f32(acc[v], vmulq_f32(a, a)); /* mul then add: never fused, as the scalar (-ffp-contract=off) */
        }
    float s[16];
    for (int v = 0; v < 4; v++) vst1q_f32(s + 4 * v, acc[v]);
    float t = sum16(s);
    for (; i < n; i++) t += x[i] * x[i];
    return t;
}

static float scale_mul_neon(const float *x, float r, const float *w, int n, float *h) {
    /* maxnm ignores a NaN lane, as the scalar `a > amax` does */
    float32x4_t am = vdupq_n_f32(0.0f), rv = vdupq_n_f32(r);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vmulq_f32(vmulq_f32(vld1q_f32(x + i), rv), vld1q_f32(w + i));
        vst1q_f32(h + i, v);
        am = vmaxnmq_f32(am, vabsq_f32(v));
    }
    float amax = vmaxnmvq_f32(am);
    for (; i < n; i++) {
        float v = (x[i] * r) * w[i];
        h[i] = v;
        float a = fabsf(v);
        if (a > amax) amax = a;
    }
    return amax;
}

static void add_neon(float *x, const float *d, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vaddq_f32(vld1q_f32(x + i), vld1q_f32(d + i)));
    for (; i < n; i++) x[i] += d[i];
}

static void relu2_mul_neon(float *g, const float *u, int n) {
    const float32x4_t zero = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vld1q_f32(g + i);
        float32x4_t a = vbslq_f32(vcgtq_f32(v, zero), v, zero); /* NaN -> 0, as `g > 0 ? g : 0` */
        vst1q_f32(g + i, vmulq_f32(vmulq_f32(a, a), vld1q_f32(u + i)));
    }
    for (; i < n; i++) {
        float a = g[i] > 0.0f ? g[i] : 0.0f;
        g[i] = (a * a) * u[i];
    }
}

/* silu(g) * u of four gates: silu_mul_one's operations. The lanes that fail `-|g| > EXP_LO` (a NaN fails it, as
 * in the scalar compare) are zeroed after the exp, so the exp needs no clamp of its own (one fmaxnm fewer) */
static inline __attribute__((always_inline)) float32x4_t silu4_neon(float32x4_t x, float32x4_t u) {
    const float32x4_t a = vnegq_f32(vabsq_f32(x));
    const uint32x4_t in = vcgtq_f32(a, vdupq_n_f32(EXP_LO));
    const float32x4_t e = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(ops_exp_neon_in_range(a)), in));
    const float32x4_t num = vbslq_f32(vcgezq_f32(x), x, vmulq_f32(x, e)); /* NaN: not >= 0, g * e */
    return vmulq_f32(vdivq_f32(num, vaddq_f32(vdupq_n_f32(1.0f), e)), u);
}

/* two vectors a step (ld1 / st1 of register pairs, half the loop's own instructions per gate), then one, then the
 * scalar tail. gcc 12 -O3: 32.5 instructions per four gates (39 before: one vector a step, the clamp, 2^n in three
 * steps), where AVX2 has 33 per eight: the same work per vector on half the lanes, plus five register copies for
 * the Horner fmla, which overwrites its addend (no vector fmad before SVE). Four vectors a step spill. */
static void silu_mul_neon(float *g, const float *u, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const float32x4x2_t x = vld1q_f32_x2(g + i), w = vld1q_f32_x2(u + i);
        float32x4x2_t y;
        y.val[0] = silu4_neon(x.val[0], w.val[0]);
        y.val[1] = silu4_neon(x.val[1], w.val[1]);
        vst1q_f32_x2(g + i, y);
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(g + i, silu4_neon(vld1q_f32(g + i), vld1q_f32(u + i)));
    for (; i < n; i++) g[i] = silu_mul_one(g[i], u[i]);
}
#endif

/* ---------- dispatch helpers ---------- */

static inline float sumsq(const float *x, int n) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) return sumsq_avx2(x, n);
#endif
#if defined(__aarch64__)
    if (ops_neon()) return sumsq_neon(x, n);
#endif
    return sumsq_scalar(x, n);
}

static inline float scale_mul(const float *x, float r, const float *w, int n, float *h) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) return scale_mul_avx2(x, r, w, n, h);
#endif
#if defined(__aarch64__)
    if (ops_neon()) return scale_mul_neon(x, r, w, n, h);
#endif
    return scale_mul_scalar(x, r, w, n, h);
}

static inline void add(float *x, const float *d, int n) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) {
        add_avx2(x, d, n);
        return;
    }
#endif
#if defined(__aarch64__)
    if (ops_neon()) {
        add_neon(x, d, n);
        return;
    }
#endif
    add_scalar(x, d, n);
}

/* rsqrt as torch computes it for f32: 1 / sqrt(mean + eps), both single-precision IEEE operations */
static inline float inv_rms(const float *x, int n, float eps) {
    float mean = sumsq(x, n) / (float)n;
    return 1.0f / sqrtf(mean + eps);
}

/* Rows are independent: prefill chunks and batches spread them over the pool once the work the hand-off takes off
 * the caller, m * row_work * (nt - 1) / nt, passes what the hand-off costs, 2^15 row-elements: on 2 threads that
 * is 26+ rows of 2,560 (2B-4T width) as measured below; a decode row, or the 16 rows of a 2-thread batched decode
 * step (~20 us of work), stay on the caller. add_rmsnorm_quant, d = 2560, 2 threads, 2-core Zen 5, us per call,
 * the caller alone -> the pool: 16 rows 18-20 -> 19-34 (pool from 4 rows), 32 rows 35 -> 28-32, 64 rows 65-68 ->
 * 43-44 (the bound was 1 << 18, 103 rows, before 2026-11-30). On 16 threads the same cost takes 16 rows of 2,560
 * (the bound, 34,953 row-elements, is 13.7 rows): there lease 4 measured them on the caller at 2.9 ms of an
 * 18.6 ms batched step (16 sequences, Xeon with AMX), while glu_rmsnorm_quant's 16 rows of 6,912, 2.7 times the
 * data, took 0.75 ms on the pool (bench/TILES_RESULTS.md). */
static void run_rows(int m, int64_t row_work, bk_range_fn fn, void *ctx) {
    const int nt = bk_get_num_threads();
    if (m >= 8 && nt > 1 && (int64_t)m * row_work * (nt - 1) >= ((int64_t)nt << 15))
        bk_parallel_for(m, 1, nt, fn, ctx);
    else
        fn(ctx, 0, m);
}

typedef struct {
    float *x;
    const float *delta, *w;
    int d, k_pad;
    float eps;
    float *h;
    int8_t *xq;
    float *act_scale;
    int32_t *act_sum;
} norm_job;

static void add_rmsnorm_quant_rows(void *ctx, int b, int e) {
    const norm_job *j = ctx;
    const int d = j->d;
    const bk_quantize_scaled_fn quant = bk_table.quantize_scaled;
    for (int r = b; r < e; r++) {
        float *xr = j->x + (int64_t)r * d, *hr = j->h + (int64_t)r * d;
        int8_t *qr = j->xq + (int64_t)r * j->k_pad;
        if (j->delta) add(xr, j->delta + (int64_t)r * d, d);
        float amax = scale_mul(xr, inv_rms(xr, d, j->eps), j->w, d, hr);
        float s = bk_act_scale(amax);
        j->act_sum[r] = quant(hr, d, s, qr);
        memset(qr + d, 0, (size_t)(j->k_pad - d));
        j->act_scale[r] = s;
    }
}

void ops_add_rmsnorm_quant(float *x, const float *delta, const float *w, int m, int d, float eps, float *h,
                           int8_t *xq, int k_pad, float *act_scale, int32_t *act_sum) {
    norm_job job = {x, delta, w, d, k_pad, eps, h, xq, act_scale, act_sum};
    run_rows(m, d, add_rmsnorm_quant_rows, &job);
}

static void add_rmsnorm_rows(void *ctx, int b, int e) {
    const norm_job *j = ctx;
    const int d = j->d;
    for (int r = b; r < e; r++) {
        float *xr = j->x + (int64_t)r * d;
        if (j->delta) add(xr, j->delta + (int64_t)r * d, d);
        scale_mul(xr, inv_rms(xr, d, j->eps), j->w, d, j->h + (int64_t)r * d);
    }
}

void ops_add_rmsnorm(float *x, const float *delta, const float *w, int m, int d, float eps, float *out) {
    norm_job job = {x, delta, w, d, 0, eps, out, NULL, NULL, NULL};
    run_rows(m, d, add_rmsnorm_rows, &job);
}

/* Per-head RMSNorm in place (Qwen3's q_norm / k_norm): heads of hd floats starting at column col0 of each of the
 * m rows (row stride ld); the same inv_rms and scale_mul as ops_add_rmsnorm, so the same floats. */
void ops_head_rmsnorm(float *x, int m, int ld, int col0, int heads, int hd, const float *w, float eps) {
    for (int r = 0; r < m; r++)
        for (int h = 0; h < heads; h++) {
            float *p = x + (int64_t)r * ld + col0 + (int64_t)h * hd;
            scale_mul(p, inv_rms(p, hd, eps), w, hd, p);
        }
}

typedef struct {
    float *gu;
    int inter, act, k_pad;
    const float *w;
    float eps;
    int8_t *xq;
    float *act_scale;
    int32_t *act_sum;
} glu_job;

static void glu_rmsnorm_quant_rows(void *ctx, int b, int e) {
    const glu_job *j = ctx;
    const int inter = j->inter;
    const bk_quantize_scaled_fn quant = bk_table.quantize_scaled;
    for (int r = b; r < e; r++) {
        float *g = j->gu + (int64_t)r * 2 * inter;
        const float *u = g + inter;
        if (j->act == OPS_ACT_RELU2) {
#if defined(__x86_64__)
            if (ops_isa() >= OPS_ISA_AVX2) relu2_mul_avx2(g, u, inter);
            else
#endif
#if defined(__aarch64__)
            if (ops_neon()) relu2_mul_neon(g, u, inter);
            else
#endif
            for (int i = 0; i < inter; i++) {
                float a = g[i] > 0.0f ? g[i] : 0.0f;
                g[i] = (a * a) * u[i];
            }
        } else {
#if defined(__x86_64__)
            if (ops_isa() >= OPS_ISA_AVX2) silu_mul_avx2(g, u, inter);
            else
#endif
#if defined(__aarch64__)
            if (ops_neon()) silu_mul_neon(g, u, inter);
            else
#endif
            for (int i = 0; i < inter; i++) g[i] = silu_mul_one(g[i], u[i]);
        }
        /* normalize in place over the gate half (w NULL: no sub-norm, Llama-architecture models), then
         * quantize it (xq NULL: the caller quantizes, per group: ops.glu_rmsnorm) */
        if (!j->xq) {
            if (j->w) scale_mul(g, inv_rms(g, inter, j->eps), j->w, inter, g);
            continue;
        }
        int8_t *qr = j->xq + (int64_t)r * j->k_pad;
        float amax = 0.0f;
        if (j->w) amax = scale_mul(g, inv_rms(g, inter, j->eps), j->w, inter, g);
        else
            for (int i = 0; i < inter; i++) amax = fabsf(g[i]) > amax ? fabsf(g[i]) : amax;
        float s = bk_act_scale(amax);
        j->act_sum[r] = quant(g, inter, s, qr);
        memset(qr + inter, 0, (size_t)(j->k_pad - inter));
        j->act_scale[r] = s;
    }
}

void ops_glu_rmsnorm_quant(float *gu, int m, int inter, int act, const float *w, float eps, int8_t *xq,
                           int k_pad, float *act_scale, int32_t *act_sum) {
    glu_job job = {gu, inter, act, k_pad, w, eps, xq, act_scale, act_sum};
    run_rows(m, 3 * (int64_t)inter, glu_rmsnorm_quant_rows, &job);
}


#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) static void f16_row_avx2(const uint16_t *src, int d, float *dst) {
    int i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < d; i++) dst[i] = ops_half_to_float(src[i]);
}
#endif

int ops_embed_f16(const uint16_t *table, int64_t vocab, int d, const int32_t *ids, int m, float *out) {
    for (int r = 0; r < m; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return r;
    for (int r = 0; r < m; r++) {
        const uint16_t *src = table + (int64_t)ids[r] * d;
        float *dst = out + (int64_t)r * d;
#if defined(__x86_64__)
        if (ops_isa() >= OPS_ISA_AVX2) {
            f16_row_avx2(src, d, dst);
            continue;
        }
#endif
#if defined(__aarch64__)
        if (ops_neon()) { /* fcvtl: exact, like the scalar conversion */
            int i = 0;
            for (; i + 8 <= d; i += 8) {
                const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + i));
                vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(h)));
                vst1q_f32(dst + i + 4, vcvt_high_f32_f16(h));
            }
            for (; i < d; i++) dst[i] = ops_half_to_float(src[i]);
            continue;
        }
#endif
        for (int i = 0; i < d; i++) dst[i] = ops_half_to_float(src[i]);
    }
    return -1;
}
