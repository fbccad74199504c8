/* Group-scaled ternary GEMV for m rows ("tg128", simd/layout.py; tg.h): the weights of the Ternary Bonsai
 * models (GGUF Q2_0: one f16 scale per 128 weights of a row), activations quantized per group of 128 too.
 *   dot_g[n] = sum_{k in g} u[n,k] * xq[k] - xsum[g]          (exact int32; u = t + 1, 2-bit code in {0,1,2})
 *   acc = 0; for g in order: acc = acc + (float)dot_g[n] * (scale[n,g] * xd[g]);   out[n] = acc
 * The tile's group (544 bytes: 16 f16 scales, then 8 tile16 blocks) is one contiguous piece of a single
 * sequential stream; a group's int16 sums (8 blocks, |sum| <= 8 * 2048) never overflow. m > 1 (prefill, verify)
 * reads each tile's groups once from memory and again from cache for the other rows.
 */
#include "kernels.h"
#include "half.h"
#include "tg.h"

#include <math.h>

#if defined(__x86_64__)
#include "x86_common.h"
#endif
#if defined(__aarch64__)
#include "ternary_neon.h"
#endif

typedef void (*tg_fn)(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                      float *out, int n, int tile_begin, int tile_end);

static inline void tg_store(const float *acc, int row0, int n, float *out) {
    for (int r = 0; r < 16 && row0 + r < n; r++) out[row0 + r] = acc[r];
}

static void tg_scalar(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                      float *out, int n, int tile_begin, int tile_end) {
    const int groups = k_pad / BK_TG_GROUP;
    for (int t = tile_begin; t < tile_end; t++)
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            float acc[16] = {0};
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = w + ((size_t)t * groups + g) * BK_TG_GROUP_BYTES;
                const float d = xd[(size_t)i * groups + g];
                const int32_t s = xsum[(size_t)i * groups + g];
                for (int r = 0; r < 16; r++) {
                    int32_t dot = 0;
                    for (int b = 0; b < 8; b++) {
                        const uint8_t *blk = q + 32 + b * 64;
                        const int8_t *xb = x + BK_TG_GROUP * g + 16 * b;
                        for (int j = 0; j < 4; j++) {
                            unsigned byte = blk[r * 4 + j];
                            for (int c = 0; c < 4; c++) dot += (int32_t)((byte >> (2 * c)) & 3) * xb[4 * c + j];
                        }
                    }
                    float sc = bk_half_to_float((uint16_t)(q[2 * r] | (q[2 * r + 1] << 8))) * d;
                    float p = (float)(dot - s) * sc;
                    acc[r] = acc[r] + p;
                }
            }
            tg_store(acc, t * 16, n, out + (size_t)i * n);
        }
}

#if defined(__x86_64__)
#define TG_PREFETCH_BYTES 2048 /* as the tile16 AVX2 GEMV had (gemv_ternary.c), fixed: not yet swept */

AVX2_TARGET static void tg_avx2(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m,
                                int k_pad, float *out, int n, int tile_begin, int tile_end) {
    const int groups = k_pad / BK_TG_GROUP;
    const size_t tile_bytes = (size_t)groups * BK_TG_GROUP_BYTES;
    const __m256i m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12), ones = _mm256_set1_epi16(1);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            const float *d = xd + (size_t)i * groups;
            const int32_t *xs = xsum + (size_t)i * groups;
            __m256 alo = _mm256_setzero_ps(), ahi = alo;
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = p + (size_t)g * BK_TG_GROUP_BYTES;
                __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0;
                for (int b = 0; b < 8; b++) { /* one group = AVX2_FLUSH_BLOCKS blocks */
                    const int8_t *xb = x + BK_TG_GROUP * g + 16 * b;
                    __m256i x0 = _mm256_set1_epi32(load_i32(xb)), x1 = _mm256_set1_epi32(load_i32(xb + 4));
                    __m256i x2 = _mm256_set1_epi32(load_i32(xb + 8)), x3 = _mm256_set1_epi32(load_i32(xb + 12));
                    _mm_prefetch((const char *)q + 32 + b * 64 + TG_PREFETCH_BYTES, _MM_HINT_T0); /* a hint: never faults */
                    TERNARY_HALF_AVX2(l0, l1, q + 32 + b * 64);
                    TERNARY_HALF_AVX2(h0, h1, q + 32 + b * 64 + 32);
                }
                __m256i s = _mm256_set1_epi32(xs[g]);
                __m256 dg = _mm256_set1_ps(d[g]);
                __m256 slo = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q)), dg);
                __m256 shi = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q + 16))), dg);
                __m256 dlo = _mm256_cvtepi32_ps(_mm256_sub_epi32(TERNARY_WIDEN_AVX2(l0, l1, ones), s));
                __m256 dhi = _mm256_cvtepi32_ps(_mm256_sub_epi32(TERNARY_WIDEN_AVX2(h0, h1, ones), s));
                alo = _mm256_add_ps(alo, _mm256_mul_ps(dlo, slo)); /* -ffp-contract=off: never fused */
                ahi = _mm256_add_ps(ahi, _mm256_mul_ps(dhi, shi));
            }
            float *o = out + (size_t)i * n;
            if (t * 16 + 16 <= n) {
                _mm256_storeu_ps(o + t * 16, alo);
                _mm256_storeu_ps(o + t * 16 + 8, ahi);
            } else {
                float acc[16];
                _mm256_storeu_ps(acc, alo);
                _mm256_storeu_ps(acc + 8, ahi);
                tg_store(acc, t * 16, n, o);
            }
        }
    }
}
#endif

#if defined(__aarch64__)
/* sdot (dotprod path): a tile16 block is 4 vectors of 4 rows x 4 bytes, each 2-bit plane c of a byte holding
 * columns 4c..4c+3, so plane c meets activation lane c (the gemv_ternary NEON body's scheme); the group's f32
 * steps are the scalar body's, lane by lane. */
__attribute__((target("arch=armv8.2-a+dotprod")))
static void tg_dotprod(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                       float *out, int n, int tile_begin, int tile_end) {
    const int groups = k_pad / BK_TG_GROUP;
    const size_t tile_bytes = (size_t)groups * BK_TG_GROUP_BYTES;
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            const float *d = xd + (size_t)i * groups;
            const int32_t *xs = xsum + (size_t)i * groups;
            float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = p + (size_t)g * BK_TG_GROUP_BYTES;
                int32x4_t dot[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
                for (int b = 0; b < 8; b++) {
                    const int8x16_t xv = vld1q_s8(x + BK_TG_GROUP * g + 16 * b);
                    for (int r = 0; r < 4; r++) dot[r] = ternary_sdot_neon(dot[r], vld1q_u8(q + 32 + b * 64 + 16 * r), xv, m3);
                }
                const int32x4_t s = vdupq_n_s32(xs[g]);
                const float32x4_t dg = vdupq_n_f32(d[g]);
                for (int r = 0; r < 4; r++) {
                    /* f16 -> f32 is exact; then one rounding per step, never fused (-ffp-contract=off) */
                    float32x4_t sc = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(q + 8 * r))), dg);
                    acc[r] = vaddq_f32(acc[r], vmulq_f32(vcvtq_f32_s32(vsubq_s32(dot[r], s)), sc));
                }
            }
            float res[16];
            for (int r = 0; r < 4; r++) vst1q_f32(res + 4 * r, acc[r]);
            tg_store(res, t * 16, n, out + (size_t)i * n);
        }
    }
}

/* Plain NEON (no sdot): the same group dots by smlal into int16 lanes (one per row and byte; a group adds at
 * most 8 blocks * 4 planes * 2 * 128 = 8192 to a lane), then the dotprod body's float steps. */
static void tg_neon(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                    float *out, int n, int tile_begin, int tile_end) {
    const int groups = k_pad / BK_TG_GROUP;
    const size_t tile_bytes = (size_t)groups * BK_TG_GROUP_BYTES;
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        for (int i = 0; i < m; i++) {
            const int8_t *x = xq + (size_t)i * k_pad;
            const float *d = xd + (size_t)i * groups;
            const int32_t *xs = xsum + (size_t)i * groups;
            float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = p + (size_t)g * BK_TG_GROUP_BYTES;
                int16x8_t s[8];
                for (int v = 0; v < 8; v++) s[v] = vdupq_n_s16(0);
                for (int b = 0; b < 8; b++) {
                    int8x8_t xd4[4];
                    ternary_dwords_neon(x + BK_TG_GROUP * g + 16 * b, xd4);
                    for (int r = 0; r < 4; r++)
                        ternary_smlal_neon(&s[2 * r], &s[2 * r + 1], vld1q_u8(q + 32 + b * 64 + 16 * r), xd4, m3);
                }
                const int32x4_t sum = vdupq_n_s32(xs[g]);
                const float32x4_t dg = vdupq_n_f32(d[g]);
                for (int r = 0; r < 4; r++) {
                    int32x4_t dot = vpaddq_s32(vpaddlq_s16(s[2 * r]), vpaddlq_s16(s[2 * r + 1])); /* rows 4r..4r+3 */
                    float32x4_t sc = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(q + 8 * r))), dg);
                    acc[r] = vaddq_f32(acc[r], vmulq_f32(vcvtq_f32_s32(vsubq_s32(dot, sum)), sc));
                }
            }
            float res[16];
            for (int r = 0; r < 4; r++) vst1q_f32(res + 4 * r, acc[r]);
            tg_store(res, t * 16, n, out + (size_t)i * n);
        }
    }
}

/* A full group: the scalar steps four lanes at a time (fcvtns rounds half to even, as nearbyintf; maxnm
 * skips a NaN as fmaxf does; max is exact, so the order of the amax reduction does not matter). */
static int32_t quant_group_neon(const float *x, int8_t *q, float *xd) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int c = 0; c < BK_TG_GROUP; c += 4) m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(x + c)));
    const float amax = vmaxnmvq_f32(m);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float32x4_t vi = vdupq_n_f32(inv);
    const int32x4_t lo = vdupq_n_s32(-127), hi = vdupq_n_s32(127);
    int32x4_t sum = vdupq_n_s32(0);
    for (int c = 0; c < BK_TG_GROUP; c += 8) {
        const float32x4_t pa = vmulq_f32(vld1q_f32(x + c), vi), pb = vmulq_f32(vld1q_f32(x + c + 4), vi);
        int32x4_t a = vcvtnq_s32_f32(pa), b = vcvtnq_s32_f32(pb);
        a = vminq_s32(vmaxq_s32(a, lo), hi), b = vminq_s32(vmaxq_s32(b, lo), hi);
        a = vbslq_s32(vceqq_f32(pa, pa), a, lo), b = vbslq_s32(vceqq_f32(pb, pb), b, lo); /* a NaN: -127, as on x86 */
        sum = vaddq_s32(sum, vaddq_s32(a, b));
        vst1_s8(q + c, vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(b))));
    }
    *xd = amax / 127.0f;
    return vaddvq_s32(sum);
}
#endif

/* avx512 and avxvnni run the AVX2 body (BK_PICK's next path down) */
static const tg_fn tg_bodies[BK_N_ISA] = {
    BK_BODY(SCALAR, tg_scalar) BK_X86_BODY(AVX2, tg_avx2) BK_ARM_BODY(NEON, tg_neon) BK_ARM_BODY(DOTPROD, tg_dotprod)
};

/* One group of 128 (or fewer: k1 - k0 live values, the rest of the group 0): returns the sum of the codes. A NaN
 * never sets the group's amax (fmaxf skips it) and quantizes to -127 (what cvtps2dq + the clamp give on x86); an
 * infinite value makes inv 0, so it (inf * 0 = NaN) quantizes to -127 and the rest of its group to 0. */
static int32_t quant_group_scalar(const float *x, int live, int8_t *q, float *xd) {
    float amax = 0.0f;
    for (int c = 0; c < live; c++) amax = fmaxf(amax, fabsf(x[c]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int c = 0; c < BK_TG_GROUP; c++) {
        int v = 0;
        if (c < live) {
            const float r = nearbyintf(x[c] * inv);
            v = !(r >= -127.0f) ? -127 : (r > 127.0f ? 127 : (int)r); /* no (int) of a NaN: undefined in C */
        }
        q[c] = (int8_t)v;
        sum += v;
    }
    *xd = amax / 127.0f;
    return sum;
}

#if defined(__x86_64__)
/* A full group with AVX2: the same operations (cvtps rounds half to even under the default MXCSR, as
 * nearbyintf does; |x * inv| <= 127 so the clamp never changes a value but is kept for the last ulp). */
AVX2_TARGET static int32_t quant_group_avx2(const float *x, int8_t *q, float *xd) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int c = 0; c < BK_TG_GROUP; c += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)), m);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < BK_TG_GROUP; c += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8 * j), vi));
            v[j] = _mm256_min_epi32(_mm256_max_epi32(v[j], lo), hi);
            sum = _mm256_add_epi32(sum, v[j]);
        }
        /* packs interleave 128-bit lanes: undo with a dword permute */
        __m256i p16 = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
        __m256i p8 = _mm256_packs_epi16(p16, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + c), p8);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *xd = amax / 127.0f;
    return _mm_cvtsi128_si32(s4);
}
#endif

void bk_quantize_act_g128(const float *x, int m, int k, int ldx, int k_pad, int8_t *xq, float *xd, int32_t *xsum) {
    const int groups = k_pad / BK_TG_GROUP;
#if defined(__x86_64__)
    const int isa = bk_get_isa();
    const int simd = isa == BK_ISA_AVX2 || isa == BK_ISA_AVX512 || isa == BK_ISA_AVXVNNI;
#elif defined(__aarch64__)
    const int isa = bk_get_isa();
    const int simd = isa == BK_ISA_NEON || bk_isa_has_sdot(isa);
#else
    const int simd = 0;
#endif
    for (int i = 0; i < m; i++)
        for (int g = 0; g < groups; g++) {
            const int k0 = g * BK_TG_GROUP, live = k - k0 < BK_TG_GROUP ? (k - k0 > 0 ? k - k0 : 0) : BK_TG_GROUP;
            const float *xr = x + (size_t)i * ldx + k0;
            int8_t *q = xq + (size_t)i * k_pad + k0;
            float *d = xd + (size_t)i * groups + g;
            int32_t *s = xsum + (size_t)i * groups + g;
#if defined(__x86_64__)
            if (simd && live == BK_TG_GROUP) {
                *s = quant_group_avx2(xr, q, d);
                continue;
            }
#endif
#if defined(__aarch64__)
            if (simd && live == BK_TG_GROUP) {
                *s = quant_group_neon(xr, q, d);
                continue;
            }
#endif
            (void)simd;
            *s = quant_group_scalar(xr, live, q, d);
        }
}

#define TG_ARGS(X) X(const uint8_t *, w) X(const int8_t *, xq) X(const float *, xd) X(const int32_t *, xsum) X(int, m) \
    X(int, k_pad) X(float *, out) X(int, n)
BK_TILE_JOB(tg_job, tg_fn, TG_ARGS)

void bk_gemv_tg(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xsum, int m, int k_pad,
                float *out, int n) {
    BK_RUN_TILE_JOB(tg_job, BK_PICK(tg_bodies, bk_get_isa()), TG_ARGS, n, (size_t)k_pad * m, 16 * 4096);
}
