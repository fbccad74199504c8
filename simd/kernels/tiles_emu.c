/* Portable C emulation of the AMX instructions the tile kernels use (tiles.h), on every architecture.
 *
 * One register file per thread (the hardware's tiles are per-thread state too): 8 tiles of 16 rows x 64
 * bytes and the configuration they were given. The semantics are Intel's pseudo-code (ISE, chapter 3):
 * a load fills the configured rows x colsb and zeroes the rest of the tile; tdpbssd / tdpbusd add, for
 * each row m of C and each dword column n, the 4-byte dot products of A's row m with B's column n over the
 * dword rows of B, wrapping in 32 bits; every shape rule the CPU enforces with #UD (configured tiles, A's
 * colsb = 4 x B's rows, A and C with the same rows, B and C with the same colsb) is checked here and a
 * violation aborts with a line naming it: a kernel that the hardware would fault on must not pass its
 * tests on the emulation.
 */
#include "tiles.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    bk_tilecfg_t cfg;
    int configured;
    uint8_t tile[8][16][64];
} emu_state;

static _Thread_local emu_state emu;

static void emu_fault(const char *what) {
    fprintf(stderr, "bitnet tile emulation: %s (the hardware raises #UD here)\n", what);
    abort();
}

static void check_tile(int t) {
    if (!emu.configured) emu_fault("tile instruction before ldtilecfg");
    if (t < 0 || t > 7) emu_fault("tile number out of 0..7");
    if (emu.cfg.rows[t] == 0 || emu.cfg.colsb[t] == 0) emu_fault("tile used but not configured");
}

void bk_emu_tile_config(const bk_tilecfg_t *cfg) {
    if (cfg->palette_id != 1) emu_fault("palette other than 1");
    for (int t = 0; t < 8; t++)
        if (cfg->rows[t] > 16 || cfg->colsb[t] > 64) emu_fault("tile shape over 16 rows x 64 bytes");
    memcpy(&emu.cfg, cfg, sizeof *cfg);
    memset(emu.tile, 0, sizeof emu.tile); /* ldtilecfg zeroes every tile */
    emu.configured = 1;
}

void bk_emu_tile_release(void) {
    memset(&emu, 0, sizeof emu);
}

void bk_emu_tile_zero(int t) {
    check_tile(t);
    memset(emu.tile[t], 0, sizeof emu.tile[t]);
}

void bk_emu_tile_load(int t, const void *base, size_t stride) {
    check_tile(t);
    const int rows = emu.cfg.rows[t], colsb = emu.cfg.colsb[t];
    memset(emu.tile[t], 0, sizeof emu.tile[t]);
    for (int r = 0; r < rows; r++) memcpy(emu.tile[t][r], (const uint8_t *)base + (size_t)r * stride, colsb);
}

void bk_emu_tile_store(int t, void *base, size_t stride) {
    check_tile(t);
    const int rows = emu.cfg.rows[t], colsb = emu.cfg.colsb[t];
    for (int r = 0; r < rows; r++) memcpy((uint8_t *)base + (size_t)r * stride, emu.tile[t][r], colsb);
}

/* the shape rules of every tdp* (configured, distinct tiles; A's colsb = 4 x B's rows, A and C with the same rows,
 * B and C with the same colsb) */
static void check_tdp(int c, int a, int b) {
    check_tile(c), check_tile(a), check_tile(b);
    if (c == a || c == b || a == b) emu_fault("tdp with a repeated tile register");
    const bk_tilecfg_t *g = &emu.cfg;
    if (g->colsb[a] % 4 || g->colsb[c] % 4) emu_fault("tdp colsb not a multiple of 4");
    if (g->colsb[a] / 4 != g->rows[b]) emu_fault("tdp with A's colsb / 4 != B's rows");
    if (g->rows[c] != g->rows[a]) emu_fault("tdp with C's rows != A's rows");
    if (g->colsb[c] != g->colsb[b]) emu_fault("tdp with C's colsb != B's colsb");
}

/* a_signed: tdpbssd (A s8) or tdpbusd (A u8); B is s8 in both. */
static void emu_dp(int c, int a, int b, int a_signed) {
    check_tdp(c, a, b);
    const bk_tilecfg_t *g = &emu.cfg;
    const int M = g->rows[c], N = g->colsb[c] / 4, KK = g->colsb[a] / 4;
    for (int m = 0; m < M; m++) {
        uint32_t acc[16];
        memcpy(acc, emu.tile[c][m], sizeof acc);
        for (int kk = 0; kk < KK; kk++)
            for (int q = 0; q < 4; q++) {
                const uint8_t av = emu.tile[a][m][4 * kk + q];
                const int32_t x = a_signed ? (int32_t)(int8_t)av : (int32_t)av;
                const int8_t *brow = (const int8_t *)emu.tile[b][kk];
                for (int n = 0; n < N; n++) acc[n] += (uint32_t)(x * (int32_t)brow[4 * n + q]); /* wraps */
            }
        memcpy(emu.tile[c][m], acc, 4 * (size_t)N);
    }
}

void bk_emu_tile_dpbssd(int c, int a, int b) { emu_dp(c, a, b, 1); }

static float emu_bf16(const uint8_t *p) { /* a bf16 from its 2 bytes (little-endian); a denormal reads as 0 */
    uint32_t u = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* tdpbf16ps: for each row m of C and each f32 column n, over the dword rows k of B: C[m][n] += A[m].bf16[2k] *
 * B[k].bf16[2n], then += A[m].bf16[2k+1] * B[k].bf16[2n+1] (Intel's pseudo-code order; the products are exact
 * in f32), with denormal inputs read as 0 and denormal results flushed to 0; the same shape rules as tdpbssd. */
void bk_emu_tile_dpbf16ps(int c, int a, int b) {
    check_tdp(c, a, b);
    const bk_tilecfg_t *g = &emu.cfg;
    const int M = g->rows[c], N = g->colsb[c] / 4, KK = g->colsb[a] / 4;
    for (int m = 0; m < M; m++) {
        float acc[16];
        memcpy(acc, emu.tile[c][m], sizeof acc);
        for (int kk = 0; kk < KK; kk++)
            for (int n = 0; n < N; n++)
                for (int h = 0; h < 2; h++) {
                    float r = acc[n] + emu_bf16(&emu.tile[a][m][4 * kk + 2 * h]) * emu_bf16(&emu.tile[b][kk][4 * n + 2 * h]);
                    uint32_t u;
                    memcpy(&u, &r, 4);
                    if ((u & 0x7f800000u) == 0) r = 0.0f * r; /* flush a denormal, keep its sign */
                    acc[n] = r;
                }
        memcpy(emu.tile[c][m], acc, 4 * (size_t)N);
    }
}
void bk_emu_tile_dpbusd(int c, int a, int b) { emu_dp(c, a, b, 0); }
