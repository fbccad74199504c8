/* x86 helpers shared by the kernel files: target attributes and the f32 epilogue of a tile
 * (dot - act_sum, then ((float)dot / act_scale) * row_scale, or the raw int32 dot for tests). */
#ifndef BITNET_X86_COMMON_H
#define BITNET_X86_COMMON_H
#include <immintrin.h>

#include "kernels.h"

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,avx2")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* acc += dot(u8 a, s8 b) per dword lane, accumulating in place. GCC 12 compiles _mm512_dpbusd_epi32 in a
 * long-lived accumulator loop as copy -> vpdpbusd -> copy back plus a stack store per instruction (seen in
 * objdump of the GEMV); the asm form keeps the accumulator in its register. */
AVX512_TARGET static inline __m512i dpbusd512(__m512i acc, __m512i a_u8, __m512i b_s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a_u8), "v"(b_s8));
    return acc;
}

/* acc += v in int16 lanes, in place. With plain _mm256_add_epi16 GCC 12 reassociates a long run of accumulations
 * into sums of many products computed first, and spills them (the AVX2 GEMM: 42 stack accesses per block). */
AVX2_TARGET static inline __m256i addw_acc256(__m256i acc, __m256i v) {
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(v));
    return acc;
}

/* The x86 GEMV bodies' software prefetch (BK_GEMV_PREFETCH_DEFAULT, kernels.h): the 64-byte line pf bytes
 * ahead of p, when pf (bk_table.gemv_prefetch, read once per call) is not 0. A hint: it never faults, so it may
 * run past the end of the weights. */
static inline void bk_prefetch_ahead(const void *p, size_t pf) {
    if (pf) _mm_prefetch((const char *)p + pf, _MM_HINT_T0);
}

/* Read [p, p + nbytes) once at streaming speed (four independent 32-byte loads per 128 bytes, one per line of
 * each pair), so that a compute-heavy loop over the same bytes right after finds them in L2 (the GEMMs' weight
 * chunks of the AVX-512 GEMM: gemm_ternary.c). The empty asm keeps the loads, whose sums nothing reads. */
AVX2_TARGET static inline void bk_stream_warm(const uint8_t *p, size_t nbytes) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i + 128 <= nbytes; i += 128) {
        a = _mm256_add_epi64(a, _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + i)),
                                                 _mm256_loadu_si256((const __m256i *)(p + i + 64))));
        b = _mm256_add_epi64(b, _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(p + i + 32)),
                                                 _mm256_loadu_si256((const __m256i *)(p + i + 96))));
    }
    __asm__ volatile("" ::"x"(a), "x"(b));
}

AVX512_TARGET static inline void finish_tile_avx512(__m512i code_dot, int32_t act_sum, int row0, int n,
                                                    const float *row_scale, float act_scale, float *out,
                                                    int32_t *out_i32) {
    __m512i dot = _mm512_sub_epi32(code_dot, _mm512_set1_epi32(act_sum));
    if (row0 + 16 <= n) {
        if (out_i32) {
            _mm512_storeu_si512(out_i32 + row0, dot);
        } else {
            __m512 f = _mm512_div_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(act_scale));
            _mm512_storeu_ps(out + row0, _mm512_mul_ps(f, _mm512_loadu_ps(row_scale + row0)));
        }
    } else {
        int32_t dots[16];
        _mm512_storeu_si512(dots, dot);
        bk_store_tile(dots, row0, n, row_scale, act_scale, out, out_i32);
    }
}

AVX2_TARGET static inline void finish_half_avx2(__m256i code_dot, int32_t act_sum, int row0, int n,
                                                const float *row_scale, float act_scale, float *out,
                                                int32_t *out_i32) {
    __m256i dot = _mm256_sub_epi32(code_dot, _mm256_set1_epi32(act_sum));
    if (row0 + 8 <= n) {
        if (out_i32) {
            _mm256_storeu_si256((__m256i *)(out_i32 + row0), dot);
        } else {
            __m256 f = _mm256_div_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(act_scale));
            _mm256_storeu_ps(out + row0, _mm256_mul_ps(f, _mm256_loadu_ps(row_scale + row0)));
        }
    } else if (row0 < n) {
        int32_t dots[8];
        _mm256_storeu_si256((__m256i *)dots, dot);
        for (int r = 0; r < 8 && row0 + r < n; r++) {
            if (out_i32)
                out_i32[row0 + r] = dots[r];
            else
                out[row0 + r] = ((float)dots[r] / act_scale) * row_scale[row0 + r];
        }
    }
}

/* Ternary tile16 (AVX2; gemv_ternary.c, gemv_tg.c; needs m3 = set1_epi8(3), m12 = set1_epi8(12) and x0..x3,
 * the block's 4 broadcast activation dwords, in scope). One 32-byte half block (8 rows x 16 columns) into two
 * int16 accumulators with one shift instead of three: s = v >> 4 brings planes 2 and 3 down to where planes 0
 * and 1 are; planes 0 and 2 are masked to their value u (a16 += u * x), planes 1 and 3 are masked in place,
 * i.e. 4u (b16 += 4u * x: exact, shifted out at the flush). 1 shift + 4 and + 4 pmaddubsw + 4 add per 32 bytes
 * where shifting every plane down took 3 + 4 + 4 + 4: on a Zen 3 core the 1-thread GEMV is bound by these ALU
 * ops when its matrix is in cache (22.5 -> 23.5 GB/s from L2/L3; from DRAM the same: there the read is the
 * limit). Bounds per block and int16 lane, x in [-128, 127]: a16 gains at most 2 * (2*2*128) = 1024 in
 * magnitude, b16 2 * (2*8*128) = 4096, so b16 takes 8 blocks (AVX2_FLUSH_BLOCKS: -32768 at worst) before the
 * widening. */
#define TERNARY_HALF_AVX2(a16, b16, ptr)                                                                   \
    do {                                                                                                   \
        __m256i v_ = _mm256_loadu_si256((const __m256i *)(ptr));                                           \
        __m256i s_ = _mm256_srli_epi16(v_, 4);                                                             \
        a16 = _mm256_add_epi16(a16, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v_, m3), x0),   \
                                                      _mm256_maddubs_epi16(_mm256_and_si256(s_, m3), x2))); \
        b16 = _mm256_add_epi16(b16, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v_, m12), x1),  \
                                                      _mm256_maddubs_epi16(_mm256_and_si256(s_, m12), x3))); \
    } while (0)
#define AVX2_FLUSH_BLOCKS 8
/* The int32 dot of a pair of TERNARY_HALF_AVX2 accumulators (ones = set1_epi16(1)): a16 + b16 / 4, exact. */
#define TERNARY_WIDEN_AVX2(a16, b16, ones) \
    _mm256_add_epi32(_mm256_madd_epi16(a16, ones), _mm256_srai_epi32(_mm256_madd_epi16(b16, ones), 2))

#endif
