/* Ternary GEMV and GEMM bodies on 256-bit vpdpbusd (template: included by ternary_avxvnni.c once per
 * encoding). Expects VNNI_TARGET (function attribute), VNNI_DPBUSD(acc, u8, s8) and VNNI_NAME(stem).
 * A 64-byte tile16 block is two 32-byte halves (rows 0-7 and 8-15), each one dword per row, so each half
 * is exactly one ymm operand of vpdpbusd, as in the AVX-512 bodies but twice as many instructions.
 */

/* GEMV: shift-free unpacking (v & (3 << 2i) = u << 2i, still a valid u8), one accumulator per column group
 * and half, shifts applied once per tile (same bound as the AVX-512 body: K_pad <= 2^18). */
VNNI_TARGET static void VNNI_NAME(gemv_ternary)(const uint8_t *w, const float *row_scale, const int8_t *xq,
                                                int k_pad, float act_scale, int32_t act_sum, float *out,
                                                int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const int kb = k_pad / 16;
    const size_t tile_bytes = (size_t)kb * 64;
    const __m256i m0 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x0c), m2 = _mm256_set1_epi8(0x30),
                  m3 = _mm256_set1_epi8((char)0xc0);
    const size_t pf = (size_t)bk_table.gemv_prefetch; /* kernels.h: BK_GEMV_PREFETCH_DEFAULT */
    for (int t = tile_begin; t < tile_end; t++) {
        const uint8_t *p = w + (size_t)t * tile_bytes;
        __m256i z = _mm256_setzero_si256();
        __m256i l0 = z, l1 = z, l2 = z, l3 = z, h0 = z, h1 = z, h2 = z, h3 = z;
        for (int b = 0; b < kb; b++) {
            const int8_t *xb = xq + 16 * b;
            bk_prefetch_ahead(p + (size_t)b * 64, pf);
            __m256i x0 = _mm256_set1_epi32(load_i32(xb)), x1 = _mm256_set1_epi32(load_i32(xb + 4));
            __m256i x2 = _mm256_set1_epi32(load_i32(xb + 8)), x3 = _mm256_set1_epi32(load_i32(xb + 12));
            __m256i lo = _mm256_loadu_si256((const __m256i *)(p + (size_t)b * 64));
            __m256i hi = _mm256_loadu_si256((const __m256i *)(p + (size_t)b * 64 + 32));
            l0 = VNNI_DPBUSD(l0, _mm256_and_si256(lo, m0), x0);
            l1 = VNNI_DPBUSD(l1, _mm256_and_si256(lo, m1), x1);
            l2 = VNNI_DPBUSD(l2, _mm256_and_si256(lo, m2), x2);
            l3 = VNNI_DPBUSD(l3, _mm256_and_si256(lo, m3), x3);
            h0 = VNNI_DPBUSD(h0, _mm256_and_si256(hi, m0), x0);
            h1 = VNNI_DPBUSD(h1, _mm256_and_si256(hi, m1), x1);
            h2 = VNNI_DPBUSD(h2, _mm256_and_si256(hi, m2), x2);
            h3 = VNNI_DPBUSD(h3, _mm256_and_si256(hi, m3), x3);
        }
        __m256i lo_dot = _mm256_add_epi32(_mm256_add_epi32(l0, _mm256_srai_epi32(l1, 2)),
                                          _mm256_add_epi32(_mm256_srai_epi32(l2, 4), _mm256_srai_epi32(l3, 6)));
        __m256i hi_dot = _mm256_add_epi32(_mm256_add_epi32(h0, _mm256_srai_epi32(h1, 2)),
                                          _mm256_add_epi32(_mm256_srai_epi32(h2, 4), _mm256_srai_epi32(h3, 6)));
        finish_half_avx2(lo_dot, act_sum, t * 16, n, row_scale, act_scale, out, out_i32);
        finish_half_avx2(hi_dot, act_sum, t * 16 + 8, n, row_scale, act_scale, out, out_i32);
    }
}

/* GEMM: one tile, MG (1..4) tokens, plane by plane: code plane s of both halves is unpacked, and each token's
 * activation dword is broadcast once and feeds both halves (8 accumulators + 2 operands + mask + broadcast: 12
 * of the 16 ymm registers of the VEX encoding). Unpacking all four planes of a half first kept the 16 broadcasts
 * of a block (shared by the halves) alive: GCC 12 put them and the accumulators on the stack, 32 stack accesses
 * per block of 4 tokens in the VEX body (the AVX2 GEMM had the same; gemm_ternary.c). Same exact sums. */
VNNI_TARGET __attribute__((always_inline)) static inline void VNNI_NAME(gemm_group)(
    const uint8_t *w, size_t tile_bytes, int t, const int8_t *xq, int m0, const int MG, int k_pad,
    const float *row_scale, const float *act_scale, const int32_t *act_sum, float *out, int32_t *out_i32, int n) {
    const int kb = k_pad / 16;
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i acc[2][4];
#pragma GCC unroll 4
    for (int i = 0; i < MG; i++) acc[0][i] = acc[1][i] = _mm256_setzero_si256();
    const uint8_t *p = w + (size_t)t * tile_bytes;
    const int8_t *x = xq + (size_t)m0 * k_pad;
    for (int b = 0; b < kb; b++) {
        const __m256i *blk = (const __m256i *)(p + (size_t)b * 64);
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m256i u0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(blk), 2 * s), m3);
            __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(blk + 1), 2 * s), m3);
#pragma GCC unroll 4
            for (int i = 0; i < MG; i++) {
                __m256i xs = _mm256_set1_epi32(load_i32(x + (size_t)i * k_pad + 16 * b + 4 * s));
                acc[0][i] = VNNI_DPBUSD(acc[0][i], u0, xs);
                acc[1][i] = VNNI_DPBUSD(acc[1][i], u1, xs);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MG; i++) {
        size_t off = (size_t)(m0 + i) * n;
        float *o = out ? out + off : NULL;
        int32_t *oi = out_i32 ? out_i32 + off : NULL;
        finish_half_avx2(acc[0][i], act_sum[m0 + i], t * 16, n, row_scale, act_scale[m0 + i], o, oi);
        finish_half_avx2(acc[1][i], act_sum[m0 + i], t * 16 + 8, n, row_scale, act_scale[m0 + i], o, oi);
    }
}

VNNI_TARGET static void VNNI_NAME(gemm_ternary)(const uint8_t *w, const float *row_scale, const int8_t *xq, int m,
                                                int k_pad, const float *act_scale, const int32_t *act_sum,
                                                float *out, int32_t *out_i32, int n, int tile_begin, int tile_end) {
    const size_t tile_bytes = (size_t)(k_pad / 16) * 64;
    /* chunks of tiles that stay in L2 while the token groups sweep them (as in gemm_ternary.c) */
    size_t c = ((size_t)256 << 10) / tile_bytes;
    const int chunk = c < 1 ? 1 : (int)c;
    for (int tc = tile_begin; tc < tile_end; tc += chunk) {
        int tce = tc + chunk < tile_end ? tc + chunk : tile_end;
        int m0 = 0;
        for (; m0 + 4 <= m; m0 += 4)
            for (int t = tc; t < tce; t++)
                VNNI_NAME(gemm_group)(w, tile_bytes, t, xq, m0, 4, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
        if (m0 + 2 <= m) {
            for (int t = tc; t < tce; t++)
                VNNI_NAME(gemm_group)(w, tile_bytes, t, xq, m0, 2, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
            m0 += 2;
        }
        if (m0 < m)
            for (int t = tc; t < tce; t++)
                VNNI_NAME(gemm_group)(w, tile_bytes, t, xq, m0, 1, k_pad, row_scale, act_scale, act_sum, out, out_i32, n);
    }
}
