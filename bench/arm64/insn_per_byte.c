/* Instructions per weight byte of one kernel call, counted by qemu-user (insn_per_byte.sh runs this under
 * `qemu-* -singlestep -d exec,nochain`, one log line per executed instruction). Built for aarch64 and for
 * x86-64 from the same source; the count of a run with REPS calls minus that of a run with one call is the
 * instructions of one warm call, set-up and data generation cancelled out.
 *   insn_per_byte KERNEL ISA REPS   KERNEL: ternary | q4g | tg | b3 | i8 | gemm | att16 | att8 | silu | rope |
 *                                   kvf16; ISA: the kernels.h number
 * Prints the bytes the kernel reads per call: weight bytes for the GEMVs; weight bytes x tokens for gemm (a
 * ternary GEMM of GEMM_M tokens, so its count is per weight byte and token); for att16 / att8 (one decode step
 * of attention, 2B-4T-shaped heads, ATT_POS positions, f16 or int8 cache) the key and value bytes it reads; for
 * the per-token steps around them the f32 bytes they read: silu (the gate and up halves of one token, INTER wide,
 * the gate alone), rope (one token's q and k heads, 2B-4T: 20 + 5 of 128), kvf16 (one position's keys and values
 * of 5 KV heads into an f16 cache).
 * One thread (no pool hand-off in the count). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "b3.h"
#include "kernels.h"
#include "ops.h"
#include "q4g.h"
#include "tg.h"

enum { N = 512, K = 2560, GEMM_M = 8 };
/* attention: two of 2B-4T's KV heads (128 wide, 4 query heads each), a decode step at position ATT_POS - 1 */
enum { ATT_NH = 8, ATT_NKV = 2, ATT_HD = 128, ATT_POS = 256, ATT_CTX = 288 };
/* the per-token steps: an MLP as wide as 2B-4T's (6912), its 20 query and 5 KV heads of 128 */
enum { INTER = 6912, TOK_NH = 20, TOK_NKV = 5 };

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
    } else if (!strcmp(kern, "i8")) {
        bytes = (size_t)N * K;
        int8_t *w = malloc(bytes);
        int32_t *rowsum = calloc(N, 4);
        for (size_t i = 0; i < bytes; i++) w[i] = (int8_t)((int)(RND() % 255) - 127);
        for (int r = 0; r < reps; r++) bk_gemv_i8(w, scale, rowsum, xq, K, as, out, NULL, N);
    } else if (!strcmp(kern, "gemm")) {
        size_t wb = (size_t)N * K / 4;
        bytes = wb * GEMM_M;
        uint8_t *w = malloc(wb);
        for (size_t i = 0; i < wb; i++) w[i] = (uint8_t)RND();
        int8_t *xm = malloc((size_t)GEMM_M * K);
        float asm_[GEMM_M], *om = malloc(4 * (size_t)GEMM_M * N);
        int32_t sm[GEMM_M];
        for (int i = 0; i < GEMM_M; i++) memcpy(xm + (size_t)i * K, xq, K), asm_[i] = as, sm[i] = sum;
        for (int r = 0; r < reps; r++) bk_gemm_ternary(w, scale, xm, GEMM_M, K, asm_, sm, om, NULL, N);
    } else if (!strcmp(kern, "att16") || !strcmp(kern, "att8")) {
        const int q8 = !strcmp(kern, "att8"), row = (ATT_NH + 2 * ATT_NKV) * ATT_HD, nblk = ATT_CTX / OPS_KT_BLOCK;
        const size_t blk = q8 ? (size_t)OPS_Q8_BLOCK_BYTES(ATT_HD) : (size_t)OPS_KT_BLOCK * ATT_HD * 2;
        const size_t cache = (size_t)ATT_NKV * nblk * blk; /* bytes of each of the two caches */
        uint8_t *kc = malloc(cache), *vc = malloc(cache);
        for (size_t i = 0; i < cache; i++) kc[i] = (uint8_t)RND(), vc[i] = (uint8_t)RND();
        if (q8) /* scales: finite */
            for (int j = 0; j < ATT_NKV * nblk; j++)
                for (int t = 0; t < OPS_KT_BLOCK; t++) {
                    float one = 0.01f;
                    memcpy(kc + (size_t)j * blk + (size_t)OPS_KT_BLOCK * ATT_HD + 4 * t, &one, 4);
                    memcpy(vc + (size_t)j * blk + (size_t)OPS_KT_BLOCK * ATT_HD + 4 * t, &one, 4);
                }
        else /* halves: finite (exponent below 0x1f) */
            for (size_t i = 1; i < cache; i += 2) kc[i] &= 0x3b, vc[i] &= 0x3b;
        bytes = 2 * (size_t)ATT_NKV * ATT_POS * (q8 ? ATT_HD + 4 : 2 * ATT_HD);
        float *qkv = malloc(4 * (size_t)row), *o = malloc(4 * (size_t)ATT_NH * ATT_HD);
        float *cs = malloc(4 * (size_t)ATT_CTX * ATT_HD / 2), *sn = malloc(4 * (size_t)ATT_CTX * ATT_HD / 2);
        float *scratch = malloc(4 * (size_t)OPS_ATT_SCRATCH_ROWS * ATT_CTX);
        for (int i = 0; i < ATT_CTX * ATT_HD / 2; i++) cs[i] = 0.6f, sn[i] = 0.8f;
        for (int r = 0; r < reps; r++) {
            for (int i = 0; i < row; i++) qkv[i] = x[i % K] / 10.0f;
            ops_attention(qkv, 1, ATT_NH, ATT_NKV, ATT_HD, cs, sn, ATT_POS - 1, kc, vc, q8 ? OPS_KV_Q8 : OPS_KV_F16,
                          ATT_CTX, o, scratch, OPS_ATT_SCRATCH_ROWS);
        }
    } else if (!strcmp(kern, "silu")) {
        bytes = 2 * (size_t)INTER * 4;
        float *gu = malloc(bytes);
        for (int i = 0; i < 2 * INTER; i++) gu[i] = x[i % K];
        for (int r = 0; r < reps; r++) /* in place; the bodies have no data-dependent branches */
            ops_glu_rmsnorm_quant(gu, 1, INTER, OPS_ACT_SILU, NULL, 1e-5f, NULL, 0, NULL, NULL);
    } else if (!strcmp(kern, "rope")) {
        const int n = (TOK_NH + TOK_NKV) * ATT_HD;
        bytes = (size_t)n * 4;
        float *q = malloc(bytes), *cs = malloc(4 * ATT_HD / 2), *sn = malloc(4 * ATT_HD / 2);
        for (int i = 0; i < ATT_HD / 2; i++) cs[i] = 0.6f, sn[i] = 0.8f; /* a rotation: values stay in range */
        for (int i = 0; i < n; i++) q[i] = x[i % K];
        for (int r = 0; r < reps; r++) ops_rope_heads(q, TOK_NH + TOK_NKV, ATT_HD, cs, sn);
    } else if (!strcmp(kern, "kvf16")) {
        bytes = 2 * (size_t)TOK_NKV * ATT_HD * 4;
        uint16_t *kc = malloc(2 * (size_t)TOK_NKV * ATT_HD * OPS_KT_BLOCK), *vc = malloc(2 * (size_t)TOK_NKV * ATT_HD);
        for (int r = 0; r < reps; r++)
            for (int j = 0; j < TOK_NKV; j++)
                ops_kv_store_f16(x + j * ATT_HD, x + (TOK_NKV + j) * ATT_HD, ATT_HD,
                                 kc + (size_t)j * ATT_HD * OPS_KT_BLOCK + r % OPS_KT_BLOCK, vc + (size_t)j * ATT_HD);
    } else {
        return 2;
    }
    printf("%zu\n", bytes);
    return 0;
}
