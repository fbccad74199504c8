"""The NEON bodies, cross-compiled for aarch64 and run under qemu-user: each must give the same bytes as the
scalar reference body on random data (tails included), and the dispatcher must pick "neon" there.

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user); skips with
that reason when they are missing. On an aarch64 host the regular test_kernels.py covers NEON natively.
"""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "simd", "kernels")
CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")

pytestmark = pytest.mark.skipif(
    not (CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)"
)

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

static unsigned long long rs = 88172645463325252ull;
static unsigned rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (unsigned)rs; }
static int fails = 0;
#define CHECK(cond, ...) do { if (!(cond)) { printf("FAIL " __VA_ARGS__); printf("\n"); fails++; } } while (0)

int main(void) {
    bk_init();
    printf("active %d dotprod %d\n", bk_get_isa(), bk_get_features()->dotprod);
    CHECK(bk_get_isa() == BK_ISA_NEON, "dispatcher did not pick neon");
    static const int shapes[][3] = {{16, 64, 1}, {37, 100, 3}, {100, 3200, 5}, {250, 68, 2}, {640, 2560, 9}, {17, 8640, 2}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], k = shapes[s][1], m = shapes[s][2];
        int n_pad = (n + 15) / 16 * 16, k_pad = (k + 63) / 64 * 64, tiles = n_pad / 16;
        float *x = malloc(sizeof(float) * m * k);
        for (int i = 0; i < m * k; i++) x[i] = ((int)(rnd() % 20001) - 10000) / 997.0f;
        x[0] = 2.5f * 127.0f / 127.0f;
        int8_t *xq[2]; float sc[2][16]; int32_t sm[2][16];
        for (int v = 0; v < 2; v++) {
            xq[v] = malloc((size_t)m * k_pad);
            for (int r = 0; r < m; r++)
                bk_quantize_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](x + (size_t)r * k, k, k_pad, xq[v] + (size_t)r * k_pad, &sc[v][r], &sm[v][r]);
        }
        CHECK(!memcmp(xq[0], xq[1], (size_t)m * k_pad) && !memcmp(sc[0], sc[1], 4 * m) && !memcmp(sm[0], sm[1], 4 * m), "quantize %d %d", n, k);
        uint8_t *wt = malloc((size_t)n_pad * k_pad / 4);
        for (size_t i = 0; i < (size_t)n_pad * k_pad / 4; i++) { unsigned b = 0; for (int j = 0; j < 4; j++) b |= (rnd() % 3) << (2 * j); wt[i] = (uint8_t)b; }
        int8_t *wi = malloc((size_t)n_pad * k_pad);
        int32_t *rowsum = calloc(n_pad, 4);
        for (size_t i = 0; i < (size_t)n_pad * k_pad; i++) wi[i] = (int8_t)((int)(rnd() % 255) - 127);
        uint16_t *wh = malloc(2 * (size_t)n_pad * k);
        for (size_t i = 0; i < (size_t)n_pad * k; i++) wh[i] = (uint16_t)((rnd() % 0x7800) | ((rnd() & 1) << 15)); /* finite halves */
        float *row_scale = malloc(4 * n_pad);
        for (int i = 0; i < n_pad; i++) row_scale[i] = 0.5f + (rnd() % 1000) / 1000.0f;
        float *o[2]; int32_t *oi[2];
        uint8_t *aux = malloc(2 * (size_t)k_pad);
        for (int i = 0; i < k_pad; i++) { aux[i] = (uint8_t)(xq[0][i] ^ 0x80); aux[k_pad + i] = (uint8_t)(xq[0][i] < 0 ? -xq[0][i] : xq[0][i]); }
        for (int v = 0; v < 2; v++) {
            int isa = v ? BK_ISA_NEON : BK_ISA_SCALAR;
            o[v] = malloc(4 * (size_t)m * n); oi[v] = malloc(4 * (size_t)m * n);
            bk_gemv_ternary_bodies[isa](wt, row_scale, xq[0], k_pad, sc[0][0], sm[0][0], o[v], NULL, n, 0, tiles);
            bk_gemv_ternary_bodies[isa](wt, row_scale, xq[0], k_pad, sc[0][0], sm[0][0], NULL, oi[v], n, 0, tiles);
        }
        CHECK(!memcmp(o[0], o[1], 4 * n) && !memcmp(oi[0], oi[1], 4 * n), "gemv_ternary %d %d", n, k);
        for (int v = 0; v < 2; v++)
            bk_gemm_ternary_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[v], NULL, n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * (size_t)m * n), "gemm_ternary %d %d %d", n, k, m);
        for (int v = 0; v < 2; v++)
            bk_gemv_i8_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](wi, row_scale, rowsum, xq[0], aux, k_pad, sc[0][0], o[v], NULL, n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * n), "gemv_i8 %d %d", n, k);
        for (int v = 0; v < 2; v++)
            bk_gemv_f16_bodies[v ? BK_ISA_NEON : BK_ISA_SCALAR](wh, x, k, o[v], n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * n), "gemv_f16 %d %d", n, k);
        /* the threaded drivers on the neon path */
        bk_set_num_threads(2);
        bk_gemm_ternary(wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[1], NULL, n);
        bk_gemm_ternary_bodies[BK_ISA_SCALAR](wt, row_scale, xq[0], m, k_pad, sc[0], sm[0], o[0], NULL, n, 0, tiles);
        CHECK(!memcmp(o[0], o[1], 4 * (size_t)m * n), "threaded gemm %d %d %d", n, k, m);
    }
    printf(fails ? "FAILED %d\n" : "ALL OK\n", fails);
    return fails != 0;
}
"""


def test_neon_bodies_match_scalar_under_qemu(tmp_path):
    src = tmp_path / "neon_harness.c"
    src.write_text(HARNESS)
    exe = tmp_path / "neon_harness"
    sources = sorted(glob.glob(os.path.join(KERNELS, "*.c")))
    cmd = [CC, "-O2", "-pthread", "-ffp-contract=off", "-std=c11", "-Wall", "-Wno-unused-function", "-static",
           "-I", KERNELS, str(src), *sources, "-o", str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout + r.stderr
