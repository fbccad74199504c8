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

/* ---------- per-ISA row kernels: dot, axpy, f16 row -> f32, exp(x - max) in place ---------- */

typedef struct {
    float (*dot)(const float *a, const float *b, int n);
    void (*axpy)(float a, const float *x, float *y, int n);
    void (*f16_row)(const uint16_t *src, float *dst, int n);
    float (*exp_sum)(float *x, int n, float mx); /* x[i] = exp(x[i] - mx); returns the sum */
} att_kernels;

static float dot_scalar(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static void axpy_scalar(float a, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}
static void f16_row_scalar(const uint16_t *src, float *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = h2f(src[i]);
}
static float exp_sum_scalar(float *x, int n, float mx) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    return sum;
}

/* exp on x <= 0 (softmax after subtracting the max): Cephes' expf polynomial, ~1 ulp, like the
 * vectorized exp torch uses; arguments below -87.3 give 0 (their true value underflows anyway) */
#define EXP_LO (-87.3f)
#define EXP_C0 1.9875691500E-4f
#define EXP_C1 1.3981999507E-3f
#define EXP_C2 8.3334519073E-3f
#define EXP_C3 4.1665795894E-2f
#define EXP_C4 1.6666665459E-1f
#define EXP_C5 5.0000001201E-1f

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

AVX2_FN static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
AVX2_FN static float dot_avx2(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
AVX2_FN static void axpy_avx2(float a, const float *x, float *y, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
AVX2_FN static void f16_row_avx2(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = h2f(src[i]);
}
AVX2_FN static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(EXP_C0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
AVX2_FN static float exp_sum_avx2(float *x, int n, float mx) {
    __m256 vm = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    return sum;
}

AVX512_FN static float dot_avx512(const float *a, const float *b, int n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    if (i < n) { /* masked tail: head_dim need not be a multiple of 16 (e.g. 100) */
        for (; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), s0);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
AVX512_FN static void axpy_avx512(float a, const float *x, float *y, int n) {
    __m512 va = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, k, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
    }
}
AVX512_FN static void f16_row_avx512(const uint16_t *src, float *dst, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i)));
    }
}
AVX512_FN static float exp_sum_avx512(float *x, int n, float mx) {
    __m512 vm = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm), _mm512_set1_ps(EXP_LO));
        __m512 nn = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(0.693359375f), v);
        r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(EXP_C0);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C1));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
        __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
        __m512 e = _mm512_maskz_mov_ps(k, _mm512_scalef_ps(y, nn));
        _mm512_mask_storeu_ps(x + i, k, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
AVX2_FN static void store_f16_avx2(const float *src, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = f2h(src[i]);
}
#endif

static att_kernels kernels_for(int isa) {
    att_kernels k = {dot_scalar, axpy_scalar, f16_row_scalar, exp_sum_scalar};
#if defined(__x86_64__)
    if (isa >= OPS_ISA_AVX512) {
        k.dot = dot_avx512, k.axpy = axpy_avx512, k.f16_row = f16_row_avx512, k.exp_sum = exp_sum_avx512;
    } else if (isa >= OPS_ISA_AVX2) {
        k.dot = dot_avx2, k.axpy = axpy_avx2, k.f16_row = f16_row_avx2, k.exp_sum = exp_sum_avx2;
    }
#endif
    return k;
}

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
    const int group = n_heads / n_kv;
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

    /* 2. causal attention. A work item is one KV head with `sub` of the query heads it serves: each cached
     * key / value row is loaded (and converted from f16) once for all of them. Items are split finer
     * only when there are too few to keep every thread busy. */
    const att_kernels K = kernels_for(isa);
    const int threads = ops_get_num_threads();
    int sub = group;
    while (sub % 2 == 0 && n_kv * (group / sub) < 2 * threads) sub /= 2;
    const int n_sub = group / sub, items = n_kv * n_sub;
#pragma omp parallel num_threads(threads) if (items > 1 && (int64_t)m * (pos0 + m) * n_heads * head_dim > 32768)
    {
        float kbuf[head_dim]; /* one key or value row in f32 */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            const int kvh = item / n_sub, h0 = kvh * group + (item % n_sub) * sub;
            const uint16_t *k16 = (const uint16_t *)k_cache + (int64_t)kvh * n_ctx * head_dim;
            const uint16_t *v16 = (const uint16_t *)v_cache + (int64_t)kvh * n_ctx * head_dim;
            const float *k32 = (const float *)k_cache + (int64_t)kvh * n_ctx * head_dim;
            const float *v32 = (const float *)v_cache + (int64_t)kvh * n_ctx * head_dim;
            for (int r = 0; r < m; r++) {
                const int n = pos0 + r + 1;
                const float *q = qkv + (int64_t)r * stride;
                for (int t = 0; t < n; t++) {
                    const float *krow = k32 + (int64_t)t * head_dim;
                    if (kv_f16) {
                        K.f16_row(k16 + (int64_t)t * head_dim, kbuf, head_dim);
                        krow = kbuf;
                    }
                    for (int h = h0; h < h0 + sub; h++) scratch[(int64_t)h * n_ctx + t] = K.dot(q + h * head_dim, krow, head_dim) * scale;
                }
                for (int h = h0; h < h0 + sub; h++) {
                    float *sc = scratch + (int64_t)h * n_ctx, mx = -INFINITY;
                    for (int t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
                    float inv = 1.0f / K.exp_sum(sc, n, mx);
                    for (int t = 0; t < n; t++) sc[t] *= inv;
                    memset(out + (int64_t)r * q_dim + h * head_dim, 0, sizeof(float) * head_dim);
                }
                for (int t = 0; t < n; t++) {
                    const float *vrow = v32 + (int64_t)t * head_dim;
                    if (kv_f16) {
                        K.f16_row(v16 + (int64_t)t * head_dim, kbuf, head_dim);
                        vrow = kbuf;
                    }
                    for (int h = h0; h < h0 + sub; h++)
                        K.axpy(scratch[(int64_t)h * n_ctx + t], vrow, out + (int64_t)r * q_dim + h * head_dim, head_dim);
                }
            }
        }
    }
}
