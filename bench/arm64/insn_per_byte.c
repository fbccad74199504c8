/* Instructions per weight byte of one kernel call, counted by qemu-user (insn_per_byte.sh runs this under
 * `qemu-* -singlestep -d exec,nochain`, one log line per executed instruction). Built for aarch64 and for
 * x86-64 from the same source; the count of a run with REPS calls minus that of a run with one call is the
 * instructions of one warm call, set-up and data generation cancelled out.
 *   insn_per_byte KERNEL ISA REPS   KERNEL: ternary | q4g | tg | b3; ISA: the kernels.h number
 * Prints the weight bytes the kernel reads per call. One thread (no pool hand-off in the count). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "b3.h"
#include "kernels.h"
#include "q4g.h"
#include "tg.h"

enum { N = 512, K = 2560 };

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    const char *kern = argv[1];
    int isa = atoi(argv[2]), reps = atoi(argv[3]);
    bk_init();
    bk_set_num_threads(1);
    if (bk_set_isa(isa) != 0) { fprintf(stderr, "isa %d not supported here\n", isa); return 3; }
    unsigned long long rs = 88172645463325252ull;
#define RND() (rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17, (unsigned)rs)
    float *x = malloc(4 * K), *scale = malloc(4 * N), *out = malloc(4 * N);
    int8_t *xq = malloc(K);
    for (int i = 0; i < K; i++) x[i] = ((int)(RND() % 2001) - 1000) / 100.0f;
    for (int i = 0; i < N; i++) scale[i] = 1.0f;
    float as; int32_t sum;
    bk_quantize_act(x, 1, K, K, xq, &as, &sum);
    size_t bytes = 0;
    if (!strcmp(kern, "ternary")) {
        bytes = (size_t)N * K / 4;
        uint8_t *w = malloc(bytes);
        for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)RND();
        for (int r = 0; r < reps; r++) bk_gemv_ternary(w, scale, xq, K, as, sum, out, NULL, N);
    } else if (!strcmp(kern, "q4g")) {
        size_t cb = (size_t)N * K / 2, gb = (size_t)N * (K / 32);
        bytes = cb + gb;
        uint8_t *c = malloc(cb), *g = malloc(gb);
        for (size_t i = 0; i < cb; i++) c[i] = (uint8_t)RND();
        for (size_t i = 0; i < gb; i++) g[i] = (uint8_t)(RND() % 64);
        for (int r = 0; r < reps; r++) bk_gemv_q4g(c, g, scale, xq, 1, K, &as, out, NULL, N);
    } else if (!strcmp(kern, "tg")) {
        bytes = (size_t)(N / 16) * (K / 128) * BK_TG_GROUP_BYTES;
        uint8_t *w = calloc(bytes, 1); /* scales 0: finite */
        for (size_t i = 0; i < bytes; i++) if (i % BK_TG_GROUP_BYTES >= 32) w[i] = (uint8_t)RND();
        float xd[K / 128]; int32_t xs[K / 128];
        bk_quantize_act_g128(x, 1, K, K, K, xq, xd, xs);
        for (int r = 0; r < reps; r++) bk_gemv_tg(w, xq, xd, xs, 1, K, out, N);
    } else if (!strcmp(kern, "b3")) {
        bytes = (size_t)(N / 16) * bk_b3_tile_bytes(K);
        uint8_t *w = malloc(bytes);
        for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)RND();
        for (int r = 0; r < reps; r++) bk_gemv_b3(w, scale, xq, K, as, sum, out, NULL, N);
    } else {
        return 2;
    }
    printf("%zu\n", bytes);
    return 0;
}
