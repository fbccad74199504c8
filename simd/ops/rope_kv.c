/* RoPE of one row's heads, and the f16 KV-cache write of one position (a key into its transposed block's
 * column, a value into its row): the first step of attention (attention.c), per position and KV head.
 *
 * Half-split RoPE as transformers' (FORMATS.md §1): q'[i] = q[i]*cos[i] - q[i+h]*sin[i],
 * q'[i+h] = q[i+h]*cos[i] + q[i]*sin[i] (h = head_dim/2): two products, then one subtraction or addition, never
 * fused (the build has -ffp-contract=off), so the AVX2 and NEON bodies give the scalar body's bits lane by lane.
 *
 * f32 -> f16 rounds to nearest even on every path (bk_float_to_half; F16C's vcvtps2ph; NEON's fcvtn). The
 * vector conversions keep a NaN's top payload bits where the scalar one writes the quiet NaN 0x7e00 (with its
 * sign): the vector bodies clear them, so a NaN key or value gives the same cache bytes on every path.
 */
#include "ops.h"
#include "attn_common.h" /* AVX2_FN */

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

/* ---------- scalar bodies ---------- */

/* pairs from .. half-1 of one head (a vector body's tail starts past 0) */
static void rope_pairs(float *v, int half, const float *cos, const float *sin, int from) {
    for (int i = from; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cos[i] - x2 * sin[i];
        v[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

static void rope_scalar(float *v, int half, const float *cos, const float *sin) { rope_pairs(v, half, cos, sin, 0); }

static void kv_store_f16_scalar(const float *k, const float *v, int hd, uint16_t *k_col, uint16_t *v_row) {
    for (int i = 0; i < hd; i++) v_row[i] = bk_float_to_half(v[i]);
    for (int i = 0; i < hd; i++) k_col[(int64_t)i * OPS_KT_BLOCK] = bk_float_to_half(k[i]);
}

/* ---------- AVX2 bodies (F16C) ---------- */
#if defined(__x86_64__)
AVX2_FN static void rope_avx2(float *v, int half, const float *cos, const float *sin) {
    int i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + i + half);
        const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(v + i + half, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
    rope_pairs(v, half, cos, sin, i);
}

/* 8 halves of 8 floats. A NaN converts to sign | 0x7e00 | payload bits (F16C keeps the top ones, quieted):
 * a half whose 0x7e00 bits are all set is a NaN, and its payload bits are cleared, as bk_float_to_half writes it */
AVX2_FN static inline __m128i half8_avx2(__m256 x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT), quiet = _mm_set1_epi16(0x7e00);
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, quiet), quiet);
    return _mm_andnot_si128(_mm_and_si128(nan, _mm_set1_epi16(0x01ff)), h);
}

AVX2_FN static void kv_store_f16_avx2(const float *k, const float *v, int hd, uint16_t *k_col, uint16_t *v_row) {
    int i = 0;
    for (; i + 8 <= hd; i += 8) {
        _mm_storeu_si128((__m128i *)(v_row + i), half8_avx2(_mm256_loadu_ps(v + i)));
        uint16_t kh[8];
        _mm_storeu_si128((__m128i *)kh, half8_avx2(_mm256_loadu_ps(k + i)));
        for (int j = 0; j < 8; j++) k_col[(int64_t)(i + j) * OPS_KT_BLOCK] = kh[j]; /* the key's column: scattered */
    }
    kv_store_f16_scalar(k + i, v + i, hd - i, k_col + (int64_t)i * OPS_KT_BLOCK, v_row + i);
}
#endif

/* ---------- NEON bodies ---------- */
#if defined(__aarch64__)
static void rope_neon(float *v, int half, const float *cos, const float *sin) {
    int i = 0;
    for (; i + 8 <= half; i += 8) { /* two vectors a step: ld1 / st1 of register pairs */
        const float32x4x2_t x1 = vld1q_f32_x2(v + i), x2 = vld1q_f32_x2(v + i + half);
        const float32x4x2_t c = vld1q_f32_x2(cos + i), s = vld1q_f32_x2(sin + i);
        float32x4x2_t a, b;
        for (int j = 0; j < 2; j++) {
            a.val[j] = vsubq_f32(vmulq_f32(x1.val[j], c.val[j]), vmulq_f32(x2.val[j], s.val[j])); /* never fmls */
            b.val[j] = vaddq_f32(vmulq_f32(x2.val[j], c.val[j]), vmulq_f32(x1.val[j], s.val[j]));
        }
        vst1q_f32_x2(v + i, a);
        vst1q_f32_x2(v + i + half, b);
    }
    rope_pairs(v, half, cos, sin, i);
}

/* 8 halves of 8 floats (fcvtn rounds to nearest even under Linux's default FPCR). A NaN converts to
 * sign | 0x7e00 | payload bits: its payload bits are cleared, as bk_float_to_half writes it (see half8_avx2) */
static inline uint16x8_t half8_neon(float32x4_t lo, float32x4_t hi) {
    const uint16x8_t h = vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(lo), hi)), quiet = vdupq_n_u16(0x7e00);
    const uint16x8_t nan = vceqq_u16(vandq_u16(h, quiet), quiet);
    return vbicq_u16(h, vandq_u16(nan, vdupq_n_u16(0x01ff)));
}

static void kv_store_f16_neon(const float *k, const float *v, int hd, uint16_t *k_col, uint16_t *v_row) {
    int i = 0;
    for (; i + 8 <= hd; i += 8) {
        const float32x4x2_t vv = vld1q_f32_x2(v + i), kk = vld1q_f32_x2(k + i);
        vst1q_u16(v_row + i, half8_neon(vv.val[0], vv.val[1]));
        const uint16x8_t kh = half8_neon(kk.val[0], kk.val[1]);
        uint16_t *col = k_col + (int64_t)i * OPS_KT_BLOCK; /* the key's column: one lane per block row */
        vst1q_lane_u16(col, kh, 0);
        vst1q_lane_u16(col + OPS_KT_BLOCK, kh, 1);
        vst1q_lane_u16(col + 2 * OPS_KT_BLOCK, kh, 2);
        vst1q_lane_u16(col + 3 * OPS_KT_BLOCK, kh, 3);
        vst1q_lane_u16(col + 4 * OPS_KT_BLOCK, kh, 4);
        vst1q_lane_u16(col + 5 * OPS_KT_BLOCK, kh, 5);
        vst1q_lane_u16(col + 6 * OPS_KT_BLOCK, kh, 6);
        vst1q_lane_u16(col + 7 * OPS_KT_BLOCK, kh, 7);
    }
    kv_store_f16_scalar(k + i, v + i, hd - i, k_col + (int64_t)i * OPS_KT_BLOCK, v_row + i);
}
#endif

/* ---------- dispatch ---------- */

void ops_rope_heads(float *x, int n_heads, int head_dim, const float *cos, const float *sin) {
    const int half = head_dim / 2;
    void (*body)(float *, int, const float *, const float *) = rope_scalar;
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) body = rope_avx2;
#endif
#if defined(__aarch64__)
    if (ops_neon()) body = rope_neon;
#endif
    for (int h = 0; h < n_heads; h++) body(x + (int64_t)h * head_dim, half, cos, sin);
}

void ops_kv_store_f16(const float *k, const float *v, int head_dim, uint16_t *k_col, uint16_t *v_row) {
#if defined(__x86_64__)
    if (ops_isa() >= OPS_ISA_AVX2) {
        kv_store_f16_avx2(k, v, head_dim, k_col, v_row);
        return;
    }
#endif
#if defined(__aarch64__)
    if (ops_neon()) {
        kv_store_f16_neon(k, v, head_dim, k_col, v_row);
        return;
    }
#endif
    kv_store_f16_scalar(k, v, head_dim, k_col, v_row);
}
