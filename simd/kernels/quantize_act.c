/* Per-token activation quantization (FORMATS.md §1):
 *   act_scale = 127 / max(max|x|, 1e-5);  xq = clamp(round_half_even(x * act_scale), -128, 127);  0 in padding
 *   act_sum = sum(xq)  (the correction term of the u8 x s8 dot product on codes W+1).
 * Rounding: the vector paths use cvtps2dq under the default MXCSR mode (nearest, ties to even); the scalar
 * path uses nearbyintf, which follows the same mode. roundf would round ties away from zero: wrong.
 * max is order-independent, the products are single IEEE multiplies: every path gives the same bytes.
 * A NaN input quantizes to -128 on every path (what cvtps2dq + saturation gives) and never sets the scale: the
 * largest magnitude skips it, as the scalar `a > amax` does (x86: max_ps(a, b) returns b when either is NaN, so the
 * running max is the second operand; NEON: vmaxnm). An infinite input makes the scale 0, so it (inf * 0 = NaN)
 * quantizes to -128 and every finite value of its row to 0.
 */
#include "kernels.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

static inline int8_t quantize_one(float v, float scale) {
    float r = nearbyintf(v * scale);
    if (!(r >= -128.0f)) return -128; /* also NaN */
    if (r > 127.0f) return 127;
    return (int8_t)r;
}

/* Each path in two halves: the largest magnitude, then the quantization at a given scale (the second half
 * is also bk_table.quantize_scaled, which simd/ops/norm.c uses after its fused RMSNorm). */

static int32_t quantize_scaled_scalar(const float *x, int k, float s, int8_t *xq) {
    int32_t sum = 0;
    for (int i = 0; i < k; i++) {
        xq[i] = quantize_one(x[i], s);
        sum += xq[i];
    }
    return sum;
}

/* max(amax, max |x[i..k)|): the whole scalar maximum, or the tail a vector loop left */
static inline float amax_from(const float *x, int i, int k, float amax) {
    for (; i < k; i++) {
        float a = fabsf(x[i]);
        if (a > amax) amax = a;
    }
    return amax;
}

static void quantize_act_scalar(const float *x, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum) {
    float s = bk_act_scale(amax_from(x, 0, k, 0.0f));
    *act_sum = quantize_scaled_scalar(x, k, s, xq);
    memset(xq + k, 0, (size_t)(k_pad - k));
    *act_scale = s;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static int32_t quantize_scaled_avx2(const float *x, int k, float s, int8_t *xq) {
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i vsum = _mm256_setzero_si256();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        __m256i q[4];
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vs));
            q[j] = _mm256_max_epi32(_mm256_min_epi32(q[j], hi), lo);
            vsum = _mm256_add_epi32(vsum, q[j]);
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permutevar8x32_epi32(p, order));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(vsum), _mm256_extracti128_si256(vsum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4) + quantize_scaled_scalar(x + i, k - i, s, xq + i);
}

__attribute__((target("avx2,fma")))
static void quantize_act_avx2(const float *x, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float s = bk_act_scale(amax_from(x, i, k, _mm_cvtss_f32(m4)));
    *act_sum = quantize_scaled_avx2(x, k, s, xq);
    memset(xq + k, 0, (size_t)(k_pad - k));
    *act_scale = s;
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
static int32_t quantize_scaled_avx512(const float *x, int k, float s, int8_t *xq) {
    const __m512 vs = _mm512_set1_ps(s);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    __m512i vsum = _mm512_setzero_si512();
    for (int i = 0; i < k; i += 16) {
        __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + i), vs));
        q = _mm512_max_epi32(_mm512_min_epi32(q, hi), lo);
        q = _mm512_maskz_mov_epi32(mk, q);
        vsum = _mm512_add_epi32(vsum, q);
        _mm_mask_storeu_epi8(xq + i, mk, _mm512_cvtepi32_epi8(q));
    }
    return _mm512_reduce_add_epi32(vsum);
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
static void quantize_act_avx512(const float *x, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum) {
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(mk, x + i)), vmax);
    }
    float s = bk_act_scale(_mm512_reduce_max_ps(vmax));
    *act_sum = quantize_scaled_avx512(x, k, s, xq);
    memset(xq + k, 0, (size_t)(k_pad - k));
    *act_scale = s;
}
#endif

#if defined(__aarch64__)
static int32_t quantize_scaled_neon(const float *x, int k, float s, int8_t *xq) {
    int32x4_t vsum = vdupq_n_s32(0);
    int i = 0;
    for (; i + 4 <= k; i += 4) {
        /* vcvtnq: round to nearest, ties to even (as the reference); it makes a NaN 0, the other paths -128 */
        float32x4_t p = vmulq_n_f32(vld1q_f32(x + i), s);
        int32x4_t q = vcvtnq_s32_f32(p);
        q = vmaxq_s32(vminq_s32(q, vdupq_n_s32(127)), vdupq_n_s32(-128));
        q = vbslq_s32(vceqq_f32(p, p), q, vdupq_n_s32(-128));
        vsum = vaddq_s32(vsum, q);
        int32_t t[4];
        vst1q_s32(t, q);
        for (int j = 0; j < 4; j++) xq[i + j] = (int8_t)t[j];
    }
    return vaddvq_s32(vsum) + quantize_scaled_scalar(x + i, k - i, s, xq + i);
}

static void quantize_act_neon(const float *x, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum) {
    float32x4_t vmax = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 4 <= k; i += 4) vmax = vmaxnmq_f32(vmax, vabsq_f32(vld1q_f32(x + i)));   /* maxnm: a NaN never wins */
    float s = bk_act_scale(amax_from(x, i, k, vmaxnmvq_f32(vmax)));
    *act_sum = quantize_scaled_neon(x, k, s, xq);
    memset(xq + k, 0, (size_t)(k_pad - k));
    *act_scale = s;
}
#endif

const bk_quantize_fn bk_quantize_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, quantize_act_scalar) BK_X86_BODY(AVX2, quantize_act_avx2) BK_X86_BODY(AVX512, quantize_act_avx512)
    BK_ARM_BODY(NEON, quantize_act_neon)
};

const bk_quantize_scaled_fn bk_quantize_scaled_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, quantize_scaled_scalar) BK_X86_BODY(AVX2, quantize_scaled_avx2)
    BK_X86_BODY(AVX512, quantize_scaled_avx512) BK_ARM_BODY(NEON, quantize_scaled_neon)
};

/* rows, not tiles: its own range function */
#define QUANTIZE_ARGS(X) X(const float *, x) X(int, k) X(int, k_pad) X(int8_t *, xq) X(float *, act_scale) \
    X(int32_t *, act_sum)
BK_JOB_STRUCT(quantize_job, bk_quantize_fn, QUANTIZE_ARGS);

static void quantize_rows(void *ctx, int b, int e) {
    quantize_job *j = ctx;
    for (int r = b; r < e; r++)
        j->fn(j->x + (size_t)r * j->k, j->k, j->k_pad, j->xq + (size_t)r * j->k_pad, j->act_scale + r, j->act_sum + r);
}

void bk_quantize_act(const float *x, int m, int k, int k_pad, int8_t *xq, float *act_scale, int32_t *act_sum) {
    quantize_job job = BK_JOB_INIT(bk_table.quantize_act, QUANTIZE_ARGS);
    /* rows in units of 4; a single short row is not worth a thread hand-off */
    bk_run_tiles(m, (size_t)m * k, 32768, quantize_rows, &job);
}
