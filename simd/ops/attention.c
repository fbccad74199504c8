/* RoPE + KV-cache write + causal grouped-query attention, for one decode row or a prefill chunk.
 *
 * Math as transformers' BitNetAttention (FORMATS.md §1): half-split RoPE
 *   q'[i] = q[i]*cos[i] - q[i+h]*sin[i],  q'[i+h] = q[i+h]*cos[i] + q[i]*sin[i]   (h = head_dim/2),
 * scores = q.k / sqrt(head_dim), softmax in f32 (exp(s - max) / sum), out = sum_t p_t v_t.
 * KV head j serves query heads j*g .. j*g+g-1 (g = n_heads / n_kv).
 *
 * The cache of one layer is [n_kv, n_ctx, head_dim]: the keys of one head are contiguous, so a decode
 * step streams them linearly. Heads are spread over OpenMP threads; scratch holds one score row per head.
 */
#include "ops.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---------- f16 <-> f32, scalar (round to nearest even, like F16C and numpy) ---------- */

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0)); /* inf / nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);                                    /* overflow */
    if (ax < 0x38800000u) { /* subnormal half (or zero): add a magic number, let the FPU round */
        float a, magic = 0.5f;
        memcpy(&a, &ax, 4);
        a += magic;
        uint32_t r;
        memcpy(&r, &a, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    uint32_t mant_odd = (ax >> 13) & 1;
    ax += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round half to even */
    return (uint16_t)(sign | (ax >> 13));
}

/* ---------- dot / axpy over one cached row ---------- */

static float dot_f32_scalar(const float *q, const float *k, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += q[i] * k[i];
    return s;
}
static float dot_f16_scalar(const float *q, const uint16_t *k, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += q[i] * h2f(k[i]);
    return s;
}
static void axpy_f32_scalar(float a, const float *v, float *acc, int n) {
    for (int i = 0; i < n; i++) acc[i] += a * v[i];
}
static void axpy_f16_scalar(float a, const uint16_t *v, float *acc, int n) {
    for (int i = 0; i < n; i++) acc[i] += a * h2f(v[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
__attribute__((target("avx2,fma,f16c"))) static float dot_f32_avx2(const float *q, const float *k, int n) {
    __m256 a = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    float s = hsum8(a);
    for (; i < n; i++) s += q[i] * k[i];
    return s;
}
__attribute__((target("avx2,fma,f16c"))) static float dot_f16_avx2(const float *q, const uint16_t *k, int n) {
    __m256 a = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i))), a);
    float s = hsum8(a);
    for (; i < n; i++) s += q[i] * h2f(k[i]);
    return s;
}
__attribute__((target("avx2,fma,f16c"))) static void axpy_f32_avx2(float a, const float *v, float *acc, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += a * v[i];
}
__attribute__((target("avx2,fma,f16c"))) static void axpy_f16_avx2(float a, const uint16_t *v, float *acc, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(va, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + i))),
                                                  _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += a * h2f(v[i]);
}
__attribute__((target("avx2,fma,f16c"))) static void store_f16_avx2(const float *src, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = f2h(src[i]);
}
#endif

static void rope_rows(float *x, int n_heads, int head_dim, const float *cos, const float *sin) {
    int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + h * head_dim;
        for (int i = 0; i < half; i++) {
            float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * cos[i] - x2 * sin[i];
            v[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

void ops_attention(float *qkv, int m, int n_heads, int n_kv, int head_dim, const float *rope_cos,
                   const float *rope_sin, int pos0, void *k_cache, void *v_cache, int kv_f16, int n_ctx,
                   float *out, float *scratch) {
    const int isa = ops_isa();
    const int q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim, stride = q_dim + 2 * kv_dim;
    const int half = head_dim / 2, group = n_heads / n_kv;
    const float scale = 1.0f / sqrtf((float)head_dim);
    (void)isa;

    /* 1. rotate q and k of every row, append k and v to the cache */
    for (int r = 0; r < m; r++) {
        float *row = qkv + (int64_t)r * stride;
        int pos = pos0 + r;
        const float *c = rope_cos + (int64_t)pos * half, *s = rope_sin + (int64_t)pos * half;
        rope_rows(row, n_heads, head_dim, c, s);
        rope_rows(row + q_dim, n_kv, head_dim, c, s);
        for (int j = 0; j < n_kv; j++) {
            int64_t at = ((int64_t)j * n_ctx + pos) * head_dim;
            const float *kr = row + q_dim + j * head_dim, *vr = row + q_dim + kv_dim + j * head_dim;
            if (kv_f16) {
                uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
#if defined(__x86_64__)
                if (isa >= OPS_ISA_AVX2) {
                    store_f16_avx2(kr, kc, head_dim);
                    store_f16_avx2(vr, vc, head_dim);
                    continue;
                }
#endif
                for (int i = 0; i < head_dim; i++) {
                    kc[i] = f2h(kr[i]);
                    vc[i] = f2h(vr[i]);
                }
            } else {
                memcpy((float *)k_cache + at, kr, sizeof(float) * head_dim);
                memcpy((float *)v_cache + at, vr, sizeof(float) * head_dim);
            }
        }
    }

    /* 2. causal attention, one query head per iteration */
#pragma omp parallel for schedule(static) num_threads(ops_get_num_threads()) if (n_heads > 1)
    for (int h = 0; h < n_heads; h++) {
        const int kvh = h / group;
        float *sc = scratch + (int64_t)h * n_ctx;
        for (int r = 0; r < m; r++) {
            const float *q = qkv + (int64_t)r * stride + h * head_dim;
            float *o = out + (int64_t)r * q_dim + h * head_dim;
            const int n = pos0 + r + 1;
            float mx = -INFINITY;
            for (int t = 0; t < n; t++) {
                int64_t at = ((int64_t)kvh * n_ctx + t) * head_dim;
                float d;
#if defined(__x86_64__)
                if (isa >= OPS_ISA_AVX2)
                    d = kv_f16 ? dot_f16_avx2(q, (const uint16_t *)k_cache + at, head_dim)
                               : dot_f32_avx2(q, (const float *)k_cache + at, head_dim);
                else
#endif
                    d = kv_f16 ? dot_f16_scalar(q, (const uint16_t *)k_cache + at, head_dim)
                               : dot_f32_scalar(q, (const float *)k_cache + at, head_dim);
                d *= scale;
                sc[t] = d;
                if (d > mx) mx = d;
            }
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                sc[t] = expf(sc[t] - mx);
                sum += sc[t];
            }
            memset(o, 0, sizeof(float) * head_dim);
            for (int t = 0; t < n; t++) {
                float p = sc[t] / sum;
                int64_t at = ((int64_t)kvh * n_ctx + t) * head_dim;
#if defined(__x86_64__)
                if (isa >= OPS_ISA_AVX2) {
                    if (kv_f16) axpy_f16_avx2(p, (const uint16_t *)v_cache + at, o, head_dim);
                    else axpy_f32_avx2(p, (const float *)v_cache + at, o, head_dim);
                    continue;
                }
#endif
                if (kv_f16) axpy_f16_scalar(p, (const uint16_t *)v_cache + at, o, head_dim);
                else axpy_f32_scalar(p, (const float *)v_cache + at, o, head_dim);
            }
        }
    }
}
