"""The 256-bit vpdpbusd bodies (simd/kernels/ternary_vnni256.h: the "avxvnni" path of Intel cores with AVX-VNNI and
no AVX-512, and its EVEX twin) on every x86 machine: test_kernels.py runs the real bodies only where the CPU has
AVX-VNNI or AVX-512 (qemu's x86 emulation has neither instruction). Here the same template is compiled a third
time for AVX2, with vpdpbusd replaced by an exact AVX2 equivalent (u8 x s8 products widened to 16 bits, pairs
summed into each dword), and its GEMM and GEMV must give the exact dots of a scalar reference of the tile16 layout
at odd shapes, every token-group size and tail, and every byte value (codes 0..3, activations -128..127).
"""
import platform

import pytest

from cross_c import needs_host_cc, run_harness

pytestmark = [needs_host_cc,
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                 reason="the template is x86 code (AVX2 intrinsics); this machine is not x86-64")]

HARNESS = r"""
#include "x86_common.h"

/* acc += dot(u8 a, s8 b) per dword, exactly as vpdpbusd: even and odd bytes widened to 16 bits, then vpmaddwd */
AVX2_TARGET static inline __m256i dpbusd_emu(__m256i acc, __m256i a, __m256i b) {
    __m256i ae = _mm256_and_si256(a, _mm256_set1_epi16(0xff)), ao = _mm256_srli_epi16(a, 8);
    __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ae, be), _mm256_madd_epi16(ao, bo)));
}
#define VNNI_TARGET AVX2_TARGET
#define VNNI_DPBUSD(acc, a, b) dpbusd_emu(acc, a, b)
#define VNNI_NAME(stem) stem##_emu
#include "ternary_vnni256.h"

/* tile16: tile t, block b, byte 4r + j holds rows 16t + r, columns 16b + 4i + j in its bit pairs i */
static int32_t ref_dot(const uint8_t *w, int kb, int row, const int8_t *x) {
    const uint8_t *tile = w + (size_t)(row / 16) * kb * 64;
    int r = row % 16;
    int32_t s = 0;
    for (int b = 0; b < kb; b++)
        for (int j = 0; j < 4; j++) {
            unsigned byte = tile[(size_t)b * 64 + 4 * r + j];
            for (int i = 0; i < 4; i++) s += (int32_t)((byte >> (2 * i)) & 3) * x[16 * b + 4 * i + j];
        }
    return s;
}

int main(void) {
    static const int shapes[][2] = {{16, 64}, {37, 128}, {250, 2560}, {64, 6912}};
    static const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 39};
    for (unsigned si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        int n = shapes[si][0], k_pad = shapes[si][1], kb = k_pad / 16, nt = (n + 15) / 16;
        uint8_t *w = malloc((size_t)nt * kb * 64);
        for (size_t i = 0; i < (size_t)nt * kb * 64; i++) w[i] = (uint8_t)rnd();
        for (unsigned mi = 0; mi < sizeof ms / sizeof *ms; mi++) {
            int m = ms[mi];
            int8_t *x = malloc((size_t)m * k_pad);
            int32_t *sums = malloc(4 * (size_t)m), *got = malloc(4 * (size_t)m * n);
            float *scale = malloc(4 * (size_t)m);
            for (int i = 0; i < m * k_pad; i++) x[i] = (int8_t)(rnd() & 0xff);
            for (int i = 0; i < m; i++) { scale[i] = 1.0f; sums[i] = (int32_t)(rnd() % 1000); }
            gemm_ternary_emu(w, NULL, x, m, k_pad, scale, sums, NULL, got, n, 0, nt);
            for (int i = 0; i < m; i++)
                for (int r = 0; r < n; r++)
                    CHECK(got[(size_t)i * n + r] == ref_dot(w, kb, r, x + (size_t)i * k_pad) - sums[i],
                          "gemm n %d k %d m %d: token %d row %d", n, k_pad, m, i, r);
            if (m <= 3) {
                gemv_ternary_emu(w, NULL, x, k_pad, 1.0f, sums[0], NULL, got, n, 0, nt);
                for (int r = 0; r < n; r++)
                    CHECK(got[r] == ref_dot(w, kb, r, x) - sums[0], "gemv n %d k %d: row %d", n, k_pad, r);
            }
            free(x), free(sums), free(got), free(scale);
        }
        free(w);
    }
    return REPORT();
}
"""


def test_vnni256_template_gives_the_exact_dots(tmp_path):
    run_harness(tmp_path, HARNESS, target="host", name="vnni256_emu")
