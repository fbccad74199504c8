/* Shared by attention.c (f16 / f32 cache) and attention_q8.c (int8 cache): the x86 bodies' target attributes,
 * softmax's exp (Cephes' expf polynomial, ~1 ulp, like the vectorized exp torch uses) in one scalar lane and in
 * AVX2 / AVX-512 registers, the one reduction order of 16 lane sums, and lane masks. One copy, so bodies that must
 * give the same bits use the very same operations.
 *
 * exp is only ever taken of x <= 0 (a score minus the row's max): arguments below EXP_LO give 0 (their true value
 * underflows anyway), so 2^n is always a normal float (n >= -126) and is built from its exponent bits. */
#ifndef BITNET_ATTN_COMMON_H
#define BITNET_ATTN_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
/* the AVX2 level of the dispatcher implies FMA and F16C (simd/kernels/dispatch.c) */
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#endif

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
AVX2_FN static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
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
AVX2_FN static inline __m256i lanes_below(int k) { /* lanes 0..k-1 set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
AVX512_FN static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

#endif
